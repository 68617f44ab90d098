"""The planner and the executor on bad input and at the edges: bad slots, mismatched sides and
head slices refused before any byte moves, unaligned byte views, part fusion limits, pages in
descending order, whole pages between every layout pair, and ``ByteRanges`` coverage.
(The property tests against the reference copy are in ``test_plan.py``.)
"""
from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch
from plan_reference import (
    SIDE_KINDS,
    build_layout,
    make_slots,
    min_runs_reference,
    random_regions,
    reference_copy,
)

from kvxfer import rangecheck
from kvxfer.copy import copy_runs, execute_plan, gather_runs, scatter_runs
from kvxfer.errors import LayoutError, PlanError
from kvxfer.grant import ByteRanges, GrantTable
from kvxfer.layout import (
    Layout,
    hnd_layout,
    page_major_layout,
    token_major_layout,
)
from kvxfer.plan import (
    HeadSlice,
    Runs,
    plan_transfer,
)


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


def reference_covers(granted, region, offset, nbytes) -> list[bool]:
    """What ``ByteRanges.covers`` must answer, in plain Python: each run lies wholly inside one
    merged stretch of the ``granted`` (region, start, nbytes) triples of its region."""
    merged: dict[int, list[list[int]]] = {}
    for r, a, n in sorted(zip(*(np.asarray(x).tolist() for x in granted))):
        iv = merged.setdefault(r, [])
        if iv and a <= iv[-1][1]:
            iv[-1][1] = max(iv[-1][1], a + n)
        else:
            iv.append([a, a + n])
    starts = {r: [a for a, _ in iv] for r, iv in merged.items()}

    def one(r: int, o: int, n: int) -> bool:
        i = bisect.bisect_right(starts.get(r, []), o) - 1
        return n > 0 and o >= 0 and i >= 0 and o + n <= merged[r][i][1]
    return [one(int(r), int(o), int(n)) for r, o, n in zip(region, offset, nbytes)]


def test_byte_ranges_covers_many_runs_as_a_reference_does():
    """``covers`` over many runs in random order (no neighbour to start from) answers, run by
    run and in the caller's order, what a plain merge-and-search does: inside, straddling,
    outside, hostile; ``covers_run`` the same for each run alone."""
    rng = np.random.default_rng(11)
    k = 6000
    starts = rng.choice(1 << 16, k, replace=False).astype(np.int64) * 512
    granted = (rng.integers(0, 3, k), starts, np.full(k, 256, np.int64))
    grant = ByteRanges(*granted)
    region = rng.integers(-1, 4, 3 * k)
    offset = rng.choice(starts, 3 * k) + rng.integers(-300, 300, 3 * k)
    nbytes = rng.integers(-5, 400, 3 * k)
    offset[::97], nbytes[::89], nbytes[1::89] = -(1 << 62), 1 << 62, (1 << 63) - 1   # hostile values
    region[::101] = 1 << 40                                # a region id past the axis
    in_one, in_zero = granted[0] == 1, granted[0] == 0     # another region's grants, named past this one's ends
    region[5::103], offset[5::103] = 0, (1 << 40) + rng.choice(starts[in_one], len(offset[5::103]))
    region[7::103], offset[7::103] = 1, rng.choice(starts[in_zero], len(offset[7::103])) - (1 << 40)
    got = grant.covers(region, offset, nbytes)
    want = reference_covers(granted, region, offset, nbytes)
    assert got.tolist() == want and 0 < int(got.sum()) < len(got)
    assert [grant.covers_run(int(r), int(o), int(n)) for r, o, n in zip(region, offset, nbytes)] == want
    assert not grant.covers_run(0, 1 << 70, 1) and not grant.covers_run(0, 0, -(1 << 70))   # beyond int64


def test_byte_ranges_covers_refuses_columns_it_cannot_read():
    """The compiled check takes int64 columns of one length (anything else converts first or is
    refused by name), and an empty grant covers nothing."""
    grant = ByteRanges([0], [0], [4096])
    starts, ends = grant.intervals(0)   # region 0 starts the one axis of all regions
    assert grant.covers([0, 0], np.array([0, 4000], np.int32), [4096, 200]).tolist() == [True, False]
    with pytest.raises(ValueError, match="offset has 1 entries"):
        rangecheck.covered(starts, ends, np.zeros(2, np.int64), np.zeros(1, np.int64),
                           np.ones(2, np.int64), np.empty(2, bool))
    with pytest.raises(TypeError, match="region must be a 1-D int64 array"):
        rangecheck.covered(starts, ends, np.zeros(2, np.int32), np.zeros(2, np.int64),
                           np.ones(2, np.int64), np.empty(2, bool))
    with pytest.raises(BufferError):   # a read-only result
        rangecheck.covered(starts, ends, *(np.ones(2, np.int64) for _ in range(3)), bytes(2))
    empty = ByteRanges([], [], [])
    assert not empty.covers([0], [0], [1]).any() and not empty.covers_run(0, 0, 1)


def test_grant_check_names_the_first_fault_of_a_message_in_one_call():
    """``GrantTable.check`` refuses, in this order: a region id it has no region for, a run
    outside the grant, a granted run past its region's end (a grant larger than the region);
    runs as arrays or as lists, values beyond int64 refused, not raised."""
    table = GrantTable([4096, 4096])
    table.expect("r", ByteRanges([0, 1], [0, 0], [8192, 1024]))   # region 0's grant passes its end
    cases = {((0,), (0,), (4096,)): None, ((1,), (512,), (512,)): None,
             ((0,), (4000,), (200,)): "outside region", ((0, 2), (0, 0), (1, 1)): "unknown region",
             ((0, 1), (4000, 1000), (200, 100)): "outside grant",            # the grant fault comes first
             ((0, 1), (4000, 0), (200, 100)): "outside region", ((0,), (0,), (1 << 64,)): "outside grant"}
    for (r, o, n), want in cases.items():
        for cols in ((list(r), list(o), list(n)),) + (((np.array(r), np.array(o), np.array(n)),) if n[0] < 1 << 63
                                                       else ()):
            got = table.check("r", *cols)
            assert (got if got is None else got.split(":")[0]) == want, (r, o, n, got)
    assert table.check("r", [0], [0], [0, 1]).startswith("malformed header")


def test_byte_ranges_covers_neighbour_groups_run_by_run():
    """Runs in stream order (a page's rows next to each other) start their search at the interval
    that held the run before: one bad run among granted neighbours is still found, and so is a
    run that jumps over a gap, goes back, or names another region."""
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
    granted = (np.repeat([0, 1], 512), np.tile(pages * 16384, 2), np.full(1024, 16384))
    got = grant.covers(region, offset, nbytes)
    want = reference_covers(granted, region, offset, nbytes)
    assert got.tolist() == want
    assert not got[[100, 300, 411, 412]].any() and int((~got).sum()) <= 5
    # chains of neighbours cut anywhere (a message's cut mid-page), gaps that pass between two
    # granted intervals, runs that go back: every answer is still the run's own
    for seed in range(20):
        r2 = np.random.default_rng(100 + seed)
        cut = int(r2.integers(0, 16))
        off2 = np.tile(rows, 2)[cut: cut + 3000].copy()
        n2 = np.full(len(off2), 512)
        pick = r2.integers(0, len(off2), 40)
        off2[pick[:10]] += r2.integers(-40000, 40000, 10)      # jumps within the chain gap
        n2[pick[10:20]] = r2.integers(1, 20000, 10)            # runs that reach past their page
        off2[pick[20:30]] -= 512                               # back onto the other half row
        off2[pick[30:]] = r2.choice(pages, 10) * 16384 - 1     # one byte before a granted page
        reg2 = np.zeros(len(off2), np.int64)
        got = grant.covers(reg2, off2, n2)
        assert got.tolist() == reference_covers(granted, reg2, off2, n2), seed
    # a bad run's key reads as 0: a group in a grant that starts at byte 0 must not hide it
    first = ByteRanges([0], [0], [16384])
    offset, nbytes = np.arange(32) * 512, np.full(32, 512)
    nbytes[3], offset[20] = 0, -1
    assert np.flatnonzero(~first.covers(np.zeros(32, np.int64), offset, nbytes)).tolist() == [3, 20]
