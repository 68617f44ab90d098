"""The executor: runs of a ``TransferPlan`` applied to torch byte regions.

``execute_plan`` copies a plan between two lists of regions in one process (local transport,
offload, reload); ``gather_runs`` / ``scatter_runs`` pack runs into and out of one contiguous
staging block (network transports); ``copy_runs`` copies flat run arrays. Index arrays are built
with numpy; no Python loop per run where the count can be large.

Two executions of the same plan, chosen by where the regions live:

- host regions (both sides on the CPU): the tuned row moves of ``kvxfer.copy_host`` (numpy
  memcpy of void rows, strided views where rows are evenly spaced), measured by ``scripts/bench_*``;
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

import numpy as np
import torch

from .byte_rows import by_region, element_index, on_host, span_of, unit_of, unit_views
from .copy_device import STATS, cached_moves, execute_plan_batched, pair_moves
from .copy_host import COPY_ONE_BY_ONE, copy_group, copy_rows
from .errors import TransportError
from .plan import BIG_RUN, FEW_RUNS, Runs, TransferPlan, check_plan_bounds


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
    if len(nbytes) > FEW_RUNS and not on_host(regions, [out]):
        moves, _ = cached_moves(key, "gather", lambda: pair_moves(_staged_runs(region, offset, nbytes, True),
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
    for r, idx in by_region(region):
        unit = unit_of(offset[idx], nbytes[idx], pos[idx])
        src = torch.from_numpy(element_index(offset[idx], nbytes[idx], unit)).to(regions[r].device)
        dst = element_index(pos[idx], nbytes[idx], unit)
        reg_rows, out_rows = unit_views(unit, regions[r], out)
        span = span_of(dst)
        if span is not None and out.device == regions[r].device:  # one region: straight into the block
            torch.index_select(reg_rows, 0, src, out=out_rows[span])
        else:
            out_rows[torch.from_numpy(dst).to(out.device)] = reg_rows[src].to(out.device)
    return out


def scatter_runs(regions: Sequence[torch.Tensor], region: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray, data: torch.Tensor, *, key=None) -> None:
    """Inverse of ``gather_runs``: write consecutive bytes of ``data`` to the runs."""
    if len(nbytes) > FEW_RUNS and not on_host(regions, [data]):
        moves, _ = cached_moves(key, "scatter", lambda: pair_moves(_staged_runs(region, offset, nbytes, False),
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
    for r, idx in by_region(region):
        big = idx[nbytes[idx] >= BIG_RUN]
        for i in big.tolist():  # one copy per >= 64 KiB run: bounded by bytes / 64 KiB
            regions[r][offset[i]: offset[i] + nbytes[i]].copy_(data[pos[i]: pos[i] + nbytes[i]])
        small = idx[nbytes[idx] < BIG_RUN]
        if len(small):
            unit = unit_of(offset[small], nbytes[small], pos[small])
            dst = torch.from_numpy(element_index(offset[small], nbytes[small], unit)).to(regions[r].device)
            src = element_index(pos[small], nbytes[small], unit)
            reg_rows, data_rows = unit_views(unit, regions[r], data)
            span = span_of(src)
            rows = data_rows[span] if span is not None else data_rows[torch.from_numpy(src).to(data.device)]
            reg_rows.index_copy_(0, dst, rows.to(regions[r].device))


def copy_runs(src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor], runs: Runs, *,
              key=None) -> None:
    """Apply runs between two sets of local byte regions (any device). ``key``: the plan the
    runs come from, so device index tensors are built once for it."""
    sr, so, dr, do, n = runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset, runs.nbytes
    if len(n) > FEW_RUNS and not on_host(src_regions, dst_regions):
        moves, _ = cached_moves(key, "runs", lambda: pair_moves(runs, src_regions, dst_regions),
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
    for _, idx in by_region(pair):
        idx = small[idx]
        s_reg, d_reg = src_regions[sr[idx[0]]], dst_regions[dr[idx[0]]]
        unit = unit_of(so[idx], do[idx], n[idx])
        si, di = element_index(so[idx], n[idx], unit), element_index(do[idx], n[idx], unit)
        s_rows, d_rows = unit_views(unit, s_reg, d_reg)
        copy_rows(s_rows, d_rows, si, di)


def execute_plan(plan: TransferPlan, src_regions: Sequence[torch.Tensor],
                 dst_regions: Sequence[torch.Tensor]) -> None:
    """The reference executor: apply ``plan`` between two local pools' byte regions. Host
    regions take the tuned row moves; a device side takes ``execute_plan_batched``.

    Every run is checked against its region before a byte moves (``check_plan_bounds``),
    except for a plan ``Planner.plan`` made (``TransferPlan.fits``) on regions at least as
    large as the layouts it planned for: that check cannot fail, and costs ~20-40 us a request."""
    if not on_host(src_regions, dst_regions):
        return execute_plan_batched(plan, src_regions, dst_regions)
    src_sizes, dst_sizes = [r.numel() for r in src_regions], [r.numel() for r in dst_regions]
    if not plan.fits_regions(src_sizes, dst_sizes):   # a plan the planner made for such regions is in bounds
        check_plan_bounds(plan, src_sizes, dst_sizes)
    for g in plan.groups:
        if not copy_group(g, src_regions, dst_regions):
            copy_runs(src_regions, dst_regions, g.runs())


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (shares memory)."""
    if not t.is_contiguous():
        raise TransportError(f"region tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(-1).view(torch.uint8)


__all__ = ["execute_plan", "execute_plan_batched", "gather_runs", "scatter_runs", "copy_runs", "byte_view",
           "check_plan_bounds", "STATS"]
