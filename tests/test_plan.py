"""Property tests of the planner against a naive reference copy.

The reference below walks every (part, token, head) with a plain Python loop and
computes byte offsets straight from the ``Part`` fields. It shares no code with
``kvxfer.plan``, so a planner bug (a wrong stride, a bad merge, a fused run that
crosses a gap) shows up as a byte difference. Destinations are filled with random
"canary" bytes first: comparing whole regions then also proves that no byte outside
the request was written.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.copy import copy_runs, execute_plan, gather_runs, scatter_runs
from kvxfer.errors import LayoutError, PlanError
from kvxfer.grant import ByteRanges
from kvxfer.layout import (
    Layout,
    hnd_layout,
    host_layout,
    mla_layout,
    page_major_layout,
    token_major_layout,
)
from kvxfer.plan import (
    PACK_BELOW,
    HeadSlice,
    Planner,
    Runs,
    TransferPlan,
    plan_transfer,
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


# ------------------------------------------------------------------------------------
# The property
# ------------------------------------------------------------------------------------
@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_plan_matches_reference_copy(case: Case) -> None:
    rng = np.random.default_rng(case.seed)
    src = random_regions(case.src, rng)
    canary = random_regions(case.dst, rng)
    expected = [t.numpy().copy() for t in canary]
    want_bytes = reference_copy(case.src, [t.numpy() for t in src], case.src_slots, case.src_heads,
                                case.dst, expected, case.dst_slots, case.dst_heads,
                                None if case.layers is None else set(case.layers))
    src_before = [t.clone() for t in src]
    for pack_below in (0, PACK_BELOW, HUGE):
        plan = plan_transfer(case.src, case.src_slots, case.dst, case.dst_slots, src_heads=case.src_heads,
                             dst_heads=case.dst_heads, layers=case.layers, pack_below=pack_below)
        assert plan.nbytes == want_bytes
        runs = plan.runs()
        assert int(runs.nbytes.sum()) == want_bytes and (runs.nbytes > 0).all()
        assert_disjoint(runs.dst_region, runs.dst_offset, runs.nbytes)
        if pack_below == 0:
            assert plan.num_packed_runs == 0
        if pack_below == HUGE:
            assert plan.num_packed_runs == plan.num_runs
        for executor in (execute_plan, execute_packed):
            dst = [t.clone() for t in canary]
            executor(plan, src, dst)
            for i, (got, want) in enumerate(zip(dst, expected)):
                if not np.array_equal(got.numpy(), want):
                    bad = np.flatnonzero(got.numpy() != want)
                    pytest.fail(f"{executor.__name__} pack_below={pack_below}: region {i} "
                                f"({case.dst.regions[i].name}) differs at {len(bad)} bytes, first {bad[:8]}")
    assert all(torch.equal(a, b) for a, b in zip(src, src_before)), "the source was modified"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_never_beats_the_minimum_and_prepared_equals_one_shot(case: Case) -> None:
    """No plan can have fewer runs than the unit-chain minimum; a smaller count would
    mean a run that is not contiguous on one side. The prepared Planner and the
    one-shot call must agree run for run."""
    kw = dict(src_heads=case.src_heads, dst_heads=case.dst_heads)
    one_shot = plan_transfer(case.src, case.src_slots, case.dst, case.dst_slots, **kw).runs()
    prepared = Planner(case.src, case.dst, **kw).plan(case.src_slots, case.dst_slots).runs()
    for a, b in zip(one_shot, prepared):
        np.testing.assert_array_equal(a, b)
    floor = min_runs_reference(case.src, case.src_slots, case.src_heads, case.dst, case.dst_slots, case.dst_heads)
    assert len(one_shot.nbytes) >= floor


# ------------------------------------------------------------------------------------
# Run counts: the planner reaches the minimum where the design promises it.
# ------------------------------------------------------------------------------------
def joint_runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> int:
    """Maximal runs of (src, dst) pairs that step by +1 on both sides, taken in source
    order (the order of runs is free, so pages 5, 4 -> 13, 12 are one run of two)."""
    if len(src_idx) == 0:
        return 0
    order = np.argsort(src_idx)
    s, d = src_idx[order], dst_idx[order]
    step = (np.diff(s) == 1) & (np.diff(d) == 1)
    return int(len(s) - step.sum())


def page_runs_case(rng: np.random.Generator, num_pages: int, n_pages: int, scatter: bool) -> np.ndarray:
    pages = np.arange(1, num_pages)
    pages = rng.permutation(pages)[:n_pages] if scatter else pages[:n_pages]
    if scatter and rng.random() < 0.5:  # sorted but gappy: some pages adjacent, some not
        pages = np.sort(pages)
    return pages


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from((1, 2, 16, 64)), layers=st.integers(1, 4),
       heads=st.integers(1, 4), v_dim=st.sampled_from((8, 4, 16)), n_pages=st.integers(1, 12),
       scatter=st.booleans())
def test_page_major_runs_are_one_per_page_run(seed: int, page_size: int, layers: int, heads: int, v_dim: int,
                                              n_pages: int, scatter: bool) -> None:
    """Every layer's K and V of a page sit back to back, also when K and V head dims
    differ, so a run of pages adjacent on both sides is one run."""
    rng = np.random.default_rng(seed)
    num_pages = 16
    lay = page_major_layout(layers=layers, heads=heads, head_dim=8, v_head_dim=v_dim, dtype="bfloat16",
                            num_pages=num_pages, page_size=page_size)
    sp = page_runs_case(rng, num_pages, n_pages, scatter)
    dp = page_runs_case(rng, num_pages, n_pages, scatter)
    slots = lambda pages: (pages[:, None] * page_size + np.arange(page_size)).ravel()  # noqa: E731
    plan = plan_transfer(lay, slots(sp), lay, slots(dp))
    want = joint_runs(sp, dp)
    assert plan.num_runs == want
    assert want == min_runs_reference(lay, slots(sp), HeadSlice(), lay, slots(dp), HeadSlice())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from((1, 4, 16)), layers=st.integers(1, 4),
       heads=st.integers(1, 4), v_dim=st.sampled_from((8, 16)), n=st.integers(1, 60),
       style=st.sampled_from(SLOT_STYLES))
def test_token_major_runs_are_one_per_layer_kv_and_slot_run(seed: int, page_size: int, layers: int, heads: int,
                                                            v_dim: int, n: int, style: str) -> None:
    rng = np.random.default_rng(seed)
    num_pages = -(-n // page_size) + 4
    lay = token_major_layout(layers=layers, heads=heads, head_dim=8, v_head_dim=v_dim, dtype="float16",
                             num_slots=num_pages * page_size, page_size=page_size)
    s = make_slots(rng, style, n, page_size, num_pages)
    d = make_slots(rng, style, n, page_size, num_pages)
    plan = plan_transfer(lay, s, lay, d)
    want = layers * 2 * joint_runs(s, d)
    assert plan.num_runs == want
    assert want == min_runs_reference(lay, s, HeadSlice(), lay, d, HeadSlice())


# ------------------------------------------------------------------------------------
# Bad input: a ValueError subclass naming the field and both values, nothing written.
# ------------------------------------------------------------------------------------
def _pools(src: Layout, dst: Layout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rng = np.random.default_rng(0)
    return random_regions(src, rng), random_regions(dst, rng)


TM = dict(layers=2, heads=4, head_dim=8, dtype="bfloat16", num_slots=64, page_size=4)


@pytest.mark.parametrize("src_slots, dst_slots, error, words", [
    ([4, 5, 64], [4, 5, 6], LayoutError, ["src_slots", "64", "out of range", "4..63"]),
    ([4, 5, 6], [4, 2, 6], LayoutError, ["dst_slots", "2", "padding page", "page_size 4"]),
    ([4, 5, -1], [4, 5, 6], LayoutError, ["src_slots", "-1"]),
    ([4, 5, 6], [4, 5], PlanError, ["3 src slots", "2 dst slots"]),
    ([4.0, 5.0], [4, 5], LayoutError, ["integers", "float64"]),
])
def test_bad_slots_raise_and_write_nothing(src_slots, dst_slots, error, words) -> None:
    lay = token_major_layout(**TM)
    src, dst = _pools(lay, lay)
    before = [t.clone() for t in dst]
    with pytest.raises(error) as e:
        execute_plan(plan_transfer(lay, np.asarray(src_slots), lay, np.asarray(dst_slots)), src, dst)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {e.value}"
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


@pytest.mark.parametrize("dst_kw, heads, error, words", [
    (dict(dtype="float16"), (HeadSlice(), HeadSlice()), PlanError, ["dtype", "bfloat16", "float16"]),
    (dict(head_dim=16), (HeadSlice(), HeadSlice()), PlanError, ["head_dim", "8", "16"]),
    (dict(v_head_dim=4), (HeadSlice(), HeadSlice()), PlanError, ["head_dim", "8", "4", "'v'"]),
    (dict(layers=1), (HeadSlice(), HeadSlice()), PlanError, ["layer=1", "layers [0]"]),
    (dict(heads=2), (HeadSlice(), HeadSlice()), PlanError, ["4 heads", "2"]),
    (dict(heads=2), (HeadSlice(0, 2), HeadSlice(0, 1)), None, []),  # 4/2 == 2: fine
    (dict(heads=6), (HeadSlice(0, 4), HeadSlice(0, 4)), PlanError, ["6 heads", "not divisible", "4 slices"]),
])
def test_mismatched_sides_raise_and_write_nothing(dst_kw, heads, error, words) -> None:
    src_lay = token_major_layout(**TM)
    dst_lay = token_major_layout(**{**TM, **dst_kw})
    src, dst = _pools(src_lay, dst_lay)
    before = [t.clone() for t in dst]
    slots = np.arange(4, 12)
    if error is None:
        execute_plan(plan_transfer(src_lay, slots, dst_lay, slots, src_heads=heads[0], dst_heads=heads[1]), src, dst)
        assert not all(torch.equal(a, b) for a, b in zip(dst, before))
        return
    with pytest.raises(error) as e:
        execute_plan(plan_transfer(src_lay, slots, dst_lay, slots, src_heads=heads[0], dst_heads=heads[1]), src, dst)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {e.value}"
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0)])
def test_head_slice_outside_the_pool(index: int, count: int) -> None:
    with pytest.raises(PlanError) as e:
        HeadSlice(index, count)
    assert str(index) in str(e.value) and str(count) in str(e.value)


def test_run_outside_a_region_is_refused_before_any_byte_moves() -> None:
    """A plan executed against regions smaller than its layout says (a peer that lied
    about its pool) fails the bounds check, and the regions that did fit are untouched."""
    lay = token_major_layout(**TM)
    src, dst = _pools(lay, lay)
    dst[-1] = dst[-1][:100].clone()  # the last region (v1) is too short
    before = [t.clone() for t in dst]
    with pytest.raises(PlanError, match="reaches byte"):
        execute_plan(plan_transfer(lay, np.arange(4, 40), lay, np.arange(4, 40)), src, dst)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_dict_slots_must_name_every_space() -> None:
    lay = token_major_layout(**TM)
    with pytest.raises(PlanError, match="no entry for slot space 'token'"):
        plan_transfer(lay, {"swa": np.arange(4, 8)}, lay, np.arange(4, 8))


def test_empty_request_plans_nothing() -> None:
    lay = token_major_layout(**TM)
    plan = plan_transfer(lay, np.zeros(0, np.int64), lay, np.zeros(0, np.int64))
    assert plan.num_runs == 0 and plan.nbytes == 0 and len(plan.runs().nbytes) == 0


@pytest.mark.parametrize("n", [40, 12])   # above and below FEW_RUNS: indexed rows, then a copy per run
@pytest.mark.parametrize("shift", [0, 1, 2, 4])
def test_gather_scatter_copy_on_unaligned_byte_views(shift: int, n: int) -> None:
    """Regions may be byte views that start anywhere (a slice of a bigger buffer): the
    executors must move bytes, whatever element width they use internally."""
    from kvxfer.plan import FEW_RUNS
    assert (n <= FEW_RUNS) == (n == 12)
    rng = np.random.default_rng(shift)
    base_src = torch.from_numpy(rng.integers(0, 256, 4096 + 8, dtype=np.uint8))
    base_dst = torch.from_numpy(rng.integers(0, 256, 4096 + 8, dtype=np.uint8))
    src, dst = [base_src[shift: shift + 2048], base_src[2048 + 8:]], [base_dst[3: 3 + 2048], base_dst[2048 + 8:]]
    lens = rng.choice([8, 16, 24, 64], n).astype(np.int64)
    slots = rng.permutation(2048 // 64)[:n // 2]        # 64-byte cells, distinct per region
    reg = np.repeat([0, 1], n // 2)
    src_off = np.concatenate([slots * 64, slots[::-1] * 64]).astype(np.int64)
    dst_off = np.concatenate([slots[::-1] * 64, slots * 64]).astype(np.int64)
    want = [t.numpy().copy() for t in dst]
    for r, so, do, ln in zip(reg, src_off, dst_off, lens):
        want[r][do: do + ln] = src[r].numpy()[so: so + ln]
    block = gather_runs(src, reg, src_off, lens)
    assert np.array_equal(block.numpy(), np.concatenate([src[r].numpy()[o: o + ln]
                                                         for r, o, ln in zip(reg, src_off, lens)]))
    staged = torch.zeros(int(lens.sum()) + shift, dtype=torch.uint8)[shift:]   # an unaligned staging buffer
    gather_runs(src, reg, src_off, lens, out=staged)
    assert torch.equal(staged, block)
    for mover in ("scatter", "copy"):
        b = base_dst.clone()
        out = [b[3: 3 + 2048], b[2048 + 8:]]   # same unaligned starts as dst
        if mover == "scatter":
            scatter_runs(out, reg, dst_off, lens, staged)
        else:
            copy_runs(src, out, Runs(reg, src_off, reg, dst_off, lens, np.zeros(n, bool)))
        for got, exp in zip(out, want):
            assert np.array_equal(got.numpy(), exp), mover


def test_parts_fuse_only_within_one_region_on_each_side() -> None:
    """Hand-made layouts where the destination's V part starts exactly one page block
    after K, but in another region: the page's K and V must stay two runs."""
    from kvxfer.layout import Part as P
    from kvxfer.layout import Region, Space
    space = (Space(name="token", num_slots=8, page_size=4),)
    common = dict(space="token", token_stride=4, heads=1, head_stride=4, head_bytes=4, dtype="float32")
    src = Layout(kind="pages", spaces=space, regions=(Region(name="pages", nbytes=64),),
                 parts=(P(layer=0, kind="k", region=0, base=0, page_stride=32, **common),
                        P(layer=0, kind="v", region=0, base=16, page_stride=32, **common)))
    dst = Layout(kind="split", spaces=space, regions=(Region(name="k", nbytes=32), Region(name="v", nbytes=48)),
                 parts=(P(layer=0, kind="k", region=0, base=0, page_stride=16, **common),
                        P(layer=0, kind="v", region=1, base=16, page_stride=16, **common)))
    slots = np.arange(4, 8)
    plan = plan_transfer(src, slots, src, slots)
    assert plan.num_runs == 1    # same layout on both sides: one run for the page
    plan = plan_transfer(src, slots, dst, slots)
    assert plan.num_runs == 2
    rng = np.random.default_rng(0)
    s, d = random_regions(src, rng), random_regions(dst, rng)
    want = [t.numpy().copy() for t in d]
    reference_copy(src, [t.numpy() for t in s], slots, HeadSlice(), dst, want, slots, HeadSlice())
    execute_plan(plan, s, d)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(d, want))


@pytest.mark.parametrize("build, runs_per_page_run", [
    (lambda: page_major_layout(layers=3, heads=2, head_dim=8, v_head_dim=4, dtype="bfloat16", num_pages=12,
                               page_size=4), lambda lay: 1),
    (lambda: token_major_layout(layers=3, heads=2, head_dim=8, dtype="bfloat16", num_slots=48, page_size=4),
     lambda lay: len(lay.parts)),
    (lambda: hnd_layout(layers=3, heads=2, head_dim=8, dtype="bfloat16", num_pages=12, page_size=4),
     lambda lay: len(lay.parts)),
])
def test_pages_handed_out_in_descending_order_still_coalesce(build, runs_per_page_run) -> None:
    """Allocators that free a request's pages last-first hand them out in descending
    order; when both sides do, the pages still touch in source order: one run per part."""
    lay = build()
    src = (np.arange(9, 4, -1)[:, None] * 4 + np.arange(4)).ravel()   # pages 9, 8, 7, 6, 5
    dst = (np.arange(6, 1, -1)[:, None] * 4 + np.arange(4)).ravel()   # pages 6, 5, 4, 3, 2
    plan = plan_transfer(lay, src, lay, dst)
    assert plan.num_runs == runs_per_page_run(lay)
    rng = np.random.default_rng(1)
    s, d = random_regions(lay, rng), random_regions(lay, rng)
    want = [t.numpy().copy() for t in d]
    reference_copy(lay, [t.numpy() for t in s], src, HeadSlice(), lay, want, dst, HeadSlice())
    execute_plan(plan, s, d)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(d, want))


@pytest.mark.parametrize("src_kind", SIDE_KINDS)
@pytest.mark.parametrize("dst_kind", SIDE_KINDS)
def test_whole_pages_between_every_layout_pair(src_kind: str, dst_kind: str) -> None:
    """Whole pages are where parts fuse (page-major, host page-first), so every pairing
    gets a deterministic byte check on them, K and V dims differing."""
    rng = np.random.default_rng(11)
    kw = dict(mla=False, layers=[0, 1, 2], heads=2, head_dim=8, v_head_dim=4, dtype="float16", scale_block=None,
              page_size=4, num_pages=10)
    src, dst = build_layout(src_kind, **kw), build_layout(dst_kind, **kw)
    s = make_slots(rng, "pages", 20, 4, 10)
    d = make_slots(rng, "pages", 20, 4, 10)
    s_regions, canary = random_regions(src, rng), random_regions(dst, rng)
    want = [t.numpy().copy() for t in canary]
    reference_copy(src, [t.numpy() for t in s_regions], s, HeadSlice(), dst, want, d, HeadSlice())
    plan = plan_transfer(src, s, dst, d)
    execute_plan(plan, s_regions, canary)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(canary, want))
    assert plan.num_runs == min_runs_reference(src, s, HeadSlice(), dst, d, HeadSlice())


def test_byte_ranges_covers_many_runs_as_it_covers_one():
    """``covers`` over many runs (searched in sorted order) answers, run by run and in the
    caller's order, what ``covers_run`` answers for each: inside, straddling, outside, hostile."""
    rng = np.random.default_rng(11)
    k = 6000                       # above the size where covers sorts its keys
    starts = rng.choice(1 << 16, k, replace=False).astype(np.int64) * 512
    grant = ByteRanges(rng.integers(0, 3, k), starts, np.full(k, 256, np.int64))
    region = rng.integers(-1, 4, 3 * k)
    offset = rng.choice(starts, 3 * k) + rng.integers(-300, 300, 3 * k)
    nbytes = rng.integers(-5, 400, 3 * k)
    offset[::97], nbytes[::89] = -(1 << 62), 1 << 62      # hostile values
    got = grant.covers(region, offset, nbytes)
    want = [grant.covers_run(int(r), int(o), int(n)) for r, o, n in zip(region, offset, nbytes)]
    assert got.tolist() == want and 0 < int(got.sum()) < len(got)


def test_byte_ranges_covers_neighbour_groups_run_by_run():
    """Runs in stream order (a page's rows next to each other) are first checked a group's
    span at a time: one bad run inside an otherwise granted group is still found, and a span
    over a gap or across regions never passes for its runs."""
    rng = np.random.default_rng(5)
    pages = rng.permutation(4096)[:512]                       # granted 16 KiB pages, scattered
    grant = ByteRanges(np.repeat([0, 1], 512), np.tile(pages * 16384, 2), np.full(1024, 16384))
    rows = (pages[:, None] * 16384 + np.arange(16) * 1024 + 512).reshape(-1)   # a half row per token
    region, offset, nbytes = np.repeat([0, 1], len(rows)), np.tile(rows, 2), np.full(2 * len(rows), 512)
    assert grant.covers(region, offset, nbytes).all()
    offset[37] += 1024 * 16                                   # into the next page: mostly not granted
    nbytes[100] = 1 << 20                                     # past its page
    region[300] = 2                                           # a region with no grant
    offset[411], nbytes[412] = -(1 << 62), 0                  # hostile, empty
    offset[500: 516] = rng.permutation(offset[500: 516])      # a group out of order: still fine
    got = grant.covers(region, offset, nbytes)
    want = [grant.covers_run(int(r), int(o), int(n)) for r, o, n in zip(region, offset, nbytes)]
    assert got.tolist() == want
    assert not got[[100, 300, 411, 412]].any() and int((~got).sum()) <= 5
    # a bad run's key reads as 0: a group in a grant that starts at byte 0 must not hide it
    first = ByteRanges([0], [0], [16384])
    offset, nbytes = np.arange(32) * 512, np.full(32, 512)
    nbytes[3], offset[20] = 0, -1
    assert np.flatnonzero(~first.covers(np.zeros(32, np.int64), offset, nbytes)).tolist() == [3, 20]
