"""UCX receiving side: check an ANNOUNCE whole, answer GO, land packed frames, ACK after DONE.

``UCXReceiver`` is a mixin of ``UCXTransport``; its methods run on the I/O thread, except
``writes_pending`` (any thread). ``_on_announce`` checks every announced run against the grant
and the regions before GO (an eager one, after its puts: ``eager``); ``_poll_data`` receives
packed frames (in place for host memory; for CUDA, and staged host frames unless
``stage_host="never"``, into the receive ring, each frame scattered as it lands:
``_land_frames``); ``_try_finish`` acknowledges; ``_fail_in`` ends a transfer and keeps the
grant's memory marked (``writes_pending``) while puts or posted receives may land, and ring slots
held while frame receives may still write them (``frames.RingSpill`` stands in for those).

No oracle: the FAIL a peer gets for a refusal because of the grant (unknown, ended or live
request, runs outside it) reads the same; only the local counters and arrivals tell them apart.
"""
from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api

from kvxfer.copy import copy_runs
from kvxfer.plan import FEW_RUNS, Runs
from kvxfer.transport.base import Arrival
from kvxfer.transport.kit import peer_reason

from . import bindings as ucp
from .frames import HeldSlot, RingHold, RingSpill, StagedFrames, Stream, byte_cut, cut, stream_iovs
from .protocol import DATA_BIT, FRAME_BITS, KIND_MASK, MAX_DTAG, Ack, Announce, Fail, Go
from .sender import ucx_buffer
from .state import Incoming, Peer

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable
    from kvxfer.transport.kit import StagingPool

    from .protocol import Message






class UCXReceiver:
    """Receiver half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only: set in ``UCXTransport.__init__`` or defined by the
    # other halves (``UCXControl``, ``UCXSender``, ``UCXTransport``). Annotations, no values,
    # so nothing here shadows the real attributes at run time.
    grants: GrantTable
    max_incoming: int
    max_incoming_per_peer: int
    _worker: Any                      # ucx_api.UCXWorker
    _whandle: int                     # its ucp_worker_h (None once freed)
    _regions: list[torch.Tensor]
    _base: np.ndarray
    _region_sizes: np.ndarray
    _is_host: np.ndarray
    _host_views: list   # numpy view of each host region (None: CUDA)
    _all_host: bool
    _cuda_devices: set[torch.device]
    _in: dict[tuple[str, int], Incoming]
    _peers: dict[str, Peer]
    _by_dtag: dict[int, Incoming]
    _landing: dict[tuple[str, int], tuple[str, int, float]]
    _landing_rids: collections.Counter
    _open_rids: collections.Counter
    _draining: list
    _zombies: list
    _drop: Callable[[Any, Any, str], None]        # UCXInbox
    _rx_ring: StagingPool
    _spill: RingSpill
    frame_bytes: int
    stage_host: str
    _acts: int
    _send: Callable[[Peer, Message], None]
    _deliver: Callable[[Arrival], None]
    _pregrants: dict[str, set[str]]                # UCXEager
    _fences: dict[str, tuple[set[str], float]]
    _fence_queued: set[str]
    _fence: Callable[[str], None]

    def _on_announce(self, p, m: Announce) -> None:
        xid, rid = m.xid, m.request_id
        runs, nput, inline = m.run_array(), m.nput, m.inline
        reg, off, n = runs
        # Without the grant's capability: handled exactly as an ANNOUNCE for an unknown id (the same
        # answer: no oracle; grants.check and is_live refuse it) but with no arrival: it never
        # fails or completes the request.
        quiet = not self.grants.capability_ok(rid, m.cap)
        # Each peer its own share: max_incoming_per_peer, and past max_incoming in all, no more than
        # an equal part of it among the peers with transfers open (so at most 2 x max_incoming open).
        if p.open_in >= self.max_incoming_per_peer or len(self._in) >= self.max_incoming and \
                p.open_in >= self.max_incoming // max(1, sum(1 for q in self._peers.values() if q.open_in)):
            return self._refuse(p, xid, rid, 0, m.notify, self.grants.reject(
                rid, f"too many transfers: {len(self._in)} open, {p.open_in} from this peer"), quiet)
        # An empty transfer writes nothing: acknowledged whatever its request id (no oracle)
        reason = self.grants.check(rid, reg, off, n, m.cap) if len(n) else None
        # A granted run lies inside the grant: non-negative and below 2**62, so the sums below hold.
        # A few runs are summed as Python ints (a numpy reduction of one run costs ~1.5 us; 3 here).
        nl = n.tolist() if reason is None and len(n) <= FEW_RUNS else None
        if reason is None and len(n) and (
                any(o + c > self.grants.region_sizes[r] for r, o, c in zip(reg.tolist(), off.tolist(), nl))
                if nl is not None else (off + n > self._region_sizes[reg]).any()):
            # GrantTable trusts the grant to lie inside the regions; a grant past the end is ours to catch.
            reason = self.grants.reject(rid, "outside region: a granted run ends past its region")
        if reason is None and (p.id, xid) in self._in:
            reason = self.grants.reject(rid, f"malformed header: transfer {xid} announced twice")
        packed = runs[:, nput:]
        total = 0 if reason is not None else sum(nl[nput:]) if nl is not None else int(packed[2].sum())
        nbytes = sum(nl) if nl is not None else int(n.sum()) if reason is None else 0
        if reason is None and inline and len(inline) != total:
            reason = self.grants.reject(rid, f"malformed header: {len(inline)} inline bytes for {total} packed")
        if reason is None and m.eager and (len(inline) != total or p.id not in self._pregrants.get(rid, ())):
            reason = self.grants.reject(rid, "malformed header: an eager announce needs this receiver's pregrant "
                                        "and every packed byte inline")
        host = self._all_host or bool(self._is_host[packed[0]].all())
        # The receive ring: for CUDA destinations, and for host ones the sender staged (it does for
        # peers over the network) unless stage_host is "never"; other host frames land in place
        # as iovs (staged ones cut as the sender cut them).
        ring = reason is None and total > 0 and not inline and \
            (not host or m.staged and self.stage_host != "never")
        if ring and m.frame_bytes > self.frame_bytes:
            reason = self.grants.reject(rid, f"malformed header: frames of {m.frame_bytes} bytes do not fit the "
                                        f"receiver's staging frames of {self.frame_bytes}: use one frame_bytes")
        if reason is None and total and 2 * total // m.frame_bytes + 1 >= 1 << FRAME_BITS:   # bounds the cut
            reason = self.grants.reject(rid, f"malformed header: {total} packed bytes in frames of {m.frame_bytes}")
        if reason is not None:
            ok = len(n) and (n > 0).all() and (n < 1 << 40).all()
            return self._refuse(p, xid, rid, int(n.sum()) if ok else 0, m.notify, reason, quiet)
        if m.eager:   # its puts are flushed (``eager``): checked above, now it is done
            if inline:
                self._land_inline(tuple(packed), inline)
            self._deliver(Arrival(rid, nbytes, True, "", m.notify))
            return self._send(p, Ack(xid))
        staging = None
        if ring:   # frames through the receive ring: cut as the sender cut them (``frames``)
            bounds = cut(packed[2], m.frame_bytes) if m.staged else byte_cut(total, m.frame_bytes)
            staging = StagedFrames(Stream(*packed), bounds, self._rx_ring.device)
        i = Incoming(p, xid, rid, time.monotonic() + m.timeout, nbytes, m.notify, tuple(packed), staging,
                     m.frame_bytes, 0 if inline else staging.count if staging else -(-total // m.frame_bytes),
                     puts=nput, cap=m.cap)
        self._open_rids[rid] += 1   # writes_pending until _forget_in (forget() fails it asynchronously)
        self._in[(p.id, xid)] = i
        p.open_in += 1
        if inline:  # checked a moment ago: lands now, with no re-check and no frames
            self._land_inline(i.packed, inline)
            i.packed = None
        elif total and not ring:   # frames land in the runs themselves
            addr = self._base[packed[0]] + packed[1]
            i.iov = ucp.IovFrames(stream_iovs(addr, packed[2], cut(packed[2], m.frame_bytes)) if m.staged
                                  else ucp.frame_iovs(addr, packed[2], m.frame_bytes))
        if nput == 0 and not i.frames:  # all here already: ACK without GO and DONE
            i.done = True
            return self._try_finish(i)
        # The data tag names this transfer: 38 random bits, unused here, told only to its sender
        # (GO, on its channel). A frame lands only under its exact tag (posted receive, or the
        # ring's lookup below), so a third party's sprayed frame hits one of the N frames open
        # here with probability N / 2**62.
        while (dtag := secrets.randbelow(MAX_DTAG - 1) + 1) in self._by_dtag:
            pass
        i.dtag = dtag
        self._by_dtag[dtag] = i
        if i.iov is not None:   # posted before GO: no frame of it can arrive unexpected
            i.iov.recv(self._whandle, DATA_BIT | i.dtag << FRAME_BITS)
            if i.iov.error:
                return self._fail_in(i, f"posting receives failed: {i.iov.error}")
        self._send(p, Go(xid, i.dtag))

    def _refuse(self, p, xid: int, rid: str, nbytes: int, notify: bytes, reason: str, quiet: bool = False) -> None:
        if not quiet:   # quiet: a wrong capability, which must not touch the request
            self._deliver(Arrival(rid, nbytes, False, reason, notify))
        self._send(p, Fail(xid, peer_reason(reason)))

    def _poll_data(self) -> None:
        """I/O thread, every turn: receive arrived frames of ring transfers into free slots of
        the receive ring (none free: the frame waits in UCX, counted in ``waits``; an unusable
        frame is dropped), land completed ones, and finish transfers whose frames all landed."""
        probe, want_tag, mask = self._worker.tag_probe, ucx_api.UCXXTag(DATA_BIT), ucx_api.UCXXTagMask(KIND_MASK)
        while (res := probe(want_tag, mask, remove=False)).matched:
            tag = res.sender_tag.value
            i, k = self._by_dtag.get((tag & ~KIND_MASK) >> FRAME_BITS), tag & ((1 << FRAME_BITS) - 1)
            want = -1 if i is None or i.staging is None or k >= i.frames or i.staging.seen[k] else i.staging.size(k)
            ring_free = res.length != want or self._rx_ring.available()
            if not ring_free and not self._spill.room():   # back-pressure: next turn
                break
            res = probe(want_tag, mask, remove=True)   # the same message (UCX adds only inside progress)
            self._acts += 1
            if res.length != want:
                # Under a tag nobody here has: dropped and counted, no transfer touched. Under a live
                # transfer's tag (only its sender has it) but not a frame still to come in the ring
                # (received in place, past the end, a second copy, the wrong size): that sender's
                # mistake fails the transfer.
                if i is not None:
                    self._fail_in(i, self.grants.reject(i.rid, f"malformed frame: {k} of {res.length} bytes"))
                self._drop(self._worker, res, "frame")
                continue
            slot = self._rx_ring.get(want, i.staging.device) if ring_free else self._spill.get(i.staging.device)
            i.staging.seen[k] = True
            i.staging.reqs.append((self._worker.tag_recv_with_handle(ucx_buffer(slot), res), k, slot))
        for i in [i for i in self._in.values() if i.iov is not None and i.got < i.frames]:
            done = i.iov.poll()
            if i.iov.error:   # at once: the frames still posted are cancelled
                self._acts += 1
                self._fail_in(i, self.grants.reject(i.rid, i.iov.error) if i.iov.error.startswith("malformed")
                              else f"peer failed: receiving packed frames: {i.iov.error}")
            elif done:
                self._acts += 1
                i.got, i.packed = i.frames, None   # landed in place
                self._try_finish(i)
        if self._draining:
            self._reap_draining()
        if self._spill.held:
            self._spill.prune()
        for i in [i for i in self._in.values() if i.staging is not None and i.staging.reqs]:
            self._land_frames(i)
        self._zombies = [z for z in self._zombies if not z[0].completed]

    def _land_frames(self, i: Incoming) -> None:
        """Scatter every received frame of ``i`` into its runs (checked against the grant first:
        the request may have ended meanwhile) and free its slot; all landed: finish."""
        st = i.staging
        assert st is not None
        done = [r for r in st.reqs if r[0].completed]
        if not done:
            return
        st.reqs = [r for r in st.reqs if not r[0].completed]
        self._acts += 1
        for j, (req, k, slot) in enumerate(done):
            try:
                req.check_error()
                reason = None
            except Exception as e:
                reason = f"peer failed: receiving packed frames: {e}"
            part = st.part(k)
            if reason is None and (reason := self.grants.check(i.rid, *part, i.cap)) is None:
                self._land(part, slot)   # in place (CUDA: the copies completed) before the slot is free
            self._free_slot(slot)
            if reason is not None:
                for _, _, s in done[j + 1:]:
                    self._free_slot(s)
                return self._fail_in(i, reason)
            i.got += 1
        if i.got == i.frames:
            i.packed = None   # landed, frame by frame
            self._try_finish(i)

    def _free_slot(self, slot: torch.Tensor) -> None:
        """A frame landed: its ring slot is free again (a spill frame is let go)."""
        if self._spill.owns(slot):
            self._spill.put(slot)
        else:
            self._rx_ring.put(slot)

    def _try_finish(self, i: Incoming) -> None:
        if not i.done or i.got < i.frames:
            return
        self._forget_in(i)
        if i.nbytes or self.grants.is_live(i.rid, i.cap):   # an empty transfer of no live request: ACK only
            self._deliver(Arrival(i.rid, i.nbytes, True, "", i.notify))
        self._send(i.peer, Ack(i.xid))

    def _land(self, packed: tuple, data: torch.Tensor) -> None:
        """Write consecutive bytes of ``data`` to the packed runs (region, offset, length arrays)
        with copy_runs, which sees the staging rows as evenly spaced (~1.5x scatter_runs here)."""
        region, offset, nbytes = packed
        copy_runs([data], self._regions, Runs(np.zeros_like(nbytes), np.cumsum(nbytes) - nbytes, region, offset,
                                              nbytes, np.ones(len(nbytes), bool)))
        for dev in self._cuda_devices:  # "arrived" means in place, not queued on a stream
            torch.cuda.current_stream(dev).synchronize()

    def _land_inline(self, packed: tuple, inline: bytes) -> None:
        """``_land`` for inline bytes (checked against the grant): a few host runs are written
        through numpy views (no torch call: ~10 us less per transfer), others by ``_land``."""
        views = self._host_views
        if len(packed[2]) <= FEW_RUNS:
            runs = list(zip(*(a.tolist() for a in packed)))
            if all(views[r] is not None for r, _, _ in runs):
                src, pos = memoryview(inline), 0
                for r, o, c in runs:
                    views[r][o:o + c] = src[pos:pos + c]
                    pos += c
                return
        self._land(packed, torch.frombuffer(bytearray(inline), dtype=torch.uint8))

    def _forget_in(self, i: Incoming) -> None:
        """End ``i`` here. Whatever may still land of it is marked (``_draining``) before it stops
        counting as open, so ``writes_pending`` (any thread) never sees a gap."""
        self._by_dtag.pop(i.dtag, None)
        if i.staging is not None and i.staging.reqs:   # receives still write their slots: fenced
            self._hold_slots(i)
        if i.iov is not None and not i.iov.poll():   # receives posted into the grant's memory
            i.iov.cancel(self._whandle)
            self._draining.append((i.peer.id, i.rid, i.iov, int(i.packed[2].sum()) if i.packed is not None else 0,
                                   time.monotonic()))
            self._landing_rids[i.rid] += 1   # writes_pending until they are all done
        if self._in.pop((i.peer.id, i.xid), None) is not None:
            i.peer.open_in -= 1
            self._open_rids[i.rid] -= 1
            if self._open_rids[i.rid] <= 0:
                del self._open_rids[i.rid]

    def _hold_slots(self, i: Incoming) -> None:
        """``i`` ended with frames still being received into ring slots: each slot is free once
        its receive completed, or once the sender is proven dead (``fencing._release_peer`` ends
        the ``_draining`` entry made here; no ucp call cancels a matched receive). Counted in
        ``fencing()`` under a key of its own: these writes reach ring slots, never the grant."""
        st = i.staging
        assert st is not None
        hold = RingHold([req for req, _, _ in st.reqs])

        def held() -> bool:
            return any(e[2] is hold for e in self._draining)
        for req, _, slot in st.reqs:
            until = HeldSlot(req, held)
            if self._spill.owns(slot):
                self._spill.hold(until, slot)
            else:
                self._rx_ring.put(slot, until)
                self._spill.hold(until)   # while held, a spill frame may stand in for it
            self._zombies.append((req, slot))
        key = ("ring slots", i.rid)
        self._draining.append((i.peer.id, key, hold, sum(int(s.numel()) for _, _, s in st.reqs), time.monotonic()))
        self._landing_rids[key] += 1
        st.reqs = []

    def _reap_draining(self) -> None:
        """Ended transfers whose posted receives are all done: nothing more of them lands."""
        left = []
        for entry in self._draining:
            if entry[2].poll():
                self._landed(entry[1])
            else:
                left.append(entry)
        self._draining = left

    def _fail_in(self, i: Incoming, reason: str, tell: bool = True, puts_left: bool = True) -> None:
        if puts_left and i.dtag and i.puts and not i.done and (i.peer.id, i.xid) in self._in \
                and (i.peer.id, i.xid) not in self._landing:   # GO went out: puts may come, silent peer or not
            self._landing[(i.peer.id, i.xid)] = (i.rid, i.nbytes, time.monotonic())
            self._landing_rids[i.rid] += 1
        self._forget_in(i)   # after: writes_pending stays True throughout
        self._deliver(Arrival(i.rid, i.nbytes, False, reason, i.notify))
        if tell:
            self._send(i.peer, Fail(i.xid, peer_reason(reason)))

    def _landed(self, rid: str) -> None:
        self._landing_rids[rid] -= 1
        if self._landing_rids[rid] <= 0:
            del self._landing_rids[rid]

    def writes_pending(self, request_id: str) -> bool:
        """Decode's endpoint, any thread, after ``forget``: True while a sender that had GO for this
        request has not proven its puts flushed (DONE or ABORT after its flush, or a re-handshake),
        or frames posted into the grant are not done, and the sender is not proven dead. A silent
        sender keeps it True (silence is not death); see ``fencing()``. Until it is False the
        grant's memory must not be reused. Transfers of the request still open here count too:
        ``forget`` fails them on the I/O thread a moment later."""
        return request_id in self._landing_rids or (request_id in self._open_rids
                                                    and not self.grants.is_live(request_id)) \
            or request_id in self._fence_queued or request_id in self._fences   # eager: until FENCED

    def _drop_request(self, rid: str) -> None:
        for i in [i for i in self._in.values() if i.rid == rid]:
            self._fail_in(i, self.grants.reject(rid, "ended request: the receiver forgot it mid-transfer"))
        self._fence(rid)
