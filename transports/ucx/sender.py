"""UCX sending side on the I/O thread: announce, put after GO, flush, DONE; and the ends of transfers.

A transfer comes prepared (``planner``) in a ``Submit``. ``start_out`` sends its ANNOUNCE (and,
pregranted, puts at once: ``eager``); ``on_answer`` takes the receiver's GO, ACK or FAIL;
``start_puts`` issues every put and iov frame when GO comes; ``flush_puts`` flushes once per peer
and turn; ``advance`` gathers staged frames into the send ring as its slots free (``pump_frames``)
and sends DONE once the flush and every frame completed; ``fail_out`` ends a transfer (ABORT once
no put of it is in flight; its frames in flight keep their slots until their sends end).

Who calls what: the loop (``start_out`` per ``Submit``, ``flush_puts`` and ``advance`` each turn,
``unpark_due`` while transfers wait for a PREGRANT, ``settle_held`` and ``check_deadlines`` per
tick), ``Control`` (``on_answer``, ``on_pregrant``, ``on_fence``), ``Rehandshake`` (``start_out``,
``outgoing``), ``Fencing`` and ``Lifecycle`` (``fail_peer``, ``let_go``, ``fail_out``). ``holding``:
failed transfers whose puts may still read their source (``fencing()``'s "sources").
"""
from __future__ import annotations

import time

import torch
from ucxx._lib import libucxx as ucx_api

from kvxfer.copy import gather_runs
from kvxfer.errors import PeerError, RejectedWrite, TransferTimeout
from kvxfer.transport.kit import StagingPool

from . import bindings as ucp
from .eager import EagerSends
from .frames import Completes, RingSpill, ucx_buffer
from .outbox import Outbox
from .peers import Peers
from .protocol import DATA_BIT, EAGER_STARTED, FRAME_BITS, Abort, Ack, Announce, Done, Fail, Fence, Go, Pregrant
from .regions import Regions
from .state import Outgoing, Peer
from .turn import Leftovers, Turn
from .workers import Workers

_REFUSALS = ("outside", "unknown", "ended", "malformed", "refused")  # GrantTable reasons: RejectedWrite


# Eager transfers of at least this many bytes send their ANNOUNCE before the first put: the
# receiver tracks them (deadline; the sender's death fails the arrival) while they move. A
# smaller one's ANNOUNCE leaves with the turn's batch, after its puts were posted (cma puts are
# done by then: the batch often carries its DONE too). Its memory is pregranted and fenced
# either way; a sender dying in that moment leaves no arrival, and the request's own deadline or
# the peer's death ends it. ``bench_peers.py --quick`` (GB/s): one run of 1 MiB, ahead 4.87,
# 3.69, 3.11, with the batch 5.37, 5.63; one run of 16 MiB against NIXL in the same run, ahead
# 0.81, 0.82, 0.88x, with the batch 0.88, 0.90, 0.97x.
ANNOUNCE_AHEAD = 64 << 20


class Sender:
    """Outgoing transfers on the I/O thread (see the module docstring). ``outgoing``: transfer id ->
    transfer, from its start until it ends; ``unflushed``: puts issued this turn, per peer;
    ``flushing``: flushed, DONE not sent yet; ``holding``: failed with puts maybe in flight."""

    def __init__(self, regions: Regions, workers: Workers, peers: Peers, outbox: Outbox, eager: EagerSends,
                 send_ring: StagingPool, leftovers: Leftovers, turn: Turn):
        self.regions, self.workers, self.peers, self.outbox, self.eager = regions, workers, peers, outbox, eager
        self.ring, self.leftovers, self.turn = send_ring, leftovers, turn
        # Send-ring slots a failed transfer's frames still occupy (their sends may wait on a
        # connection in retransmit backoff, a silent peer's, for a long while) are stood in for by
        # spill frames, as many as are held: the ring never shrinks for peers that are heard.
        self.spill = RingSpill(send_ring.frame_bytes)
        self.spilling: list = []   # (request, spill frame) of live transfers' sends
        self.outgoing: dict[int, Outgoing] = {}
        self.unflushed: dict[str, list] = {}
        self.flushing: list = []
        self.holding: list[Outgoing] = []

    # ---- starting --------------------------------------------------------------------------
    def start_out(self, o: Outgoing) -> None:
        if o.handle.poll() != 0:  # failed or timed out while queued: nothing read its source
            o.handle.release_source()
            return
        if o.peer.rehello is not None:   # re-handshaking: announced after the new HELLO
            o.peer.waiting.append(o)
            return
        self.outgoing[o.xid] = o
        a, eager = o.announce, self.eager.eager_ok(o)   # relative deadline: clocks differ across hosts
        o.announce = Announce(a.xid, a.request_id, max(o.handle.deadline - time.monotonic(), 0.0), a.notify, a.runs,
                              a.nput, a.frame_bytes, a.inline, a.cap, a.staged,
                              EAGER_STARTED if eager else 0)   # not replace(): ~3x dearer
        if eager:   # pregranted: announce and put now, DONE after the flush (``eager``)
            o.eager = True
            if o.handle.nbytes >= ANNOUNCE_AHEAD:   # ahead of the puts: the receiver tracks it from here
                self.outbox.send_now(o.peer, o.announce)
            else:   # with the turn's batch, after the puts were posted: often with its DONE, one message
                self.outbox.send(o.peer, o.announce)
            return self.start_puts(o, 0)
        if self.eager.park(o):   # its PREGRANT is on its way (``eager``)
            return
        self.outbox.send(o.peer, o.announce)
        o.state = "wait_go"

    def restart(self, o: Outgoing) -> None:
        """``o`` waited for its PREGRANT (``EagerSends``): start it again (eager if the PREGRANT
        allows, else announced), unless it failed meanwhile."""
        if o.state == "wait_pregrant":
            del self.outgoing[o.xid]
            o.state = "queued"
            self.start_out(o)

    def start_puts(self, o: Outgoing, dtag: int) -> None:
        """GO came: issue every put and packed frame at once (all in flight); the turn flushes."""
        ep = o.peer.eph
        if not ep:   # ucxx closed the endpoint (its connection failed): nothing issued, none in flight
            return self.fail_out(o, PeerError(f"request {o.handle.request_id}: the connection to peer "
                                              f"{o.peer.id[:8]} failed"))
        if o.puts:   # every put in one call (the compiled helper): the puts it posted before a failure are in flight
            try:
                _, status = ucp.post_puts(ep, o.puts, o.peer.rkeys, self.regions.put_params_far if o.peer.far
                                          else self.regions.put_params)
            except ValueError as e:   # checked before any was posted (the peer's rkeys gone, say): none in flight
                return self.fail_out(o, PeerError(f"request {o.handle.request_id}: {e}"))
            if status:
                return self._fail_issued(o, f"put failed: {ucp.why(status)}")
        if o.iov is not None:
            o.iov.send(ep, DATA_BIT | dtag << FRAME_BITS)
            if o.iov.error:
                return self._fail_issued(o, f"sending frames failed: {o.iov.error}")
        o.dtag = dtag   # staged frames leave from pump_frames, as ring slots free
        o.state, o.eph, o.peer.ep_used = "flushing", ep, True
        self.unflushed.setdefault(o.peer.id, []).append(o)

    def _fail_issued(self, o: Outgoing, why: str) -> None:
        """Fail ``o`` part way through ``start_puts``: what it issued (puts, frames) still reads
        the source, so the turn's flush covers it before the source is released."""
        o.state = "flushing"
        self.unflushed.setdefault(o.peer.id, []).append(o)
        self.fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"))

    # ---- each turn -------------------------------------------------------------------------
    def flush_puts(self) -> None:
        """One ep flush per peer covers every put issued to it this turn."""
        for outs in self.unflushed.values():
            self._flush(outs)
        self.unflushed.clear()

    def flush_peer(self, p: Peer) -> None:
        """Flush now what was issued to ``p`` this turn (its endpoint is about to be replaced:
        ``Rehandshake.renew``)."""
        if (outs := self.unflushed.pop(p.id, None)) is not None:
            self._flush(outs)

    def _flush(self, outs: list[Outgoing]) -> None:
        f = ucp.flush(outs[0].peer.eph, self.workers.flush_param)
        for o in outs:
            o.flush = f
        self.flushing += outs

    def pump_frames(self, o: Outgoing) -> bool:
        """Every turn, for a transfer past GO with staged frames: gather its next frames into free
        slots of the send ring and tag-send them; a slot is free again once its send completed
        (``Completes``), whatever became of the transfer. The ring exhausted, it waits (counted in
        ``waits``) and never allocates. True when every frame has left."""
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
                self.fail_out(o, PeerError(f"request {o.handle.request_id}: sending frame {r[1]} failed: {e}"))
                return False
        st.reqs = left
        ring, spill = self.ring, self.spill
        while st.next < st.count:
            free = ring.available()
            if not free and not spill.room():   # back-pressure: looked at again next turn
                return False
            k, size = st.next, st.size(st.next)
            slot = ring.get(size, st.device) if free else spill.get(st.device)   # a spill frame: whole
            view = slot if free else slot[:size]
            gather_runs(self.regions.tensors, *st.part(k), out=view)
            if slot.is_cuda:   # UCX reads the slot at once: the gather must be complete
                torch.cuda.current_stream(slot.device).synchronize()
            req = o.peer.ep.tag_send(ucx_buffer(view), ucx_api.UCXXTag(DATA_BIT | o.dtag << FRAME_BITS | k))
            if free:
                ring.put(slot, Completes(req))
            else:
                self.spilling.append((req, slot))
            st.reqs.append((req, k, slot))
            st.next += 1
            self.turn.acts += 1
        return not st.reqs

    def advance(self) -> None:
        """DONE for every flushed transfer whose packed frames left too (in the turn of its flush
        when that completes at once, as it does for shared-memory puts)."""
        if self.spilling or self.spill.held:
            self.prune_spill()
        waiting = []
        for o in self.flushing:
            if o.state != "flushing":  # failed meanwhile
                continue
            sent = o.staging is None or self.pump_frames(o)
            if o.state != "flushing":   # a frame failed
                continue
            if (st := o.flush.poll()) is None or not sent or (o.iov is not None and not o.iov.poll()):
                waiting.append(o)
            elif st != 0:
                self.fail_out(o, PeerError(f"request {o.handle.request_id}: flush failed: {ucp.why(st)}"))
            elif o.iov is not None and o.iov.error:
                self.fail_out(o, PeerError(f"request {o.handle.request_id}: sending frames failed: {o.iov.error}"))
            else:
                o.handle.release_source()   # every put is remotely visible: the source is read
                o.staging, o.state = None, "wait_ack"
                self.outbox.send(o.peer, Done(o.xid))
                if o.eager and not o.announce.inline:   # flushed: in the receiver's memory (``eager``)
                    del self.outgoing[o.xid]
                    o.state = "done"
                    # now, not after the turn's sends (``Turn.later``): the caller it wakes delays the
                    # announce, already queued, by its pack at most; after the sends, the receiver
                    # that announce woke often ran first on this core. 1 MiB eager, two processes,
                    # 3 interleaved pairs: sender medians 400-499 -> 341-382 us, arrival 535-580 -> 562-572
                    o.handle.finish(release=True)
        self.flushing = waiting

    def unpark_due(self, now: float) -> None:
        """Each turn while transfers wait for a PREGRANT: announce those whose wait ran out."""
        self.eager.unpark_due(now, self.restart)

    # ---- answers ---------------------------------------------------------------------------
    def on_answer(self, p: Peer, m: Go | Ack | Fail) -> None:
        """The receiver's GO, ACK or FAIL for one of our transfers (a FAIL for a fence aside: ``Control``)."""
        o = self.outgoing.get(m.xid)
        if o is None or o.peer is not p:
            return  # a late answer for a transfer that already ended here
        if isinstance(m, Go) and o.state == "wait_go" and o.stale:
            # Announced before a re-handshake began: a put of it now would follow the flush
            # and belong to neither epoch. ABORT (nothing issued) lets the receiver let go.
            self.fail_out(o, PeerError(f"request {o.handle.request_id}: the receiver fenced us; re-handshaking"))
        elif isinstance(m, Go) and o.state == "wait_go":
            self.start_puts(o, m.dtag)
        elif isinstance(m, Ack) and (o.state == "wait_ack" or o.state == "wait_go" and not o.puts
                                     and o.staging is None and o.iov is None):
            del self.outgoing[o.xid]
            o.handle.finish(release=True)   # puts flushed before DONE, or there were none
        elif isinstance(m, Fail):
            self.fail_out(o, (RejectedWrite if m.why.startswith(_REFUSALS) else PeerError)(
                f"request {o.handle.request_id}: receiver refused the transfer: {m.why}"), tell=False)

    def on_pregrant(self, p: Peer, m: Pregrant) -> None:
        self.eager.on_pregrant(p, m, self.restart)

    def on_fence(self, p: Peer, m: Fence) -> None:
        """The receiver ended these requests: their pregrants go, their eager transfers still
        flushing fail, and FENCED follows a flush of our endpoint (``EagerSends``)."""
        rids = set(m.rids)
        self.eager.forget(p, rids, self.restart)
        for o in [o for o in self.outgoing.values() if o.peer is p and o.eager and o.state == "flushing"
                  and o.handle.request_id in rids]:
            self.fail_out(o, RejectedWrite(f"request {o.handle.request_id}: the receiver ended the request"))
        self.eager.flush_fence(p, m.rids)

    # ---- ends ------------------------------------------------------------------------------
    def fail_out(self, o: Outgoing, err: Exception, tell: bool = True) -> None:
        """End ``o``. Once GO came, the receiver holds the grant's memory until ABORT says that
        no put of ours is still on its way: sent after the flush, whoever failed the transfer."""
        self.outgoing.pop(o.xid, None)
        o.handle.finish(err)
        if o.state == "flushing":
            o.abort = str(err)
            if self.puts_settled(o):
                self.release_and_abort(o)
            else:
                self.holding.append(o)   # puts issued, not flushed: they still read the source
        else:
            o.handle.release_source()
            if tell and o.state != "wait_pregrant":   # parked: never announced
                self.outbox.send(o.peer, Abort(o.xid, str(err)))
        o.state = "failed"
        if o.staging is not None:   # frames still being sent keep their ring slots (``Completes``)
            self._hold_frames(o)
        if o.iov is not None and o.iov.reqs:
            self.leftovers.keep(o.iov)   # their requests are freed as they complete
        if o.flush is not None and o.flush.ptr is not None:
            self.leftovers.keep(o.flush)

    def _hold_frames(self, o: Outgoing) -> None:
        """Failed ``o``'s frames still being sent keep their slots until their sends complete; a
        spill frame may stand in for each meanwhile (``frames.RingSpill``)."""
        st = o.staging
        assert st is not None
        for req, _, slot in st.reqs:
            self.leftovers.zombies.append((req, slot))
            if req.completed:
                continue
            if self.spill.owns(slot):
                self.spilling = [(r, f) for r, f in self.spilling if f is not slot]
                self.spill.hold(Completes(req), slot)
            else:
                self.spill.hold(Completes(req))
        st.reqs, st.next = [], st.count

    def prune_spill(self) -> None:
        """Each turn while spill frames are out: those whose sends completed are let go."""
        if self.spilling:
            left = []
            for req, frame in self.spilling:
                if req.completed:
                    self.spill.put(frame)
                else:
                    left.append((req, frame))
            self.spilling = left
        if self.spill.held:
            self.spill.prune()

    def fail_peer(self, p: Peer, why: str, tell: bool = True) -> None:
        """Every transfer to ``p`` that is open here fails with ``why`` (ABORT once flushed, if ``tell``)."""
        for o in [o for o in self.outgoing.values() if o.peer is p]:
            self.fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"), tell=tell)

    def check_deadlines(self, now: float) -> None:
        for o in [o for o in self.outgoing.values() if now > o.handle.deadline]:
            self.fail_out(o, TransferTimeout(f"transfer for request {o.handle.request_id} passed its deadline "
                                             f"({o.state.replace('_', ' ')})"))

    @staticmethod
    def puts_settled(o: Outgoing) -> bool:
        """No put or frame of ``o`` reads its source any more: the flush ended and the frames
        left. Never because the peer is silent: a silent peer may come back, and a put queued
        in a socket then reads the source and lands (the peer proven dead: ``Fencing.release_peer``)."""
        return o.flush is not None and o.flush.completed and (o.iov is None or o.iov.poll())

    def release_and_abort(self, o: Outgoing) -> None:
        """No put of failed ``o`` reads its source or lands any more: release it, and tell the
        receiver (ABORT: it may give the grant's memory back) only when the flush succeeded."""
        o.handle.release_source()
        if o.flush is not None and o.flush.poll() != 0:   # what it covered may still land: no ABORT, no FENCED
            o.peer.flush_failed = True
        else:
            self.outbox.send(o.peer, Abort(o.xid, o.abort))

    def settle_held(self) -> None:
        """Held transfers whose puts settled: sources released, ABORTs sent (each tick, and at shutdown)."""
        for o in self.holding:
            if self.puts_settled(o):
                self.release_and_abort(o)
        self.holding = [o for o in self.holding if not o.handle.source_released]

    def let_go(self, p: Peer, why: str) -> None:
        """``p`` is forgotten and our endpoint to it closed (no put of ours reads a source any more):
        release the sources held for it, and fail its transfers that waited for a re-handshake."""
        for o in [o for o in (*self.holding, *self.flushing) if o.peer is p]:
            o.handle.release_source()
        self.holding = [o for o in self.holding if o.peer is not p]
        self.flushing = [o for o in self.flushing if o.peer is not p]
        self.unflushed.pop(p.id, None)
        for o in p.waiting:
            o.handle.finish(PeerError(f"request {o.handle.request_id}: peer {why}"), release=True)

    def fenced_all(self) -> None:
        """Closing, with no put of ours in flight: tell each receiver that pregranted us (``EagerSends``)."""
        if not self.holding:
            for p in self.peers.values():
                self.eager.say_fenced_all(p)

    def sends_on(self, eph: int) -> bool:
        """May a put or frame of ours still be in flight over endpoint ``eph`` (``Rehandshake.check_old``
        keeps a replaced endpoint open until none may: one closed under a frame in UCX's rendezvous
        leaves it never completed)? A transfer's on it (under way or failed), or any ended work's
        (its endpoint is not recorded: while any is in flight, every replaced endpoint stays)."""
        return any(o.eph == eph for o in (*self.holding, *self.flushing)) or bool(self.leftovers.zombies)

    def holds(self, p: Peer) -> bool:
        """Does a put of ours to ``p`` maybe still read a source?"""
        return any(o.peer is p for o in self.holding)

    def busy(self) -> set[str]:
        """Ids of the peers a transfer of ours is open, flushing or held for."""
        return {o.peer.id for o in (*self.outgoing.values(), *self.holding, *self.flushing)} | set(self.unflushed)

    def uses(self, p: Peer) -> bool:
        """Does anything of ours to ``p`` still read a source or wait (``Lifecycle.retire_closing``)?"""
        return any(o.peer is p for o in (*self.outgoing.values(), *self.holding, *self.flushing)) \
            or p.id in self.unflushed

    def clear(self) -> None:
        """At the I/O thread's exit (the endpoints are gone): nothing of ours is in flight."""
        self.outgoing, self.flushing, self.holding, self.unflushed = {}, [], [], {}
        self.spill, self.spilling = RingSpill(self.ring.frame_bytes), []
