"""Runs of one device region gathered as one indexed copy of rows into a packed frame, and the
stretches of a frame's runs that share their regions. Row arithmetic is ``kvxfer.byte_rows``'s
(``unit_of``, ``element_index``). Vectorized: no loop per run. Host regions take the compiled
executor instead (``kvxfer.copy.gather_runs`` / ``scatter_runs``: a memmove per run).

Who calls what: ``Framer`` (``frames.py``) calls ``region_spans`` per packed frame it fills, and
``gather_rows`` for a frame with CUDA regions.
"""
from __future__ import annotations

import numpy as np
import torch

from kvxfer.byte_rows import element_index, unit_of
from kvxfer.plan import merge_runs


def row_index(off: np.ndarray, n: np.ndarray) -> tuple[int, np.ndarray, bool]:
    """How to move runs that lie back to back on one side as one indexed copy of rows.

    Returns (row length, row index, window): rows of the gcd of offsets and lengths
    (contiguous rows; the fast path when runs are aligned), or, for same-length runs that
    are not aligned, one row per run of a sliding-window view (``window`` True).
    """
    u = unit_of(off, n)
    if n[0] > u and (n == n[0]).all():
        return int(n[0]), off, True
    return u, element_index(off, n, u), False


def gather_rows(region: torch.Tensor, off: np.ndarray, n: np.ndarray, out: torch.Tensor) -> None:
    """out = the region's runs back to back, with one index_select (on the region's device)."""
    off, _, n = merge_runs(off, np.cumsum(n) - n, n)   # runs that touch in the region: longer rows
    length, idx, window = row_index(off, n)
    rows = (region.as_strided((region.numel() - length + 1, length), (1, 1)) if window
            else region[: region.numel() // length * length].view(-1, length))
    torch.index_select(rows, 0, torch.from_numpy(idx).to(region.device), out=out.view(-1, length))


def region_spans(*keys: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of the stretches where every key stays the same (runs in the order they come,
    unlike ``byte_rows.by_region``, which groups a region's runs wherever they are)."""
    change = np.zeros(max(len(keys[0]) - 1, 0), bool)
    for k in keys:
        change |= k[1:] != k[:-1]
    cuts = [0, *(np.flatnonzero(change) + 1).tolist(), len(keys[0])]
    return list(zip(cuts[:-1], cuts[1:]))
