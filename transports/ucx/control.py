"""UCX control plane of a transport: what each control message from a peer does; and the fencing rules.

Every method runs on the I/O thread. Each loop turn ``Inbox.poll`` receives control batches
(dropping one over ``max_control_bytes`` unread) and checks who sent each (its channel secret);
``Control.on_message`` parses each message (``protocol.parse_message``) and ``handle`` hands it to
the part it is for: ANNOUNCE, DONE and ABORT to ``Receiver``, GO, ACK and FAIL to ``Sender``,
HELLO here (``on_hello``), WELCOME to ``Join``, PREGRANT and FENCE to ``Sender`` (``eager``),
FENCED to ``Pregrants``, BYE to ``Fencing``. Replies go through ``Outbox.send``, one batch per
peer and turn. The loop's tick (``Loop.tick``, a few times a second) fails transfers past their
deadline, pings peers, and ends those silent past ``peer_timeout``.

Fencing (silence is not death). A peer silent past ``peer_timeout`` has its transfers failed on
both sides within their deadlines, but what it could still write or read stays held:

* receiver: ended transfers it had GO for stay in ``Landing.puts`` and posted frame receives in
  ``Landing.draining``, so ``writes_pending`` stays True; the peer is *fenced*: its ANNOUNCEs are
  refused until it re-handshakes. An entry ends when the peer sends DONE or ABORT for it (sent
  only after its endpoint flush completed, so its puts have landed), when it re-handshakes
  (a HELLO with a higher epoch, sent only after a flush of its endpoint completed: every put
  issued before it has landed), when it is proven dead, or, only if the operator set
  ``quarantine_timeout``, when that expires (counted in ``fencing()["expired"]``). Proven dead
  (``fencing``): on our kernel, in our PID and network namespaces, its process is gone (pid
  check); elsewhere (another host or network namespace, no user-chosen TLS: ``Peer.err``,
  endpoints with UCX error handling on both sides) UCX reported its endpoint failed while
  the peer was not silent: its connection was reset or closed, which its process's death does
  (after a silence, our own kernel ending the connection reads the same). Either way ``fence_grace``
  s of progress later it is released as *writes impossible* and forgotten: to write again it
  must connect and handshake anew. A peer elsewhere that is alive but silent (a cut link, a
  stall) is NOT released by closing our endpoint to it: measured
  (``tests/test_ucx_close_fence.py``), its puts and messages keep landing after our
  endpoint is force-closed, over the TCP connection its own wireup made, which our endpoint
  does not own. It stays fenced as above until it flushes, re-handshakes or fails.
* sender: a failed transfer whose puts or frames were issued keeps its source until its
  endpoint flush completes (then ABORT), or until the peer is proven dead (then our endpoint
  to it is closed, which cancels every local read, and the peer must be connected anew).
  When a silent peer speaks again, or fences us, we flush our endpoint to it and re-handshake
  (``Rehandshake``): announces wait for that HELLO, so no write of the old epoch follows it. To
  a peer elsewhere (``err``) a new endpoint carries the HELLO at once instead, while the old one
  drains: the HELLO's ``drained`` says which epochs' writes may still land.
  Silence is seen per direction, so a receiver may fence a sender that never saw it silent:
  hearing a peer it fenced, the receiver tells it (FAIL, transfer id 0, "peer fenced"); an
  announce it refused as fenced fails no request there and goes again after the new HELLO
  (``Rehandshake.requeue``); a GO for an announce older than the re-handshake starts no put (ABORT).
  A "peer fenced" said before it read our latest HELLO (under an older control tag, or for an
  announce older than that HELLO) starts no re-handshake more: that HELLO lifted the fence.
"""
from __future__ import annotations

from kvxfer.grant import GrantTable

from .eager import Pregrants
from .fencing import Fencing
from .join import Join
from .landing import Landing
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers
from .protocol import (
    Abort,
    Ack,
    Announce,
    Bye,
    Done,
    Fail,
    Fence,
    Fenced,
    Go,
    Hello,
    Malformed,
    Message,
    Pregrant,
    Welcome,
    parse_message,
)
from .receiver import Receiver
from .rehandshake import Rehandshake
from .sender import Sender
from .state import Peer
from .workers import Workers

FENCED = "peer fenced"   # the FAIL a fenced peer's ANNOUNCE gets: flush, then HELLO with a higher epoch


class Control:
    """Control messages from checked peers (see the module docstring)."""

    def __init__(self, options: UCXOptions, grants: GrantTable, workers: Workers, outbox: Outbox, sender: Sender,
                 receiver: Receiver, landing: Landing, pregrants: Pregrants, rehandshake: Rehandshake,
                 fencing: Fencing, join: Join, peers: Peers):
        self.max_control_bytes = options.max_control_bytes
        self.peers = peers
        self.grants, self.workers, self.outbox = grants, workers, outbox
        self.sender, self.receiver, self.landing, self.pregrants = sender, receiver, landing, pregrants
        self.rehandshake, self.fencing, self.join = rehandshake, fencing, join

    def on_message(self, p: Peer, raw, current: bool = True) -> None:
        """One control message of a batch from ``p`` (its channel checked): what it is, then act.
        ``current``: its batch came under ``p``'s latest control tag (else ``p`` sent it before it
        read our latest new-epoch HELLO, or our WELCOME to its own: ``Peers.rebind_tag``)."""
        try:
            m = parse_message(raw, self.max_control_bytes)
        except Malformed as e:
            if e.answer is not None:
                # An ANNOUNCE with valid ids and a bad field: counted and dropped like any
                # malformed message, and never used to end the request it names (that would let
                # anyone fail a live request by its id). Its sender's transfer fails (FAIL, which
                # reads the same for live and unknown ids: no oracle); the request goes on.
                xid, rid = e.answer
                self.receiver.refuse(p, xid, rid, 0, b"", self.grants.reject(rid, str(e)), quiet=True)
            else:
                self.grants.reject("?", str(e)[:200])
            return
        p.clock.touch()
        back = p.gone
        if back:   # back after silence: whatever we sent it may be lost; flush, then re-handshake
            p.gone = False
            self.rehandshake.begin(p, "heard again after silence")
        self.handle(p, m, current)
        if back and p.fenced and not isinstance(m, Announce):
            # We fenced it; it may not know (its own view of us never went silent). Tell it now,
            # so it re-handshakes before its next announce instead of having that refused.
            self.outbox.send(p, Fail(0, f"{FENCED}: flush, then HELLO with a new epoch"))

    def handle(self, p: Peer, m: Message, current: bool = True) -> None:
        if isinstance(m, Announce):
            if p.fenced:   # a write of the epoch we fenced: refused until the peer re-handshakes
                # No arrival: the request is not failed here. Its sender re-handshakes and
                # announces it again (``Rehandshake.requeue``); if it never does, the request's own
                # deadline ends it.
                self.outbox.send(p, Fail(m.xid, f"{FENCED}: flush, then HELLO with a new epoch"))
                return
            self.receiver.on_announce(p, m)
        elif isinstance(m, Hello):
            if m.epoch >= p.epoch:   # an older HELLO (over an endpoint it replaced) names an older tag
                p.tag_out = m.ctag
            self.on_hello(p, m)
            self.outbox.send(p, Welcome(self.workers.address, p.tag_in))   # its connect() waits for a round trip here
        elif isinstance(m, Welcome):
            self.join.on_welcome(p, m, current)
        elif isinstance(m, Fail) and m.why.startswith(FENCED):
            # The receiver fenced us (we never saw it silent, or not yet): flush, then HELLO
            # with a new epoch; an announce it refused for that goes again after the HELLO.
            # Unless it said so before it read our latest HELLO (under an older tag, or refusing
            # an announce older than that HELLO): that HELLO lifted the fence already, and one
            # more re-handshake would fail the transfers waiting for GO.
            o = self.sender.outgoing.get(m.xid)
            if o is not None and not (o.peer is p and o.state == "wait_go"):
                o = None
            if current and not (o is not None and o.stale):
                self.rehandshake.begin(p, f"it fenced us (FAIL for transfer {m.xid})")
            if o is not None:
                self.rehandshake.requeue(o)
        elif isinstance(m, (Go, Ack, Fail)):
            self.sender.on_answer(p, m)
        elif isinstance(m, (Done, Abort)):
            self.receiver.on_end(p, m)
        elif isinstance(m, Pregrant):
            self.sender.on_pregrant(p, m)
        elif isinstance(m, Fence):
            self.sender.on_fence(p, m)
        elif isinstance(m, Fenced):
            self.pregrants.on_fenced(p, m)
        elif isinstance(m, Bye) and current:
            # Its transport closed (or it disconnected us) after flushing (bounded) and sending
            # ABORTs for what it held; anything still held here was not proven flushed: it stays
            # fenced. A BYE under an older tag was said before it read our WELCOME to its latest
            # HELLO, i.e. before it connected again (over an endpoint it replaced, it arrives
            # when TCP's backoff lets it: measured ~20 s after a heal): stale, dropped.
            p.bye_at = p.clock.heard
            self.fencing.peer_gone(p, "peer closed its transport")

    def on_hello(self, p: Peer, m: Hello) -> None:
        """A HELLO from a known peer (same channel secret). With a higher epoch it re-handshakes:
        the fence lifts. What it may still write is released up to its ``drained`` epoch: every
        put it issued in an epoch below that has landed (it flushed the endpoints they went
        over). A HELLO that says an older epoch still drains came over a new endpoint
        (``Rehandshake.renew``): ours to it moves too (``renew_control``), and a later HELLO with
        the same epoch and a higher ``drained`` releases the rest."""
        p.host, p.pid, p.start, p.sends_eager = m.host, m.pid, m.start, m.eager
        if m.epoch > p.epoch:
            # What it says from now on comes under a new tag (our WELCOME to this HELLO gives it):
            # what it said before, arriving late over an endpoint it replaced, reads as such.
            self.peers.rebind_tag(p)
            p.bye_at = None   # connected again: a BYE before this HELLO is over
            if p.fenced:   # a "peer fenced" hint queued this turn is answered by this HELLO
                p.outbox = [x for x in p.outbox if not (isinstance(x, Fail) and not x.xid and x.why.startswith(FENCED))]
            p.epoch, p.fenced, p.dead_since = m.epoch, False, None
            if m.drained < m.epoch:
                self.rehandshake.renew_control(p)
            self.pregrants.refence(p)   # eager: a FENCE it may have missed while silent goes again
        if m.drained > p.drained:
            p.drained = m.drained
            self.landing.drained(p, m.drained)
