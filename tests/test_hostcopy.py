"""The compiled host copy (``kvxfer/hostcopy.c``, through ``kvxfer.copy``): every run is checked
against its region before a byte moves, whatever its caller checked; bad arrays are refused in
words; large copies let other threads run.
"""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from kvxfer import hostcopy
from kvxfer.copy import (
    RELEASE_GIL_FROM,
    STREAM_FROM,
    copy_runs,
    execute_plan,
    gather_runs,
    host_table,
    scatter_runs,
)
from kvxfer.errors import PlanError, TransportError
from kvxfer.plan import FEW_RUNS, RunGroup, Runs, TransferPlan


def _runs(rows: list[tuple[int, int, int, int, int]]) -> Runs:
    a = np.array(rows, np.int64).reshape(-1, 5)
    return Runs(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], np.zeros(len(a), bool))


def _regions(n: int, size: int, fill: int) -> list[torch.Tensor]:
    return [torch.full((size,), fill + i, dtype=torch.uint8) for i in range(n)]


def _good_rows(count: int) -> list[tuple[int, int, int, int, int]]:
    return [(i % 2, 16 * i, (i + 1) % 2, 16 * i, 16) for i in range(count)]   # more than FEW_RUNS


@pytest.mark.parametrize("bad, match", [
    ((0, 4000, 0, 0, 200), "outside its regions"),                  # source past the end
    ((0, 0, 1, 4090, 16), "outside its regions"),                   # destination past the end
    ((0, -16, 0, 0, 16), "outside its regions"),                    # negative offset
    ((0, 0, 0, 0, -1), "outside its regions"),                      # negative length
    ((0, 2**63 - 8, 0, 0, 16), "outside its regions"),              # offset + n overflows int64
    ((0, 16, 0, 16, 2**63 - 1), "outside its regions"),
    ((2, 0, 0, 0, 16), "names region"),                             # region id past the list
    ((0, 0, -1, 0, 16), "names region"),
])
def test_a_bad_run_is_refused_and_nothing_moves(bad, match):
    """The last run is bad: the good ones before it must not have been copied either."""
    src, dst = _regions(2, 4096, 1), _regions(2, 4096, 100)
    before = [t.clone() for t in dst]
    with pytest.raises(PlanError, match=match):
        copy_runs(src, dst, _runs(_good_rows(FEW_RUNS + 4) + [bad]))
    assert all(torch.equal(a, b) for a, b in zip(before, dst))


def test_gather_and_scatter_check_their_runs_too():
    regions = _regions(2, 4096, 1)
    k = FEW_RUNS + 4
    region, offset, n = np.array([0] * (k - 1) + [1]), np.arange(k, dtype=np.int64) * 64, np.full(k, 64)
    offset[-1] = 4096 - 32   # 32 bytes past the end of region 1
    out = torch.zeros(int(n.sum()), dtype=torch.uint8)
    with pytest.raises(PlanError, match="outside its region"):
        gather_runs(regions, region, offset, n, out)
    assert int(out.count_nonzero()) == 0
    before = [t.clone() for t in regions]
    with pytest.raises(PlanError, match="outside its region"):
        scatter_runs(regions, region, offset, n, torch.full((int(n.sum()),), 9, dtype=torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(before, regions))


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("bad, block, match", [
    ((0, 4000, 200), None, "outside its region"),         # past the region's end
    ((1, -16, 16), None, "outside its region"),           # negative offset
    ((0, 0, -1), None, "outside its region"),             # negative length
    ((0, 2**63 - 8, 16), None, "outside its region"),     # offset + n overflows int64
    ((2, 0, 16), None, "outside its region"),             # region id past the list
    ((-1, 0, 16), None, "outside its region"),
    ((0, 0, 16), -8, "passes the block"),                 # the runs need 8 bytes more than the block
])
def test_staged_copies_refuse_a_bad_run_and_move_nothing(gather, bad, block, match):
    """``copy_staged`` (gather_runs / scatter_runs between host regions and one block): the last
    run is bad, or the runs need more than the block holds; nothing moves either way."""
    regions = _regions(2, 4096, 1)
    rows = [(i % 2, 16 * i, 16) for i in range(FEW_RUNS + 4)] + [bad]
    region, offset, n = (np.ascontiguousarray(c) for c in np.array(rows, np.int64).T)
    size = 16 * (len(rows) - 1) + max(bad[2], 0) + (block or 0) if block else 1 << 16
    data = torch.full((size,), 7, dtype=torch.uint8)
    before, before_data = [t.clone() for t in regions], data.clone()
    with pytest.raises(ValueError, match=match):
        hostcopy.copy_staged(data.data_ptr(), data.numel(), *_tables(regions), region, offset, n, gather,
                             RELEASE_GIL_FROM)
    assert all(torch.equal(a, b) for a, b in zip(before, regions)) and torch.equal(data, before_data)


def test_staged_copies_land_in_run_order_both_ways():
    """gather_runs then scatter_runs of the same runs (more than FEW_RUNS, every length and
    alignment, two regions) moves every byte to its place, streamed or not."""
    rng = np.random.default_rng(9)
    src = [torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8)) for _ in range(2)]
    n = rng.integers(1, 700, 200)
    region, offset = rng.integers(0, 2, 200), rng.integers(0, (1 << 16) - 700, 200)
    block = gather_runs(src, region, offset, n)
    want = torch.cat([src[r][o: o + k] for r, o, k in zip(region, offset, n)])
    assert torch.equal(block, want)
    for stream_from in (-1, 0):
        dst = _regions(2, 1 << 16, 0)
        order = np.concatenate(([0], np.cumsum(n)))
        expect = [t.clone() for t in dst]
        for i in range(200):   # overlapping destinations: the last run written wins, in run order
            expect[region[i]][offset[i]: offset[i] + n[i]] = block[order[i]: order[i + 1]]
        hostcopy.copy_staged(block.data_ptr(), block.numel(), *_tables(dst), *(np.ascontiguousarray(c, np.int64)
                             for c in (region, offset, n)), False, RELEASE_GIL_FROM, stream_from)
        assert all(torch.equal(a, b) for a, b in zip(dst, expect)), stream_from


def test_runs_between_host_regions_land_byte_exact():
    rng = np.random.default_rng(3)
    src = [torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8)) for _ in range(3)]
    dst = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)]
    rows = [(int(rng.integers(3)), int(rng.integers(0, 1 << 15)), i % 2, 512 * i, int(rng.integers(1, 512)))
            for i in range(100)]
    copy_runs(src, dst, _runs(rows))
    want = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)]
    for sr, so, dr, do, n in rows:
        want[dr][do: do + n] = src[sr][so: so + n]
    assert all(torch.equal(a, b) for a, b in zip(dst, want))
    staged = gather_runs(src, np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                         np.array([r[4] for r in rows]))
    assert torch.equal(staged, torch.cat([src[sr][so: so + n] for sr, so, _, _, n in rows]))


def test_bad_arrays_are_refused_in_words():
    a8, z = np.zeros(1, np.int64), np.zeros(1, np.int64)
    with pytest.raises(TypeError, match="src_offset must be a 1-D int64 array"):
        hostcopy.copy_runs(a8, a8, a8, a8, z, np.zeros(1, np.int32), z, z, z, 0)
    with pytest.raises(ValueError, match="dst_region has 2 entries"):
        hostcopy.copy_runs(a8, a8, a8, a8, z, z, np.zeros(2, np.int64), z, z, 0)
    with pytest.raises(ValueError, match="one address and one size"):
        hostcopy.copy_runs(a8, np.zeros(2, np.int64), a8, a8, z, z, z, z, z, 0)
    with pytest.raises(ValueError, match="address 0"):   # a region at NULL with a run of bytes in it
        hostcopy.copy_runs(a8, np.full(1, 64), a8, np.full(1, 64), z, z, z, z, np.full(1, 8), 0)
    with pytest.raises(TypeError):
        hostcopy.copy_runs(a8, a8, a8, a8, z, z, z, z, [0], 0)


def test_a_region_that_is_not_contiguous_is_refused():
    src = [torch.zeros(8192, dtype=torch.uint8)[::2]]
    dst = [torch.zeros(4096, dtype=torch.uint8)]
    with pytest.raises(TransportError, match="not contiguous"):
        copy_runs(src, dst, _runs(_good_rows(FEW_RUNS + 1)))


def test_a_device_region_in_the_list_takes_the_device_path():
    """One region off the host (``meta`` here): the compiled copy must never see its address."""
    src = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8, device="meta")]
    dst = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)]
    g = RunGroup(np.array([1], np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                 np.arange(0, 64 * (FEW_RUNS + 2), 64), np.arange(0, 64 * (FEW_RUNS + 2), 64),
                 np.full(FEW_RUNS + 2, 32), False)
    with pytest.raises((NotImplementedError, RuntimeError)):   # torch: meta -> cpu has no data to copy
        execute_plan(TransferPlan((g,)), src, dst)
    with pytest.raises((NotImplementedError, RuntimeError)):   # a HostTable side gives its tensors there
        execute_plan(TransferPlan((g,)), src, host_table(dst))


@pytest.mark.parametrize("helper", ["copy_runs", "copy_group"])
def test_a_large_copy_lets_other_threads_run(helper):
    """At RELEASE_GIL_FROM bytes and above the copy runs without the GIL: a thread busy in
    Python moves on while it copies (with the GIL held it could not: the switch interval is
    longer than the copy)."""
    n = max(32 << 20, RELEASE_GIL_FROM)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    dst.fill_(2)
    tables = [np.array([t.data_ptr()], np.int64) for t in (src,)] + [np.array([n], np.int64)]
    dtab = [np.array([dst.data_ptr()], np.int64), np.array([n], np.int64)]
    z, size = np.zeros(1, np.int64), np.array([n], np.int64)
    count, stop, started = [0], [False], threading.Event()

    def spin():
        started.set()
        while not stop[0]:
            count[0] += 1
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    t = threading.Thread(target=spin)
    try:
        t.start()
        started.wait(5)
        moved = []
        for _ in range(3):
            before = count[0]
            if helper == "copy_runs":
                hostcopy.copy_runs(tables[0], tables[1], dtab[0], dtab[1], z, z, z, z, size, RELEASE_GIL_FROM)
            else:
                hostcopy.copy_group(tables[0], tables[1], dtab[0], dtab[1], z, z, z, z, z, z, size, 1, 0, 0,
                                    RELEASE_GIL_FROM)
            moved.append(count[0] - before)
    finally:
        stop[0] = True
        t.join()
        sys.setswitchinterval(old)
    assert bool((dst == 1).all())
    assert max(moved) > 0, moved


def _tables(regions: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([t.data_ptr() for t in regions], np.int64), np.array([t.numel() for t in regions], np.int64))


def _columns(rows: list[tuple[int, int, int, int, int]]) -> list[np.ndarray]:
    """The five run columns as the compiled helper takes them (contiguous int64 arrays)."""
    return [np.ascontiguousarray(c) for c in np.array(rows, np.int64).reshape(-1, 5).T]


@pytest.mark.parametrize("stream_from", [-1, 0])
def test_streamed_copies_land_every_byte_whatever_the_alignment(stream_from):
    """``stream_from``: runs of every length and alignment (streaming stores cover only a 16-byte
    aligned middle; the head and tail are copied plainly) land exactly as without streaming."""
    rng = np.random.default_rng(5)
    src = [torch.from_numpy(rng.integers(0, 256, 1 << 17, dtype=np.uint8))]
    dst = [torch.zeros(1 << 18, dtype=torch.uint8)]
    lengths = [1, 15, 16, 63, 255, 256, 257, 300, 511, 512, 513, 1000, 4096, 4099, 8191]
    rows, do = [], 3
    for i, n in enumerate(lengths * 4):
        so = int(rng.integers(0, (1 << 17) - n))
        rows.append((0, so, 0, do, n))
        do += n + i % 17   # every destination alignment
    hostcopy.copy_runs(*_tables(src), *_tables(dst), *_columns(rows), RELEASE_GIL_FROM, stream_from)
    want = torch.zeros(1 << 18, dtype=torch.uint8)
    for _, so, _, d, n in rows:
        want[d: d + n] = src[0][so: so + n]
    assert torch.equal(dst[0], want)


def test_streamed_copies_of_overlapping_runs_move_as_memmove():
    """A run whose source and destination overlap (one region, moved by less than its length) is
    copied as memmove, streaming or not: streaming stores front to back would read bytes they
    had already overwritten."""
    base = torch.from_numpy(np.random.default_rng(6).integers(0, 256, 1 << 15, dtype=np.uint8))
    for shift in (64, -64, 4096 + 16):
        region = [base.clone()]
        want = base.clone()
        so, n = 4096, 8192
        want[so + shift: so + shift + n] = base[so: so + n].clone()
        tab = _tables(region)
        hostcopy.copy_runs(*tab, *tab, *_columns([(0, so, 0, so + shift, n)]), RELEASE_GIL_FROM, 0)
        assert torch.equal(region[0], want), shift


def test_a_scatter_large_enough_to_stream_lands_byte_exact():
    """``scatter_runs`` of at least ``STREAM_FROM`` bytes (streaming stores): half rows into rows
    twice as long, as a receiver lands a head slice of token-major pages."""
    n_rows, half = (2 * STREAM_FROM) // 512, 512
    data = torch.from_numpy(np.random.default_rng(7).integers(0, 256, n_rows * half, dtype=np.uint8))
    dst = [torch.zeros(n_rows * 2 * half + 4096, dtype=torch.uint8)]
    offset = np.random.default_rng(8).permutation(n_rows).astype(np.int64) * (2 * half) + half
    scatter_runs(dst, np.zeros(n_rows, np.int64), offset, np.full(n_rows, half, np.int64), data)
    rows = dst[0][: n_rows * 2 * half].view(n_rows, 2, half)
    assert int(rows[:, 0].count_nonzero()) == 0 and int(dst[0][n_rows * 2 * half:].count_nonzero()) == 0
    assert torch.equal(rows[torch.from_numpy(offset // (2 * half)), 1], data.view(n_rows, half))



def _group(parts: list[tuple[int, int, int, int]], rows: list[tuple[int, int, int]], heads: int = 1,
           shs: int = 0, dhs: int = 0) -> RunGroup:
    p, r = np.array(parts, np.int64).reshape(-1, 4), np.array(rows, np.int64).reshape(-1, 3)
    return RunGroup(p[:, 0], p[:, 1], p[:, 2], p[:, 3], r[:, 0], r[:, 1], r[:, 2], False, heads, shs, dhs)


def test_a_group_lands_as_its_runs_would():
    """``execute_plan`` on host regions copies each group in one call (``hostcopy.copy_group``),
    never spelling its runs out: what lands is what ``RunGroup.runs()`` says, part x row x
    head, for heads that did not merge and for whole rows; through a ``HostTable`` made once
    too."""
    rng = np.random.default_rng(5)
    src = [torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8)) for _ in range(3)]
    groups = (_group([(0, 0, 1, 0), (2, 8192, 0, 4096), (1, 100, 1, 30000)],
                     [(64 * i, 96 * i + 7, 40 + i) for i in range(20)], heads=3, shs=2048, dhs=4096),
              _group([(1, 50, 0, 20000)], [(0, 0, 1000), (5000, 3000, 16)]))
    plan = TransferPlan(groups)
    want = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)]
    copy_runs(src, want, plan.runs())
    for tables in (False, True):
        dst = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)]
        if tables:
            execute_plan(plan, host_table(src), host_table(dst))
        else:
            execute_plan(plan, src, dst)
        assert all(torch.equal(a, b) for a, b in zip(dst, want)), tables
    assert host_table([src[0], torch.zeros(4, dtype=torch.uint8, device="meta")]) is None


@pytest.mark.parametrize("part, row, heads, strides, match", [
    ((0, 4000, 0, 0), (0, 0, 200), 1, (0, 0), "outside its regions"),          # source past the end
    ((0, 0, 1, 0), (0, 4090, 16), 1, (0, 0), "outside its regions"),           # destination past the end
    ((0, 0, 0, 0), (-16, 0, 16), 1, (0, 0), "outside its regions"),            # negative row
    ((0, 0, 0, 0), (0, 0, -1), 1, (0, 0), "outside its regions"),              # negative length
    ((0, 2**63 - 8, 0, 0), (16, 0, 16), 1, (0, 0), "outside its regions"),     # base + row overflows
    ((0, 0, 0, 0), (0, 0, 16), 3, (2**62, 0), "outside its regions"),          # head 2 x stride overflows
    ((0, 0, 0, 0), (0, 0, 16), 4, (0, 1400), "head 3"),                        # the last head leaves
    ((2, 0, 0, 0), (0, 0, 16), 1, (0, 0), "names region"),                     # region id past the list
    ((0, 0, -1, 0), (0, 0, 16), 1, (0, 0), "names region"),
    ((0, 0, 0, 0), (0, 0, 16), 0, (0, 0), "heads must be >= 1"),
])
def test_a_bad_group_is_refused_by_the_compiled_copy_and_nothing_moves(part, row, heads, strides, match):
    """Whatever its caller checked (``execute_plan`` skips ``check_plan_bounds`` for a plan the
    planner vouched for), ``copy_group`` checks every part x row x head first: the bad one is
    last (the second part, its last row), and the good ones before it must not have moved."""
    src, dst = _regions(2, 4096, 1), _regions(2, 4096, 100)
    before = [t.clone() for t in dst]
    bad = _group([(0, 0, 1, 0), part], [(16 * i, 16 * i, 16) for i in range(8)] + [row], heads, *strides)
    cols = [np.ascontiguousarray(c, np.int64) for c in (bad.src_region, bad.src_base, bad.dst_region, bad.dst_base,
                                                          bad.row_src, bad.row_dst, bad.row_len)]
    with pytest.raises(ValueError, match=match):
        hostcopy.copy_group(*_tables(src), *_tables(dst), *cols, heads, *strides, RELEASE_GIL_FROM)
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
    with pytest.raises(PlanError):   # and through the executor (its own check, before the helper's)
        execute_plan(TransferPlan((bad,)), src, dst)
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
