"""Byte regions as rows: the index arithmetic of the device executor (``kvxfer.copy_device``).
Regions are 1-D uint8 tensors; a run is ``nbytes`` bytes at ``offset`` of a region. Index
arrays are built with numpy, with no Python loop per run.
"""
from __future__ import annotations

import numpy as np
import torch

WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def unit_views(unit: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` as rows of ``unit`` bytes, all in the widest element type every one of
    them allows (the same for all, so assigning rows between them moves bytes, never
    converts values): torch's index kernels move a uint8 row one byte at a time."""
    size, dt = 1, torch.uint8
    for s, d in WIDE:
        if unit % s == 0 and all(t.data_ptr() % s == 0 and t.storage_offset() % s == 0 for t in tensors):
            size, dt = s, d
            break
    return [t[: (t.numel() // unit) * unit].view(dt).view(-1, unit // size) for t in tensors]


def span_of(index: np.ndarray) -> slice | None:
    """``index`` as a slice when it is consecutive: rows then need no index."""
    if len(index) and int(index[-1]) - int(index[0]) == len(index) - 1 and bool((np.diff(index) == 1).all()):
        return slice(int(index[0]), int(index[-1]) + 1)
    return None


def element_index(offsets: np.ndarray, lens: np.ndarray, unit: int) -> np.ndarray:
    """Indices of every ``unit``-sized element covered by the runs, in run order."""
    counts = lens // unit
    total = int(counts.sum())
    firsts = np.repeat(offsets // unit - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return firsts + np.arange(total, dtype=np.int64)


def unit_of(*arrays: np.ndarray) -> int:
    return int(np.gcd.reduce(np.concatenate([np.asarray(a, np.int64).ravel() for a in arrays]))) or 1


def by_region(region: np.ndarray):
    """Yield (region id, index array) for each region present, without a loop per run."""
    if len(region) == 0:
        return
    order = np.argsort(region, kind="stable")
    r = region[order]
    cuts = np.flatnonzero(np.diff(r)) + 1
    for idx in np.split(order, cuts):
        yield int(region[idx[0]]), idx


__all__ = ["WIDE", "unit_views", "span_of", "element_index", "unit_of", "by_region"]
