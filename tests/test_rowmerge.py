"""The planner's compiled row work (``kvxfer/rowmerge.c``) against plain Python loops written here,
and its refusals of arrays it cannot read. The planner's own tests (``test_plan*.py``) check the
plans it makes byte for byte against a naive copy."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer import rowmerge
from kvxfer.errors import LayoutError
from kvxfer.layout import token_major_layout
from kvxfer.plan_rows import Geometry, can_touch, merge_any_order, merge_runs


def reference_merge(rs, rd, lens, sort):
    """Runs merged where one starts, on both sides, where the one before it ends; with ``sort``,
    once more in (stable) source order when they are out of it."""
    out: list[list[int]] = []
    for s, d, n in zip(rs, rd, lens):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    if sort and any(b[0] < a[0] for a, b in zip(out, out[1:])):
        return reference_merge(*zip(*sorted(out, key=lambda r: r[0])), False)
    return out


def reference_offset(slot, page_size, page_stride, token_stride, shift):
    page, in_page = divmod(slot, page_size)   # Python's floor division
    return page * page_stride + in_page * token_stride + shift


def random_runs(rng, n):
    """Runs of which about half continue the one before on both sides, in shuffled blocks."""
    rs, rd, lens = [], [], []
    for _ in range(n):
        length = int(rng.integers(1, 5)) * 8
        if rs and rng.random() < 0.5:
            rs.append(rs[-1] + lens[-1])
            rd.append(rd[-1] + lens[-1])
        else:
            rs.append(int(rng.integers(0, 4096)) * 8)
            rd.append(int(rng.integers(0, 4096)) * 8)
        lens.append(length)
    return [np.asarray(c, np.int64) for c in (rs, rd, lens)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("sort", [False, True])
def test_merge_equals_the_plain_loop(seed, sort):
    rng = np.random.default_rng(seed)
    rs, rd, lens = random_runs(rng, int(rng.integers(2, 300)))
    if seed % 4 == 0:   # descending blocks: only a source-order pass merges them
        rs, rd, lens = rs[::-1].copy(), rd[::-1].copy(), lens[::-1].copy()
    got = (merge_any_order if sort else lambda a, b, c, _: merge_runs(a, b, c))(rs, rd, lens, True)
    want = reference_merge(rs.tolist(), rd.tolist(), lens.tolist(), sort)
    assert np.stack(got, axis=1).tolist() == want


def test_a_descending_request_merges_in_source_order():
    # pages handed out last-first on both sides: they touch only once sorted by source
    rs = np.array([96, 64, 32, 0], np.int64)
    got = merge_any_order(rs, rs + 1000, np.full(4, 32, np.int64), True)
    assert [a.tolist() for a in got] == [[0], [1000], [128]]
    assert [a.tolist() for a in merge_any_order(rs, rs + 1000, np.full(4, 32, np.int64), False)] == \
        [rs.tolist(), (rs + 1000).tolist(), [32] * 4]


# every way an offset is worked out: pages back to back (one multiply), or a page stride of their
# own with a page size that is a power of two (shifts) or not (a division)
GEOMETRIES = [(16, 16 * 64, 64), (16, 3 * 16 * 64, 64), (3, 3 * 64, 64), (3, 5 * 3 * 64, 64), (1, 64, 64),
              (4, 8 * 4 * 64, 64)]


@pytest.mark.parametrize("src", range(len(GEOMETRIES)))
@pytest.mark.parametrize("dst", [1, 3])
def test_token_rows_equal_the_plain_loop(src, dst):
    rng = np.random.default_rng(10 * src + dst)
    n = int(rng.integers(50, 200))
    geoms = [(*GEOMETRIES[i][:3], int(rng.integers(0, 4)) * 8) for i in (src, dst)]
    # whole pages in shuffled order, some slots below zero (the floor division of a negative slot)
    pages = rng.permutation(64) - 2
    slots = [(pages[:, None] * g[0] + np.arange(g[0])).ravel() for g in geoms]
    n = min(n, *(len(s) for s in slots))
    src, dst = (np.ascontiguousarray(s[:n], np.int64) for s in slots)
    length = geoms[0][2]
    out = np.empty((3, n), np.int64)
    k = rowmerge.token_rows(src, dst, geoms[0], geoms[1], length, out[0], out[1], out[2])
    want = reference_merge([reference_offset(int(s), *geoms[0]) for s in src],
                           [reference_offset(int(d), *geoms[1]) for d in dst], [length] * n, False)
    assert out[:, :k].T.tolist() == want
    # through the planner's geometry, with the merge in source order when asked
    g = Geometry("a", "b", geoms[0][0], geoms[1][0], (geoms[0][1], geoms[0][2], 0), (geoms[1][1], geoms[1][2], 0),
                 length, 0, 0, 1, *(np.zeros(1, np.int64),) * 4)
    got = g.rows(src, dst)[0][:3]
    touch = can_touch(geoms[0][0], geoms[0][1], geoms[0][2], length) and \
        can_touch(geoms[1][0], geoms[1][1], geoms[1][2], length)
    want = reference_merge([reference_offset(int(s), *geoms[0][:3], 0) for s in src],
                           [reference_offset(int(d), *geoms[1][:3], 0) for d in dst], [length] * n, touch)
    assert np.stack(got, axis=1).tolist() == want


def test_outside_finds_the_first_value_out_of_range():
    v = np.array([16, 17, 40, 15, 99], np.int64)
    assert rowmerge.outside(v, 16, 64) == 3
    assert rowmerge.outside(v[:3].copy(), 16, 64) == -1
    assert rowmerge.outside(v, 16, 41) == 3
    assert rowmerge.outside(np.zeros(0, np.int64), 0, 1) == -1
    layout = token_major_layout(layers=1, heads=1, head_dim=8, dtype="float16", num_slots=64, page_size=16)
    with pytest.raises(LayoutError, match=r"slots\[2\] = 3 is in the padding page"):
        layout.check_slots("token", np.array([16, 17, 3, 70]))
    with pytest.raises(LayoutError, match=r"slots\[1\] = 64 is out of range"):
        layout.check_slots("token", np.array([16, 64], np.int32))   # converted, then checked
    assert layout.check_slots("token", np.arange(16, 64)[::2]).tolist() == list(range(16, 64, 2))  # strided


def test_arrays_it_cannot_read_are_refused_before_anything_is_written():
    a = np.arange(4, dtype=np.int64)
    out = [np.full(4, -7, np.int64) for _ in range(3)]
    with pytest.raises(TypeError, match="rs must be a 1-D int64 array"):
        rowmerge.merge(a.astype(np.int32), a, a, *out)
    with pytest.raises(ValueError, match="differ in length"):
        rowmerge.merge(a, a[:3].copy(), a, *out)
    with pytest.raises(ValueError, match="out_lens has 3 entries, fewer than the 4 runs"):
        rowmerge.merge(a, a, a, out[0], out[1], out[2][:3])
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        rowmerge.merge(np.arange(8, dtype=np.int64)[::2], a, a, *out)
    with pytest.raises(TypeError, match="out_rs must be a 1-D int64 array"):
        rowmerge.merge(a, a, a, np.zeros(4, np.int32), out[1], out[2])
    with pytest.raises((TypeError, ValueError, BufferError)):   # read-only output
        ro = np.zeros(4, np.int64)
        ro.setflags(write=False)
        rowmerge.merge(a, a, a, ro, out[1], out[2])
    geom = (16, 256, 16, 0)
    with pytest.raises(ValueError, match="src page size must be >= 1"):
        rowmerge.token_rows(a, a, (0, 256, 16, 0), geom, 16, *out)
    with pytest.raises(TypeError):
        rowmerge.token_rows(a, a, [16, 256, 16, 0], geom, 16, *out)
    with pytest.raises(ValueError, match="4 src slots vs 3 dst slots"):
        rowmerge.token_rows(a, a[:3].copy(), geom, geom, 16, *out)
    with pytest.raises(ValueError, match="fewer than the 4 runs"):
        rowmerge.token_rows(a, a, geom, geom, 16, out[0][:2], out[1], out[2])
    with pytest.raises(TypeError, match="values must be a 1-D int64 array"):
        rowmerge.outside(np.zeros(3, np.float64), 0, 1)
    assert all((o == -7).all() for o in out)
