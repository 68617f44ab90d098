"""The planner: (layout, slots, head slice) x (layout, slots, head slice) -> runs.

Pure and vectorized: numpy over slot arrays, and one compiled call (``kvxfer/rowmerge.c``) for each
geometry's rows and merges; no I/O, no Python loop per token or page.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .errors import PlanError
from .layout import Layout, Part
from .plan_rows import (
    Geometry,
    fuse_parts,
    merge_runs,  # noqa: F401  (transports import it from here)
)

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
    """Groups of runs. ``fits``: set only by ``Planner.plan`` (never by the constructor): the
    byte sizes of the source and destination layouts' regions, which every run of the plan is
    known to stay inside (``Layout`` checks that each part fits its region, ``check_slots``
    that each slot is in its space, merging only joins adjacent runs; the planner's arrays are
    read-only). Executors skip ``check_plan_bounds`` for such a plan when every region given
    is at least that size (``fits_regions``); any other plan, from a peer, a file or built by
    hand, is checked run by run."""
    groups: tuple[RunGroup, ...]
    fits: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, init=False)

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
        if len(parts) == 1:   # fresh arrays already: a copy of 65,536 runs' six columns cost ~0.6 ms
            return parts[0]
        return Runs(*(np.concatenate(cols) for cols in zip(*parts)))

    def run_tuples(self) -> list[tuple[int, int, int, int, int]]:
        """``runs()`` as Python ints, group after group (see ``RunGroup.run_tuples``)."""
        return [run for g in self.groups for run in g.run_tuples()]

    @staticmethod
    def concat(plans: Sequence["TransferPlan"]) -> "TransferPlan":
        out = TransferPlan(tuple(g for p in plans for g in p.groups))
        fits = {p.fits for p in plans}
        if len(fits) == 1 and None not in fits:   # every plan fits the same regions: so does the whole
            object.__setattr__(out, "fits", fits.pop())
        return out

    def fits_regions(self, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> bool:
        """Whether the planner vouched for this plan (``fits``) and regions of these sizes hold
        it: then ``check_plan_bounds`` cannot fail and may be skipped."""
        f = self.fits
        return (f is not None and len(src_sizes) >= len(f[0]) and len(dst_sizes) >= len(f[1])
                and all(a >= b for a, b in zip(src_sizes, f[0])) and all(a >= b for a, b in zip(dst_sizes, f[1])))


EMPTY_PLAN = TransferPlan(())


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
            a.flags.writeable = False   # shared by every plan of this planner (see TransferPlan.fits)
            self._geoms.append(Geometry(*key, a[:, 0], a[:, 1], a[:, 2], a[:, 3]))
        self._fits = (tuple(r.nbytes for r in src.regions), tuple(r.nbytes for r in dst.regions))
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
        row_sets: list[tuple] = []
        for g in self._geoms:
            s, d = slots[(g.src_space, g.dst_space)]
            if len(s):
                row_sets.extend((g, *rows) for rows in g.rows(s, d))
        if self._may_fuse:
            row_sets = fuse_parts(row_sets)
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
        for grp in out:   # read-only: a plan changed after planning would void ``fits``
            for a in (grp.src_region, grp.src_base, grp.dst_region, grp.dst_base, grp.row_src, grp.row_dst,
                      grp.row_len):
                a.setflags(write=False)
        plan = TransferPlan(tuple(out))
        object.__setattr__(plan, "fits", self._fits)
        return plan


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


def check_plan_bounds(plan: TransferPlan, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> None:
    """Raise PlanError if any run leaves its region (before any byte moves)."""
    for g in plan.groups:
        for side, regs, bases, rows, hs, sizes in (
                ("src", g.src_region, g.src_base, g.row_src, g.src_head_stride, src_sizes),
                ("dst", g.dst_region, g.dst_base, g.row_dst, g.dst_head_stride, dst_sizes)):
            if len(regs) and (regs.min() < 0 or regs.max() >= len(sizes)):
                raise PlanError(f"{side} region id outside 0..{len(sizes) - 1}")
            lim = np.asarray(sizes, np.int64)[regs]
            try:   # a hand-made or hostile plan's offsets may pass int64: outside any region
                lo = bases + (rows.min() if len(rows) else 0)
                hi = bases + (int((rows + g.row_len).max()) + (g.heads - 1) * hs if len(rows) else 0)
            except OverflowError:
                raise PlanError(f"{side} run offsets of a group overflow int64") from None
            if (lo < 0).any() or (hi > lim).any():
                p = int(np.argmax((lo < 0) | (hi > lim)))
                raise PlanError(f"{side} run reaches byte {int(hi[p])} of region {int(regs[p])} "
                                f"which has {int(lim[p])}")
