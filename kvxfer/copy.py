"""The executor: runs of a ``TransferPlan`` applied to torch byte regions.

``execute_plan`` copies a plan between two lists of regions in one process (local transport,
offload, reload); ``gather_runs`` / ``scatter_runs`` pack runs into and out of one contiguous
staging block (network transports); ``copy_runs`` copies flat run arrays. Index arrays are built
with numpy; no Python loop per run where the count can be large.

Two executions of the same plan, chosen by where the regions live:

- host regions (every region of both sides on the CPU): the compiled helper ``kvxfer.hostcopy``
  checks every run against its region, then copies them in one call per plan group
  (``copy_group``: one memmove per run, the runs never spelled out as arrays; the GIL released
  for large copies). Against the numpy row moves it replaced, with cold caches (plans of 4 and
  16 MiB from a shuffled pool, medians of 3 runs): page-first host pools +2% to +40%,
  layer-first ones -8% to +18%; a plain memcpy per run is what ``scripts/bench_offload.py``
  shows as the ceiling for scattered pages. A caller that copies between the same regions
  again and again (the offload manager) reads them once (``host_table``) and passes the
  ``HostTable``: with caches holding other bytes (a 4 MiB reload of 128 runs after 64 MiB of
  other writes), ``RunGroup.runs()`` cost ~180 us and reading 9 regions' addresses ~100 us
  against a ~600 us copy; without both the executor took 562 us where a C loop of memcpy over
  the same precomputed runs took 589 (medians of 100);
- any device region (CUDA, or ``meta`` in the tests): ``execute_plan_batched``
  (``kvxfer.copy_device``): per group and
  region pair, one gather and one scatter (``index_select`` / ``index_copy_``) with index
  tensors built once per plan, uploaded once and cached on the device keyed by the plan
  (``DEVICE_INDEX_CACHE`` entries, LRU). Nothing reads device data on the host, nothing
  synchronizes: the copy is enqueued on the current stream (callers order it with events).
  ``copy_runs``, ``gather_runs`` and ``scatter_runs`` take ``key=`` (the plan or group the
  runs came from) to use the same cache; ``STATS`` counts index uploads.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .copy_device import STATS, cached_moves, execute_plan_batched, pair_moves
from .errors import PlanError, TransportError
from .plan import FEW_RUNS, Runs, TransferPlan, check_plan_bounds

try:
    from . import hostcopy
except ImportError as e:   # an install that did not build it
    raise ImportError(f"kvxfer's compiled helper (kvxfer/hostcopy.c) is not built: {e}. "
                      "Run scripts/setup, or pip install -e . (needs a C compiler and the Python headers)") from e

# Host copies of at least this many bytes release the GIL while they copy (~20 us and up):
# shorter ones keep it, as taking it back behind a thread busy in Python can cost a switch interval.
RELEASE_GIL_FROM = 256 * 1024
# A scatter of at least this many bytes into host regions (a receiver landing a message in a pool)
# writes with streaming stores, which skip reading each destination line first (hostcopy.c).
STREAM_FROM = 1 << 20


class HostTable(NamedTuple):
    """Regions in host memory as the compiled helper reads them: addresses and sizes in bytes
    (int64 arrays), the sizes again as ints (``TransferPlan.fits_regions``) and the tensors,
    kept alive. ``host_table`` makes one per call, or once for regions that live as long as
    their owner (a pool's, a host pool's): ``execute_plan`` takes it in place of the tensors."""
    addr: np.ndarray
    size: np.ndarray
    sizes: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]


def host_table(regions: Sequence[torch.Tensor]) -> HostTable | None:
    """The ``HostTable`` of ``regions``, or None when one is not in host memory (~0.3 us a
    region with warm caches, ~10 us cold: a pool of 80 layers costs ~50 us a call and more)."""
    if not all(t.is_cpu for t in regions):
        return None
    if not all(t.is_contiguous() for t in regions):
        bad = next(t for t in regions if not t.is_contiguous())
        raise TransportError(f"region tensor of shape {tuple(bad.shape)} is not contiguous")
    n, sizes = len(regions), tuple(t.nbytes for t in regions)
    return HostTable(np.fromiter([t.data_ptr() for t in regions], np.int64, n), np.array(sizes, np.int64), sizes,
                     tuple(regions))


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.int64)


def _host_copy(src: HostTable, dst: HostTable, runs: Runs,
               stream_from: int = -1) -> None:
    """Copy ``runs`` between host regions (``host_table`` of each side) in one compiled call.
    Every run is checked against its region first: a bad one raises PlanError naming it, and
    nothing is copied. ``stream_from``: streaming stores from that many bytes (see hostcopy.c)."""
    try:
        hostcopy.copy_runs(src[0], src[1], dst[0], dst[1], _i64(runs.src_region), _i64(runs.src_offset),
                           _i64(runs.dst_region), _i64(runs.dst_offset), _i64(runs.nbytes), RELEASE_GIL_FROM,
                           stream_from)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _host_staged(block: torch.Tensor, regions: HostTable, region: np.ndarray,
                 offset: np.ndarray, nbytes: np.ndarray, gather: bool, stream_from: int = -1) -> None:
    """The runs into (``gather``) or out of ``block``, back to back, in one compiled call; every
    run is checked against its region and the block first (PlanError naming it; nothing moves)."""
    try:
        hostcopy.copy_staged(block.data_ptr(), block.nbytes, regions[0], regions[1], _i64(region), _i64(offset),
                             _i64(nbytes), gather, RELEASE_GIL_FROM, stream_from)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _staged_runs(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, gather: bool) -> Runs:
    """Runs between ``regions`` and one staging block (region 0), the block's bytes in run order
    (for the device path's cached moves)."""
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
    if len(nbytes) <= FEW_RUNS:
        p = 0
        for r, o, k in zip(region.tolist(), offset.tolist(), nbytes.tolist()):
            out[p: p + k].copy_(regions[r][o: o + k])
            p += k
        return out
    src = host_table(regions)
    if src is not None and host_table([out]) is not None:
        _host_staged(out, src, region, offset, nbytes, True)
        return out
    moves, _ = cached_moves(key, "gather", lambda: pair_moves(_staged_runs(region, offset, nbytes, True),
                                                                regions, [out]), regions, [out])
    for m in moves:
        m.apply(regions, [out])
    return out


def scatter_runs(regions: Sequence[torch.Tensor], region: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray, data: torch.Tensor, *, key=None) -> None:
    """Inverse of ``gather_runs``: write consecutive bytes of ``data`` to the runs. Host regions
    take streaming stores from ``STREAM_FROM`` bytes: a receiver landing a message in its pool
    (TP 4 -> 2 token-major, half rows 1024 B apart, 4 MiB messages: the zmq receiver's work
    212-224 -> 162-163 us/MiB; whole rows or pages unchanged)."""
    if len(nbytes) <= FEW_RUNS:
        p = 0
        for r, o, k in zip(region.tolist(), offset.tolist(), nbytes.tolist()):
            regions[r][o: o + k].copy_(data[p: p + k])
            p += k
        return
    dst = host_table(regions)
    if dst is not None and host_table([data]) is not None:
        _host_staged(data, dst, region, offset, nbytes, False, STREAM_FROM)
        return
    moves, _ = cached_moves(key, "scatter", lambda: pair_moves(_staged_runs(region, offset, nbytes, False),
                                                                 [data], regions), [data], regions)
    for m in moves:
        m.apply([data], regions)


def copy_runs(src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor], runs: Runs, *,
              key=None) -> None:
    """Apply runs between two sets of local byte regions (any device). ``key``: the plan the
    runs come from, so device index tensors are built once for it."""
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    if len(n) <= FEW_RUNS:
        for a, b, c, d, k in zip(sr.tolist(), so.tolist(), dr.tolist(), do.tolist(), n.tolist()):
            dst_regions[c][d: d + k].copy_(src_regions[a][b: b + k], non_blocking=True)
        return
    src, dst = host_table(src_regions), host_table(dst_regions)
    if src is not None and dst is not None:
        _host_copy(src, dst, runs)
        return
    moves, _ = cached_moves(key, "runs", lambda: pair_moves(runs, src_regions, dst_regions), src_regions, dst_regions)
    for m in moves:
        m.apply(src_regions, dst_regions)


def execute_plan(plan: TransferPlan, src_regions: Sequence[torch.Tensor] | HostTable,
                 dst_regions: Sequence[torch.Tensor] | HostTable) -> None:
    """The reference executor: apply ``plan`` between two local pools' byte regions (tensors,
    or a ``HostTable`` made once for them). Host regions take one compiled call per group
    (``hostcopy.copy_group``: the runs are never spelled out); a device side takes
    ``execute_plan_batched``.

    Every run is checked against its region before a byte moves (``check_plan_bounds``; the
    compiled helper checks each run again), except for a plan ``Planner.plan`` made
    (``TransferPlan.fits``) on regions at least as large as the layouts it planned for: that
    check cannot fail, and costs ~20-40 us a request."""
    src = src_regions if isinstance(src_regions, HostTable) else host_table(src_regions)
    dst = dst_regions if isinstance(dst_regions, HostTable) else host_table(dst_regions)
    if src is None or dst is None:
        return execute_plan_batched(plan, _tensors(src_regions), _tensors(dst_regions))
    if not plan.fits_regions(src.sizes, dst.sizes):   # a plan the planner made for such regions is in bounds
        check_plan_bounds(plan, src.sizes, dst.sizes)
    for g in plan.groups:
        try:
            hostcopy.copy_group(src.addr, src.size, dst.addr, dst.size, _i64(g.src_region), _i64(g.src_base),
                                _i64(g.dst_region), _i64(g.dst_base), _i64(g.row_src), _i64(g.row_dst),
                                _i64(g.row_len), g.heads, g.src_head_stride, g.dst_head_stride, RELEASE_GIL_FROM)
        except ValueError as e:
            raise PlanError(str(e)) from None


def _tensors(regions: Sequence[torch.Tensor] | HostTable) -> Sequence[torch.Tensor]:
    return regions.tensors if isinstance(regions, HostTable) else regions


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (shares memory)."""
    if not t.is_contiguous():
        raise TransportError(f"region tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(-1).view(torch.uint8)


__all__ = ["execute_plan", "HostTable", "host_table", "execute_plan_batched", "gather_runs", "scatter_runs",
           "copy_runs", "byte_view", "check_plan_bounds", "STATS", "RELEASE_GIL_FROM"]
