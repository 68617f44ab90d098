"""SGLang's pool shapes as kvxfer layouts over the engine's own memory (fast tier, no SGLang).

Memory is made in each SGLang shape (``sglang_shapes``) and filled with a pattern; the builders of
``kvxfer.integrations.sglang.layouts`` describe it from pointers, lengths, shapes and strides;
kvxfer's planner moves a request to a pool of another shape, with another TP split (head slices
inside unified page envelopes too) and another page size. Every check reads the destination
through the engine's own indexing and compares bytes; nothing else of the destination changes;
the pools' regions are the engine's bytes (same addresses, nothing allocated); bad descriptions
are refused in words.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_shapes import HND, MHA, MLA, Mamba, Unified, fill, raw, view_of

from kvxfer.copy import execute_plan
from kvxfer.errors import LayoutError
from kvxfer.integrations.sglang.layouts import (
    StateTensor,
    View,
    hybrid_swa,
    mamba_state,
    mha_from_kv_args,
    mla_from_kv_args,
    physical_slots,
    seed_page_major,
    strided_kv,
    unified_envelopes,
)
from kvxfer.memory import RawMemory
from kvxfer.plan import HeadSlice, plan_transfer
from kvxfer.pools import MHAPool

LAYERS, HEADS, DIM = 2, 4, 16


def engine_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,)).clone()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def storages(engine) -> list[torch.Tensor]:
    if isinstance(engine, Unified):
        return [engine.buf]
    if isinstance(engine, MHA):
        return engine.fused
    if isinstance(engine, MLA):
        return engine.kv
    return engine.k + engine.v


def check_moved(src, s_slots, dst, d_slots, move, *, kinds=("k", "v"), layers=range(LAYERS),
                src_heads=(0, HEADS), dst_heads=(0, HEADS)):
    """Run ``move()``; the destination rows (its own indexing) equal the source's, and nothing
    else of the destination's memory changed."""
    before = [engine_bytes(t) for t in storages(dst)]
    saved = {(layer, k): dst.row(layer, k, d_slots).clone() for layer in layers for k in kinds}
    move()
    for layer in layers:
        for k in kinds:
            want = src.row(layer, k, s_slots)[:, src_heads[0]:src_heads[1]]
            got = dst.row(layer, k, d_slots)[:, dst_heads[0]:dst_heads[1]]
            assert same(got, want), (layer, k)
            view = dst.views_by[(layer, k)] if isinstance(dst, Unified) else None
            old = saved[(layer, k)]
            if view is not None:
                view[torch.as_tensor(d_slots)] = old
            elif isinstance(dst, HND):
                s = torch.as_tensor(d_slots)
                (dst.k if k == "k" else dst.v)[layer][s // dst.page, :, s % dst.page] = old
            elif isinstance(dst, MLA):
                dst.kv[layer][torch.as_tensor(d_slots)] = old
            else:
                (dst.k if k == "k" else dst.v)[dst.ids.index(layer)][torch.as_tensor(d_slots)] = old
    for b, t in zip(before, storages(dst)):
        assert torch.equal(engine_bytes(t), b), "bytes outside the moved rows changed"


def transfer(src_desc, s_slots, dst_desc, d_slots, src_heads=HeadSlice(), dst_heads=HeadSlice(), **dst_kw):
    sp, dp = src_desc.pool(), dst_desc.pool(**dst_kw)
    execute_plan(plan_transfer(sp.layout, s_slots, dp.layout, d_slots, src_heads=src_heads, dst_heads=dst_heads),
                 sp.regions(), dp.regions())


def unified_desc(u: Unified):
    mem, views = u.views()
    return strided_kv(mem, views, page_size=u.page, num_slots=u.views_by[(0, "kv" if u.mla else "k")].shape[0])


def per_view_desc(engine, page: int):
    mem, views = engine.views()
    return strided_kv(mem, views, page_size=page)


S_SLOTS = np.array([25, 16, 17, 33, 46, 47, 28, 29, 30, 31, 56, 57, 58])        # 13 tokens, scattered
D_SLOTS = np.arange(24, 24 + 13)


def test_mha_tp1_to_unified_tp2_other_page_size_head_slice_inside_envelopes():
    src = MHA(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=1)
    dst = Unified(layers=LAYERS, heads=HEADS // 2, dim=DIM, slots=128, page=8, seed=2)   # decode TP 2, rank 1
    check_moved(src, S_SLOTS, dst, D_SLOTS,
                lambda: transfer(per_view_desc(src, 4), S_SLOTS, unified_desc(dst), D_SLOTS,
                                 src_heads=HeadSlice(1, 2)), src_heads=(2, 4), dst_heads=(0, 2))


def test_unified_tp1_to_unified_tp2_both_ranks():
    src = Unified(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=3)
    for rank in range(2):
        dst = Unified(layers=LAYERS, heads=HEADS // 2, dim=DIM, slots=64, page=4, seed=4 + rank)
        check_moved(src, S_SLOTS, dst, D_SLOTS,
                    lambda dst=dst, rank=rank: transfer(unified_desc(src), S_SLOTS, unified_desc(dst), D_SLOTS,
                                                        src_heads=HeadSlice(rank, 2)),
                    src_heads=(2 * rank, 2 * rank + 2), dst_heads=(0, 2))


def test_unified_tp2_to_token_major_tp1_gathers_both_ranks():
    dst = MHA(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=16, seed=5, first_layer=0)
    for rank in range(2):
        src = Unified(layers=LAYERS, heads=HEADS // 2, dim=DIM, slots=64, page=4, seed=6 + rank)
        check_moved(src, S_SLOTS, dst, D_SLOTS,
                    lambda src=src, rank=rank: transfer(unified_desc(src), S_SLOTS, per_view_desc(dst, 16), D_SLOTS,
                                                        dst_heads=HeadSlice(rank, 2)),
                    src_heads=(0, 2), dst_heads=(2 * rank, 2 * rank + 2))


def test_hnd_to_token_major_other_page_size():
    src = HND(layers=LAYERS, heads=HEADS, dim=DIM, pages=16, page=8, seed=7)
    dst = MHA(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=8, dtype=torch.float16)
    check_moved(src, S_SLOTS, dst, D_SLOTS, lambda: transfer(per_view_desc(src, 8), S_SLOTS,
                                                             per_view_desc(dst, 4), D_SLOTS))


def test_mla_token_major_to_unified_mla():
    src = MLA(layers=LAYERS, dim=48, slots=64, seed=9)
    dst = Unified(layers=LAYERS, heads=1, dim=48, slots=64, page=8, seed=10, mla=True)
    check_moved(src, S_SLOTS, dst, D_SLOTS, lambda: transfer(per_view_desc(src, 4), S_SLOTS, unified_desc(dst),
                                                             D_SLOTS), kinds=("kv",), src_heads=(0, 1),
                dst_heads=(0, 1))


def test_seed_page_major_bytes_on_a_kvxfer_pool_of_that_layout():
    """SGLang 0.5.23 cannot build ``PageMajorMHATokenToKVPool``: its bytes are a kvxfer page-major
    pool's; described from the raw pointer alone they read the same and move to token-major."""
    seed = MHAPool(layers=LAYERS, heads=HEADS, head_dim=DIM, dtype="bfloat16", num_pages=16, page_size=4,
                   layout="page_major")
    fill(seed.buffers[0], 11)
    desc = seed_page_major(raw(seed.buffers[0]), layers=range(LAYERS), heads=HEADS, head_dim=DIM, dtype="bfloat16",
                           page_size=4, num_pages=16)
    pool = desc.pool()
    assert pool.regions()[0].data_ptr() == seed.buffers[0].data_ptr()
    for layer in range(LAYERS):
        assert all(same(a, b) for a, b in zip(pool.get_kv_buffer(layer, S_SLOTS), seed.get_kv_buffer(layer, S_SLOTS)))
    dst = MHA(layers=LAYERS, heads=HEADS // 2, dim=DIM, slots=64, page=8, seed=12)

    class Seed:
        def row(self, layer, kind, slots):
            return seed.get_part(layer, kind, slots)
    check_moved(Seed(), S_SLOTS, dst, D_SLOTS, lambda: transfer(desc, S_SLOTS, per_view_desc(dst, 8), D_SLOTS,
                                                                src_heads=HeadSlice(0, 2)),
                src_heads=(0, 2), dst_heads=(0, 2))


def test_hybrid_swa_full_and_window_layers_move_with_the_engines_map():
    """``SWAKVPool``: full layers 0, 2 in one pool, sliding-window layers 1, 3 in another; the
    window's tokens move through each side's full -> swa map."""
    def side(seed, page, slots, swa_slots):
        full = MHA(layers=2, heads=HEADS, dim=DIM, slots=slots, page=page, seed=seed)
        swa = MHA(layers=2, heads=HEADS, dim=DIM, slots=swa_slots, page=page, seed=seed + 1)
        full.ids, swa.ids = [0, 2], [1, 3]
        for i, v in enumerate(full.views()[1]):
            assert v.layer == [0, 0, 2, 2][i]
        fm, fv = full.views()
        sm, sv = swa.views()
        return full, swa, hybrid_swa(strided_kv(fm, fv, page_size=page), strided_kv(sm, sv, page_size=page))
    p_full, p_swa, p_desc = side(20, 4, 64, 32)
    d_full, d_swa, d_desc = side(30, 8, 64, 32)
    p_map = torch.zeros(64, dtype=torch.int64)
    p_map[S_SLOTS[-4:]] = torch.tensor([8, 9, 10, 11])        # prefill's window: its last 4 tokens
    d_map = torch.zeros(64, dtype=torch.int64)
    d_map[D_SLOTS[-4:]] = torch.tensor([16, 17, 18, 19])
    sp, dp = p_desc.pool(swa_map=p_map, window=4), d_desc.pool(swa_map=d_map, window=4)
    before = engine_bytes(d_swa.fused[0])
    plan = plan_transfer(sp.layout, {"token": S_SLOTS, "swa": sp.space_slots("swa", S_SLOTS[-4:])},
                         dp.layout, {"token": D_SLOTS, "swa": dp.space_slots("swa", D_SLOTS[-4:])})
    execute_plan(plan, sp.regions(), dp.regions())
    for layer in (0, 2):
        for k in ("k", "v"):
            assert same(d_full.row(layer, k, D_SLOTS), p_full.row(layer, k, S_SLOTS))
    for layer in (1, 3):
        for k in ("k", "v"):
            assert same(d_swa.row(layer, k, [16, 17, 18, 19]), p_swa.row(layer, k, [8, 9, 10, 11]))
    after = engine_bytes(d_swa.fused[0]).view(2, -1, HEADS * DIM * 2)
    untouched = [r for r in range(after.shape[1]) if r not in (16, 17, 18, 19)]
    assert torch.equal(after[:, untouched], before.view(2, -1, HEADS * DIM * 2)[:, untouched])


def test_mamba_state_tp1_to_tp2_slices_each_conv_sub_block():
    conv_blocks = (8, 4, 4)                     # [x | B | C]: each sub-block is sharded on its own
    p = Mamba(layers=2, slots=9, conv_channels=[16], width=3, heads=4, head_shape=(2, 4), seed=40)

    def desc(m, blocks):
        return mamba_state([StateTensor(raw(m.conv[0]), tuple(m.conv[0].shape[2:]), "bfloat16", blocks)],
                           StateTensor(raw(m.temporal), tuple(m.temporal.shape[2:]), "float32"),
                           layers=[1, 5], num_slots=m.temporal.shape[1])
    for rank in range(2):
        d = Mamba(layers=2, slots=5, conv_channels=[8], width=3, heads=2, head_shape=(2, 4), seed=41 + rank)
        src, dst = desc(p, conv_blocks).pool(), desc(d, (4, 2, 2)).pool()
        execute_plan(plan_transfer(src.layout, {"state": [3]}, dst.layout, {"state": [2]},
                                   src_heads=HeadSlice(rank, 2)), src.regions(), dst.regions())
        for li in range(2):
            got, src_row = d.conv[0][li, 2], p.conv[0][li, 3]
            want = torch.cat([src_row[0 + 4 * rank:4 + 4 * rank], src_row[8 + 2 * rank:10 + 2 * rank],
                              src_row[12 + 2 * rank:14 + 2 * rank]])
            assert same(got, want)
            assert same(d.temporal[li, 2], p.temporal[li, 3, 2 * rank:2 * rank + 2])
        assert dst.regions()[0].data_ptr() == d.conv[0].data_ptr()


def test_kv_args_alone_describe_token_major_mla_and_unified_envelopes():
    """What SGLang hands a backend (pointers, lengths, per-page item bytes) is enough for
    token-major MHA and MLA, and for whole unified envelopes between identical pools."""
    src = MHA(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=50)
    ptrs = [t.data_ptr() for t in src.k + src.v]
    lens = [t.numel() * 2 for t in src.k + src.v]
    desc = mha_from_kv_args(ptrs, lens, [4 * HEADS * DIM * 2] * 4, layers=[0, 1], page_size=4, heads=HEADS,
                            dtype="bfloat16")
    pool = desc.pool()
    assert [r.data_ptr() for r in pool.regions()] == ptrs   # in KVArgs order: k0 k1 v0 v1
    assert same(pool.get_part(1, "v", S_SLOTS), src.row(1, "v", S_SLOTS))
    mla = MLA(layers=LAYERS, dim=48, slots=64, seed=51)
    mdesc = mla_from_kv_args([t.data_ptr() for t in mla.kv], [t.numel() * 2 for t in mla.kv], [4 * 96] * 2,
                             layers=[0, 1], page_size=4, dtype="bfloat16")
    assert same(mdesc.pool().get_part(1, "kv", S_SLOTS), mla.row(1, "kv", S_SLOTS))
    a = Unified(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=52)
    b = Unified(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=53)
    ea = unified_envelopes(raw(a.buf), page_bytes=a.page_bytes, page_size=4)
    eb = unified_envelopes(raw(b.buf), page_bytes=b.page_bytes, page_size=4)
    check_moved(a, S_SLOTS, b, D_SLOTS, lambda: transfer(ea, S_SLOTS, eb, D_SLOTS))


def test_virtual_slots_translate_through_the_page_table():
    v2p = np.array([0, 7, 3, 0, 5])               # virtual page 1 -> physical 7, 2 -> 3, 4 -> 5
    assert physical_slots([4, 5, 11, 16, 19], v2p, 4).tolist() == [28, 29, 15, 20, 23]
    with pytest.raises(LayoutError, match="maps to no physical page"):
        physical_slots([12], v2p, 4)
    with pytest.raises(LayoutError, match="outside the page table"):
        physical_slots([20], v2p, 4)


def test_the_pools_are_the_engines_memory():
    u = Unified(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=60)
    pool = unified_desc(u).pool()
    assert pool.regions()[0].data_ptr() == u.buf.data_ptr()
    k = torch.randn(3, HEADS, DIM, dtype=torch.bfloat16)
    pool.set_kv_buffer(1, [8, 9, 10], k, k)
    assert same(u.row(1, "k", [8, 9, 10]), k) and same(u.row(1, "v", [8, 9, 10]), k)
    m = MHA(layers=LAYERS, heads=HEADS, dim=DIM, slots=64, page=4, seed=61)
    mp = per_view_desc(m, 4).pool()
    assert sorted(r.data_ptr() for r in mp.regions()) == sorted(t.data_ptr() for t in m.k + m.v)


def bad_cases():
    m = MHA(layers=1, heads=HEADS, dim=DIM, slots=64, page=4, seed=70)
    mem, views = m.views()
    u = Unified(layers=1, heads=HEADS, dim=DIM, slots=64, page=4, seed=71)
    umem, uviews = u.views()
    squeezed = [v._replace(strides=(v.strides[0] // 2, v.strides[1], v.strides[2])) for v in uviews]
    hnd = HND(layers=1, heads=HEADS, dim=DIM, pages=8, page=8, seed=72)
    hmem, hviews = hnd.views()
    small = RawMemory(mem[0].ptr, mem[0].nbytes // 2)
    keep = (m, u, hnd)
    return [
        ("an element stride that is not one element",
         lambda: strided_kv(mem, [views[0]._replace(strides=(512, 32, 4)), views[1]], page_size=4),
         "must be contiguous"),
        ("views and blocks of different counts", lambda: strided_kv(mem[:1], views, page_size=4), "one block per view"),
        ("too small a block", lambda: strided_kv([small, mem[1]], views, page_size=4).pool(), "too small"),
        ("HND page size disagrees", lambda: strided_kv(hmem, hviews, page_size=4), "page_size is 4"),
        ("entries that overlap", lambda: strided_kv(umem, squeezed, page_size=4, num_slots=64).pool(), "share bytes"),
        ("more slots than rows", lambda: strided_kv(mem, views, page_size=4, num_slots=128), "more than a view"),
        ("KVArgs item bytes not whole heads",
         lambda: mha_from_kv_args([b.ptr for b in mem], [b.nbytes for b in mem], [1000, 1000], layers=[0],
                                  page_size=4, heads=HEADS, dtype="bfloat16"), "whole 2-byte elements"),
        ("KVArgs lists of different lengths",
         lambda: mha_from_kv_args([mem[0].ptr], [mem[0].nbytes], [512, 512], layers=[0], page_size=4,
                                  heads=HEADS, dtype="bfloat16"), "expected"),
        ("conv sub-blocks that do not add up",
         lambda: mamba_state([StateTensor(mem[0], (16, 3), "bfloat16", (8, 4))],
                             StateTensor(mem[1], (4, 8), "float32"), layers=[0], num_slots=5), "do not add up"),
        ("a view that is not [slots, heads, dim]",
         lambda: strided_kv(mem, [View(0, "k", 0, (64, 64), (128, 2), "bfloat16"), views[1]], page_size=4),
         "are not"),
    ], keep


def test_bad_descriptions_are_refused_in_words():
    cases, keep = bad_cases()
    assert len(cases) >= 10
    for name, make, words in cases:
        with pytest.raises(LayoutError, match=words):
            make()
            pytest.fail(f"not refused: {name}")
    del keep


def test_view_of_reads_strides_in_bytes():
    t = torch.zeros(8, 2, 4, dtype=torch.float32)
    assert view_of(t, 3, "k") == View(3, "k", 0, (8, 2, 4), (32, 16, 4), "float32")
