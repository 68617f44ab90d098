"""The planner tests' reference: a naive copy that walks every (part, token, head) with a plain
Python loop and computes byte offsets straight from the ``Part`` fields (sharing no code with
``kvxfer.plan``), the fewest runs a request can take, and random cases (layouts, slots, heads)
for the property tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from kvxfer.copy import copy_runs, gather_runs, scatter_runs
from kvxfer.layout import (
    Layout,
    hnd_layout,
    host_layout,
    mla_layout,
    page_major_layout,
    token_major_layout,
)
from kvxfer.plan import (
    HeadSlice,
    TransferPlan,
)

HUGE = 1 << 40  # pack_below larger than any run: everything is packed
SIDE_KINDS = ("token_major", "hnd", "page_major", "host_layer_first", "host_page_first")
MLA_KINDS = ("mla", "host_layer_first", "host_page_first")
# (src page size, dst page size): every pair of small sizes plus the two large mismatches.
PAGE_PAIRS = [(a, b) for a in (1, 2, 4, 8, 16) for b in (1, 2, 4, 8, 16)] + [(16, 64), (64, 16)]
DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3")
SLOT_STYLES = ("random", "contiguous", "shuffled", "pages")


# ------------------------------------------------------------------------------------
# Reference: one slice assignment per (part, token, head), offsets from Part fields only.
# ------------------------------------------------------------------------------------
def reference_copy(src: Layout, src_bytes: list[np.ndarray], src_slots: np.ndarray, src_heads: HeadSlice,
                   dst: Layout, dst_bytes: list[np.ndarray], dst_slots: np.ndarray, dst_heads: HeadSlice,
                   layers: set[int] | None = None) -> int:
    """Copy the request byte by byte into ``dst_bytes`` (in place); return bytes moved."""
    moved = 0
    for sp in src.parts:
        if layers is not None and sp.layer not in layers:
            continue
        dp = dst.part(sp.layer, sp.kind)
        s_ps, d_ps = src.space(sp.space).page_size, dst.space(dp.space).page_size
        n = sp.heads // src_heads.count
        s_h0, d_h0 = src_heads.index * n, dst_heads.index * (dp.heads // dst_heads.count)
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            for j in range(n):
                so = sp.base + (s // s_ps) * sp.page_stride + (s % s_ps) * sp.token_stride + (s_h0 + j) * sp.head_stride
                do = dp.base + (d // d_ps) * dp.page_stride + (d % d_ps) * dp.token_stride + (d_h0 + j) * dp.head_stride
                dst_bytes[dp.region][do: do + dp.head_bytes] = src_bytes[sp.region][so: so + sp.head_bytes]
                moved += sp.head_bytes
    return moved


def min_runs_reference(src: Layout, src_slots: np.ndarray, src_heads: HeadSlice,
                       dst: Layout, dst_slots: np.ndarray, dst_heads: HeadSlice) -> int:
    """The fewest runs any plan can have: sort the (part, token, head) units by source
    address and cut wherever the next unit is not adjacent on BOTH sides. A run must be
    contiguous on both sides, so it is a chain of such units and no plan can do better."""
    units = []
    for sp in src.parts:
        dp = dst.part(sp.layer, sp.kind)
        s_ps, d_ps = src.space(sp.space).page_size, dst.space(dp.space).page_size
        n = sp.heads // src_heads.count
        s_h0, d_h0 = src_heads.index * n, dst_heads.index * (dp.heads // dst_heads.count)
        j = np.arange(n)[None, :]
        so = (sp.base + (src_slots // s_ps) * sp.page_stride + (src_slots % s_ps) * sp.token_stride)[:, None] \
            + (s_h0 + j) * sp.head_stride
        do = (dp.base + (dst_slots // d_ps) * dp.page_stride + (dst_slots % d_ps) * dp.token_stride)[:, None] \
            + (d_h0 + j) * dp.head_stride
        units.append(np.stack([np.full(so.size, sp.region), so.ravel(), np.full(so.size, dp.region),
                               do.ravel(), np.full(so.size, sp.head_bytes)], axis=1))
    u = np.concatenate(units)
    u = u[np.lexsort((u[:, 1], u[:, 0]))]
    joined = ((u[1:, 0] == u[:-1, 0]) & (u[1:, 2] == u[:-1, 2])
              & (u[1:, 1] == u[:-1, 1] + u[:-1, 4]) & (u[1:, 3] == u[:-1, 3] + u[:-1, 4]))
    return int(len(u) - joined.sum())


# ------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------
@dataclass
class Case:
    src: Layout
    dst: Layout
    src_slots: np.ndarray
    dst_slots: np.ndarray
    src_heads: HeadSlice
    dst_heads: HeadSlice
    layers: list[int] | None
    seed: int


def build_layout(kind: str, *, mla: bool, layers: list[int], heads: int, head_dim: int, v_head_dim: int,
                 dtype: str, scale_block: int | None, page_size: int, num_pages: int) -> Layout:
    """A device layout of ``kind``, or a host layout built from a token-major device layout."""
    num_slots = num_pages * page_size
    if mla:
        device = mla_layout(layers=layers, kv_lora_rank=head_dim, rope_dim=v_head_dim % 3, dtype=dtype,
                            num_slots=num_slots, page_size=page_size)
    else:
        common = dict(layers=layers, heads=heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
                      page_size=page_size, scale_block=scale_block)
        if kind == "hnd":
            device = hnd_layout(num_pages=num_pages, **common)
        elif kind == "page_major":
            device = page_major_layout(num_pages=num_pages, **common)
        else:
            device = token_major_layout(num_slots=num_slots, **common)
    if kind.startswith("host_"):
        return host_layout(device, kind[len("host_"):], num_slots)
    return device


def make_slots(rng: np.random.Generator, style: str, n: int, page_size: int, num_pages: int) -> np.ndarray:
    """``n`` distinct usable slots (never the padding page) in one of four shapes."""
    usable = np.arange(page_size, num_pages * page_size)
    if style == "random":
        return rng.choice(usable, size=n, replace=False)
    if style == "pages":  # whole pages in random order, filled from in-page offset 0
        pages = rng.permutation(np.arange(1, num_pages))[: -(-n // page_size)]
        return (pages[:, None] * page_size + np.arange(page_size)).ravel()[:n]
    start = int(rng.integers(page_size, num_pages * page_size - n + 1))
    run = np.arange(start, start + n)
    return rng.permutation(run) if style == "shuffled" else run


@st.composite
def cases(draw) -> Case:
    mla = draw(st.integers(0, 7)) == 0  # 1 in 8 cases is MLA (it has fewer knobs)
    src_kind = draw(st.sampled_from(MLA_KINDS if mla else SIDE_KINDS))
    dst_kind = draw(st.sampled_from(MLA_KINDS if mla else SIDE_KINDS))
    first = draw(st.integers(0, 3))
    layers = list(range(first, first + draw(st.integers(1, 3))))
    head_dim, v_head_dim = draw(st.sampled_from((4, 8, 12))), draw(st.sampled_from((4, 8, 12)))
    dtype = draw(st.sampled_from(DTYPES))
    scale_block = draw(st.sampled_from((None, 4))) if dtype == "fp8_e4m3" and not mla else None
    if mla:  # MLA latent is replicated on every rank: no head slicing
        src_heads = dst_heads = HeadSlice(0, 1)
        src_total = dst_total = 1
    else:
        per_slice = draw(st.integers(1, 3))
        src_count, dst_count = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2)))
        src_heads = HeadSlice(draw(st.integers(0, src_count - 1)), src_count)
        dst_heads = HeadSlice(draw(st.integers(0, dst_count - 1)), dst_count)
        src_total, dst_total = per_slice * src_count, per_slice * dst_count
    src_ps, dst_ps = draw(st.sampled_from(PAGE_PAIRS))
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    styles = (draw(st.sampled_from(SLOT_STYLES)), draw(st.sampled_from(SLOT_STYLES)))
    sides = []
    for kind, total, ps, style in ((src_kind, src_total, src_ps, styles[0]), (dst_kind, dst_total, dst_ps, styles[1])):
        num_pages = -(-n // ps) + 1 + draw(st.integers(0, 3))
        lay = build_layout(kind, mla=mla, layers=layers, heads=total, head_dim=head_dim, v_head_dim=v_head_dim,
                           dtype=dtype, scale_block=scale_block, page_size=ps, num_pages=num_pages)
        sides.append((lay, make_slots(rng, style, n, ps, num_pages)))
    sub = draw(st.one_of(st.none(), st.lists(st.sampled_from(layers), min_size=1, unique=True)))
    return Case(sides[0][0], sides[1][0], sides[0][1], sides[1][1], src_heads, dst_heads, sub, seed)


def random_regions(layout: Layout, rng: np.random.Generator) -> list[torch.Tensor]:
    return [torch.from_numpy(rng.integers(0, 256, r.nbytes, dtype=np.uint8)) for r in layout.regions]


def execute_packed(plan: TransferPlan, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """What a wire transport does: packed groups travel as one gathered block, the rest run by run."""
    for g in plan.groups:
        r = g.runs()
        if g.packed:
            block = gather_runs(src, r.src_region, r.src_offset, r.nbytes)
            assert block.numel() == g.nbytes
            scatter_runs(dst, r.dst_region, r.dst_offset, r.nbytes, block)
        else:
            copy_runs(src, dst, r)


def assert_disjoint(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> None:
    order = np.lexsort((offset, region))
    r, o, n = region[order], offset[order], nbytes[order]
    same = r[1:] == r[:-1]
    assert not (same & (o[:-1] + n[:-1] > o[1:])).any(), "two runs write the same destination byte"
