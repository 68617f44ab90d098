"""UCX sending side: plan runs into puts and packed frames, announce, put after GO, flush, DONE.

``UCXSender`` is a mixin of ``UCXTransport``. ``submit`` (caller's thread) prepares a transfer
(``_prepare`` / ``_prepare_few``: bounds, puts, announced runs, packed runs) and enqueues it;
everything else runs on the I/O thread: ``_start_out`` sends the ANNOUNCE, ``_start_puts``
issues puts and iov frames when GO comes, ``_flush_puts`` flushes once per peer and turn,
``_advance`` gathers staged frames into the send ring as its slots free (``_pump_frames``) and
sends DONE once the flush and every frame completed, ``_fail_out`` ends a transfer (ABORT once
no put of it is in flight; its frames in flight keep their slots until their sends end).
"""
from __future__ import annotations

import ctypes
import itertools
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api

from kvxfer.copy import gather_runs
from kvxfer.errors import PeerError, PlanError, TransportError
from kvxfer.plan import TransferPlan, merge_runs
from kvxfer.transport.base import TransferHandle
from kvxfer.transport.kit import (
    keyable,
    merge_in_stream,
    region_key,
    region_unkey,
    runs_inside,
    runs_inside_few,
    split_long_runs,
)

from . import bindings as ucp
from .frames import STAGE_BELOW, Completes, StagedFrames, Stream, cut
from .protocol import DATA_BIT, FRAME_BITS, Abort, Announce, Done
from .state import Outgoing, Peer

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable
    from kvxfer.transport.kit import StagingPool

    from .protocol import Message

_I8 = np.dtype("<i8")
INLINE_BELOW = 256 * 1024   # packed bytes below this travel inside the ANNOUNCE


def ucx_buffer(t: torch.Tensor):
    """ucxx buffer for a uint8 tensor: numpy for host memory, CUDA array interface otherwise."""
    from ucxx._lib.arr import Array
    return Array(t.numpy() if t.device.type == "cpu" else t)




class UCXSender:
    """Sender half of ``UCXTransport`` (see the module docstring for who calls what)."""

    # Declared for the type checker only: set in ``UCXTransport.__init__`` or defined by the
    # other halves (``UCXControl``, ``UCXReceiver``, ``UCXTransport``). Annotations, no values,
    # so nothing here shadows the real attributes at run time.
    grants: GrantTable
    frame_bytes: int
    put_below: int
    put_below_many: int
    few_runs: int
    max_control_bytes: int
    stage_host: str
    _network_only: bool
    _acts: int
    _regions: list[torch.Tensor]
    _base: np.ndarray
    _base_list: list[int]
    _region_sizes: np.ndarray
    _is_host: np.ndarray
    _host_list: list[bool]
    _host_views: list   # numpy view of each host region (None: CUDA)
    _all_host: bool
    _put_params: np.ndarray
    _put_params_far: np.ndarray
    _flush_param: ucp.RequestParam
    _out: dict[int, Outgoing]
    _unflushed: dict[str, list]
    _flushing: list
    _holding: list
    _zombies: list
    _xids: itertools.count[int]
    _staging: StagingPool
    _send: Callable[[Peer, Message], None]
    _eager_ok: Callable[[Outgoing], bool]          # UCXEager
    _start_eager: Callable[[Outgoing], None]
    _park: Callable[[Outgoing], bool]

    def _prepare_transfer(self, p, handle: TransferHandle, plan: TransferPlan, notify: bytes,
                          cap: bytes = b"") -> Outgoing:
        """Caller's thread: bounds, puts, announce and packed data of one transfer (PlanError,
        TransportError when it cannot be sent)."""
        if not self._regions and plan.num_runs:
            raise TransportError("register(regions) must be called before submit")
        inline = b""
        if plan.num_runs <= self.few_runs:
            # pregranted, or its PREGRANT may still come (``eager._park``): small runs are put too
            puts, runs, nput, packed, inline = self._prepare_few(p, plan, p.fence_answers or
                                                                 handle.request_id in p.pregranted)
        else:
            puts, runs, nput, packed = self._prepare(p, plan)
        if len(runs) + len(notify) > self.max_control_bytes // 2:
            raise PlanError(f"a plan of {len(runs) // 24} runs does not fit one announce of at most "
                            f"{self.max_control_bytes // 2} bytes: send it in smaller chunks")
        staging = iov = None
        if packed is not None:
            sr, so, n = packed
            total = int(n.sum())
            host = self._all_host or bool(self._is_host[sr].all())
            if total < INLINE_BELOW:               # in the announce: no GO wait, no frames
                inline = gather_runs(self._regions, sr, so, n).cpu().numpy().tobytes()
            elif host and not self._stages_host(p, total, max(len(n), len(runs) // 24 - nput)):
                # frames read straight from the source runs
                iov = ucp.IovFrames(ucp.frame_iovs(self._base[sr] + so, n, self.frame_bytes))
            else:   # gathered frame by frame into the send ring, on the I/O thread after GO
                bounds = cut(np.frombuffer(runs, _I8).reshape(3, -1)[2, nput:], self.frame_bytes)
                staging = StagedFrames(Stream(sr, so, n), bounds, self._staging.device)
        xid = next(self._xids)
        announce = Announce(xid, handle.request_id, 0.0, bytes(notify), runs, nput, self.frame_bytes, inline, cap,
                            staging is not None)
        return Outgoing(xid, p, handle, announce, puts, staging, self.frame_bytes, iov)

    def _stages_host(self, p: Peer, total: int, pieces: int) -> bool:
        """Do ``total`` packed bytes of host memory to ``p``, ``pieces`` runs on the busier side,
        go through the send ring (``stage_host``; "network": small pieces to a network peer)?"""
        return self.stage_host == "always" or (self.stage_host == "network" and (p.far or self._network_only)
                                               and total < STAGE_BELOW * pieces)

    def _prepare(self, p, plan: TransferPlan) -> tuple:
        """Bounds-check the runs: (puts, announced runs, put count, packed runs as
        (source region, offset, length) arrays or None)."""
        r = plan.runs()
        sr, so, dr, do, n = r[:5]
        if len(n) and n.min() <= 0:
            raise PlanError("a run of the plan is empty or negative")
        for side, reg, off, lim in (("source", sr, so, self._region_sizes), ("destination", dr, do, p.sizes)):
            if not runs_inside(reg, off, n, lim):
                raise PlanError(f"a {side} run leaves its region (the {side} has {len(lim)} regions)")
        # Runs below put_below_many travel packed, whatever the plan says: this bounds the put loop
        # (one Python step per put) by bytes / put_below_many, and a small put costs more than packing.
        pk = np.ones(len(n), bool) if p.pack_all else n < self.put_below_many   # pack_all: see Peer
        npk = int(np.count_nonzero(pk))
        put = slice(None) if npk == 0 else slice(0) if npk == len(n) else ~pk
        keyed = keyable(self._region_sizes, p.sizes)
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
        n_, (src, dst), (sreg, dreg) = split_long_runs(self.frame_bytes, pn, (self._base[ps] + pso, p.base[pd] + pdo),
                                                      (ps, pd))
        puts = np.stack((src, dst, n_, sreg, dreg), axis=1).astype(_I8, copy=False).tobytes()
        return puts, np.stack(announced).astype(_I8, copy=False).tobytes(), len(n) - npk, packed

    def _prepare_few(self, p, plan: TransferPlan, put_all: bool = False) -> tuple:
        """``_prepare`` for a plan of at most ``few_runs`` runs, with Python ints (``put_all``:
        none packed, whatever its size), and the packed bytes when they go inline from host
        memory (read through numpy views: no torch call, ~7 us less per transfer)."""
        small = 0 if put_all else self.put_below
        put_runs: list[tuple[int, int, int, int, int]]
        packed_runs: list[tuple[int, int, int, int, int]]
        put_runs, packed_runs, frame = [], [], self.frame_bytes
        puts: list[int] = []
        ssz, dsz = self.grants.region_sizes, p.sizes_list
        for g in plan.groups:
            for sr, so, dr, do, n in g.run_tuples():
                if n <= 0:
                    raise PlanError("a run of the plan is empty or negative")
                if not runs_inside_few(((sr, so, n),), ssz):
                    raise PlanError(f"a source run leaves its region (the source has {len(ssz)} regions)")
                if not runs_inside_few(((dr, do, n),), dsz):
                    raise PlanError(f"a destination run leaves its region (the destination has {len(dsz)} regions)")
                (packed_runs if n < small or p.pack_all else put_runs).append((sr, so, dr, do, n))
        for sr, so, dr, do, n in put_runs:
            src, dst = self._base_list[sr] + so, p.base_list[dr] + do
            for k in range(0, n, frame):
                puts += (src + k, dst + k, min(frame, n - k), sr, dr)
        packed, inline = None, b""
        if packed_runs:
            views = self._host_views
            if sum(r[4] for r in packed_runs) < INLINE_BELOW and all(views[r[0]] is not None for r in packed_runs):
                inline = b"".join([views[sr][so:so + n] for sr, so, _, _, n in packed_runs])
            else:
                psr, pso, _, _, pn = (np.array(c, np.int64) for c in zip(*packed_runs))
                packed = (psr, pso, pn)
        runs = put_runs + packed_runs
        rows = struct.pack(f"<{3 * len(runs)}q", *[r[2] for r in runs], *[r[3] for r in runs], *[r[4] for r in runs])
        return struct.pack(f"<{len(puts)}q", *puts), rows, len(put_runs), packed, inline

    # ---- I/O thread ---------------------------------------------------------------------
    def _start_out(self, o: Outgoing) -> None:
        if o.handle.poll() != 0:  # failed or timed out while queued: nothing read its source
            o.handle.release_source()
            return
        if o.peer.rehello is not None:   # re-handshaking: announced after the new HELLO
            o.peer.waiting.append(o)
            return
        self._out[o.xid] = o
        a, eager = o.announce, self._eager_ok(o)   # relative deadline: clocks differ across hosts
        o.announce = Announce(a.xid, a.request_id, max(o.handle.deadline - time.monotonic(), 0.0), a.notify, a.runs,
                              a.nput, a.frame_bytes, a.inline, a.cap, a.staged, eager)   # not replace(): ~3x dearer
        if eager:   # pregranted: put now, announce after the flush (``eager``)
            return self._start_eager(o)
        if self._park(o):   # its PREGRANT is on its way (``eager``)
            return
        self._send(o.peer, o.announce)
        o.state = "wait_go"

    def _start_puts(self, o: Outgoing, dtag: int) -> None:
        """GO came: issue every put and packed frame at once (all in flight); the turn flushes."""
        ep = o.peer.eph
        if o.puts:   # every put in one call (the compiled helper): the puts it posted before a failure are in flight
            try:
                _, status = ucp.post_puts(ep, o.puts, o.peer.rkeys, self._put_params_far if o.peer.far
                                          else self._put_params)
            except ValueError as e:   # checked before any was posted (the peer's rkeys gone, say): none in flight
                return self._fail_out(o, PeerError(f"request {o.handle.request_id}: {e}"), tell=not o.eager)
            if status:
                return self._fail_issued(o, f"put failed: {ucp.why(status)}")
        if o.iov is not None:
            o.iov.send(ep, DATA_BIT | dtag << FRAME_BITS)
            if o.iov.error:
                return self._fail_issued(o, f"sending frames failed: {o.iov.error}")
        o.dtag = dtag   # staged frames leave from _pump_frames, as ring slots free
        o.state = "flushing"
        self._unflushed.setdefault(o.peer.id, []).append(o)

    def _fail_issued(self, o: Outgoing, why: str) -> None:
        """Fail ``o`` part way through ``_start_puts``: what it issued (puts, frames) still reads
        the source, so the turn's flush covers it before the source is released."""
        o.state = "flushing"
        self._unflushed.setdefault(o.peer.id, []).append(o)
        self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"))

    def _flush_puts(self) -> None:
        """One ep flush per peer covers every put issued to it this turn."""
        for outs in self._unflushed.values():
            f = ucp.Flush(ucp.ep_flush(outs[0].peer.eph, ctypes.byref(self._flush_param)))
            for o in outs:
                o.flush = f
            self._flushing += outs
        self._unflushed.clear()

    def _pump_frames(self, o: Outgoing) -> bool:
        """I/O thread, every turn, for a transfer past GO with staged frames: gather its next
        frames into free slots of the send ring and tag-send them; a slot is free again once
        its send completed (``Completes``), whatever became of the transfer. The ring exhausted,
        it waits (counted in ``waits``) and never allocates. True when every frame has left."""
        st = o.staging
        assert st is not None
        left = []
        for r in st.reqs:
            if not r[0].completed:
                left.append(r)
                continue
            try:
                r[0].check_error()
            except Exception as e:   # the rest of its slots free as their sends end
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: sending frame {r[1]} failed: {e}"))
                return False
        st.reqs = left
        while st.next < st.count:
            if not self._staging.available():   # back-pressure: looked at again next turn
                return False
            k, size = st.next, st.size(st.next)
            slot = self._staging.get(size, st.device)
            gather_runs(self._regions, *st.part(k), out=slot)
            if slot.is_cuda:   # UCX reads the slot at once: the gather must be complete
                torch.cuda.current_stream(slot.device).synchronize()
            req = o.peer.ep.tag_send(ucx_buffer(slot), ucx_api.UCXXTag(DATA_BIT | o.dtag << FRAME_BITS | k))
            self._staging.put(slot, Completes(req))
            st.reqs.append((req, k, slot))
            st.next += 1
            self._acts += 1
        return not st.reqs

    def _advance(self) -> None:
        """DONE for every flushed transfer whose packed frames left too (in the turn of its flush
        when that completes at once, as it does for shared-memory puts)."""
        waiting = []
        for o in self._flushing:
            if o.state != "flushing":  # failed meanwhile
                continue
            sent = o.staging is None or self._pump_frames(o)
            if o.state != "flushing":   # a frame failed
                continue
            if (st := o.flush.poll()) is None or not sent or (o.iov is not None and not o.iov.poll()):
                waiting.append(o)
            elif st != 0:
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: flush failed: {ucp.why(st)}"))
            elif o.iov is not None and o.iov.error:
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: sending frames failed: {o.iov.error}"))
            else:
                o.handle.release_source()   # every put is remotely visible: the source is read
                o.staging, o.state = None, "wait_ack"
                self._send(o.peer, o.announce if o.eager else Done(o.xid))
                if o.eager and not o.announce.inline:   # flushed: in the receiver's memory (``eager``)
                    del self._out[o.xid]
                    o.state = "done"
                    # now, not after the turn's sends (``_later``): the caller it wakes delays the
                    # announce, already queued, by its pack at most; after the sends, the receiver
                    # that announce woke often ran first on this core. 1 MiB eager, two processes,
                    # 3 interleaved pairs: sender medians 400-499 -> 341-382 us, arrival 535-580 -> 562-572
                    o.handle.finish(release=True)
        self._flushing = waiting

    def _fail_out(self, o: Outgoing, err: Exception, tell: bool = True) -> None:
        """End ``o``. Once GO came, the receiver holds the grant's memory until ABORT says that
        no put of ours is still on its way: sent after the flush, whoever failed the transfer."""
        self._out.pop(o.xid, None)
        o.handle.finish(err)
        if o.state == "flushing":
            o.abort = str(err)
            if self._puts_settled(o):
                self._release_and_abort(o)
            else:
                self._holding.append(o)   # puts issued, not flushed: they still read the source
        else:
            o.handle.release_source()
            if tell and o.state != "wait_pregrant":   # parked: never announced
                self._send(o.peer, Abort(o.xid, str(err)))
        o.state = "failed"
        if o.staging is not None:   # frames still being sent keep their ring slots (``Completes``)
            self._zombies.extend((r, slot) for r, _, slot in o.staging.reqs)
            o.staging.reqs, o.staging.next = [], o.staging.count
        if o.iov is not None and o.iov.reqs:
            self._zombies.append((o.iov, None))   # their requests are freed as they complete
        if o.flush is not None and o.flush.ptr is not None:
            self._zombies.append((o.flush, None))

    @staticmethod
    def _puts_settled(o: Outgoing) -> bool:
        """No put or frame of ``o`` reads its source any more: the flush ended and the frames
        left. Never because the peer is silent: a silent peer may come back, and a put queued
        in a socket then reads the source and lands (the peer proven dead: ``_release_peer``)."""
        return o.flush is not None and o.flush.completed and (o.iov is None or o.iov.poll())

    def _release_and_abort(self, o: Outgoing) -> None:
        """No put of failed ``o`` reads its source or lands any more: release it, and tell the
        receiver (ABORT: it may give the grant's memory back) only when the flush succeeded."""
        o.handle.release_source()
        if o.flush is not None and o.flush.poll() != 0:   # what it covered may still land: no ABORT, no FENCED
            o.peer.flush_failed = True
        elif not o.eager:   # an eager one was never announced
            self._send(o.peer, Abort(o.xid, o.abort))
