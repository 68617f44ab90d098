"""A transfer prepared in the caller's thread: bounds, puts, the announce and its packed data.

Who calls what: ``UCXTransport.submit`` (any caller thread, once per chunk) calls
``prepare_transfer``, which checks every run against both sides' regions (``PlanError``), splits
the plan into puts and packed runs (``prepare`` for many runs, ``prepare_few`` with Python ints for
at most ``few_runs``), and picks how the packed bytes travel: inside the ANNOUNCE (below
``INLINE_BELOW``), as iov frames read in place (host memory), or staged frame by frame through
the send ring (CUDA memory; host memory to peers over the network: ``stage_host``). The
``Outgoing`` it returns goes to the I/O thread in a ``Submit``; nothing here touches the network.
"""
from __future__ import annotations

import itertools
import struct

import numpy as np

from kvxfer.copy import gather_runs
from kvxfer.errors import PlanError, TransportError
from kvxfer.plan import TransferPlan, merge_runs
from kvxfer.transport.base import TransferHandle
from kvxfer.transport.kit import (
    StagingPool,
    keyable,
    merge_in_stream,
    region_key,
    region_unkey,
    runs_inside,
    runs_inside_few,
    split_long_runs,
)

from . import bindings as ucp
from .frames import StagedFrames, Stream, cut, small_pieces
from .options import UCXOptions
from .protocol import Announce
from .regions import Regions
from .state import Outgoing, Peer
from .workers import Workers

_I8 = np.dtype("<i8")
INLINE_BELOW = 256 * 1024   # packed bytes below this travel inside the ANNOUNCE


class Planner:
    """Caller threads: plans into ``Outgoing`` transfers (see the module docstring)."""

    def __init__(self, options: UCXOptions, regions: Regions, workers: Workers, send_ring: StagingPool):
        self.options, self.regions, self.workers, self.send_ring = options, regions, workers, send_ring
        self.frame_bytes, self.few_runs = options.frame_bytes, options.few_runs
        self.xids = itertools.count(1)

    def prepare_transfer(self, p: Peer, handle: TransferHandle, plan: TransferPlan, notify: bytes,
                         cap: bytes = b"") -> Outgoing:
        """Bounds, puts, announce and packed data of one transfer (PlanError, TransportError when it
        cannot be sent)."""
        r = self.regions
        if not r.tensors and plan.num_runs:
            raise TransportError("register(regions) must be called before submit")
        inline = b""
        if plan.num_runs <= self.few_runs:
            # pregranted, or its PREGRANT may still come (``eager.EagerSends.park``): small runs are put too
            puts, runs, nput, packed, inline = self.prepare_few(p, plan, p.fence_answers or
                                                                handle.request_id in p.pregranted)
        else:
            puts, runs, nput, packed = self.prepare(p, plan)
        if len(runs) + len(notify) > self.options.max_control_bytes // 2:
            raise PlanError(f"a plan of {len(runs) // 24} runs does not fit one announce of at most "
                            f"{self.options.max_control_bytes // 2} bytes: send it in smaller chunks")
        staging = iov = None
        if packed is not None:
            sr, so, n = packed
            total = int(n.sum())
            host = r.all_host or bool(r.is_host[sr].all())
            if total < INLINE_BELOW:               # in the announce: no GO wait, no frames
                inline = gather_runs(r.tensors, sr, so, n).cpu().numpy().tobytes()
            elif host and not self.stages_host(p, total, max(len(n), len(runs) // 24 - nput)):
                # frames read straight from the source runs
                iov = ucp.IovFrames(ucp.frame_iovs(r.base[sr] + so, n, self.frame_bytes))
            else:   # gathered frame by frame into the send ring, on the I/O thread after GO
                bounds = cut(np.frombuffer(runs, _I8).reshape(3, -1)[2, nput:], self.frame_bytes)
                staging = StagedFrames(Stream(sr, so, n), bounds, self.send_ring.device)
        xid = next(self.xids)
        announce = Announce(xid, handle.request_id, 0.0, bytes(notify), runs, nput, self.frame_bytes, inline, cap,
                            staging is not None)
        return Outgoing(xid, p, handle, announce, puts, staging, self.frame_bytes, iov)

    def stages_host(self, p: Peer, total: int, pieces: int) -> bool:
        """Do ``total`` packed bytes of host memory to ``p``, ``pieces`` runs on the busier side,
        go through the send ring (``stage_host``; "network": small pieces to a network peer)?"""
        stage_host = self.options.stage_host
        return stage_host == "always" or (stage_host == "network" and (p.far or self.workers.network_only)
                                          and small_pieces(total, pieces))

    def prepare(self, p: Peer, plan: TransferPlan) -> tuple:
        """Bounds-check the runs: (puts, announced runs, put count, packed runs as
        (source region, offset, length) arrays or None)."""
        regions = self.regions
        r = plan.runs()
        sr, so, dr, do, n = r[:5]
        if len(n) and n.min() <= 0:
            raise PlanError("a run of the plan is empty or negative")
        for side, reg, off, lim in (("source", sr, so, regions.sizes), ("destination", dr, do, p.sizes)):
            if not runs_inside(reg, off, n, lim):
                raise PlanError(f"a {side} run leaves its region (the {side} has {len(lim)} regions)")
        # Runs below put_below_many travel packed, whatever the plan says: this bounds the put loop
        # (one Python step per put) by bytes / put_below_many, and a small put costs more than packing.
        pk = np.ones(len(n), bool) if p.pack_all else n < self.options.put_below_many   # pack_all: see Peer
        npk = int(np.count_nonzero(pk))
        put = slice(None) if npk == 0 else slice(0) if npk == len(n) else ~pk
        keyed = keyable(regions.sizes, p.sizes)
        announced: tuple[np.ndarray, ...] | None
        packed = announced = None
        if npk:
            psr, pso, pdr, pdo, pn = (sr, so, dr, do, n) if npk == len(n) else (sr[pk], so[pk], dr[pk], do[pk], n[pk])
            # Packed runs are one byte stream: runs that continue each other on one side are one
            # iov piece there. A head slice of token-major pages is 512 B rows on the strided side
            # and whole pages on the other: the receiver checks and posts 16x fewer runs (TP 2 -> 4).
            packed = merge_in_stream(psr, pso, pn) if keyed else (psr, pso, pn)
            announced = merge_in_stream(pdr, pdo, pn) if keyed else (pdr, pdo, pn)
        # Runs adjacent on both sides go as one put (announced as the plan has them: the grant
        # check does not care). Put runs come first in the announce.
        ps, pso, pd, pdo, pn = sr[put], so[put], dr[put], do[put], n[put]
        if npk < len(n):
            announced = (pd, pdo, pn) if announced is None else \
                tuple(np.concatenate(c) for c in zip((pd, pdo, pn), announced))
        if len(pn) > 1 and keyed:
            ks, kd, pn = merge_runs(region_key(ps, pso), region_key(pd, pdo), pn)
            (ps, pso), (pd, pdo) = region_unkey(ks), region_unkey(kd)
        n_, (src, dst), (sreg, dreg) = split_long_runs(self.frame_bytes, pn, (regions.base[ps] + pso,
                                                                              p.base[pd] + pdo), (ps, pd))
        puts = np.stack((src, dst, n_, sreg, dreg), axis=1).astype(_I8, copy=False).tobytes()
        return puts, np.stack(announced).astype(_I8, copy=False).tobytes(), len(n) - npk, packed

    def prepare_few(self, p: Peer, plan: TransferPlan, put_all: bool = False) -> tuple:
        """``prepare`` for a plan of at most ``few_runs`` runs, with Python ints (``put_all``:
        none packed, whatever its size), and the packed bytes when they go inline from host
        memory (read through numpy views: no torch call, ~7 us less per transfer)."""
        small = 0 if put_all else self.options.put_below
        put_runs: list[tuple[int, int, int, int, int]]
        packed_runs: list[tuple[int, int, int, int, int]]
        put_runs, packed_runs, frame = [], [], self.frame_bytes
        puts: list[int] = []
        ssz, dsz = self.regions.size_list, p.sizes_list
        for g in plan.groups:
            for sr, so, dr, do, n in g.run_tuples():
                if n <= 0:
                    raise PlanError("a run of the plan is empty or negative")
                if not runs_inside_few(((sr, so, n),), ssz):
                    raise PlanError(f"a source run leaves its region (the source has {len(ssz)} regions)")
                if not runs_inside_few(((dr, do, n),), dsz):
                    raise PlanError(f"a destination run leaves its region (the destination has {len(dsz)} regions)")
                (packed_runs if n < small or p.pack_all else put_runs).append((sr, so, dr, do, n))
        base_list = self.regions.base_list
        for sr, so, dr, do, n in put_runs:
            src, dst = base_list[sr] + so, p.base_list[dr] + do
            for k in range(0, n, frame):
                puts += (src + k, dst + k, min(frame, n - k), sr, dr)
        packed, inline = None, b""
        if packed_runs:
            views = self.regions.host_views
            if sum(r[4] for r in packed_runs) < INLINE_BELOW and all(views[r[0]] is not None for r in packed_runs):
                inline = b"".join([views[sr][so:so + n] for sr, so, _, _, n in packed_runs])
            else:
                psr, pso, _, _, pn = (np.array(c, np.int64) for c in zip(*packed_runs))
                packed = (psr, pso, pn)
        runs = put_runs + packed_runs
        rows = struct.pack(f"<{3 * len(runs)}q", *[r[2] for r in runs], *[r[3] for r in runs], *[r[4] for r in runs])
        return struct.pack(f"<{len(puts)}q", *puts), rows, len(put_runs), packed, inline
