"""Pools over memory the engine owns (``kvxfer.memory.EnginePool``, issue 33).

The engine's tensors (and raw pointers with their lengths) are described by a layout and checked;
nothing is copied: the pool's regions are the engine's bytes (same ``data_ptr``), and bytes moved
between pools of different shapes, TP slices and page sizes land exactly. Bad descriptions are
refused in words that name the region, the part and the memory. The engine-specific layout
builders are tested in ``test_vllm_*`` and ``test_sglang_*``.
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

from kvxfer.copy import execute_plan
from kvxfer.errors import LayoutError
from kvxfer.layout import Layout, Part, Region, Space, hnd_layout, mla_layout, page_major_layout, token_major_layout
from kvxfer.memory import EnginePool, RawMemory
from kvxfer.plan import HeadSlice, plan_transfer

LAYERS, HEADS, DIM = 2, 4, 8


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (random patterns hold NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def nhd(page: int, pages: int = 16) -> Layout:
    return token_major_layout(layers=LAYERS, heads=HEADS, head_dim=DIM, dtype="bfloat16", num_slots=pages * page,
                              page_size=page)


def engine_tensors(layout: Layout, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """What an engine allocated: one typed tensor per region, filled with a pattern."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (r.nbytes,), generator=g, dtype=torch.uint8).view(dtype) for r in layout.regions]


def test_the_pool_is_the_engines_memory():
    layout = nhd(4)
    ts = engine_tensors(layout)
    ptrs = [t.data_ptr() for t in ts]
    pool = EnginePool(layout, ts)
    assert [r.data_ptr() for r in pool.regions()] == ptrs == [t.data_ptr() for t in ts]
    assert [r.untyped_storage().data_ptr() for r in pool.regions()] == [t.untyped_storage().data_ptr() for t in ts]
    slots = np.array([5, 6, 9])
    k, v = pool.get_kv_buffer(1, slots)
    assert same(k, ts[2].view(-1, HEADS, DIM)[slots]) and same(v, ts[3].view(-1, HEADS, DIM)[slots])
    pool.set_kv_buffer(0, slots, k, v)                       # writes go to the engine's tensors
    assert same(ts[0].view(-1, HEADS, DIM)[slots], k)


def test_a_permuted_dense_tensor_and_raw_pointers_are_accepted():
    layout = hnd_layout(layers=1, heads=HEADS, head_dim=DIM, dtype="float16", num_pages=8, page_size=4)
    # HND memory held by a tensor shaped NHD whose strides say HND (vLLM's stride order)
    k = torch.randn(8, HEADS, 4, DIM, dtype=torch.float16).permute(0, 2, 1, 3)
    assert not k.is_contiguous()
    buf = bytearray(layout.regions[1].nbytes)
    raw = RawMemory(ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(buf), "cpu")
    pool = EnginePool(layout, [k, raw])
    assert pool.regions()[0].data_ptr() == k.data_ptr() and pool.regions()[1].data_ptr() == raw.ptr
    got = pool.get_part(0, "k", np.arange(4, 8))             # page 1, in-page slots 0..3
    assert same(got, k[1])


@pytest.mark.parametrize("src_kind,dst_kind", [("nhd", "page_major"), ("page_major", "hnd"), ("hnd", "nhd"),
                                               ("mla", "mla_page_major")])
def test_bytes_move_between_engine_pools_of_other_shapes_tp_and_page_sizes(src_kind, dst_kind):
    def build(kind, page, heads):
        if kind == "nhd":
            return token_major_layout(layers=LAYERS, heads=heads, head_dim=DIM, dtype="bfloat16",
                                      num_slots=32 * page, page_size=page)
        if kind == "hnd":
            return hnd_layout(layers=LAYERS, heads=heads, head_dim=DIM, dtype="bfloat16", num_pages=32,
                              page_size=page)
        if kind == "page_major":
            return page_major_layout(layers=LAYERS, heads=heads, head_dim=DIM, dtype="bfloat16", num_pages=32,
                                     page_size=page)
        return mla_layout(layers=LAYERS, kv_lora_rank=16, rope_dim=8, dtype="bfloat16", num_slots=32 * page,
                          page_size=page, page_major=kind == "mla_page_major")

    mla = src_kind.startswith("mla")
    src_l = build(src_kind, 4, 1 if mla else HEADS)          # prefill TP 1: every head
    dst_l = build(dst_kind, 8, 1 if mla else HEADS // 2)     # decode TP 2, rank 1: heads 2..3, pages of 8
    src, dst = EnginePool(src_l, engine_tensors(src_l, seed=1)), EnginePool(dst_l, engine_tensors(dst_l, seed=2))
    before = [b.clone() for b in dst.regions()]
    s_slots, d_slots = np.arange(4, 4 + 19), np.arange(8 * 3, 8 * 3 + 19)
    heads = {} if mla else {"src_heads": HeadSlice(1, 2), "dst_heads": HeadSlice(0, 1)}
    execute_plan(plan_transfer(src_l, s_slots, dst_l, d_slots, **heads), src.regions(), dst.regions())
    for layer in range(LAYERS):
        for kind in (("kv",) if mla else ("k", "v")):
            want = src.get_part(layer, kind, s_slots)[:, (0 if mla else 2):(1 if mla else 4)]
            assert same(dst.get_part(layer, kind, d_slots), want), (layer, kind)
    # nothing outside the moved slots changed
    untouched = [np.setdiff1d(np.arange(dst_l.spaces[0].num_slots), d_slots)]
    for layer in range(LAYERS):
        for kind in (("kv",) if mla else ("k", "v")):
            p = dst_l.part(layer, kind)
            view = lambda bufs: EnginePool(dst_l, bufs).get_part(layer, kind, untouched[0][untouched[0] >= 8])  # noqa
            assert same(view(dst.regions()), view(before)), (layer, kind, p)


def raw_block(nbytes: int) -> tuple[bytearray, int]:
    buf = bytearray(nbytes + 64)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def bad_descriptions():
    layout = nhd(4)
    ts = engine_tensors(layout)
    n = layout.regions[0].nbytes
    buf, at = raw_block(4 * n)
    odd = Layout(kind="odd", spaces=layout.spaces, regions=(Region(name="r", nbytes=n + 2),),
                 parts=(Part(layer=0, kind="k", space="token", region=0, base=1, page_stride=4 * HEADS * DIM * 2,
                             token_stride=HEADS * DIM * 2, heads=HEADS, head_stride=DIM * 2, head_bytes=DIM * 2,
                             dtype="bfloat16"),))
    clash = Layout(kind="clash", spaces=(Space(name="token", num_slots=64, page_size=4),),
                   regions=(Region(name="kv", nbytes=n),),
                   parts=tuple(Part(layer=0, kind=k, space="token", region=0, base=0, page_stride=4 * HEADS * DIM * 2,
                                    token_stride=HEADS * DIM * 2, heads=HEADS, head_stride=DIM * 2,
                                    head_bytes=DIM * 2, dtype="bfloat16") for k in ("k", "v")))
    stride = Layout(kind="stride", spaces=(Space(name="token", num_slots=64, page_size=4),),
                    regions=(Region(name="kv", nbytes=n),),
                    parts=(Part(layer=0, kind="k", space="token", region=0, base=0, page_stride=4 * HEADS * DIM * 2,
                                token_stride=DIM * 2, heads=HEADS, head_stride=DIM * 2, head_bytes=DIM * 2,
                                dtype="bfloat16"),))
    pm = page_major_layout(layers=1, heads=HEADS, head_dim=DIM, dtype="bfloat16", num_pages=16, page_size=4)
    k0 = pm.parts[0]
    nb = pm.regions[0].nbytes + k0.page_stride
    paged = Layout(kind="paged", spaces=pm.spaces, regions=(Region(name="kv", nbytes=nb),),
                   parts=(k0, dataclasses.replace(k0, layer=1, base=k0.base + k0.page_stride)))
    big, at2 = raw_block(nb)
    return [
        ("too few blocks", layout, ts[:3], "4 region"),
        ("too small", layout, [ts[0][: ts[0].numel() // 2]] + ts[1:], "too small"),
        ("wrong dtype", layout, [ts[0].view(torch.float16)] + ts[1:], "is bfloat16 but .* torch.float16"),
        ("wrong device", layout, [torch.empty(n // 2, dtype=torch.bfloat16, device="meta")] + ts[1:],
         "one device"),
        ("pointer without a length", layout, [at] + ts[1:], "a pointer without a length"),
        ("null pointer", layout, [RawMemory(0, n)] + ts[1:], "null"),
        ("unmapped pointer", layout, [RawMemory(4096, n)] + ts[1:], "not writable memory of this process"),
        ("overlapping blocks", layout, [RawMemory(at, n), RawMemory(at + n // 2, n)] + ts[2:], "share memory"),
        ("a view with gaps", layout, [torch.zeros(n, dtype=torch.bfloat16)[::2]] + ts[1:], "exactly once"),
        ("misaligned", odd, [RawMemory(at + 1, n + 2)], "misaligned"),
        ("overlapping parts", clash, [RawMemory(at, n)], r"part \(0, 'k'\) and part \(0, 'v'\) share bytes"),
        ("a wrong stride", stride, [RawMemory(at, n)], "two of its own tokens or heads"),
        ("layers of one buffer a whole page apart", paged, [RawMemory(at2, nb)],
         r"part \(0, 'k'\) and part \(1, 'k'\) share bytes"),
    ], (buf, big)


def test_bad_descriptions_are_refused_in_words():
    cases, keep = bad_descriptions()
    assert len(cases) >= 10
    for name, layout, memory, words in cases:
        with pytest.raises(LayoutError, match=words) as e:
            EnginePool(layout, memory)
        assert "region" in str(e.value) or "part" in str(e.value) or "device" in str(e.value), (name, e.value)
    del keep


def test_device_pools_are_described_without_touching_device_memory():
    """``meta`` stand-ins (the CUDA path on CPU): the checks read shapes, strides and addresses only."""
    layout = nhd(4)
    ts = [torch.empty(r.nbytes // 2, dtype=torch.bfloat16, device="meta") for r in layout.regions]
    pool = EnginePool(layout, ts, device="meta")
    assert pool.device.type == "meta" and all(r.device.type == "meta" for r in pool.regions())
    with pytest.raises(LayoutError, match="one device"):
        EnginePool(layout, ts, device="cpu")
