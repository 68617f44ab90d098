"""vLLM's KV tensors as kvxfer pools (``kvxfer.integrations.vllm.layouts``; fast tier, no vLLM).

Each builder takes tensors of one vLLM shape (as ``register_kv_caches`` hands them), filled with a
pattern; bytes moved from that pool to a pool of another shape (kvxfer's own builders, or another
vLLM shape), with a head slice (heterogeneous TP) and another block size where the layout allows
it, land where the *engine's* indexing of the destination tensor says (read with plain tensor
indexing, never through the layout under test). The pools are the engine's tensors: same
``data_ptr``, nothing allocated. Bad descriptions are refused in words naming the layer.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.control.compat import check_pair, layout_record
from kvxfer.control.records import RankInfo
from kvxfer.copy import execute_plan
from kvxfer.errors import LayoutError, PlanError
from kvxfer.integrations.vllm.layouts import cpu_kv, flash_kv, layer_index, mla_kv, paged_kv
from kvxfer.layout import mla_layout, page_major_layout, token_major_layout
from kvxfer.memory import EnginePool
from kvxfer.plan import HeadSlice, plan_transfer
from kvxfer.ranks import RankSpec

L, H, D = 2, 4, 32            # layers, KV heads (prefill TP 1), head size
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def pattern(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def paged(blocks: int, bs: int, heads: int, order: str, seed: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer views [B, H, N, K|V]: "HND" (LBHNC) or "NHD" (LBNHC) by stride order."""
    if order == "HND":
        return {n: pattern((blocks, heads, bs, 2 * D), seed=seed + i) for i, n in enumerate(NAMES)}
    return {n: pattern((blocks, bs, heads, 2 * D), seed=seed + i).permute(0, 2, 1, 3) for i, n in enumerate(NAMES)}


def flash(blocks: int, bs: int, heads: int, order: str, seed: int) -> dict[str, torch.Tensor]:
    """[2, B, N, H, D]; HND by stride order (memory [2, B, H, N, D])."""
    if order == "NHD":
        return {n: pattern((2, blocks, bs, heads, D), seed=seed + i) for i, n in enumerate(NAMES)}
    return {n: pattern((2, blocks, heads, bs, D), seed=seed + i).permute(0, 1, 3, 2, 4) for i, n in enumerate(NAMES)}


def token_kv(kind: str, t: torch.Tensor, slot: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[heads, D]`` of slot ``slot`` read with the engine's own indexing."""
    b, o = divmod(slot, bs)
    if kind == "paged":
        return t[b, :, o, :D], t[b, :, o, D:]
    return t[0, b, o], t[1, b, o]


def slots_of(blocks: list[int], n: int, bs: int) -> np.ndarray:
    pos = np.arange(n)
    return np.asarray(blocks)[pos // bs] * bs + pos % bs


@pytest.mark.parametrize("kind,order", [("paged", "NHD"), ("paged", "HND"), ("flash", "NHD"), ("flash", "HND")])
def test_token_layouts_move_a_head_slice_to_another_block_size_and_back(kind, order):
    n = 45                                           # not a multiple of either block size
    make, build = (paged, lambda kv: paged_kv(kv, head_size=D)) if kind == "paged" else (flash, flash_kv)
    src_t = make(12, 16, H, order, seed=1)           # prefill: TP 1, blocks of 16
    ptrs = {k: v.data_ptr() for k, v in src_t.items()}
    src = build(src_t)
    src_pool = src.pool()
    assert [r.data_ptr() for r in src_pool.regions()] == list(ptrs.values())
    # decode TP 2, rank 1 (heads 2, 3), page-major pages of 32 (kvxfer's own layout)
    dst_l = page_major_layout(layers=L, heads=H // 2, head_dim=D, dtype="bfloat16", num_pages=8, page_size=32)
    dst = EnginePool(dst_l, [pattern((dst_l.regions[0].nbytes // 2,), seed=9)])
    s_blocks, d_pages = [3, 7, 1], [5, 2]
    s_slots, d_slots = src.slots(s_blocks, n), slots_of(d_pages, n, 32)
    execute_plan(plan_transfer(src.layout, s_slots, dst_l, d_slots, src_heads=HeadSlice(1, 2),
                               dst_heads=HeadSlice(0, 1)), src_pool.regions(), dst.regions())
    for li, name in enumerate(NAMES):
        got_k, got_v = dst.get_part(li, "k", d_slots), dst.get_part(li, "v", d_slots)
        for i, s in enumerate(s_slots):
            k, v = token_kv(kind, src_t[name], int(s), 16)
            assert same(got_k[i], k[2:4]) and same(got_v[i], v[2:4]), (name, i)
    # back into the engine's tensors of another vLLM shape and stride order (block size 32, TP 2 rank 1)
    other = "HND" if order == "NHD" else "NHD"
    back_t = paged(6, 32, H // 2, other, seed=20)
    back = paged_kv(back_t, head_size=D)
    before = {k: v.data_ptr() for k, v in back_t.items()}
    b_slots = back.slots([4, 1], n)
    execute_plan(plan_transfer(dst_l, d_slots, back.layout, b_slots), dst.regions(), back.pool().regions())
    assert {k: v.data_ptr() for k, v in back_t.items()} == before
    for name in NAMES:
        for i, (s, b) in enumerate(zip(s_slots, b_slots)):
            k, v = token_kv(kind, src_t[name], int(s), 16)
            bk, bv = token_kv("paged", back_t[name], int(b), 32)
            assert same(bk, k[2:4]) and same(bv, v[2:4]), (name, i)


def test_a_cross_layer_buffer_is_one_region_over_the_engines_bytes():
    raw = pattern((10, L, H, 16, 2 * D), seed=3)      # BLHNC: each block holds every layer's page
    kv = {n: raw[:, i] for i, n in enumerate(NAMES)}
    src = paged_kv(kv, head_size=D)
    assert len(src.layout.regions) == 1 and src.pool().regions()[0].data_ptr() == raw.data_ptr()
    dst_l = token_major_layout(layers=L, heads=H, head_dim=D, dtype="bfloat16", num_slots=64 * 8, page_size=8)
    dst = EnginePool(dst_l, [pattern((r.nbytes // 2,), seed=4) for r in dst_l.regions])
    s_slots, d_slots = src.slots([2, 9], 20), np.arange(16, 36)
    execute_plan(plan_transfer(src.layout, s_slots, dst_l, d_slots), src.pool().regions(), dst.regions())
    for li, name in enumerate(NAMES):
        for i, s in enumerate(s_slots):
            k, v = token_kv("paged", kv[name], int(s), 16)
            assert same(dst.get_part(li, "k", d_slots[i:i + 1])[0], k)
            assert same(dst.get_part(li, "v", d_slots[i:i + 1])[0], v)


def test_cpu_tiles_move_whole_blocks_per_head_and_refuse_another_block_size():
    src_t = {n: pattern((9, H, 32, 2 * D), seed=5 + i) for i, n in enumerate(NAMES)}
    dst_t = {n: pattern((7, H // 2, 32, 2 * D), seed=15 + i) for i, n in enumerate(NAMES)}   # TP 2, rank 0
    src, dst = cpu_kv(src_t, head_size=D, packing="vec"), cpu_kv(dst_t, head_size=D, packing="vec")
    ptrs = [t.data_ptr() for t in dst_t.values()]
    n = 70                                            # 3 blocks, the last one partly filled
    s_blocks, d_blocks = src.slots([4, 8, 2], n), dst.slots([6, 1, 3], n)
    assert list(s_blocks) == [4, 8, 2]
    execute_plan(plan_transfer(src.layout, s_blocks, dst.layout, d_blocks, src_heads=HeadSlice(0, 2),
                               dst_heads=HeadSlice(0, 1)), src.pool().regions(), dst.pool().regions())
    assert [t.data_ptr() for t in dst_t.values()] == ptrs
    for name in NAMES:
        for sb, db in zip(s_blocks, d_blocks):
            assert same(dst_t[name][db], src_t[name][sb, 0:2])     # whole (block, head) tiles, K and V
    # prefix hits are whole blocks: the slots start at the block after them
    assert list(src.slots([4, 8, 2], n, start=32)) == [8, 2]
    with pytest.raises(LayoutError, match="whole blocks"):
        src.slots([4, 8, 2], n, start=5)
    # another block size, or another packing, is another part kind: nothing in common to plan
    other = cpu_kv({n: pattern((9, H, 64, 2 * D)) for n in NAMES}, head_size=D, packing="vec")
    amx = cpu_kv({n: pattern((9, H, 32, 2 * D)) for n in NAMES}, head_size=D, packing="amx")
    for far in (other, amx):
        with pytest.raises(PlanError):
            plan_transfer(src.layout, np.array([1]), far.layout, np.array([1]))
    # ... and the handshake refuses the pair in words, naming both
    p_info = RankInfo(spec=RankSpec(role="prefill", num_kv_heads=H, num_layers=L), layout=layout_record(src.layout))
    for far, theirs in ((other, "kv_cpu_vec_block64"), (amx, "kv_cpu_amx_block32")):
        d_info = RankInfo(spec=RankSpec(role="decode", num_kv_heads=H, num_layers=L), layout=layout_record(far.layout))
        assert check_pair(p_info, d_info) == ["parts: P sends kv_cpu_vec_block32 that D's layout lacks",
                                              f"parts: D expects {theirs} that P does not produce"]
    tp2 = RankInfo(spec=RankSpec(role="decode", num_kv_heads=H, num_layers=L, tp_size=2),
                   layout=layout_record(dst.layout))
    assert check_pair(p_info, tp2) == []


def test_mla_latents_move_to_another_page_size():
    c = 48
    kv = {n: pattern((6, 16, c), seed=7 + i) for i, n in enumerate(NAMES)}
    src = mla_kv(kv)
    dst_l = mla_layout(layers=L, kv_lora_rank=32, rope_dim=16, dtype="bfloat16", num_slots=8 * 32, page_size=32,
                       page_major=True)
    dst = EnginePool(dst_l, [pattern((dst_l.regions[0].nbytes // 2,), seed=8)])
    s_slots, d_slots = src.slots([2, 5, 1], 37), np.arange(32, 69)
    execute_plan(plan_transfer(src.layout, s_slots, dst_l, d_slots), src.pool().regions(), dst.regions())
    for li, name in enumerate(NAMES):
        got = dst.get_part(li, "kv", d_slots)
        for i, s in enumerate(s_slots):
            assert same(got[i, 0], kv[name][int(s) // 16, int(s) % 16])
    four = mla_kv({n: t.unsqueeze(1) for n, t in kv.items()})     # [B, 1, N, C]
    assert four.layout.parts == src.layout.parts


def bad_descriptions():
    ok = paged(4, 16, H, "HND", 0)
    yield "not a dict", lambda: paged_kv([], head_size=D), "non-empty dict"
    yield "wrong dims", lambda: paged_kv({NAMES[0]: torch.zeros(4, H, 16)}, head_size=D), "3 dims|4 dims"
    yield "head size", lambda: paged_kv(ok, head_size=D + 8), "is not K 40 \\+ V 40"
    yield "strided head dim", lambda: paged_kv({NAMES[0]: torch.zeros(4, H, 16, 2 * D, 2)[..., 0]}, head_size=D), \
        "stride 2, not 1"
    yield "dtype", lambda: paged_kv({NAMES[0]: torch.zeros(4, H, 16, 2 * D, dtype=torch.int64)}, head_size=D), \
        "dtype torch.int64"
    yield "same index", lambda: paged_kv({"a.0.x": torch.zeros(4, H, 16, 2 * D), "b.0.y": torch.zeros(4, H, 16, 2 * D)},
                                         head_size=D), "same layer index"
    yield "no index", lambda: paged_kv({"attn": torch.zeros(4, H, 16, 2 * D)}, head_size=D), "integer components"
    yield "block shapes", lambda: paged_kv({NAMES[0]: torch.zeros(4, H, 16, 2 * D),
                                            NAMES[1]: torch.zeros(4, H, 32, 2 * D)}, head_size=D), "one block shape"
    shared = torch.zeros(8, H, 16, 2 * D)
    yield "overlap", lambda: paged_kv({NAMES[0]: shared[:6], NAMES[1]: shared[2:]}, head_size=D), "share bytes"
    yield "kv axis", lambda: flash_kv({NAMES[0]: torch.zeros(3, 4, 16, H, D)}), "not 2 \\(K and V\\)"
    yield "cpu strided", lambda: cpu_kv({NAMES[0]: torch.zeros(4, 16, H, 2 * D).permute(0, 2, 1, 3)}, head_size=D,
                                        packing="vec"), "contiguous"
    yield "cpu packing", lambda: cpu_kv(ok, head_size=D, packing="avx9000"), "packing"
    yield "mla heads", lambda: mla_kv({NAMES[0]: torch.zeros(4, 2, 16, 48)}), "one head"


@pytest.mark.parametrize("case", list(bad_descriptions()), ids=lambda c: c[0])
def test_bad_descriptions_are_refused_in_words(case):
    _, build, words = case
    with pytest.raises(LayoutError, match=words) as e:
        build().pool()
    assert str(e.value)


def test_layer_index_is_the_one_integer_of_the_name():
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("language_model.model.layers.0.attn") == 0
