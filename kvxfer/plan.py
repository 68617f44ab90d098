"""The planner: (layout, slots, head slice) x (layout, slots, head slice) -> runs.

Pure and vectorized: numpy over slot arrays, no I/O, no Python loop per token or page.

A ``TransferPlan`` is a few ``RunGroup``s. A group factors its runs as
*parts x rows*: every part pair (same layer and kind on both sides) shares the same
row pattern, so a 160-part, 8k-page request is stored as 160 bases plus 8k rows,
and ``TransferPlan.runs()`` expands it into flat arrays on demand.

How runs are made as large as both sides allow:

1. per token, the heads of the slice are one segment when heads are adjacent on both
   sides (NHD), else one segment per head (HND);
2. consecutive segments that are adjacent in both source and destination merge
   (slot runs in token-major, whole pages of one head in HND), in request order and
   then in source order (pages handed out in descending order on both sides);
3. parts whose blocks sit back to back on both sides fuse (a page-major page holds
   every layer's K and V contiguously, whatever their head dims: one run per page run,
   not per layer);
4. rows shorter than ``pack_below`` bytes go into a *packed* group: the sender gathers
   them into one staging block and the receiver scatters it (see ``gather_runs``).
"""
from __future__ import annotations

import bisect
import functools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .errors import PlanError
from .layout import Layout, Part

# Runs shorter than this are packed. Measured by scripts/bench_pack.py (shared 2-core CPU
# box, 16 MiB of scattered runs, four runs): packing always wins at 8 KiB and below
# (x1.2-x24), one copy per run wins from 32 KiB up in 3 of 4 runs (x1.6-x2.0), 16 KiB
# is a toss-up (packed x1.3-x1.8 in 3 of 4); the crossover is 16-32 KiB.
PACK_BELOW = 16 * 1024
# Runs at least this long are copied one by one; shorter ones go through index gather.
BIG_RUN = 64 * 1024
# A transfer or message of at most this many runs is handled with Python ints, not arrays:
# below it, numpy's fixed cost per call (~1-5 us, ~20 calls) exceeds a loop over the runs
# (gather_runs / scatter_runs / copy_runs: a slice copy per run; index building costs more).
FEW_RUNS = 32
# copy_runs (local copies) moves runs shorter than this as rows of one index_select / scatter.
COPY_ONE_BY_ONE = 1 << 20
# ... in pieces of evenly spaced rows, while a piece averages at least this many bytes.
PIECE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Slice ``index`` of ``count`` equal slices of a part's local heads.

    Scaling per part keeps sub-blocked parts right: slice (1, 2) of a [q | k | v] conv
    state is the second half of q, of k and of v, never a cut across them.
    """
    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise PlanError(f"HeadSlice index {self.index} must be in 0..count-1 (count {self.count})")

    def of(self, part: Part, side: str) -> tuple[int, int]:
        if part.heads % self.count:
            raise PlanError(f"{side} part {part.key} has {part.heads} heads, not divisible into "
                            f"{self.count} slices (head slice {self.index}/{self.count})")
        n = part.heads // self.count
        return self.index * n, n

    def to_list(self) -> list[int]:
        return [self.index, self.count]


WHOLE = HeadSlice(0, 1)


class Runs(NamedTuple):
    """Flat runs; every array has one entry per run."""
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    packed: np.ndarray  # bool


@dataclass(frozen=True, slots=True, eq=False)
class RunGroup:
    """Runs = every part p x row r x head j (``heads`` is 1 unless heads could not merge):
    ``(src_region[p], src_base[p] + row_src[r] + j * src_head_stride, dst_region[p],
    dst_base[p] + row_dst[r] + j * dst_head_stride, row_len[r])``."""
    src_region: np.ndarray  # [parts] int64
    src_base: np.ndarray    # [parts]
    dst_region: np.ndarray  # [parts]
    dst_base: np.ndarray    # [parts]
    row_src: np.ndarray     # [rows]
    row_dst: np.ndarray     # [rows]
    row_len: np.ndarray     # [rows]
    packed: bool
    heads: int = 1
    src_head_stride: int = 0
    dst_head_stride: int = 0

    num_runs: int = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self):   # asked several times per submit: worked out once
        object.__setattr__(self, "num_runs", len(self.src_base) * len(self.row_len) * self.heads)
        object.__setattr__(self, "nbytes", len(self.src_base) * int(self.row_len.sum()) * self.heads)

    def run_tuples(self) -> list[tuple[int, int, int, int, int]]:
        """``runs()`` as Python ints ``(src_region, src_offset, dst_region, dst_offset, nbytes)``,
        for a group of a few runs (a loop per run: check ``num_runs`` first)."""
        return [(sr, sb + rs + j * self.src_head_stride, dr, db + rd + j * self.dst_head_stride, n)
                for sr, sb, dr, db in zip(self.src_region.tolist(), self.src_base.tolist(),
                                          self.dst_region.tolist(), self.dst_base.tolist())
                for rs, rd, n in zip(self.row_src.tolist(), self.row_dst.tolist(), self.row_len.tolist())
                for j in range(self.heads)]

    def runs(self) -> Runs:
        nparts, nrows, h = len(self.src_base), len(self.row_len), self.heads
        j = np.arange(h, dtype=np.int64)[None, None, :]
        so = (self.src_base[:, None, None] + self.row_src[None, :, None] + j * self.src_head_stride).ravel()
        do = (self.dst_base[:, None, None] + self.row_dst[None, :, None] + j * self.dst_head_stride).ravel()
        return Runs(np.repeat(self.src_region, nrows * h), so, np.repeat(self.dst_region, nrows * h), do,
                    np.tile(np.repeat(self.row_len, h), nparts), np.full(nparts * nrows * h, self.packed))


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    groups: tuple[RunGroup, ...]

    @property
    def num_runs(self) -> int:
        return sum(g.num_runs for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def num_packed_runs(self) -> int:
        return sum(g.num_runs for g in self.groups if g.packed)

    def runs(self) -> Runs:
        if not self.groups:
            e = np.zeros(0, np.int64)
            return Runs(e, e, e, e, e, np.zeros(0, bool))
        parts = [g.runs() for g in self.groups]
        return Runs(*(np.concatenate(cols) for cols in zip(*parts)))

    def run_tuples(self) -> list[tuple[int, int, int, int, int]]:
        """``runs()`` as Python ints, group after group (see ``RunGroup.run_tuples``)."""
        return [run for g in self.groups for run in g.run_tuples()]

    @staticmethod
    def concat(plans: Sequence["TransferPlan"]) -> "TransferPlan":
        return TransferPlan(tuple(g for p in plans for g in p.groups))


EMPTY_PLAN = TransferPlan(())


# ------------------------------------------------------------------------------------
def merge_runs(rs: np.ndarray, rd: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive rows (runs) that are adjacent on both sides: starts ``rs`` / ``rd``."""
    if len(lens) <= 1:
        return rs, rd, lens
    ends_s, ends_d = rs[:-1] + lens[:-1], rd[:-1] + lens[:-1]
    cont = (rs[1:] == ends_s) & (rd[1:] == ends_d)
    if not np.count_nonzero(cont):   # (count_nonzero: a quarter of .any()'s fixed cost)
        return rs, rd, lens
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return rs[starts], rd[starts], np.add.reduceat(lens, starts)


def _merge_any_order(rs: np.ndarray, rd: np.ndarray, lens: np.ndarray, can_touch: bool):
    """``merge_runs`` in request order, then once more in source order when rows are out of
    order: the order of runs is free, and pages handed out in descending order on both
    sides (allocators that free a request's pages last-first) touch only in source order.
    ``can_touch`` False (see ``_can_touch``) skips that sort where it cannot merge anything."""
    rs, rd, lens = merge_runs(rs, rd, lens)
    if can_touch and len(lens) > 1 and np.count_nonzero(rs[1:] < rs[:-1]):
        order = np.argsort(rs, kind="stable")
        rs, rd, lens = merge_runs(rs[order], rd[order], lens[order])
    return rs, rd, lens


@functools.lru_cache(maxsize=4096)
def _can_touch(page_size: int, page_stride: int, token_stride: int, length: int) -> bool:
    """Whether one slot's block of ``length`` bytes can end where another slot's starts:
    ``d_page * page_stride + d_in_page * token_stride == length`` has an integer solution
    with ``|d_in_page| < page_size``. (NHD rows of one head never touch: heads sit between.)"""
    for di in range(-(page_size - 1), page_size):
        rest = length - di * token_stride
        if (rest == 0) if page_stride == 0 else (rest % page_stride == 0):
            return True
    return False


def _token_offsets(slots: np.ndarray, page_size: int, page_stride: int, token_stride: int,
                   shift: int = 0) -> np.ndarray:
    page, in_page = np.divmod(slots, page_size)
    page *= page_stride
    in_page *= token_stride
    page += in_page
    if shift:
        page += shift
    return page


@dataclass(frozen=True, slots=True, eq=False)
class _Geometry:
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
        so = _token_offsets(src_slots, self.src_page_size, sps, sts, self.src_head0 * shs)
        do = _token_offsets(dst_slots, self.dst_page_size, dps, dts, self.dst_head0 * dhs)
        def touch(length: int) -> bool:
            return (_can_touch(self.src_page_size, sps, sts, length)
                    and _can_touch(self.dst_page_size, dps, dts, length))
        if nh == 1 or (shs == hb and dhs == hb):
            return [(*_merge_any_order(so, do, np.full(len(so), nh * hb, np.int64), touch(nh * hb)), 1, 0, 0)]
        # One segment per head: merge tokens per head (whole HND pages), then heads whose
        # blocks touch on both sides, and keep the rest as a head factor of the group.
        rs, rd, lens = _merge_any_order(so, do, np.full(len(so), hb, np.int64), touch(hb))
        fuse = (lens == shs) & (lens == dhs)
        out = []
        if fuse.any():
            out.append((*merge_runs(rs[fuse], rd[fuse], lens[fuse] * nh), 1, 0, 0))
        if (~fuse).any():
            out.append((rs[~fuse], rd[~fuse], lens[~fuse], nh, shs, dhs))
        return out


def _fuse_parts(row_sets: list[tuple]) -> list[tuple]:
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
            frs, frd, flens = _merge_any_order(rs, rd, np.full(len(rs), c, np.int64), True)
            out.append((sreg[pick], sbase[pick], dreg[pick], dbase[pick], frs, frd, flens, 1, 0, 0))
    return out


class Planner:
    """The prepared path: match parts once, then plan many requests.

    ``Planner(src, dst, ...)`` pairs parts and checks that they agree (dtype, head
    bytes, head counts after slicing); ``plan(src_slots, dst_slots)`` then costs only
    the vectorized row work. ``plan_transfer`` is the one-shot form.
    """

    def __init__(self, src: Layout, dst: Layout, *, src_heads: HeadSlice = WHOLE, dst_heads: HeadSlice = WHOLE,
                 layers: Sequence[int] | None = None, kinds: Sequence[str] | None = None,
                 pack_below: int = PACK_BELOW):
        self.src, self.dst, self.pack_below = src, dst, int(pack_below)
        keep_layers = None if layers is None else set(layers)
        keep_kinds = None if kinds is None else set(kinds)
        groups: dict[tuple, list] = {}
        for sp in src.parts:
            if (keep_layers is not None and sp.layer not in keep_layers) or \
               (keep_kinds is not None and sp.kind not in keep_kinds):
                continue
            if not dst.has_part(sp.key):
                raise PlanError(f"destination {dst.kind} has no part layer={sp.layer} kind={sp.kind!r} "
                                f"(it holds layers {list(dst.layers)}, kinds {list(dst.kinds)})")
            dp = dst.part(*sp.key)
            if sp.dtype != dp.dtype:
                raise PlanError(f"part {sp.key}: dtype src {sp.dtype} vs dst {dp.dtype}")
            if sp.head_bytes != dp.head_bytes:
                raise PlanError(f"part {sp.key}: head_dim src {sp.head_dim} vs dst {dp.head_dim} "
                                f"(head_bytes {sp.head_bytes} vs {dp.head_bytes})")
            sh0, sn = src_heads.of(sp, "src")
            dh0, dn = dst_heads.of(dp, "dst")
            if sn != dn:
                raise PlanError(f"part {sp.key}: src slice {src_heads.index}/{src_heads.count} has {sn} heads "
                                f"but dst slice {dst_heads.index}/{dst_heads.count} has {dn}")
            ssp, dsp = src.space(sp.space), dst.space(dp.space)
            key = (sp.space, dp.space, ssp.page_size, dsp.page_size,
                   (sp.page_stride, sp.token_stride, sp.head_stride),
                   (dp.page_stride, dp.token_stride, dp.head_stride), sp.head_bytes, sh0, dh0, sn)
            groups.setdefault(key, []).append((sp.region, sp.base, dp.region, dp.base))
        if not groups:
            raise PlanError(f"nothing to plan: no source part matches layers={layers} kinds={kinds}")
        self._geoms = []
        for key, members in groups.items():
            a = np.asarray(members, dtype=np.int64)
            self._geoms.append(_Geometry(*key, a[:, 0], a[:, 1], a[:, 2], a[:, 3]))
        # Parts fuse only within one (source region, destination region) pair: a pool with a
        # region per part (token-major, HND) never fuses, and skips the search per request.
        pairs = [(m[0], m[2]) for members in groups.values() for m in members]
        self._may_fuse = len(set(pairs)) < len(pairs)
        self.spaces = sorted({(g.src_space, g.dst_space) for g in self._geoms})

    def plan(self, src_slots, dst_slots) -> TransferPlan:
        """``*_slots``: one array (the plan has one slot space) or ``{space: array}``."""
        slots = {}
        for s_space, d_space in self.spaces:
            s = self.src.check_slots(s_space, _pick(src_slots, s_space, "src_slots"), f"src_slots[{s_space}]")
            d = self.dst.check_slots(d_space, _pick(dst_slots, d_space, "dst_slots"), f"dst_slots[{d_space}]")
            if len(s) != len(d):
                raise PlanError(f"space {s_space}: {len(s)} src slots vs {len(d)} dst slots")
            slots[(s_space, d_space)] = (s, d)
        row_sets = []
        for g in self._geoms:
            s, d = slots[(g.src_space, g.dst_space)]
            if len(s):
                row_sets.extend((g, *rows) for rows in g.rows(s, d))
        if self._may_fuse:
            row_sets = _fuse_parts(row_sets)
        else:
            row_sets = [(g.src_region, g.src_base, g.dst_region, g.dst_base, *rows) for g, *rows in row_sets]
        out = []
        for sreg, sbase, dreg, dbase, frs, frd, flens, heads, shs, dhs in row_sets:
            small = flens < self.pack_below
            n_small = int(np.count_nonzero(small))
            if n_small in (0, len(flens)):   # all rows on one side: no split (the common case)
                if len(flens):
                    out.append(RunGroup(sreg, sbase, dreg, dbase, frs, frd, flens, n_small > 0, heads, shs, dhs))
                continue
            for mask, packed in ((~small, False), (small, True)):
                out.append(RunGroup(sreg, sbase, dreg, dbase, frs[mask], frd[mask], flens[mask],
                                    packed, heads, shs, dhs))
        return TransferPlan(tuple(out))


def _pick(slots, space: str, what: str):
    if isinstance(slots, Mapping):
        if space not in slots:
            raise PlanError(f"{what} has no entry for slot space {space!r} (got {sorted(slots)})")
        return slots[space]
    return slots


def plan_transfer(src: Layout, src_slots, dst: Layout, dst_slots, *, src_heads: HeadSlice = WHOLE,
                  dst_heads: HeadSlice = WHOLE, layers: Sequence[int] | None = None,
                  kinds: Sequence[str] | None = None, pack_below: int = PACK_BELOW) -> TransferPlan:
    """Plan moving the request's KV from ``src`` (at ``src_slots``) to ``dst`` (at ``dst_slots``).

    Token ``i`` of the request sits in ``src_slots[i]`` and goes to ``dst_slots[i]``.
    ``src_heads`` / ``dst_heads`` pick the head slice on each side (heterogeneous TP);
    ``layers`` / ``kinds`` restrict which parts move (pipeline stages, MLA-only ranks).
    """
    return Planner(src, dst, src_heads=src_heads, dst_heads=dst_heads, layers=layers, kinds=kinds,
                   pack_below=pack_below).plan(src_slots, dst_slots)


# ------------------------------------------------------------------------------------
# Byte ranges: what a grant allows a peer to write.
# ------------------------------------------------------------------------------------
MAX_OFFSET = 1 << 62
# Intervals of every region live on one axis, region r at [r << _REGION_BITS, (r + 1) << _REGION_BITS),
# so a check is one searchsorted however many regions the runs name. Regions up to 1 TiB.
_REGION_BITS = 40


_FEW_INTERVALS = 4096   # grants up to this many intervals also keep them as Python ints
_SORT_KEYS_ABOVE = 4096  # covers() sorts more runs than this before searching
_SPAN_GROUP = 16          # covers() first checks groups of this many neighbouring runs as one span


class ByteRanges:
    """Sorted, merged ``[start, end)`` intervals per region; checks runs against them."""

    def __init__(self, region: np.ndarray, start: np.ndarray, nbytes: np.ndarray):
        region, start, nbytes = (np.asarray(x, dtype=np.int64) for x in (region, start, nbytes))
        if len(region) and ((region < 0).any() or (region >= 1 << (62 - _REGION_BITS)).any()
                            or (start < 0).any() or (nbytes < 0).any()
                            or (start + nbytes > 1 << _REGION_BITS).any()):
            raise PlanError(f"byte ranges must lie in regions 0..{(1 << (62 - _REGION_BITS)) - 1} "
                            f"of at most {1 << _REGION_BITS} bytes")
        key = (region << _REGION_BITS) + start
        order = np.argsort(key, kind="stable")
        s, _, n = merge_runs(key[order], key[order], nbytes[order])
        self._starts, self._ends = s, s + n     # never crosses a region: ends stay <= its limit
        self._lists: tuple[list[int], list[int]] | None = None   # the same as Python ints, on first use
        self.nbytes = int(nbytes.sum())

    @classmethod
    def of_slots(cls, layout: Layout, slots) -> "ByteRanges":
        """Every byte of every part of ``layout`` at ``slots`` (one array, or ``{space: array}``)."""
        spaces = sorted({p.space for p in layout.parts})
        if not isinstance(slots, Mapping):
            slots = {s: slots for s in spaces}
        pieces = []
        for space in spaces:
            if space in slots and len(slots[space]):
                pieces.append(Planner(layout, layout, kinds=[p.kind for p in layout.parts if p.space == space],
                                      pack_below=0).plan(slots[space], slots[space]))
        r = TransferPlan.concat(pieces).runs()
        return cls(r.dst_region, r.dst_offset, r.nbytes)

    def intervals(self, region: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of the merged intervals in ``region``."""
        lo, hi = np.searchsorted(self._starts, [region << _REGION_BITS, (region + 1) << _REGION_BITS])
        base = region << _REGION_BITS
        return self._starts[lo:hi] - base, self._ends[lo:hi] - base

    def covers_run(self, region: int, offset: int, nbytes: int) -> bool:
        """``covers`` for one run of Python ints: a message of a few runs skips array setup."""
        limit = 1 << _REGION_BITS
        if not (0 <= region < 1 << (62 - _REGION_BITS) and 0 <= offset < limit and 0 < nbytes <= limit - offset):
            return False
        key = (region << _REGION_BITS) + offset
        if self._lists is None and len(self._starts) <= _FEW_INTERVALS:
            self._lists = (self._starts.tolist(), self._ends.tolist())
        if self._lists is None:
            i = int(np.searchsorted(self._starts, key, side="right")) - 1
            return i >= 0 and key + nbytes <= int(self._ends[i])
        starts, ends = self._lists   # bisect on ints: ~10x cheaper than one searchsorted call
        i = bisect.bisect_right(starts, key) - 1
        return i >= 0 and key + nbytes <= ends[i]

    def covers(self, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bool per run: lies wholly inside one granted interval. Safe on hostile values."""
        region, offset, nbytes = (np.asarray(x, dtype=np.int64) for x in (region, offset, nbytes))
        limit = 1 << _REGION_BITS
        valid = ((region >= 0) & (region < 1 << (62 - _REGION_BITS)) & (offset >= 0) & (nbytes > 0)
                 & (offset < limit) & (nbytes <= limit - offset))   # no sum before both are bounded
        if not len(self._starts):
            return np.zeros(len(region), dtype=bool)
        key = np.where(valid, (region << _REGION_BITS) + np.where(valid, offset, 0), 0)
        end = key + np.where(valid, nbytes, 0)
        if len(key) < 2 * _SPAN_GROUP:
            return valid & self._inside(key, end)
        # Runs come in stream order: neighbours tend to share a granted interval (a page's rows).
        # A group of _SPAN_GROUP neighbours whose whole span lies in one interval is covered
        # run by run (intervals never cross a region); only the other groups are searched run
        # by run. One announce of 65,536 half rows: 7.1 -> 1.5 ms.
        m = len(key) // _SPAN_GROUP * _SPAN_GROUP
        span_ok = (self._inside(key[:m].reshape(-1, _SPAN_GROUP).min(1), end[:m].reshape(-1, _SPAN_GROUP).max(1))
                   & valid[:m].reshape(-1, _SPAN_GROUP).all(1))
        out = np.zeros(len(key), dtype=bool)
        out[:m] = np.repeat(span_ok, _SPAN_GROUP)
        rest = np.flatnonzero(~out)
        out[rest] = valid[rest] & self._inside(key[rest], end[rest])
        return out

    def _inside(self, key: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Bool per ``[key, end)``: lies in one merged interval (keys already bounded)."""
        if len(key) > _SORT_KEYS_ABOVE:   # searches in key order stay in cache: 32768 random runs 3.4 -> 1.6 ms
            order = np.argsort(key)
            i = np.empty_like(key)
            i[order] = np.searchsorted(self._starts, key[order], side="right") - 1
        else:
            i = np.searchsorted(self._starts, key, side="right") - 1
        return (i >= 0) & (end <= self._ends[np.clip(i, 0, None)])


# ------------------------------------------------------------------------------------
# Executing runs on torch byte views (the reference executor and the packing helpers).
# regions: sequences of 1-D uint8 tensors, indexed by region id.
# ------------------------------------------------------------------------------------
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _unit_views(unit: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` as rows of ``unit`` bytes, all in the widest element type every one of
    them allows (the same for all, so assigning rows between them moves bytes, never
    converts values): torch's index kernels move a uint8 row one byte at a time."""
    size, dt = 1, torch.uint8
    for s, d in _WIDE:
        if unit % s == 0 and all(t.data_ptr() % s == 0 and t.storage_offset() % s == 0 for t in tensors):
            size, dt = s, d
            break
    return [t[: (t.numel() // unit) * unit].view(dt).view(-1, unit // size) for t in tensors]


def _span(index: np.ndarray) -> slice | None:
    """``index`` as a slice when it is consecutive: rows then need no index."""
    if len(index) and int(index[-1]) - int(index[0]) == len(index) - 1 and bool((np.diff(index) == 1).all()):
        return slice(int(index[0]), int(index[-1]) + 1)
    return None


def _element_index(offsets: np.ndarray, lens: np.ndarray, unit: int) -> np.ndarray:
    """Indices of every ``unit``-sized element covered by the runs, in run order."""
    counts = lens // unit
    total = int(counts.sum())
    firsts = np.repeat(offsets // unit - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return firsts + np.arange(total, dtype=np.int64)


def _unit(*arrays: np.ndarray) -> int:
    return int(np.gcd.reduce(np.concatenate([np.asarray(a, np.int64).ravel() for a in arrays]))) or 1


def _by_region(region: np.ndarray):
    """Yield (region id, index array) for each region present, without a loop per run."""
    if len(region) == 0:
        return
    order = np.argsort(region, kind="stable")
    r = region[order]
    cuts = np.flatnonzero(np.diff(r)) + 1
    for idx in np.split(order, cuts):
        yield int(region[idx[0]]), idx


def gather_runs(regions: Sequence[torch.Tensor], region: np.ndarray, offset: np.ndarray,
                nbytes: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the bytes of the runs (in run order) into one uint8 tensor."""
    total = int(nbytes.sum())
    device = regions[0].device if len(regions) else "cpu"
    out = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out
    if len(nbytes) <= FEW_RUNS:
        p = 0
        for r, o, k in zip(region.tolist(), offset.tolist(), nbytes.tolist()):
            out[p: p + k].copy_(regions[r][o: o + k])
            p += k
        return out
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
    for r, idx in _by_region(region):
        unit = _unit(offset[idx], nbytes[idx], pos[idx])
        src = torch.from_numpy(_element_index(offset[idx], nbytes[idx], unit)).to(regions[r].device)
        dst = _element_index(pos[idx], nbytes[idx], unit)
        reg_rows, out_rows = _unit_views(unit, regions[r], out)
        span = _span(dst)
        if span is not None and out.device == regions[r].device:  # one region: straight into the block
            torch.index_select(reg_rows, 0, src, out=out_rows[span])
        else:
            out_rows[torch.from_numpy(dst).to(out.device)] = reg_rows[src].to(out.device)
    return out


def scatter_runs(regions: Sequence[torch.Tensor], region: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray, data: torch.Tensor) -> None:
    """Inverse of ``gather_runs``: write consecutive bytes of ``data`` to the runs."""
    if len(nbytes) <= FEW_RUNS:
        p = 0
        for r, o, k in zip(region.tolist(), offset.tolist(), nbytes.tolist()):
            regions[r][o: o + k].copy_(data[p: p + k])
            p += k
        return
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
    for r, idx in _by_region(region):
        big = idx[nbytes[idx] >= BIG_RUN]
        for i in big.tolist():  # one copy per >= 64 KiB run: bounded by bytes / 64 KiB
            regions[r][offset[i]: offset[i] + nbytes[i]].copy_(data[pos[i]: pos[i] + nbytes[i]])
        small = idx[nbytes[idx] < BIG_RUN]
        if len(small):
            unit = _unit(offset[small], nbytes[small], pos[small])
            dst = torch.from_numpy(_element_index(offset[small], nbytes[small], unit)).to(regions[r].device)
            src = _element_index(pos[small], nbytes[small], unit)
            reg_rows, data_rows = _unit_views(unit, regions[r], data)
            span = _span(src)
            rows = data_rows[span] if span is not None else data_rows[torch.from_numpy(src).to(data.device)]
            reg_rows.index_copy_(0, dst, rows.to(regions[r].device))


def copy_runs(src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor], runs: Runs) -> None:
    """Apply runs between two sets of local byte regions (any device)."""
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    if len(n) <= FEW_RUNS:
        for a, b, c, d, k in zip(sr.tolist(), so.tolist(), dr.tolist(), do.tolist(), n.tolist()):
            dst_regions[c][d: d + k].copy_(src_regions[a][b: b + k], non_blocking=True)
        return
    # Runs of >= 1 MiB are copied one by one (bounded by bytes / 1 MiB calls). Shorter ones move
    # as rows, so that one pair's pages (32 KiB, two merged into 64 KiB, ...) stay one block.
    big = np.flatnonzero(n >= COPY_ONE_BY_ONE)
    for i in big.tolist():
        dst_regions[dr[i]][do[i]: do[i] + n[i]].copy_(src_regions[sr[i]][so[i]: so[i] + n[i]],
                                                     non_blocking=True)
    small = np.flatnonzero(n < COPY_ONE_BY_ONE)
    if not len(small):
        return
    pair = sr[small] * (len(dst_regions) + 1) + dr[small]
    for _, idx in _by_region(pair):
        idx = small[idx]
        s_reg, d_reg = src_regions[sr[idx[0]]], dst_regions[dr[idx[0]]]
        unit = _unit(so[idx], do[idx], n[idx])
        si, di = _element_index(so[idx], n[idx], unit), _element_index(do[idx], n[idx], unit)
        s_rows, d_rows = _unit_views(unit, s_reg, d_reg)
        _copy_rows(s_rows, d_rows, si, di)


def _copy_rows(s_rows: torch.Tensor, d_rows: torch.Tensor, si: np.ndarray, di: np.ndarray) -> None:
    """``d_rows[di] = s_rows[si]``, in as few passes as the rows allow (see ``_RowMoves``)."""
    zero = np.zeros(1, np.int64)
    _RowMoves(si, di, d_rows.shape[1] * d_rows.element_size()).apply([s_rows], zero, [d_rows], zero)


class _RowMoves:
    """How to do ``d_rows[di] = s_rows[si]``, worked out once and applied to any number of
    (source, destination) row views: a plan group's parts share one row pattern.

    index_select moves whole rows (memcpy); advanced indexing (``rows[i] = ...``) goes element
    by element, ~10x slower. Rows that are evenly spaced on one side (in any order: one part's
    pages in a host pool, mostly consecutive host pages) are a few strided views there and need
    no staging copy: gather straight into the destination, or scatter straight from the source.
    """
    __slots__ = ("gather", "items")

    def __init__(self, si: np.ndarray, di: np.ndarray, row_bytes: int):
        # a piece costs one call (~10 us): worth it down to ~64 KiB, a staging pass costs a copy
        min_rows = max(1, PIECE_BYTES // max(1, row_bytes))
        order = np.argsort(di, kind="stable")
        pieces = _pieces(di[order], min_rows)
        self.gather = pieces is not None
        if self.gather:   # (source rows, destination view)
            self.items = [(si[order][a:b], view) for a, b, view in pieces]
        else:             # (source view or rows, destination rows)
            order = np.argsort(si, kind="stable")
            pieces = _pieces(si[order], min_rows) or [(0, len(si), None)]
            if pieces[0][2] is None:
                order = np.arange(len(si))
            src, dst = si[order], di[order]
            self.items = [(view if view is not None else src[a:b], dst[a:b]) for a, b, view in pieces]

    def apply(self, s_rows: Sequence[torch.Tensor], s_base: np.ndarray, d_rows: Sequence[torch.Tensor],
              d_base: np.ndarray, s_void: Sequence[np.ndarray] | None = None,
              d_void: Sequence[np.ndarray] | None = None) -> None:
        """For every part ``p``: ``d_rows[p][d_base[p] + di] = s_rows[p][s_base[p] + si]``.

        ``*_void``: the same rows as numpy void elements (CPU only; made here when not given).
        A part costs one library call per piece: the indices of every part come from one
        numpy expression per piece, so 160 parts are 160 copies, not 160 rounds of views
        and index conversions."""
        s_dev, d_dev = s_rows[0].device, d_rows[0].device
        if self.gather:
            for src, view in self.items:
                idx = _shifted(src, s_base, s_dev)
                for s, d, db, i in zip(s_rows, d_rows, d_base.tolist(), idx):
                    out = d[view.start + db: view.stop + db: view.step]
                    if s_dev == d_dev:
                        torch.index_select(s, 0, i, out=out)
                    else:
                        out.copy_(torch.index_select(s, 0, i), non_blocking=True)
            return
        cpu_dst = d_dev.type == "cpu"   # numpy moves a row of void bytes as one memcpy (~2x index_copy_)
        cpu_both = cpu_dst and s_dev.type == "cpu"
        if cpu_dst and d_void is None:
            d_void = [_void_rows(d) for d in d_rows]
        if cpu_both and s_void is None:
            s_void = [_void_rows(s) for s in s_rows]
        for src, dst in self.items:
            sliced = isinstance(src, slice)
            s_idx = None if sliced else src[None, :] + s_base[:, None] if cpu_both else _shifted(src, s_base, s_dev)
            d_idx = dst[None, :] + d_base[:, None] if cpu_dst else _shifted(dst, d_base, d_dev)
            for p, sb in enumerate(s_base.tolist()):
                if cpu_both:   # numpy on both sides
                    d_void[p][d_idx[p]] = (s_void[p][src.start + sb: src.stop + sb: src.step] if sliced
                                           else s_void[p][s_idx[p]])
                    continue
                s = s_rows[p]
                rows = s[src.start + sb: src.stop + sb: src.step] if sliced else torch.index_select(s, 0, s_idx[p])
                if cpu_dst:
                    d_void[p][d_idx[p]] = _void_rows(rows.cpu())
                else:
                    d_rows[p].index_copy_(0, d_idx[p], rows.to(d_dev))


def _shifted(index: np.ndarray, bases: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``index + bases[p]`` for every part ``p``, as index tensors on ``device``: one array
    expression and one transfer for the whole group."""
    return torch.from_numpy(np.ascontiguousarray(index[None, :] + bases[:, None])).to(device).unbind(0)


# Row views of regions, kept between calls: building one costs ~8 us (a slice, two dtype views,
# the numpy view) and a plan touches every part's region on both sides each time. Keyed by
# the region tensor's id and dropped with it (weak reference). The views are made with ``set_``
# on the region's storage, not as views of the region: a view would keep the region alive.
_REGION_VIEWS: dict[int, tuple] = {}
_ELEMENT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _views_of(t: torch.Tensor) -> dict:
    """The cache of region ``t``: ``{(unit,): width, (unit, size): rows, (unit, size, "void"): ...}``."""
    entry = _REGION_VIEWS.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t.data_ptr() or entry[2] != t.numel():
        ident = id(t)
        entry = (weakref.ref(t, lambda _, ident=ident: _REGION_VIEWS.pop(ident, None)), t.data_ptr(), t.numel(), {})
        _REGION_VIEWS[ident] = entry
    return entry[3]


def _width(unit: int, t: torch.Tensor, views: dict) -> int:
    """Widest element (bytes) that rows of ``unit`` bytes of ``t`` allow (alignment)."""
    size = views.get((unit,))
    if size is None:
        size = views[(unit,)] = next((s for s, _ in _WIDE if unit % s == 0 and t.data_ptr() % s == 0
                                      and t.storage_offset() % s == 0), 1)
    return size


def _region_rows(t: torch.Tensor, unit: int, size: int, views: dict) -> torch.Tensor:
    """Region ``t`` (1-D uint8) as ``[rows, unit // size]`` elements of ``size`` bytes."""
    rows = views.get((unit, size))
    if rows is None:
        rows = views[(unit, size)] = torch.empty(0, dtype=_ELEMENT[size], device=t.device).set_(
            t.untyped_storage(), t.storage_offset() // size, (t.numel() // unit, unit // size), (unit // size, 1))
    return rows


def _region_void(t: torch.Tensor, unit: int, size: int, views: dict) -> np.ndarray:
    """The same rows as numpy void elements of ``unit`` bytes (CPU)."""
    void = views.get((unit, size, "void"))
    if void is None:
        void = views[(unit, size, "void")] = _void_rows(_region_rows(t, unit, size, views))
    return void


def _copy_group(g: "RunGroup", src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor]) -> bool:
    """Copy a group part by part with its row pattern worked out once: every part shares the
    rows and only its bases differ, so a part costs a copy call on cached row views, not a
    planning pass (a token-major pool has two parts per layer). False when the group does not
    fit this (a head factor, runs of >= COPY_ONE_BY_ONE): ``copy_runs`` then does it."""
    if g.heads != 1 or not len(g.row_len) or int(g.row_len.max()) >= COPY_ONE_BY_ONE:
        return False
    unit = _unit(g.src_base, g.dst_base, g.row_src, g.row_dst, g.row_len)
    moves = _RowMoves(_element_index(g.row_src, g.row_len, unit), _element_index(g.row_dst, g.row_len, unit), unit)
    sides = []
    for regions, ids in ((src_regions, g.src_region), (dst_regions, g.dst_region)):
        ts = [regions[r] for r in ids.tolist()]
        sides.append((ts, [_views_of(t) for t in ts]))
    # one element width for the whole group: source and destination rows must agree
    size = min(_width(unit, t, v) for ts, vs in sides for t, v in zip(ts, vs))
    rows = [[_region_rows(t, unit, size, v) for t, v in zip(ts, vs)] for ts, vs in sides]
    voids = [[_region_void(t, unit, size, v) for t, v in zip(ts, vs)]   # numpy copies: scatter on CPU only
             if not moves.gather and ts[0].device.type == "cpu" else None for ts, vs in sides]
    moves.apply(rows[0], g.src_base // unit, rows[1], g.dst_base // unit, voids[0], voids[1])
    return True


def _pieces(index: np.ndarray, min_rows: int) -> list[tuple[int, int, slice]] | None:
    """Sorted row ``index`` as evenly spaced pieces ``(first, stop, strided slice)``; None when
    that would take more than one piece per ``min_rows`` rows (a staged copy is then cheaper)."""
    n = len(index)
    if n < 2:
        return [(0, n, slice(int(index[0]), int(index[0]) + 1))] if n else []
    gaps = np.diff(index)
    step = int(gaps.min())   # evenly spaced rows with a few holes: the smallest gap is the spacing
    cuts = np.flatnonzero(gaps != step) + 1
    if step < 1 or len(cuts) + 1 > max(4, n // min_rows):
        return None
    bounds = np.concatenate(([0], cuts, [n])).tolist()
    return [(a, b, slice(int(index[a]), int(index[b - 1]) + 1, step)) for a, b in zip(bounds[:-1], bounds[1:])]


def _void_rows(rows: torch.Tensor) -> np.ndarray:
    """A CPU ``[n, k]`` tensor as ``n`` numpy elements of ``k * itemsize`` raw bytes (shares memory)."""
    return rows.numpy().view(np.dtype((np.void, rows.shape[1] * rows.element_size()))).reshape(-1)


def execute_plan(plan: TransferPlan, src_regions: Sequence[torch.Tensor],
                 dst_regions: Sequence[torch.Tensor]) -> None:
    """The reference executor: apply ``plan`` between two local pools' byte regions."""
    check_plan_bounds(plan, [r.numel() for r in src_regions], [r.numel() for r in dst_regions])
    for g in plan.groups:
        if not _copy_group(g, src_regions, dst_regions):
            copy_runs(src_regions, dst_regions, g.runs())


def check_plan_bounds(plan: TransferPlan, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> None:
    """Raise PlanError if any run leaves its region (before any byte moves)."""
    for g in plan.groups:
        for side, regs, bases, rows, hs, sizes in (
                ("src", g.src_region, g.src_base, g.row_src, g.src_head_stride, src_sizes),
                ("dst", g.dst_region, g.dst_base, g.row_dst, g.dst_head_stride, dst_sizes)):
            if len(regs) and (regs.min() < 0 or regs.max() >= len(sizes)):
                raise PlanError(f"{side} region id outside 0..{len(sizes) - 1}")
            lim = np.asarray(sizes, np.int64)[regs]
            lo = bases + (rows.min() if len(rows) else 0)
            hi = bases + (int((rows + g.row_len).max()) + (g.heads - 1) * hs if len(rows) else 0)
            if (lo < 0).any() or (hi > lim).any():
                p = int(np.argmax((lo < 0) | (hi > lim)))
                raise PlanError(f"{side} run reaches byte {int(hi[p])} of region {int(regs[p])} "
                                f"which has {int(lim[p])}")


__all__ = ["HeadSlice", "WHOLE", "Runs", "RunGroup", "TransferPlan", "Planner", "plan_transfer",
           "ByteRanges", "merge_runs", "gather_runs", "scatter_runs", "copy_runs", "execute_plan", "PACK_BELOW"]
