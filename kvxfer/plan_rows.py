"""The row work of the planner (``kvxfer.plan``): part pairs that share one row pattern
(``Geometry``), each token's row at its byte offset merged with the rows it continues
(``Geometry.rows``; ``merge_runs``, ``merge_any_order`` for runs already made) and fusing parts
that sit back to back on both sides (``fuse_parts``). The offsets and merges are one compiled
call each (``kvxfer/rowmerge.c``), the rest numpy; no I/O. The planner's module docstring says
how the steps fit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import rowmerge


def _merged(fill, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``fill(out_rs, out_rd, out_lens) -> count`` (a ``rowmerge`` call) into fresh arrays."""
    out = np.empty((3, n), np.int64)
    k = fill(out[0], out[1], out[2])
    if 2 * k < n:   # a plan keeps its rows while its transfer lives: not the room for n of them
        out = out[:, :k].copy()
    return out[0, :k], out[1, :k], out[2, :k]


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.int64)


def merge_runs(rs: np.ndarray, rd: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive rows (runs) that are adjacent on both sides: starts ``rs`` / ``rd``."""
    if len(lens) <= 1:
        return rs, rd, lens
    rs, rd, lens = _i64(rs), _i64(rd), _i64(lens)
    return _merged(lambda *out: rowmerge.merge(rs, rd, lens, *out), len(lens))


def merge_any_order(rs: np.ndarray, rd: np.ndarray, lens: np.ndarray, can_touch: bool):
    """``merge_runs`` in request order, then once more in source order when rows are out of
    order: the order of runs is free, and pages handed out in descending order on both
    sides (allocators that free a request's pages last-first) touch only in source order.
    ``can_touch`` False (see ``can_touch``) skips that sort where it cannot merge anything."""
    return _in_source_order(*merge_runs(rs, rd, lens), can_touch)


def _in_source_order(rs: np.ndarray, rd: np.ndarray, lens: np.ndarray, can_touch: bool):
    """Merged runs merged once more in source order, when they are out of it and ``can_touch``."""
    if can_touch and len(lens) > 1 and np.count_nonzero(rs[1:] < rs[:-1]):
        order = np.argsort(rs, kind="stable")
        return merge_runs(rs[order], rd[order], lens[order])
    return rs, rd, lens


@functools.lru_cache(maxsize=4096)
def can_touch(page_size: int, page_stride: int, token_stride: int, length: int) -> bool:
    """Whether one slot's block of ``length`` bytes can end where another slot's starts:
    ``d_page * page_stride + d_in_page * token_stride == length`` has an integer solution
    with ``|d_in_page| < page_size``. (NHD rows of one head never touch: heads sit between.)"""
    for di in range(-(page_size - 1), page_size):
        rest = length - di * token_stride
        if (rest == 0) if page_stride == 0 else (rest % page_stride == 0):
            return True
    return False


@dataclass(frozen=True, slots=True, eq=False)
class Geometry:
    """Part pairs that share one row pattern."""
    src_space: str
    dst_space: str
    src_page_size: int
    dst_page_size: int
    src: tuple[int, int, int]   # page_stride, token_stride, head_stride
    dst: tuple[int, int, int]
    head_bytes: int
    src_head0: int
    dst_head0: int
    nheads: int
    src_region: np.ndarray
    src_base: np.ndarray
    dst_region: np.ndarray
    dst_base: np.ndarray

    def rows(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> list[tuple]:
        """Row sets ``(row_src, row_dst, row_len, heads, src_head_stride, dst_head_stride)``."""
        (sps, sts, shs), (dps, dts, dhs), hb, nh = self.src, self.dst, self.head_bytes, self.nheads
        src_slots, dst_slots = _i64(src_slots), _i64(dst_slots)

        def rows(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Each token's row of ``length`` bytes, merged (compiled: ``rowmerge.token_rows``)."""
            touch = (can_touch(self.src_page_size, sps, sts, length)
                     and can_touch(self.dst_page_size, dps, dts, length))
            merged = _merged(lambda *out: rowmerge.token_rows(
                src_slots, dst_slots, (self.src_page_size, sps, sts, self.src_head0 * shs),
                (self.dst_page_size, dps, dts, self.dst_head0 * dhs), length, *out), len(src_slots))
            return _in_source_order(*merged, touch)
        if nh == 1 or (shs == hb and dhs == hb):
            return [(*rows(nh * hb), 1, 0, 0)]
        # One segment per head: merge tokens per head (whole HND pages), then heads whose
        # blocks touch on both sides, and keep the rest as a head factor of the group.
        rs, rd, lens = rows(hb)
        fuse = (lens == shs) & (lens == dhs)
        out = []
        if fuse.any():
            out.append((*merge_runs(rs[fuse], rd[fuse], lens[fuse] * nh), 1, 0, 0))
        if (~fuse).any():
            out.append((rs[~fuse], rd[~fuse], lens[~fuse], nh, shs, dhs))
        return out


def fuse_parts(row_sets: list[tuple]) -> list[tuple]:
    """Fuse parts that sit back to back on both sides (see module docstring, step 3).

    ``row_sets`` holds ``(geometry, rs, rd, lens, heads, shs, dhs)`` per geometry. Parts
    of *different* geometries fuse too when their full rows start at the same offsets: a
    page-major page with K and V of different head dims is ``[L0 K | L0 V | L1 K | ...]``
    and must still move as one run per page run. Returns ``(src_region, src_base,
    dst_region, dst_base, rs, rd, lens, heads, shs, dhs)`` tuples.
    """
    out, candidates = [], []
    for g, rs, rd, lens, heads, shs, dhs in row_sets:
        whole = (g.src_region, g.src_base, g.dst_region, g.dst_base, rs, rd, lens, heads, shs, dhs)
        if len(lens) == 0 or heads > 1:
            out.append(whole)
        else:
            candidates.append((whole, lens == lens.max()))
    # Group row sets whose full rows start at the same offsets on both sides.
    groups: list[list[tuple]] = []
    for whole, full in candidates:
        for grp in groups:
            w0, f0 = grp[0]
            if np.array_equal(w0[4][f0], whole[4][full]) and np.array_equal(w0[5][f0], whole[5][full]):
                grp.append((whole, full))
                break
        else:
            groups.append([(whole, full)])
    for grp in groups:
        sreg = np.concatenate([w[0] for w, _ in grp])
        sbase = np.concatenate([w[1] for w, _ in grp])
        dreg = np.concatenate([w[2] for w, _ in grp])
        dbase = np.concatenate([w[3] for w, _ in grp])
        plen = np.concatenate([np.full(len(w[1]), w[6].max(), np.int64) for w, _ in grp])  # full-row length
        order = np.lexsort((sbase, sreg))
        sreg, sbase, dreg, dbase, plen = sreg[order], sbase[order], dreg[order], dbase[order], plen[order]
        link = ((np.diff(sbase) == plen[:-1]) & (np.diff(dbase) == plen[:-1])
                & (sreg[1:] == sreg[:-1]) & (dreg[1:] == dreg[:-1]))
        if not link.any():
            out.extend(w for w, _ in grp)
            continue
        for w, full in grp:  # rows shorter than the full length move per part
            if (~full).any():
                out.append((*w[:4], w[4][~full], w[5][~full], w[6][~full], 1, 0, 0))
        rs, rd = grp[0][0][4][grp[0][1]], grp[0][0][5][grp[0][1]]
        starts = np.flatnonzero(np.concatenate(([True], ~link)))
        chain_len = np.add.reduceat(plen, starts)  # bytes of a chain of back-to-back parts
        for c in np.unique(chain_len):
            pick = starts[chain_len == c]
            # fused rows (whole pages of several parts) may touch in source order only
            frs, frd, flens = merge_any_order(rs, rd, np.full(len(rs), c, np.int64), True)
            out.append((sreg[pick], sbase[pick], dreg[pick], dbase[pick], frs, frd, flens, 1, 0, 0))
    return out


__all__ = ["merge_runs", "merge_any_order", "can_touch", "Geometry", "fuse_parts"]
