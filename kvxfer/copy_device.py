"""Device execution of plans and runs: one gather and one scatter per region pair.

Index tensors are built once per plan (or per run set named by ``key=``), uploaded once and
cached on the device (``DEVICE_INDEX_CACHE`` entries, LRU). Nothing reads device data on
the host, nothing synchronizes: copies are enqueued on the current stream (callers order
them with events). ``STATS`` counts index uploads.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .byte_rows import by_region, element_index, span_of, unit_of, unit_views
from .plan import Runs, TransferPlan, check_plan_bounds

# On a device (``execute_plan_batched``), runs at least this long are one copy each (a DMA or
# copy kernel per run); shorter ones move as rows of one gather + scatter per region pair.
# Not measured yet: scripts/gpu_check.py (check "executor/device-threshold") times both ways
# at 64 KiB..4 MiB per run on the GPU and prints the crossover to put here.
DEVICE_COPY_ONE_BY_ONE = 1 << 20

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


def _upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cpu":
        STATS.index_uploads += 1
        STATS.index_bytes += t.numel() * 8
        t = t.to(device)
    return t


class PairMove:
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
        self.unit = unit_of(so, do, n) if len(n) else 0
        self.src_span = self.dst_span = self.src_index = self.dst_index = None
        if self.unit:
            si, di = element_index(so, n, self.unit), element_index(do, n, self.unit)
            self.src_span, self.dst_span = span_of(si), span_of(di)
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
        s_rows, d_rows = unit_views(self.unit, s, d)
        rows = s_rows[self.src_span] if self.src_span is not None else torch.index_select(s_rows, 0, self.src_index)
        if self.dst_span is not None:
            d_rows[self.dst_span].copy_(rows, non_blocking=True)
        else:   # device -> host rows land (blocking) before the host scatter reads them
            d_rows.index_copy_(0, self.dst_index, rows.to(d.device, non_blocking=d.device.type != "cpu"))


def pair_moves(runs: Runs, src_regions: Sequence[torch.Tensor],
                dst_regions: Sequence[torch.Tensor]) -> list[PairMove]:
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    pair = sr * (len(dst_regions) + 1) + dr
    return [PairMove(int(sr[idx[0]]), int(dr[idx[0]]), so[idx], do[idx], n[idx],
                      src_regions[int(sr[idx[0]])].device, dst_regions[int(dr[idx[0]])].device,
                      DEVICE_COPY_ONE_BY_ONE)
            for _, idx in by_region(pair)]


def cached_moves(key, what: str, make, src_regions: Sequence[torch.Tensor],
                  dst_regions: Sequence[torch.Tensor]) -> tuple[list[PairMove], bool]:
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
    def make() -> list[PairMove]:
        check_plan_bounds(plan, [r.numel() for r in src_regions], [r.numel() for r in dst_regions])
        return [m for g in plan.groups for m in pair_moves(g.runs(), src_regions, dst_regions)]
    moves, _ = cached_moves(plan, "plan", make, src_regions, dst_regions)
    for m in moves:
        m.apply(src_regions, dst_regions)


__all__ = ["DEVICE_COPY_ONE_BY_ONE", "DEVICE_INDEX_CACHE", "CopyStats", "STATS", "PairMove", "pair_moves",
           "cached_moves", "execute_plan_batched"]
