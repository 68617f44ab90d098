"""Sender side of a re-handshake: HELLO with a new epoch once what we sent before is accounted for.

When a silent peer speaks again, or fences us (its FAIL "peer fenced"), or is connected again
while its disconnect was pending, whatever we sent it may be lost or belong to an epoch it
fenced. Transfers waiting for GO are marked stale: each gets one answer (control is ordered): a
GO fails it without a put (``Sender.on_answer``: ABORT), a FENCED refusal announces it again
after the HELLO (``requeue``). Then one of two ways:

* **Flush, then HELLO** (peers on our host, ``begin``): flush our endpoint; ``check`` (each tick)
  sends HELLO(epoch + 1) once the flush completed, then the announces that waited for it
  (``Peer.waiting``). New announces wait for the HELLO, so no put issued after the flush began
  belongs to the old epoch; the HELLO says every earlier put landed (``drained`` = its epoch).
* **A new endpoint** (``err`` peers: another host or network namespace, ``renew``). After a
  partition heals, the old endpoint's TCP connection waits out the kernel's retransmit backoff
  (doubling up to 120 s: after a 35 s cut the next try can come ~16 s after link-up), and a flush
  waits with it: the first request after the heal would fail. So the old endpoint is kept with
  its flush (``Retired``, in ``Peer.old``), a new endpoint to the same worker (its rkeys unpacked there) carries
  HELLO(epoch + 1) at once with ``drained`` = the oldest retired epoch: the receiver lifts the
  fence for new transfers and keeps what the older epochs may still write. ``check_old`` (each
  tick): once a retired endpoint's flush completed (or UCX says its connection was reset: the
  other side closed it) HELLO(epoch, higher ``drained``) tells the receiver that memory may go;
  the endpoint is closed once nothing of ours is in flight over it. A flush failed otherwise
  (a timeout: the peer may be alive with our writes on their way) proves nothing: that epoch
  never drains, what it may write stays held there, as for a silent peer
  (``quarantine_timeout``). FENCED waits for the retired endpoints too
  (``EagerSends.check_flushes``). Frames stuck on a retired endpoint keep their send-ring slots;
  spill frames stand in for them (``Sender.spill``), or the first request would wait for a slot.
  At most ``MAX_RETIRED`` per peer; past it, a re-handshake flushes and waits as above.

Each new epoch's HELLO gives the peer a new control tag to answer under (``new_epoch``), and
the receiver's WELCOME gives us one (``Control.on_hello``): what either side said before the
other read that HELLO or WELCOME comes under an older tag (e.g. over an endpoint since replaced,
which drains with TCP's backoff: measured arriving ~20 s after a heal). Such a "peer fenced"
starts no re-handshake more, and such a BYE fences nothing (``Control.handle``): either did,
and a re-handshake more fails the transfers waiting for GO.

The receiver's side is ``Control.on_hello``: a HELLO that says an older epoch is still draining
also moves the receiver's own endpoint to us (``renew_control``): its control messages (GO,
WELCOME, pings) sit in the same kind of backoff.

Who calls what (I/O thread): ``Control`` (``begin``, ``requeue``, ``renew_control``), ``Join``
(``begin``), ``Lifecycle`` (``begin``), the loop's tick (``check``, ``check_old``).
"""
from __future__ import annotations

import logging

from . import bindings as ucp
from .outbox import Outbox
from .peers import Peers, close_ep, failure_of
from .sender import Sender
from .state import Outgoing, Peer, Retired, oldest_undrained
from .workers import Workers

log = logging.getLogger("kvxfer.transport.ucx")
MAX_RETIRED = 8   # endpoints of one peer still draining; past it, re-handshakes flush and wait


class Rehandshake:
    """Re-handshakes of our peers (see the module docstring)."""

    def __init__(self, sender: Sender, outbox: Outbox, workers: Workers, peers: Peers):
        self.sender, self.outbox, self.workers, self.peers = sender, outbox, workers, peers
        self.count = 0   # HELLOs with a new epoch sent (``fencing()["rehandshakes"]``)

    def begin(self, p: Peer, why: str) -> None:
        """Re-handshake with ``p`` (``why``: for the log): a new endpoint (``renew``) or a flush,
        then HELLO(epoch + 1)."""
        if p.rehello is not None or p.sizes is None or p.closing:   # flushing already, or we never write to it
            return
        log.info("UCX transport: re-handshake with peer %s (epoch %d): %s", p.id[:8], p.my_epoch + 1, why)
        for o in self.sender.outgoing.values():
            if o.peer is p and o.state == "wait_go":
                o.stale = True
        p.pregranted.clear()   # maybe stale after silence: announced (GO) until pregranted again
        p.pregranted_bytes = 0
        if p.err and p.addr and p.rkeys_src and len(p.old) < MAX_RETIRED:
            return self.renew(p)
        p.rehello = ucp.flush(p.eph, self.workers.flush_param)

    def renew(self, p: Peer) -> None:
        """Retire our endpoint to ``p`` with its flush, make a new one, HELLO(epoch + 1) over it now."""
        if p.ep_used:
            # Puts issued this turn are flushed on the endpoint they went over. Transfers under way
            # go on: each one's flush covers its puts (issued at once, at its GO), and frames may
            # leave over either endpoint (the receiver takes them by tag).
            self.sender.flush_peer(p)
            w = self.workers
            try:
                ep = w.endpoint(w.far() if p.far else w.worker, p.addr, p.err)
                rkeys = ucp.unpack_rkeys(ep.handle, p.rkeys_src[2])
            except Exception as e:   # UCX refused (out of resources): flush and wait instead
                log.warning("UCX transport: a new endpoint to peer %s failed (%s: %s); flushing the old one",
                            p.id[:8], type(e).__name__, e)
                p.rehello = ucp.flush(p.eph, w.flush_param)
                return
            p.old.append(Retired(p.ep, p.eph, p.rkeys, ucp.flush(p.eph, w.flush_param),
                                 p.my_epoch))
            p.ep, p.eph, p.rkeys, p.ep_used = ep, ep.handle, rkeys, False
            self.peers.watch(p)
            p.last_send = None   # pings wait for the last send to leave: the old endpoint's may not
        # else nothing of ours went over the current endpoint since it was made: a new epoch will do
        self.new_epoch(p)

    def new_epoch(self, p: Peer) -> None:
        """HELLO(epoch + 1) to ``p`` under a new control tag (``Peers.rebind_tag``: what it sends
        under an older one was said before it read this HELLO, ``Control.handle``), then the
        announces that waited for it."""
        p.my_epoch += 1
        self.count += 1
        self.peers.rebind_tag(p)
        self.outbox.send(p, self.workers.hello(p))
        waiting, p.waiting = p.waiting, []
        for o in waiting:
            self.sender.start_out(o)

    def check_old(self, p: Peer) -> None:
        """Each tick while ``p`` has retired endpoints. One whose flush ended has drained (or, the
        flush failed otherwise than by a reset, never will: what it carried may still land, and
        the peer keeps that memory held); when the oldest epoch still draining moved, HELLO says
        so (``drained``). It is closed once nothing of ours may still be in flight over it
        (``Sender.sends_on``): a frame in UCX's rendezvous completes after the flush, and closing
        its endpoint would leave it never completed, its source or ring slot held for good."""
        before = oldest_undrained(p)
        for r in p.old:
            if r.flush is not None and (st := r.flush.poll()) is not None:
                r.flush = None
                r.drained = st == 0 or failure_of(r.ep) == "reset"   # reset: the other side closed it
                if not r.drained:
                    log.warning("UCX transport: peer %s: the flush of a replaced endpoint failed (%s): what it "
                                "carried may still land; the peer keeps that memory held", p.id[:8], ucp.why(st))
            if r.flush is None and r.ep is not None and not self.sender.sends_on(r.eph):
                close_ep(r.ep, p.err)
                ucp.destroy_rkeys(r.rkeys)
                r.ep, r.rkeys = None, ucp.EMPTY_TABLE
        p.old = [r for r in p.old if r.ep is not None or not r.drained]   # an undrained one stays: its epoch
        if oldest_undrained(p) != before:   # the HELLO's ``drained`` moved
            self.outbox.send(p, self.workers.hello(p))

    def renew_control(self, p: Peer) -> None:
        """Receiver: ``p`` re-handshook on a new endpoint (its HELLO says an older epoch still drains):
        ours to it, which carries only control (we never write to it), is likely in the same
        retransmit backoff: a new one takes over (what the old one still holds, a GO or a ping,
        arrives late or not at all: a stale announce ends by its deadline)."""
        if not (p.err and p.addr and p.sizes is None) or len(p.old_ctrl) >= MAX_RETIRED:
            return
        w = self.workers
        try:
            ep = w.endpoint(w.far() if p.far else w.worker, p.addr, p.err)
        except Exception as e:
            log.warning("UCX transport: a new endpoint to peer %s failed (%s: %s)", p.id[:8], type(e).__name__, e)
            return
        # The old one stays open until the peer goes (``peers.close_retired``): UCX may have paired
        # it with the peer's endpoint, and answers that peer's rendezvous sends over it (closed,
        # they never complete: measured with UCX_TLS=tcp, the sender's sources held for good).
        p.old_ctrl.append(p.ep)
        p.ep, p.eph, p.last_send = ep, ep.handle, None
        self.peers.watch(p)

    def requeue(self, o: Outgoing) -> None:
        """``o``'s announce was refused because the receiver fenced us. Nothing of it was issued
        (no GO): it is announced again, same transfer id, after our new HELLO."""
        del self.sender.outgoing[o.xid]
        o.state, o.stale = "queued", False
        self.sender.start_out(o)   # waits in p.waiting while the re-handshake flush runs

    def check(self, p: Peer) -> None:
        """Each tick while ``p.rehello``: the flush completed? Then HELLO, then the waiting announces."""
        st = p.rehello.poll()
        if st is None:
            for o in [o for o in p.waiting if o.handle.poll() != 0]:   # timed out waiting: never read
                o.handle.release_source()
                p.waiting.remove(o)
            return
        p.rehello = None
        if st != 0:   # not flushed: try again (a dead peer never completes one)
            self.begin(p, f"the flush failed ({ucp.why(st)}): again")
            return
        self.new_epoch(p)
