"""Pools: writes, reads, host copies and buffer descriptions, for every pool kind and layout.

Every check compares whole byte buffers against an expectation built by a plain loop
over ``Part`` fields (``put_cells`` below), starting from random "canary" bytes. That
proves the bytes landed where the layout says AND that nothing else changed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from kvxfer.allocator import PageAllocator
from kvxfer.copy import execute_plan
from kvxfer.errors import LayoutError
from kvxfer.layout import Layout, Part, host_layout
from kvxfer.plan import HeadSlice, plan_transfer
from kvxfer.pools import (
    HybridSWAPool,
    KVPool,
    MHAPool,
    MLAPool,
    StatePool,
    torch_dtype,
)

PAGE = 4


# ------------------------------------------------------------------------------------
# Reference helpers (only Part fields, no kvxfer code paths)
# ------------------------------------------------------------------------------------
def cell_offset(lay: Layout, p: Part, slot: int, head: int) -> int:
    ps = lay.space(p.space).page_size
    return p.base + (slot // ps) * p.page_stride + (slot % ps) * p.token_stride + head * p.head_stride


def put_cells(lay: Layout, bufs: Sequence[np.ndarray], p: Part, slots: Sequence[int], raw: np.ndarray) -> None:
    """Write ``raw`` ``[tokens, heads, head_bytes]`` uint8 into ``bufs`` at ``slots`` of part ``p``."""
    for t, s in enumerate(slots):
        for h in range(p.heads):
            o = cell_offset(lay, p, int(s), h)
            bufs[p.region][o: o + p.head_bytes] = raw[t, h]


def get_cells(lay: Layout, bufs: Sequence[np.ndarray], p: Part, slots: Sequence[int]) -> np.ndarray:
    out = np.zeros((len(slots), p.heads, p.head_bytes), np.uint8)
    for t, s in enumerate(slots):
        for h in range(p.heads):
            o = cell_offset(lay, p, int(s), h)
            out[t, h] = bufs[p.region][o: o + p.head_bytes]
    return out


def fill_random(pool: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g))


def snapshot(pool: KVPool) -> list[np.ndarray]:
    return [b.numpy().copy() for b in pool.buffers]


def assert_buffers(pool: KVPool, expected: Sequence[np.ndarray], what: str) -> None:
    for i, (b, want) in enumerate(zip(pool.buffers, expected)):
        got = b.numpy()
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            pytest.fail(f"{what}: region {i} ({pool.layout.regions[i].name}) differs at {len(bad)} bytes, "
                        f"first {bad[:6]}")


def random_tensor(p: Part, n: int, g: torch.Generator) -> torch.Tensor:
    """A typed ``[n, heads, head_dim]`` tensor for part ``p`` (uint8 for fp8 parts)."""
    dt = torch_dtype(p.dtype)
    if dt in (torch.uint8, torch.int32):
        return torch.randint(0, 120, (n, p.heads, p.head_dim), dtype=dt, generator=g)
    return torch.randn((n, p.heads, p.head_dim), generator=g).to(dt)


def raw_bytes(t: torch.Tensor, p: Part) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], p.heads, p.head_bytes).numpy()


# ------------------------------------------------------------------------------------
# Pool factories
# ------------------------------------------------------------------------------------
def mha(layout: str, dtype: str, scales: bool) -> Callable[[], MHAPool]:
    return lambda: MHAPool(layers=[0, 3], heads=2, head_dim=8, v_head_dim=4, dtype=dtype, num_pages=10,
                           page_size=PAGE, layout=layout, scale_block=4 if scales else None)


MHA_CASES = {f"mha-{lay}-{dt}{'-scales' if sc else ''}": mha(lay, dt, sc)
             for lay in MHAPool.LAYOUTS
             for dt, sc in (("float32", False), ("bfloat16", False), ("fp8_e4m3", True))}
OTHER_CASES = {
    "mla": lambda: MLAPool(layers=3, kv_lora_rank=8, rope_dim=4, dtype="bfloat16", num_pages=10, page_size=PAGE),
    "state": lambda: StatePool(layers=[0, 2], conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                               temporal_head_shape=[2, 4], num_slots=12),
}
POOLS = {**MHA_CASES, **OTHER_CASES}


def request_slots(pool: KVPool, rng: np.random.Generator, n: int, avoid: np.ndarray | None = None) -> np.ndarray:
    """``n`` distinct usable slots in random order, none in ``avoid``."""
    sp = pool.layout.spaces[0]
    usable = np.setdiff1d(np.arange(sp.page_size, sp.num_slots), [] if avoid is None else avoid)
    return rng.permutation(usable)[:n]


# ------------------------------------------------------------------------------------
# Host copies
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POOLS))
def test_cpu_copy_round_trip_into_other_slots(name: str) -> None:
    rng = np.random.default_rng(7)
    src_pool, dst_pool = POOLS[name](), POOLS[name]()
    fill_random(src_pool, 1)
    fill_random(dst_pool, 2)
    n = 7 if name != "state" else 4
    src_slots = request_slots(src_pool, rng, n)
    dst_slots = request_slots(dst_pool, rng, n, avoid=src_slots)  # different slots than the source used
    expected = snapshot(dst_pool)
    src_bytes = snapshot(src_pool)
    for p in src_pool.layout.parts:
        put_cells(dst_pool.layout, expected, dst_pool.layout.part(*p.key), dst_slots,
                  get_cells(src_pool.layout, src_bytes, p, src_slots))
    copy = src_pool.get_cpu_copy(src_slots)
    assert all(r.device.type == "cpu" for r in copy.regions)
    dst_pool.load_cpu_copy(copy, dst_slots)
    assert_buffers(dst_pool, expected, f"{name} load_cpu_copy")
    assert_buffers(src_pool, src_bytes, f"{name} get_cpu_copy touched the source")


@pytest.mark.parametrize("layout", MHAPool.LAYOUTS)
def test_cpu_copy_between_layouts(layout: str) -> None:
    """A host copy is layout-neutral: token-major bytes reload into any MHA layout."""
    rng = np.random.default_rng(3)
    src_pool, dst_pool = mha("token_major", "bfloat16", False)(), mha(layout, "bfloat16", False)()
    fill_random(src_pool, 5)
    src_slots, dst_slots = request_slots(src_pool, rng, 9), request_slots(dst_pool, rng, 9)
    dst_pool.load_cpu_copy(src_pool.get_cpu_copy(src_slots), dst_slots)
    for layer in (0, 3):
        for a, b in zip(src_pool.get_kv_buffer(layer, src_slots), dst_pool.get_kv_buffer(layer, dst_slots)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def swa_pool(layout: str) -> HybridSWAPool:
    return HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=4, dtype="bfloat16",
                         num_pages=16, swa_num_pages=6, page_size=PAGE, window=6, layout=layout)


@pytest.mark.parametrize("layout", MHAPool.LAYOUTS)
def test_hybrid_swa_cpu_copy_keeps_the_window(layout: str) -> None:
    """The engine maps every token to a window slot, writes, then evicts the tokens that
    slid out of the window. The host copy holds all tokens of full-attention layers and
    only the window of sliding layers, and reloads into other slots on a pool whose
    engine mapped only the window."""
    n, g = 14, torch.Generator().manual_seed(0)
    src = swa_pool(layout)
    fill_random(src, 3)
    full_alloc, swa_alloc = PageAllocator(16, PAGE), PageAllocator(6, PAGE)
    full, swa = full_alloc.alloc(n), swa_alloc.alloc(n)
    src.map_swa(full, swa)
    data = {(layer, kind): random_tensor(src.layout.part(layer, kind), n, g) for layer in range(4) for kind in "kv"}
    for layer in range(4):
        src.set_kv_buffer(layer, full, data[layer, "k"], data[layer, "v"])
    window = np.arange(n - src.window, n)           # token positions still in the window
    out = np.arange(n - src.window)
    evicted = src.unmap_swa(full[out])
    np.testing.assert_array_equal(evicted, swa[out])
    swa_alloc.free(swa[: (len(out) // PAGE) * PAGE])  # whole pages that left the window
    with pytest.raises(LayoutError, match="padding page"):
        src.get_part(1, "k", full[out])             # evicted tokens have no window slot any more

    copy = src.get_cpu_copy(full)
    assert copy.num_tokens == {"token": n, "swa": src.window}
    np.testing.assert_array_equal(copy.positions["swa"], window)

    dst = swa_pool(layout)
    fill_random(dst, 4)
    dst_full = np.arange(60, 60 - n, -1)             # other slots, descending
    dst_swa = np.array([20, 21, 22, 23, 8, 9])
    with pytest.raises(LayoutError, match="padding page"):  # window not mapped yet: refused, nothing written
        before = snapshot(dst)
        dst.load_cpu_copy(copy, dst_full)
    assert_buffers(dst, before, "refused load")
    dst.map_swa(dst_full[window], dst_swa)
    expected = snapshot(dst)
    for layer in range(4):
        for kind in "kv":
            p = dst.layout.part(layer, kind)
            pos = np.arange(n) if p.space == "token" else window
            slots = dst_full[pos] if p.space == "token" else dst_swa
            put_cells(dst.layout, expected, p, slots, raw_bytes(data[layer, kind][pos], p))
    dst.load_cpu_copy(copy, dst_full)
    assert_buffers(dst, expected, f"hybrid swa {layout} load_cpu_copy")


def test_cpu_copy_of_an_empty_request() -> None:
    pool = mha("page_major", "bfloat16", False)()
    fill_random(pool, 1)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(np.zeros(0, np.int64))
    assert copy.num_tokens == {"token": 0}
    pool.load_cpu_copy(copy, np.zeros(0, np.int64))
    assert_buffers(pool, before, "empty load")


def test_load_cpu_copy_with_too_few_slots_writes_nothing() -> None:
    pool = mha("hnd", "float32", False)()
    fill_random(pool, 1)
    copy = pool.get_cpu_copy(np.arange(8, 16))
    before = snapshot(pool)
    with pytest.raises(LayoutError, match="holds token 7.*only 5 slots"):
        pool.load_cpu_copy(copy, np.arange(20, 25))
    assert_buffers(pool, before, "refused load")


# ------------------------------------------------------------------------------------
# set_kv_buffer / get_kv_buffer / prefix-valid writes
# ------------------------------------------------------------------------------------
def kv_tensors(pool: KVPool, layer: int, n: int, g: torch.Generator) -> tuple[list[torch.Tensor], dict]:
    parts = [pool.layout.part(layer, k) for k in pool.kv_kinds]
    extra = {k: random_tensor(pool.layout.part(layer, k), n, g) for k in ("k_scale", "v_scale")
             if pool.layout.has_part((layer, k))}
    return [random_tensor(p, n, g) for p in parts], extra


@pytest.mark.parametrize("name", sorted(POOLS))
def test_set_then_get_kv_buffer(name: str) -> None:
    pool, rng, g = POOLS[name](), np.random.default_rng(1), torch.Generator().manual_seed(1)
    fill_random(pool, 9)
    expected = snapshot(pool)
    layer = pool.layout.layers[-1]
    slots = request_slots(pool, rng, 5)
    tensors, extra = kv_tensors(pool, layer, len(slots), g)
    for kind, t in [*zip(pool.kv_kinds, tensors), *extra.items()]:
        p = pool.layout.part(layer, kind)
        put_cells(pool.layout, expected, p, slots, raw_bytes(t, p))
    pool.set_kv_buffer(layer, slots, *tensors, **extra)
    assert_buffers(pool, expected, f"{name} set_kv_buffer")
    for want, got in zip(tensors, pool.get_kv_buffer(layer, slots)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("name", sorted(POOLS))
def test_prefix_valid_writes_only_committed_columns(name: str) -> None:
    pool, rng, g = POOLS[name](), np.random.default_rng(2), torch.Generator().manual_seed(2)
    fill_random(pool, 4)
    expected = snapshot(pool)
    layer, cols = pool.layout.layers[0], 3
    commit = np.array([3, 1, 0])
    slots_2d = request_slots(pool, rng, 3 * cols).reshape(3, cols)
    slots_2d[2, 2] = -1  # a junk id in an uncommitted column must be ignored, not rejected
    flat, extra = kv_tensors(pool, layer, 3 * cols, g)
    tensors = [t.reshape(3, cols, *t.shape[1:]) for t in flat]
    extra = {k: t.reshape(3, cols, *t.shape[1:]) for k, t in extra.items()}
    for kind, t in [*zip(pool.kv_kinds, tensors), *extra.items()]:
        p = pool.layout.part(layer, kind)
        for row in range(3):
            c = commit[row]
            put_cells(pool.layout, expected, p, slots_2d[row, :c], raw_bytes(t[row, :c], p))
    pool.set_kv_buffer_prefix_valid(layer, slots_2d, commit, *tensors, **extra)
    # uncommitted columns are written to slot 0, the padding page (no syncing mask): take the
    # padding cells as they are, every other byte must be as expected
    actual = snapshot(pool)
    for p in pool.layout.parts:
        pad = np.arange(pool.layout.space(p.space).page_size)
        put_cells(pool.layout, expected, p, pad, get_cells(pool.layout, actual, p, pad))
    assert_buffers(pool, expected, f"{name} prefix-valid write")


# ------------------------------------------------------------------------------------
# Buffer descriptions
# ------------------------------------------------------------------------------------
def host_pool(style: str) -> KVPool:
    return KVPool(host_layout(mha("page_major", "bfloat16", False)().layout, style, 40))


BUF_CASES = {**POOLS, "hybrid_swa": lambda: swa_pool("page_major"),
             "host_layer_first": lambda: host_pool("layer_first"), "host_page_first": lambda: host_pool("page_first")}


@pytest.mark.parametrize("name", sorted(BUF_CASES))
def test_contiguous_buf_infos(name: str) -> None:
    pool = BUF_CASES[name]()
    info = pool.get_contiguous_buf_infos()
    assert info.data_ptrs == [b.data_ptr() for b in pool.buffers]
    assert info.data_lens == [r.nbytes for r in pool.layout.regions]
    for p in pool.layout.parts:
        assert info.item_lens[p.region] == p.page_stride or \
            any(q.region == p.region and q.page_stride == info.item_lens[p.region] for q in pool.layout.parts)
    described = {(pp.layer, pp.kind) for pp in info.page_parts}
    for pp in info.page_parts:
        p = pool.layout.part(pp.layer, pp.kind)
        assert (pp.region, pp.page0 + pp.offset_in_page, pp.page_stride) == (p.region, p.base, p.page_stride)
        assert (pp.token_stride, pp.head_stride) == (p.token_stride, p.head_stride)
        assert pp.offset_in_page + pp.bytes_per_page <= pp.page_stride
    layout_kind = pool.layout.kind
    if layout_kind == "page_major" or name == "hybrid_swa":
        # every K/V part of the page buffer is described, and together they tile a page
        kv = [p for p in pool.layout.parts if p.kind in ("k", "v") and pool.layout.regions[p.region].name
              in ("pages", "swa_pages")]
        assert {p.key for p in kv} <= described
        for region in {p.region for p in kv}:
            mine = sorted((pp for pp in info.page_parts if pp.region == region), key=lambda pp: pp.offset_in_page)
            assert sum(pp.bytes_per_page for pp in mine) == mine[0].page_stride == info.item_lens[region]
            assert all(a.offset_in_page + a.bytes_per_page == b.offset_in_page for a, b in zip(mine, mine[1:]))
    elif name == "host_page_first":
        assert {p.key for p in pool.layout.parts} == described   # a K block and a V block of shared pages
        assert {pp.page0 for pp in info.page_parts if pp.kind == "k"} == {0}
        assert len({pp.page0 for pp in info.page_parts if pp.kind == "v"}) == 1
    elif layout_kind in ("token_major", "hnd", "mla", "host_layer_first"):
        assert info.page_parts == []  # one part per region (or per page block): nothing shared


# ------------------------------------------------------------------------------------
# Head slices of state: sub-blocks are sliced one by one
# ------------------------------------------------------------------------------------
def test_state_head_slice_takes_the_same_share_of_every_conv_sub_block() -> None:
    """TP 1 -> TP 2: rank 1 of the decode side gets the second half of x, of B and of C,
    never a cut across the concatenated channels (a known silent-corruption bug)."""
    full = StatePool(layers=[0, 1], conv_blocks=[8, 4, 4], conv_width=3, temporal_heads=4,
                     temporal_head_shape=[2, 2], num_slots=6)
    half = StatePool(layers=[0, 1], conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                     temporal_head_shape=[2, 2], num_slots=6)
    fill_random(full, 1)
    fill_random(half, 2)
    plan = plan_transfer(full.layout, np.array([3]), half.layout, np.array([5]), src_heads=HeadSlice(1, 2))
    execute_plan(plan, full.buffers, half.buffers)
    for layer in (0, 1):
        for kind, heads in (("conv0", 8), ("conv1", 4), ("conv2", 4), ("temporal", 4)):
            src = full.get_part(layer, kind, [3])[:, heads // 2:]
            assert torch.equal(half.get_part(layer, kind, [5]).view(torch.uint8), src.view(torch.uint8)), kind


# ------------------------------------------------------------------------------------
# Bad input: LayoutError naming the field and both values, nothing written
# ------------------------------------------------------------------------------------
def _mha_bf16() -> MHAPool:
    return MHAPool(layers=2, heads=2, head_dim=8, v_head_dim=4, dtype="bfloat16", num_pages=6, page_size=PAGE)


BAD_WRITES = [
    ("k shape", lambda p: p.set_kv_buffer(0, [4, 5], torch.zeros(2, 2, 4, dtype=torch.bfloat16),
                                          torch.zeros(2, 2, 4, dtype=torch.bfloat16)), ["(2, 2, 4)", "(2, 2, 8)"]),
    ("tokens", lambda p: p.set_kv_buffer(0, [4, 5, 6], torch.zeros(2, 2, 8, dtype=torch.bfloat16),
                                         torch.zeros(3, 2, 4, dtype=torch.bfloat16)), ["(2, 2, 8)", "(3, 2, 8)"]),
    ("v dtype", lambda p: p.set_kv_buffer(0, [4, 5], torch.zeros(2, 2, 8, dtype=torch.bfloat16),
                                          torch.zeros(2, 2, 4, dtype=torch.float16)), ["float16", "bfloat16"]),
    ("raw bytes", lambda p: p.set_kv_buffer(0, [4, 5], torch.zeros(2, 2, 8, dtype=torch.uint8),
                                            torch.zeros(2, 2, 4, dtype=torch.uint8)), ["uint8", "bfloat16"]),
    ("count", lambda p: p.set_kv_buffer(0, [4, 5], torch.zeros(2, 2, 8, dtype=torch.bfloat16)),
     ["takes 2 tensors", "got 1"]),
    ("slot", lambda p: p.set_kv_buffer(0, [4, 24], torch.ones(2, 2, 8, dtype=torch.bfloat16),
                                       torch.ones(2, 2, 4, dtype=torch.bfloat16)), ["24", "out of range", "4..23"]),
    ("padding", lambda p: p.set_kv_buffer(0, [4, 1], torch.ones(2, 2, 8, dtype=torch.bfloat16),
                                          torch.ones(2, 2, 4, dtype=torch.bfloat16)), ["= 1", "padding page"]),
    ("layer", lambda p: p.set_kv_buffer(2, [4], torch.ones(1, 2, 8, dtype=torch.bfloat16),
                                        torch.ones(1, 2, 4, dtype=torch.bfloat16)), ["layer=2", "'k'"]),
    ("prefix lens", lambda p: p.set_kv_buffer_prefix_valid(0, [[4, 5]], [3], torch.ones(1, 2, 2, 8),
                                                           torch.ones(1, 2, 2, 4)), ["0..2", "[3]"]),
    ("prefix shape", lambda p: p.set_kv_buffer_prefix_valid(0, [[4, 5]], [1, 1], torch.ones(1, 2, 2, 8),
                                                            torch.ones(1, 2, 2, 4)), ["(1, 2)", "(2,)"]),
]


@pytest.mark.parametrize("what, call, words", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_bad_writes_raise_and_write_nothing(what: str, call, words: list[str]) -> None:
    pool = _mha_bf16()
    fill_random(pool, 1)
    before = snapshot(pool)
    with pytest.raises(LayoutError) as e:
        call(pool)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {e.value}"
    assert_buffers(pool, before, f"refused write ({what})")


def test_fp8_pool_accepts_float8_and_uint8() -> None:
    pool = mha("token_major", "fp8_e4m3", True)()
    k = torch.randn(2, 2, 8).to(torch.float8_e4m3fn)
    v = torch.randint(0, 255, (2, 2, 4), dtype=torch.uint8)
    pool.set_kv_buffer(0, [4, 9], k, v)
    got_k, got_v = pool.get_kv_buffer(0, [4, 9])
    assert got_k.dtype == got_v.dtype == torch.float8_e4m3fn
    assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)) and torch.equal(got_v.view(torch.uint8), v)


@pytest.mark.parametrize("pool_dtype, other", [("fp8_e4m3", torch.float8_e5m2), ("fp8_e5m2", torch.float8_e4m3fn)])
def test_fp8_formats_are_distinct(pool_dtype: str, other: torch.dtype) -> None:
    """An e5m2 tensor in an e4m3 pool (or the reverse) reads back as other numbers: refused."""
    pool = mha("token_major", pool_dtype, False)()
    fill_random(pool, 1)
    before = snapshot(pool)
    assert torch_dtype(pool_dtype) != other
    with pytest.raises(LayoutError, match=pool_dtype):
        pool.set_kv_buffer(0, [4, 9], torch.zeros(2, 2, 8).to(other), torch.zeros(2, 2, 4).to(other))
    assert_buffers(pool, before, "refused fp8 write")


def test_hybrid_map_swa_lengths_must_agree() -> None:
    pool = swa_pool("token_major")
    with pytest.raises(LayoutError, match="3 full slots vs 2 swa slots"):
        pool.map_swa([4, 5, 6], [4, 5])
    assert not pool.full_to_swa.any()


# ------------------------------------------------------------------------------------
# PageAllocator
# ------------------------------------------------------------------------------------
def test_page_allocator_hands_out_whole_fresh_pages() -> None:
    a = PageAllocator(6, PAGE)
    assert (a.capacity, a.free_pages) == (5, 5)
    s1, s2 = a.alloc(5), a.alloc(4)
    assert len(s1) == 5 and len(s2) == 4 and a.free_pages == 2
    pages1, pages2 = set(s1 // PAGE), set(s2 // PAGE)
    assert not pages1 & pages2 and 0 not in pages1 | pages2
    assert np.array_equal(s1[:PAGE] % PAGE, np.arange(PAGE))  # tokens start at in-page offset 0
    assert a.alloc(3 * PAGE) is None and a.free_pages == 2    # refusal takes nothing
    a.free(s1)
    assert a.free_pages == 4


def test_page_allocator_double_free_raises_and_keeps_state() -> None:
    a = PageAllocator(6, PAGE)
    s = a.alloc(8)
    a.free(s)
    t = a.alloc(4)  # takes one of the freed pages again
    with pytest.raises(LayoutError) as e:
        a.free(s)   # s's pages: one is taken again by t, the other is free: double free
    assert "double free" in str(e.value) and isinstance(e.value, ValueError)
    free_page = sorted(set(s // PAGE) - set(t // PAGE))[0]
    assert f"page {free_page}" in str(e.value)
    assert a.free_pages == 4  # nothing was freed by the refused call
    with pytest.raises(LayoutError, match="outside 1..5"):
        a.free([0])
    with pytest.raises(LayoutError, match="at least 2 pages"):
        PageAllocator(1, PAGE)


def test_pools_expose_their_pages_and_make_their_allocator() -> None:
    """One allocator for device and host pages, built from what every pool exposes."""
    pool = mha("hnd", "bfloat16", False)()
    assert (pool.num_pages, pool.page_size) == (10, PAGE)
    a = pool.allocator()
    assert isinstance(a, PageAllocator) and (a.num_pages, a.page_size, a.capacity) == (10, PAGE, 9)
    swa = swa_pool("token_major")
    assert (swa.allocator("swa").num_pages, swa.allocator().num_pages) == (6, 16)
    from kvxfer.host import HostPool
    host = HostPool.for_pool(pool, size=12, pin_memory=False)
    assert all(type(x) is PageAllocator for x in host.allocators.values())
    import kvxfer.pools as pools_module
    assert not hasattr(pools_module, "HostPages")


def test_page_allocator_takes_a_free_block_first() -> None:
    a = PageAllocator(10, PAGE)
    first = a.alloc(2 * PAGE)          # pages 1, 2
    a.alloc(PAGE)                      # page 3
    a.free(first)                      # free: 1, 2 and 4..9
    got = a.alloc(3 * PAGE) // PAGE    # a block of 3: pages 4..6, not 1, 2, 4
    assert sorted(set(got.tolist())) == [4, 5, 6] and a.free_pages == 5


# ------------------------------------------------------------------------------------
# Host memory: pinned by registration, never by the caching allocator; layouts without memory
# ------------------------------------------------------------------------------------
def test_pinned_host_pool_is_a_plain_allocation_registered_with_the_driver(monkeypatch) -> None:
    import kvxfer.pinned as pinned_module
    from kvxfer.host import HostPool

    real_zeros, real_empty = torch.zeros, torch.empty

    def no_pin(real):
        def alloc(*a, **kw):
            assert not kw.get("pin_memory"), "pin_memory=True tensor: the caching host allocator rounds it up"
            return real(*a, **kw)
        return alloc
    monkeypatch.setattr(torch, "zeros", no_pin(real_zeros))
    monkeypatch.setattr(torch, "empty", no_pin(real_empty))
    registered, unregistered = [], []
    monkeypatch.setattr(pinned_module, "register_host_memory", lambda ptr, n: registered.append((ptr, n)))
    monkeypatch.setattr(pinned_module, "unregister_host_memory", lambda ptr: unregistered.append(ptr))
    monkeypatch.setattr(pinned_module, "HOST_CHUNK", 4096)   # touched in pieces
    host = HostPool.for_pool(mha("page_major", "bfloat16", False)(), size=3000, pin_memory=True)
    assert host.pinned
    assert sorted(registered) == sorted((b.data_ptr(), b.numel()) for b in host.buffers)
    assert all(b.numel() > 4096 for b in host.buffers)
    assert all(not b.is_pinned() for b in host.buffers)   # no caching-allocator pin
    host.close()
    host.close()
    assert sorted(unregistered) == sorted(p for p, _ in registered)


def test_hybrid_swa_pool_of_100_gb_builds_its_layout_without_host_memory(monkeypatch) -> None:
    """Layouts are data: a 100 GB pool on the meta device allocates no host memory at all."""
    real_zeros, real_empty = torch.zeros, torch.empty

    def guarded(real):
        def alloc(*a, **kw):   # checked before allocating: the old code would zero-fill 100 GB
            size = a[0] if len(a) == 1 and not isinstance(a[0], int) else a
            nbytes = int(np.prod(size)) * (kw.get("dtype") or torch.float32).itemsize
            device = torch.device(kw.get("device") or "cpu")
            assert device.type == "meta" or nbytes < 64 << 20, f"{nbytes} bytes on {device} for a meta pool"
            return real(*a, **kw)
        return alloc
    monkeypatch.setattr(torch, "zeros", guarded(real_zeros))
    monkeypatch.setattr(torch, "empty", guarded(real_empty))
    pages = 100 * 2**30 // (48 * 2 * 8 * 128 * 2 * PAGE)   # 48 layers, K+V, 8 heads x 128, bf16
    pool = HybridSWAPool(full_layers=range(0, 48, 2), swa_layers=range(1, 48, 2), heads=8, head_dim=128,
                         dtype="bfloat16", num_pages=pages, swa_num_pages=pages, page_size=PAGE, window=128,
                         layout="page_major", device="meta")
    assert sum(r.nbytes for r in pool.layout.regions) > 99 * 2**30
    assert all(b.device.type == "meta" for b in pool.buffers)
