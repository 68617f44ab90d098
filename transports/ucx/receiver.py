"""UCX receiving side: check an ANNOUNCE whole, answer GO, land packed frames, ACK after DONE.

Every method runs on the I/O thread. ``on_announce`` (``Control``) checks every announced run
against the grant and the regions before GO (an eager one, sent as its puts started, is checked
the same and gets no GO; DONE follows their flush: ``eager``);
``poll_data`` (the loop, each turn) receives packed frames (in place for host memory; for CUDA,
and staged host frames whose pieces here are small (``rings_host``), into the receive ring, each
frame scattered as it lands: ``land_frames``); ``on_end`` (``Control``: DONE or ABORT) and ``try_finish``
acknowledge; ``fail_in`` ends a transfer and keeps the grant's memory marked in ``Landing``
(``writes_pending``) while puts or posted receives may land, and ring slots held while frame
receives may still write them (``frames.RingSpill`` stands in for those). ``drop_request``
(after ``forget``) fails the request's open transfers and fences its pregrants.

No oracle: the FAIL a peer gets for a refusal because of the grant (unknown, ended or live
request, runs outside it) reads the same; only the local counters and arrivals tell them apart.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api

from kvxfer.copy import copy_runs
from kvxfer.grant import GrantTable
from kvxfer.plan import FEW_RUNS, Runs
from kvxfer.transport.base import Arrival
from kvxfer.transport.kit import StagingPool, peer_reason

from . import bindings as ucp
from .eager import Pregrants
from .frames import (
    HeldSlot,
    RingHold,
    RingSpill,
    StagedFrames,
    Stream,
    byte_cut,
    cut,
    small_pieces,
    stream_iovs,
    ucx_buffer,
)
from .landing import Landing
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers
from .protocol import DATA_BIT, EAGER_FLUSHED, FRAME_BITS, KIND_MASK, MAX_DTAG, Abort, Ack, Announce, Done, Fail, Go
from .regions import Regions
from .state import Incoming, Peer
from .turn import Leftovers, Turn
from .workers import Workers


class Receiver:
    """Incoming transfers (see the module docstring). ``incoming``: (peer id, xid) -> transfer while
    open; ``by_dtag``: data tag -> transfer; ``ring``: the receive ring; ``spill``: frames standing
    in for held ring slots."""

    def __init__(self, options: UCXOptions, grants: GrantTable, regions: Regions, workers: Workers, peers: Peers,
                 landing: Landing, pregrants: Pregrants, outbox: Outbox, recv_ring: StagingPool, leftovers: Leftovers,
                 turn: Turn, deliver: Callable[[Arrival], None]):
        self.options, self.grants, self.regions, self.workers, self.peers = options, grants, regions, workers, peers
        self.landing, self.pregrants, self.outbox, self.ring = landing, pregrants, outbox, recv_ring
        self.leftovers, self.turn, self.deliver = leftovers, turn, deliver
        self.frame_bytes = options.frame_bytes
        self.incoming: dict[tuple[str, int], Incoming] = {}
        self.by_dtag: dict[int, Incoming] = {}   # data tag (random: ``on_announce``) -> transfer
        self.spill = RingSpill(self.frame_bytes)   # frames standing in for held ring slots (``frames``)

    def on_announce(self, p: Peer, m: Announce) -> None:
        xid, rid = m.xid, m.request_id
        runs, nput, inline = m.run_array(), m.nput, m.inline
        reg, off, n = runs
        grants, regions = self.grants, self.regions
        # Without the grant's capability: handled exactly as an ANNOUNCE for an unknown id (the same
        # answer: no oracle; grants.check and is_live refuse it) but with no arrival: it never
        # fails or completes the request.
        quiet = not grants.capability_ok(rid, m.cap)
        # Each peer its own share: max_incoming_per_peer, and past max_incoming in all, no more than
        # an equal part of it among the peers with transfers open (so at most 2 x max_incoming open).
        max_incoming = self.options.max_incoming
        if p.open_in >= self.options.max_incoming_per_peer or len(self.incoming) >= max_incoming and \
                p.open_in >= max_incoming // max(1, sum(1 for q in self.peers.values() if q.open_in)):
            return self.refuse(p, xid, rid, 0, m.notify, grants.reject(
                rid, f"too many transfers: {len(self.incoming)} open, {p.open_in} from this peer"), quiet)
        # An empty transfer writes nothing: acknowledged whatever its request id (no oracle).
        # The check covers the grant and the regions (a grant past its region's end is refused).
        reason = grants.check(rid, reg, off, n, m.cap) if len(n) else None
        # A granted run lies inside the grant: non-negative and below 2**62, so the sums below hold.
        # A few runs are summed as Python ints (a numpy reduction of one run costs ~1.5 us).
        nl = n.tolist() if reason is None and len(n) <= FEW_RUNS else None
        if reason is None and (p.id, xid) in self.incoming:
            reason = grants.reject(rid, f"malformed header: transfer {xid} announced twice")
        packed = runs[:, nput:]
        total = 0 if reason is not None else sum(nl[nput:]) if nl is not None else int(packed[2].sum())
        nbytes = sum(nl) if nl is not None else int(n.sum()) if reason is None else 0
        if reason is None and inline and len(inline) != total:
            reason = grants.reject(rid, f"malformed header: {len(inline)} inline bytes for {total} packed")
        if reason is None and m.eager and (len(inline) != total or not self.pregrants.pregranted(rid, p.id)):
            reason = grants.reject(rid, "malformed header: an eager announce needs this receiver's pregrant "
                                   "and every packed byte inline")
        host = regions.all_host or bool(regions.is_host[packed[0]].all())
        # The receive ring: for CUDA destinations, and for host ones the sender staged (it does for
        # peers over the network) into small pieces here (``rings_host``); other host frames land
        # in place as iovs (staged ones cut as the sender cut them).
        ring = reason is None and total > 0 and not inline and \
            (not host or m.staged and self.rings_host(total, packed.shape[1]))
        if ring and m.frame_bytes > self.frame_bytes:
            reason = grants.reject(rid, f"malformed header: frames of {m.frame_bytes} bytes do not fit the "
                                   f"receiver's staging frames of {self.frame_bytes}: use one frame_bytes")
        if reason is None and total and 2 * total // m.frame_bytes + 1 >= 1 << FRAME_BITS:   # bounds the cut
            reason = grants.reject(rid, f"malformed header: {total} packed bytes in frames of {m.frame_bytes}")
        if reason is not None:
            ok = len(n) and (n > 0).all() and (n < 1 << 40).all()
            return self.refuse(p, xid, rid, int(n.sum()) if ok else 0, m.notify, reason, quiet)
        if m.eager == EAGER_FLUSHED:   # its puts are flushed (an older sender): checked above, now it is done
            if inline:
                self.land_inline(tuple(packed), inline)
            self.deliver(Arrival(rid, nbytes, True, "", m.notify))
            return self.outbox.send(p, Ack(xid))
        staging = None
        if ring:   # frames through the receive ring: cut as the sender cut them (``frames``)
            bounds = cut(packed[2], m.frame_bytes) if m.staged else byte_cut(total, m.frame_bytes)
            staging = StagedFrames(Stream(*packed), bounds, self.ring.device)
        i = Incoming(p, xid, rid, time.monotonic() + m.timeout, nbytes, m.notify, tuple(packed), staging,
                     m.frame_bytes, 0 if inline else staging.count if staging else -(-total // m.frame_bytes),
                     puts=nput, cap=m.cap, epoch=p.epoch)
        self.landing.open[rid] += 1   # writes_pending until forget_in (forget() fails it asynchronously)
        self.incoming[(p.id, xid)] = i
        p.open_in += 1
        if inline:  # checked a moment ago: lands now, with no re-check and no frames
            self.land_inline(i.packed, inline)
            i.packed = None
        elif total and not ring:   # frames land in the runs themselves
            addr = regions.base[packed[0]] + packed[1]
            i.iov = ucp.IovFrames(stream_iovs(addr, packed[2], cut(packed[2], m.frame_bytes)) if m.staged
                                  else ucp.frame_iovs(addr, packed[2], m.frame_bytes))
        if nput == 0 and not i.frames:  # all here already: ACK without GO and DONE
            i.done = True
            return self.try_finish(i)
        if m.eager:   # its puts are on their way already (no frames: ``eager``): DONE follows their flush
            return
        # The data tag names this transfer: 38 random bits, unused here, told only to its sender
        # (GO, on its channel). A frame lands only under its exact tag (posted receive, or the
        # ring's lookup below), so a third party's sprayed frame hits one of the N frames open
        # here with probability N / 2**62.
        while (dtag := secrets.randbelow(MAX_DTAG - 1) + 1) in self.by_dtag:
            pass
        i.dtag = dtag
        self.by_dtag[dtag] = i
        if i.iov is not None:   # posted before GO: no frame of it can arrive unexpected
            i.iov.recv(self.workers.whandle, DATA_BIT | i.dtag << FRAME_BITS)
            if i.iov.error:
                return self.fail_in(i, f"posting receives failed: {i.iov.error}")
        self.outbox.send(p, Go(xid, i.dtag))

    def rings_host(self, total: int, pieces: int) -> bool:
        """Do staged frames of ``total`` bytes for host memory, ``pieces`` destination runs here,
        go through the receive ring? With ``stage_host`` "network": only when the pieces are small
        on average (``frames.small_pieces``, the sender's rule), where UCX's iov entries cost
        more than the scatter; long runs (a head slice into token-major slots) take each frame in
        place, one copy less. "always": every one; "never": none."""
        stage_host = self.options.stage_host
        return stage_host == "always" or (stage_host == "network" and small_pieces(total, pieces))

    def refuse(self, p: Peer, xid: int, rid: str, nbytes: int, notify: bytes, reason: str,
               quiet: bool = False) -> None:
        if not quiet:   # quiet: a wrong capability, which must not touch the request
            self.deliver(Arrival(rid, nbytes, False, reason, notify))
        self.outbox.send(p, Fail(xid, peer_reason(reason)))

    def on_end(self, p: Peer, m: Done | Abort) -> None:
        """DONE or ABORT from ``p``, sent once no put of the transfer is in flight any more."""
        if self.landing.end(p, m.xid):   # an ended transfer: its puts are flushed, nothing more of it lands
            return
        if (i := self.incoming.get((p.id, m.xid))) is not None:
            if isinstance(m, Abort):   # sent once no put of it is left: nothing more lands
                self.fail_in(i, f"aborted by the sender: {m.why}", tell=False, puts_left=False)
            else:
                i.done = True
                self.try_finish(i)

    def poll_data(self) -> None:
        """Every turn: receive arrived frames of ring transfers into free slots of the receive ring
        (none free: the frame waits in UCX, counted in ``waits``; an unusable frame is dropped),
        land completed ones, and finish transfers whose frames all landed."""
        worker = self.workers.worker
        probe, want_tag, mask = worker.tag_probe, ucx_api.UCXXTag(DATA_BIT), ucx_api.UCXXTagMask(KIND_MASK)
        while (res := probe(want_tag, mask, remove=False)).matched:
            tag = res.sender_tag.value
            i, k = self.by_dtag.get((tag & ~KIND_MASK) >> FRAME_BITS), tag & ((1 << FRAME_BITS) - 1)
            want = -1 if i is None or i.staging is None or k >= i.frames or i.staging.seen[k] else i.staging.size(k)
            ring_free = res.length != want or self.ring.available()
            if not ring_free and not self.spill.room():   # back-pressure: next turn
                break
            res = probe(want_tag, mask, remove=True)   # the same message (UCX adds only inside progress)
            self.turn.acts += 1
            if res.length != want:
                # Under a tag nobody here has: dropped and counted, no transfer touched. Under a live
                # transfer's tag (only its sender has it) but not a frame still to come in the ring
                # (received in place, past the end, a second copy, the wrong size): that sender's
                # mistake fails the transfer.
                if i is not None:
                    self.fail_in(i, self.grants.reject(i.rid, f"malformed frame: {k} of {res.length} bytes"))
                self.leftovers.drop(worker, res, "frame")
                continue
            assert i is not None and i.staging is not None
            slot = self.ring.get(want, i.staging.device) if ring_free else self.spill.get(i.staging.device)
            i.staging.seen[k] = True
            i.staging.reqs.append((worker.tag_recv_with_handle(ucx_buffer(slot), res), k, slot))
        for i in [i for i in self.incoming.values() if i.iov is not None and i.got < i.frames]:
            done = i.iov.poll()
            if i.iov.error:   # at once: the frames still posted are cancelled
                self.turn.acts += 1
                self.fail_in(i, self.grants.reject(i.rid, i.iov.error) if i.iov.error.startswith("malformed")
                             else f"peer failed: receiving packed frames: {i.iov.error}")
            elif done:
                self.turn.acts += 1
                i.got, i.packed = i.frames, None   # landed in place
                self.try_finish(i)
        if self.landing.draining:
            self.landing.reap()
        if self.spill.held:
            self.spill.prune()
        for i in [i for i in self.incoming.values() if i.staging is not None and i.staging.reqs]:
            self.land_frames(i)
        self.leftovers.prune()

    def land_frames(self, i: Incoming) -> None:
        """Scatter every received frame of ``i`` into its runs (checked against the grant first:
        the request may have ended meanwhile) and free its slot; all landed: finish."""
        st = i.staging
        assert st is not None
        done = [r for r in st.reqs if r[0].completed]
        if not done:
            return
        st.reqs = [r for r in st.reqs if not r[0].completed]
        self.turn.acts += 1
        for j, (req, k, slot) in enumerate(done):
            try:
                req.check_error()
                reason = None
            except Exception as e:
                reason = f"peer failed: receiving packed frames: {e}"
            part = st.part(k)
            if reason is None and (reason := self.grants.check(i.rid, *part, i.cap)) is None:
                self.land(part, slot)   # in place (CUDA: the copies completed) before the slot is free
            self._free_slot(slot)
            if reason is not None:
                for _, _, s in done[j + 1:]:
                    self._free_slot(s)
                return self.fail_in(i, reason)
            i.got += 1
        if i.got == i.frames:
            i.packed = None   # landed, frame by frame
            self.try_finish(i)

    def _free_slot(self, slot: torch.Tensor) -> None:
        """A frame landed: its ring slot is free again (a spill frame is let go)."""
        if self.spill.owns(slot):
            self.spill.put(slot)
        else:
            self.ring.put(slot)

    def try_finish(self, i: Incoming) -> None:
        if not i.done or i.got < i.frames:
            return
        self._forget_in(i)
        if i.nbytes or self.grants.is_live(i.rid, i.cap):   # an empty transfer of no live request: ACK only
            self.deliver(Arrival(i.rid, i.nbytes, True, "", i.notify))
        self.outbox.send(i.peer, Ack(i.xid))

    def land(self, packed: tuple, data: torch.Tensor) -> None:
        """Write consecutive bytes of ``data`` to the packed runs (region, offset, length arrays)
        with copy_runs, which sees the staging rows as evenly spaced (~1.5x scatter_runs here)."""
        region, offset, nbytes = packed
        copy_runs([data], self.regions.tensors, Runs(np.zeros_like(nbytes), np.cumsum(nbytes) - nbytes, region,
                                                     offset, nbytes, np.ones(len(nbytes), bool)))
        for dev in self.regions.cuda_devices:  # "arrived" means in place, not queued on a stream
            torch.cuda.current_stream(dev).synchronize()

    def land_inline(self, packed: tuple, inline: bytes) -> None:
        """``land`` for inline bytes (checked against the grant): a few host runs are written
        through numpy views (no torch call: ~10 us less per transfer), others by ``land``."""
        views = self.regions.host_views
        if len(packed[2]) <= FEW_RUNS:
            runs = list(zip(*(a.tolist() for a in packed)))
            if all(views[r] is not None for r, _, _ in runs):
                src, pos = memoryview(inline), 0
                for r, o, c in runs:
                    views[r][o:o + c] = src[pos:pos + c]
                    pos += c
                return
        self.land(packed, torch.frombuffer(bytearray(inline), dtype=torch.uint8))

    def _forget_in(self, i: Incoming) -> None:
        """End ``i`` here. Whatever may still land of it is marked (``Landing.drain``) before it stops
        counting as open, so ``writes_pending`` (any thread) never sees a gap."""
        self.by_dtag.pop(i.dtag, None)
        if i.staging is not None and i.staging.reqs:   # receives still write their slots: fenced
            self._hold_slots(i)
        if i.iov is not None and not i.iov.poll():   # receives posted into the grant's memory
            i.iov.cancel(self.workers.whandle)
            self.landing.drain(i.peer.id, i.rid, i.iov, int(i.packed[2].sum()) if i.packed is not None else 0)
        if self.incoming.pop((i.peer.id, i.xid), None) is not None:
            i.peer.open_in -= 1
            opened = self.landing.open
            opened[i.rid] -= 1
            if opened[i.rid] <= 0:
                del opened[i.rid]

    def _hold_slots(self, i: Incoming) -> None:
        """``i`` ended with frames still being received into ring slots: each slot is free once
        its receive completed, or once the sender is proven dead (``Fencing.release_peer`` ends
        the ``Landing.draining`` entry made here; no ucp call cancels a matched receive). Counted in
        ``fencing()`` under a key of its own: these writes reach ring slots, never the grant."""
        st = i.staging
        assert st is not None
        hold = RingHold([req for req, _, _ in st.reqs])
        landing = self.landing

        def held() -> bool:
            return any(e[2] is hold for e in landing.draining)
        for req, _, slot in st.reqs:
            until = HeldSlot(req, held)
            if self.spill.owns(slot):
                self.spill.hold(until, slot)
            else:
                self.ring.put(slot, until)
                self.spill.hold(until)   # while held, a spill frame may stand in for it
            self.leftovers.keep(req, slot)
        landing.drain(i.peer.id, ("ring slots", i.rid), hold, sum(int(s.numel()) for _, _, s in st.reqs))
        st.reqs = []

    def fail_in(self, i: Incoming, reason: str, tell: bool = True, puts_left: bool = True) -> None:
        key = (i.peer.id, i.xid)
        if puts_left and i.dtag and i.puts and not i.done and key in self.incoming \
                and key not in self.landing.puts:   # GO went out: puts may come, silent peer or not
            self.landing.hold_puts(i)
        self._forget_in(i)   # after: writes_pending stays True throughout
        self.deliver(Arrival(i.rid, i.nbytes, False, reason, i.notify))
        if tell:
            self.outbox.send(i.peer, Fail(i.xid, peer_reason(reason)))

    def fail_peer(self, p: Peer, why: str, tell: bool = True, puts_left: bool = True) -> None:
        """Every transfer from ``p`` open here fails ("peer failed: ``why``")."""
        for i in [i for i in self.incoming.values() if i.peer is p]:
            self.fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"), tell=tell, puts_left=puts_left)

    def check_deadlines(self, now: float) -> None:
        for i in [i for i in self.incoming.values() if now > i.deadline]:
            self.fail_in(i, self.grants.reject(i.rid, "deadline passed: the sender did not finish in time"))

    def drop_request(self, rid: str) -> None:
        """After ``forget`` (a command): the request's open transfers fail; its pregrants are fenced."""
        for i in [i for i in self.incoming.values() if i.rid == rid]:
            self.fail_in(i, self.grants.reject(rid, "ended request: the receiver forgot it mid-transfer"))
        self.pregrants.fence(rid)

    def opens(self, p: Peer) -> bool:
        """Is a transfer from ``p`` open here?"""
        return any(k[0] == p.id for k in self.incoming)

    def busy(self) -> set[str]:
        """Ids of the peers with a transfer open here."""
        return {k[0] for k in self.incoming}

    def clear(self) -> None:
        """At the I/O thread's exit (the endpoints are gone)."""
        self.incoming, self.by_dtag = {}, {}
