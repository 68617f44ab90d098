"""Host execution of plans: row moves on CPU byte regions, tuned with ``scripts/bench_*``.

A plan group's parts share one row pattern (``RowMoves``), worked out once and applied to
cached row views of every region (numpy memcpy of void rows, strided views where rows are
evenly spaced), so a part costs one copy call, not a planning pass.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .byte_rows import WIDE, element_index_pair, unit_of
from .plan import RunGroup

# copy_runs (local copies) moves runs shorter than this as rows of one index_select / scatter.
COPY_ONE_BY_ONE = 1 << 20

# ... in pieces of evenly spaced rows, while a piece averages at least this many bytes.
PIECE_BYTES = 64 * 1024


def copy_rows(s_rows: torch.Tensor, d_rows: torch.Tensor, si: np.ndarray, di: np.ndarray) -> None:
    """``d_rows[di] = s_rows[si]``, in as few passes as the rows allow (see ``RowMoves``)."""
    zero = np.zeros(1, np.int64)
    RowMoves(si, di, d_rows.shape[1] * d_rows.element_size()).apply([s_rows], zero, [d_rows], zero)


class RowMoves:
    """How to do ``d_rows[di] = s_rows[si]``, worked out once and applied to any number of
    (source, destination) row views: a plan group's parts share one row pattern.

    index_select moves whole rows (memcpy); advanced indexing (``rows[i] = ...``) goes element
    by element, ~10x slower. On the CPU, numpy moves void rows (one memcpy each) with a
    fixed cost of ~1 us a call against torch's several: scatters assign into void rows, and
    gathers into a contiguous destination use ``ndarray.take``. Rows that are evenly spaced on
    one side (in any order: one part's pages in a host pool, mostly consecutive host pages) are
    a few strided views there and need no staging copy: gather straight into the destination,
    or scatter straight from the source.
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
            src = si[order]
            self.gathers = [(src[a:b], view) for a, b, view in pieces]
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
        if self.gather and s_dev.type == "cpu" and d_dev.type == "cpu" and all(v.step == 1 for _, v in self.gathers):
            # numpy take into a contiguous view: one memcpy per row, ~1 us a call where torch's
            # index_select costs several; mode "wrap" never buffers (indices are in bounds:
            # the plan was checked or vouched for), "raise" would stage the output first
            s_void = [_void_rows(s) for s in s_rows] if s_void is None else s_void
            d_void = [_void_rows(d) for d in d_rows] if d_void is None else d_void
            for rows_at, view in self.gathers:
                idx = rows_at[None, :] + s_base[:, None]
                for p, db in enumerate(d_base.tolist()):
                    s_void[p].take(idx[p], out=d_void[p][view.start + db: view.stop + db], mode="wrap")
            return
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
    """The cache of region ``t``: ``{unit: (width, {size: (rows, void)})}``, rebuilt when ``t``
    is another tensor, or the same one over other memory (``data_ptr``, ``numel``)."""
    entry = _REGION_VIEWS.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t.data_ptr() or entry[2] != t.numel():
        ident = id(t)

        def forget(_: object) -> None:
            _REGION_VIEWS.pop(ident, None)
        entry = (weakref.ref(t, forget), t.data_ptr(), t.numel(), {})
        _REGION_VIEWS[ident] = entry
    return entry[3]


def _unit_views(t: torch.Tensor, unit: int) -> tuple[int, dict]:
    """``(width, {size: (rows, void)})`` of region ``t`` for rows of ``unit`` bytes: the widest
    element (bytes) its alignment allows, and its row views made so far."""
    views = _views_of(t)
    got = views.get(unit)
    if got is None:
        got = views[unit] = (next((s for s, _ in WIDE if unit % s == 0 and t.data_ptr() % s == 0
                                   and t.storage_offset() % s == 0), 1), {})
    return got


def _rows_void(t: torch.Tensor, unit: int, size: int, made: dict) -> tuple[torch.Tensor, np.ndarray | None]:
    """Region ``t`` (1-D uint8) as ``[rows, unit // size]`` elements of ``size`` bytes, and on
    the CPU the same rows as numpy void elements of ``unit`` bytes (else None)."""
    got = made.get(size)
    if got is None:
        rows = torch.empty(0, dtype=_ELEMENT[size], device=t.device).set_(
            t.untyped_storage(), t.storage_offset() // size, (t.numel() // unit, unit // size), (unit // size, 1))
        got = made[size] = (rows, _void_rows(rows) if t.device.type == "cpu" else None)
    return got


def copy_group(g: "RunGroup", src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor]) -> bool:
    """Copy a group part by part with its row pattern worked out once: every part shares the
    rows and only its bases differ, so a part costs a copy call on cached row views, not a
    planning pass (a token-major pool has two parts per layer). False when the group does not
    fit this (a head factor, runs of >= COPY_ONE_BY_ONE): ``copy_runs`` then does it."""
    if g.heads != 1 or not len(g.row_len):
        return False
    longest = int(g.row_len.max())
    if longest >= COPY_ONE_BY_ONE:
        return False
    unit = unit_of(g.src_base, g.dst_base, g.row_src, g.row_dst, g.row_len)
    if longest == unit and int(g.row_len.min()) == unit:   # every row is one unit: no index expansion
        si, di = g.row_src // unit, g.row_dst // unit
    else:
        si, di = element_index_pair(g.row_src, g.row_dst, g.row_len, unit)
    moves = RowMoves(si, di, unit)
    # each region once (a host pool is one region for every part): its cached views and width
    sides = []
    for regions, ids in ((src_regions, g.src_region), (dst_regions, g.dst_region)):
        ids_list = ids.tolist()
        sides.append((ids_list, {r: (regions[r], _unit_views(regions[r], unit)) for r in dict.fromkeys(ids_list)}))
    # one element width for the whole group: source and destination rows must agree
    size = min(w for _, regs in sides for _, (w, _) in regs.values())
    rows, voids = [], []
    for ids_list, regs in sides:
        got = {r: _rows_void(t, unit, size, made) for r, (t, (_, made)) in regs.items()}
        rows.append([got[r][0] for r in ids_list])
        cpu = got[ids_list[0]][1] is not None   # numpy copies (on CPU)
        voids.append([got[r][1] for r in ids_list] if cpu else None)
    moves.apply(rows[0], g.src_base // unit, rows[1], g.dst_base // unit, voids[0], voids[1])
    return True


def _pieces(index: np.ndarray, min_rows: int) -> list[tuple[int, int, slice]] | None:
    """Sorted row ``index`` as evenly spaced pieces ``(first, stop, strided slice)``; None when
    that would take more than one piece per ``min_rows`` rows (a staged copy is then cheaper)."""
    n = len(index)
    if n < 2:
        return [(0, n, slice(int(index[0]), int(index[0]) + 1))] if n else []
    gaps = index[1:] - index[:-1]
    step = int(gaps.min())   # evenly spaced rows with a few holes: the smallest gap is the spacing
    cuts = (gaps != step).nonzero()[0]
    if step < 1 or len(cuts) + 1 > max(4, n // min_rows):
        return None
    bounds = [0, *(cuts + 1).tolist(), n]
    return [(a, b, slice(int(index[a]), int(index[b - 1]) + 1, step)) for a, b in zip(bounds[:-1], bounds[1:])]


def _void_rows(rows: torch.Tensor) -> np.ndarray:
    """A CPU ``[n, k]`` tensor as ``n`` numpy elements of ``k * itemsize`` raw bytes (shares memory)."""
    return rows.numpy().view(np.dtype((np.void, rows.shape[1] * rows.element_size()))).reshape(-1)


__all__ = ["COPY_ONE_BY_ONE", "PIECE_BYTES", "RowMoves", "copy_rows", "copy_group"]
