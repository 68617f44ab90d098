"""The executor: runs of a ``TransferPlan`` applied to torch byte regions.

``execute_plan`` copies a plan between two lists of regions in one process (local transport,
offload, reload); ``gather_runs`` / ``scatter_runs`` pack runs into and out of one contiguous
staging block (network transports); ``copy_runs`` copies flat run arrays. Index arrays are built
with numpy; no Python loop per run where the count can be large.

Two executions of the same plan, chosen by where the regions live:

- host regions (both sides on the CPU): the tuned row moves below (numpy memcpy of void rows,
  strided views where rows are evenly spaced), measured by ``scripts/bench_*``;
- any device region (CUDA, or ``meta`` in the tests): ``execute_plan_batched``: per group and
  region pair, one gather and one scatter (``index_select`` / ``index_copy_``) with index
  tensors built once per plan, uploaded once and cached on the device keyed by the plan
  (``DEVICE_INDEX_CACHE`` entries, LRU). Nothing reads device data on the host, nothing
  synchronizes: the copy is enqueued on the current stream (callers order it with events).
  ``copy_runs``, ``gather_runs`` and ``scatter_runs`` take ``key=`` (the plan or group the
  runs came from) to use the same cache; ``STATS`` counts index uploads.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import PlanError, TransportError
from .plan import BIG_RUN, FEW_RUNS, RunGroup, Runs, TransferPlan

# copy_runs (local copies) moves runs shorter than this as rows of one index_select / scatter.
COPY_ONE_BY_ONE = 1 << 20

# On a device (``execute_plan_batched``), runs at least this long are one copy each (a DMA or
# copy kernel per run); shorter ones move as rows of one gather + scatter per region pair.
# Not measured yet: scripts/gpu_check.py (check "executor/device-threshold") times both ways
# at 64 KiB..4 MiB per run on the GPU and prints the crossover to put here.
DEVICE_COPY_ONE_BY_ONE = 1 << 20


# ... in pieces of evenly spaced rows, while a piece averages at least this many bytes.
PIECE_BYTES = 64 * 1024


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


# ------------------------------------------------------------------------------------
# Device execution: one gather and one scatter per region pair, index tensors cached per plan
# ------------------------------------------------------------------------------------
# Plans (or run sets named by ``key=``) whose device index tensors stay cached, least recently
# used first out; an entry keeps its key object alive, so an id is never reused while cached.
DEVICE_INDEX_CACHE = 256


@dataclass(slots=True)
class CopyStats:
    """Host -> device index uploads: one per plan, region pair and device, then cached."""
    index_uploads: int = 0
    index_bytes: int = 0


STATS = CopyStats()
_DEVICE_MOVES: OrderedDict = OrderedDict()   # (id(key), what, devices) -> (key, sizes, moves)
_DEVICE_LOCK = threading.Lock()


def _on_host(*sides: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" for side in sides for t in side[:1])


def _upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cpu":
        STATS.index_uploads += 1
        STATS.index_bytes += t.numel() * 8
        t = t.to(device)
    return t


class _PairMove:
    """The runs between one source and one destination region: runs of >= ``one_by_one``
    bytes as slice copies, the others as rows of ``unit`` bytes, gathered with ``src_index``
    (or the slice ``src_span``) and scattered with ``dst_index`` (or ``dst_span``)."""
    __slots__ = ("src", "dst", "big", "unit", "src_span", "dst_span", "src_index", "dst_index")

    def __init__(self, src: int, dst: int, so: np.ndarray, do: np.ndarray, n: np.ndarray,
                 s_dev: torch.device, d_dev: torch.device, one_by_one: int):
        self.src, self.dst = src, dst
        big = n >= one_by_one
        self.big = list(zip(so[big].tolist(), do[big].tolist(), n[big].tolist()))
        so, do, n = so[~big], do[~big], n[~big]
        self.unit = _unit(so, do, n) if len(n) else 0
        self.src_span = self.dst_span = self.src_index = self.dst_index = None
        if self.unit:
            si, di = _element_index(so, n, self.unit), _element_index(do, n, self.unit)
            self.src_span, self.dst_span = _span(si), _span(di)
            if self.src_span is None:
                self.src_index = _upload(si, s_dev)
            if self.dst_span is None:
                self.dst_index = _upload(di, d_dev)

    def apply(self, src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor]) -> None:
        s, d = src_regions[self.src], dst_regions[self.dst]
        for o, p, k in self.big:
            d[p: p + k].copy_(s[o: o + k], non_blocking=True)
        if not self.unit:
            return
        s_rows, d_rows = _unit_views(self.unit, s, d)
        rows = s_rows[self.src_span] if self.src_span is not None else torch.index_select(s_rows, 0, self.src_index)
        if self.dst_span is not None:
            d_rows[self.dst_span].copy_(rows, non_blocking=True)
        else:   # device -> host rows land (blocking) before the host scatter reads them
            d_rows.index_copy_(0, self.dst_index, rows.to(d.device, non_blocking=d.device.type != "cpu"))


def _pair_moves(runs: Runs, src_regions: Sequence[torch.Tensor],
                dst_regions: Sequence[torch.Tensor]) -> list[_PairMove]:
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    pair = sr * (len(dst_regions) + 1) + dr
    return [_PairMove(int(sr[idx[0]]), int(dr[idx[0]]), so[idx], do[idx], n[idx],
                      src_regions[int(sr[idx[0]])].device, dst_regions[int(dr[idx[0]])].device,
                      DEVICE_COPY_ONE_BY_ONE)
            for _, idx in _by_region(pair)]


def _cached_moves(key, what: str, make, src_regions: Sequence[torch.Tensor],
                  dst_regions: Sequence[torch.Tensor]) -> tuple[list[_PairMove], bool]:
    """The moves of ``key`` for these devices, built by ``make()`` on first use. Returns
    (moves, fresh): ``fresh`` when just built (the caller checks bounds then)."""
    if key is None:
        return make(), True
    ident = (id(key), what, tuple(t.device for t in src_regions), tuple(t.device for t in dst_regions),
             tuple(t.numel() for t in src_regions), tuple(t.numel() for t in dst_regions))
    with _DEVICE_LOCK:
        entry = _DEVICE_MOVES.get(ident)
        if entry is not None and entry[0] is key:
            _DEVICE_MOVES.move_to_end(ident)
            return entry[1], False
    moves = make()
    with _DEVICE_LOCK:
        _DEVICE_MOVES[ident] = (key, moves)
        while len(_DEVICE_MOVES) > DEVICE_INDEX_CACHE:
            _DEVICE_MOVES.popitem(last=False)
    return moves, True


def execute_plan_batched(plan: TransferPlan, src_regions: Sequence[torch.Tensor],
                         dst_regions: Sequence[torch.Tensor]) -> None:
    """``execute_plan`` for device regions (any device; what ``execute_plan`` uses when a side is
    not on the CPU): per group and region pair one gather and one scatter, with the index
    tensors built and uploaded on the plan's first execution and cached on the device, keyed
    by the plan. Enqueued on the current stream; never reads device data on the host."""
    def make() -> list[_PairMove]:
        check_plan_bounds(plan, [r.numel() for r in src_regions], [r.numel() for r in dst_regions])
        return [m for g in plan.groups for m in _pair_moves(g.runs(), src_regions, dst_regions)]
    moves, _ = _cached_moves(plan, "plan", make, src_regions, dst_regions)
    for m in moves:
        m.apply(src_regions, dst_regions)


def _staged_runs(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, gather: bool) -> Runs:
    """Runs between ``regions`` and one staging block (region 0), the block's bytes in run order."""
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
    zero, none = np.zeros(len(nbytes), np.int64), np.zeros(len(nbytes), bool)
    region = np.asarray(region, np.int64)
    if gather:
        return Runs(region, np.asarray(offset, np.int64), zero, pos, np.asarray(nbytes, np.int64), none)
    return Runs(zero, pos, region, np.asarray(offset, np.int64), np.asarray(nbytes, np.int64), none)


def gather_runs(regions: Sequence[torch.Tensor], region: np.ndarray, offset: np.ndarray,
                nbytes: np.ndarray, out: torch.Tensor | None = None, *, key=None) -> torch.Tensor:
    """Concatenate the bytes of the runs (in run order) into one uint8 tensor. ``key``: the plan
    (or group) the runs come from, so device index tensors are built once for it."""
    total = int(nbytes.sum())
    device = regions[0].device if len(regions) else "cpu"
    out = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out
    if len(nbytes) > FEW_RUNS and not _on_host(regions, [out]):
        moves, _ = _cached_moves(key, "gather", lambda: _pair_moves(_staged_runs(region, offset, nbytes, True),
                                                                    regions, [out]), regions, [out])
        for m in moves:
            m.apply(regions, [out])
        return out
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
                 nbytes: np.ndarray, data: torch.Tensor, *, key=None) -> None:
    """Inverse of ``gather_runs``: write consecutive bytes of ``data`` to the runs."""
    if len(nbytes) > FEW_RUNS and not _on_host(regions, [data]):
        moves, _ = _cached_moves(key, "scatter", lambda: _pair_moves(_staged_runs(region, offset, nbytes, False),
                                                                     [data], regions), [data], regions)
        for m in moves:
            m.apply([data], regions)
        return
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


def copy_runs(src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor], runs: Runs, *,
              key=None) -> None:
    """Apply runs between two sets of local byte regions (any device). ``key``: the plan the
    runs come from, so device index tensors are built once for it."""
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    if len(n) > FEW_RUNS and not _on_host(src_regions, dst_regions):
        moves, _ = _cached_moves(key, "runs", lambda: _pair_moves(runs, src_regions, dst_regions),
                                 src_regions, dst_regions)
        for m in moves:
            m.apply(src_regions, dst_regions)
        return
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
    __slots__ = ("gather", "gathers", "scatters")

    def __init__(self, si: np.ndarray, di: np.ndarray, row_bytes: int):
        # a piece costs one call (~10 us): worth it down to ~64 KiB, a staging pass costs a copy
        min_rows = max(1, PIECE_BYTES // max(1, row_bytes))
        order = np.argsort(di, kind="stable")
        pieces = _pieces(di[order], min_rows)
        self.gather = pieces is not None
        self.gathers: list[tuple[np.ndarray, slice]] = []   # (source rows, destination view)
        self.scatters: list[tuple[slice | np.ndarray, np.ndarray]] = []   # (source view or rows, destination rows)
        if pieces is not None:
            self.gathers = [(si[order][a:b], view) for a, b, view in pieces]
        else:
            order = np.argsort(si, kind="stable")
            s_pieces: Sequence[tuple[int, int, slice | None]] = _pieces(si[order], min_rows) or [(0, len(si), None)]
            if s_pieces[0][2] is None:
                order = np.arange(len(si))
            src, dst = si[order], di[order]
            self.scatters = [(view if view is not None else src[a:b], dst[a:b]) for a, b, view in s_pieces]

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
            for rows_at, view in self.gathers:
                idx = _shifted(rows_at, s_base, s_dev)
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
        for src, dst in self.scatters:
            s_idx = (None if isinstance(src, slice) else src[None, :] + s_base[:, None] if cpu_both
                     else _shifted(src, s_base, s_dev))
            d_idx = dst[None, :] + d_base[:, None] if cpu_dst else _shifted(dst, d_base, d_dev)
            for p, sb in enumerate(s_base.tolist()):
                if cpu_both:   # numpy on both sides
                    d_void[p][d_idx[p]] = (s_void[p][src.start + sb: src.stop + sb: src.step] if isinstance(src, slice)
                                           else s_void[p][s_idx[p]])
                    continue
                s = s_rows[p]
                rows = (s[src.start + sb: src.stop + sb: src.step] if isinstance(src, slice)
                        else torch.index_select(s, 0, s_idx[p]))
                if cpu_dst:
                    d_void[p][d_idx[p]] = _void_rows(rows.cpu())
                else:
                    d_rows[p].index_copy_(0, d_idx[p], rows.to(d_dev))


def _shifted(index: np.ndarray, bases: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``index + bases[p]`` for every part ``p``, as index tensors on ``device``: one array
    expression and one transfer for the whole group."""
    return torch.from_numpy(np.ascontiguousarray(index[None, :] + bases[:, None])).to(device).unbind(0)


_REGION_VIEWS: dict[int, tuple] = {}   # id(region tensor) -> (weakref, data_ptr, numel, views)
_ELEMENT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _views_of(t: torch.Tensor) -> dict:
    """The cache of region ``t``: ``{(unit,): width, (unit, size): rows, (unit, size, "void"): ...}``."""
    entry = _REGION_VIEWS.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t.data_ptr() or entry[2] != t.numel():
        ident = id(t)

        def forget(_: object) -> None:
            _REGION_VIEWS.pop(ident, None)
        entry = (weakref.ref(t, forget), t.data_ptr(), t.numel(), {})
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
    """The reference executor: apply ``plan`` between two local pools' byte regions. Host
    regions take the tuned row moves; a device side takes ``execute_plan_batched``."""
    if not _on_host(src_regions, dst_regions):
        return execute_plan_batched(plan, src_regions, dst_regions)
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


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (shares memory)."""
    if not t.is_contiguous():
        raise TransportError(f"region tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(-1).view(torch.uint8)
