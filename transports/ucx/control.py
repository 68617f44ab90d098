"""UCX control plane of a transport: peers, control batches in and out, heartbeats, silence.

``UCXControl`` is a mixin of ``UCXTransport``; every method runs on the I/O thread. Each loop
turn ``_poll_ctrl`` receives control batches (dropping one over ``max_control_bytes`` unread),
``_on_message`` checks who sent each message (its channel secret) and what it is
(``protocol.parse_message``) before ``_handle`` acts on it; ``_send`` queues replies, which
``_flush_outboxes`` sends as one batch per peer. ``_housekeeping`` (a few times a second) fails
transfers past their deadline, pings peers, and ends those silent past ``peer_timeout``.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.errors import PeerError, RejectedWrite, TransferTimeout
from kvxfer.transport.kit import PeerClock

from . import bindings as ucp
from .protocol import (
    CTRL_TAG,
    HELLO,
    KIND_MASK,
    Abort,
    Ack,
    Announce,
    Bye,
    Done,
    Fail,
    Go,
    Malformed,
    Message,
    Ping,
    kind_of,
    pack_batch,
    parse_batch,
    parse_message,
)

log = logging.getLogger("kvxfer.transport.ucx")

_REFUSALS = ("outside", "unknown", "ended", "malformed", "refused")  # GrantTable reasons: RejectedWrite


@dataclass(eq=False)
class Peer:
    id: str
    ep: object                       # ucx_api.UCXEndpoint, error handling off
    secret: bytes                    # the channel secret every batch to or from it carries
    clock: PeerClock = field(default_factory=PeerClock)
    base: np.ndarray | None = None   # remote region addresses, sizes, rkeys: set by connect()
    sizes: np.ndarray | None = None
    base_list: list = field(default_factory=list)   # the same as Python ints (few-runs path)
    sizes_list: list = field(default_factory=list)
    rkeys: list = field(default_factory=list)
    gone: bool = False               # silent past peer_timeout; cleared when it speaks again
    outbox: list = field(default_factory=list)
    last_send: object = None         # the latest control send to it
    next_ping: float = 0.0
    open_in: int = 0                 # incoming transfers open from it
    bye_at: float | None = None      # when it said BYE: its transport closed, it never comes back



class UCXControl:
    """Control half of ``UCXTransport`` (see the module docstring)."""

    def _send(self, p: Peer, msg: Message) -> None:
        """Queue a control message; each peer's queue leaves as one tagged message per turn."""
        if not p.outbox:
            self._acts += 1
        p.outbox.append(msg)

    def _flush_outboxes(self) -> None:
        for p in self._peers.values():
            if p.outbox:
                self._send_batch(p, p.outbox)
                p.outbox = []
        self._ctrl_sends = [s for s in self._ctrl_sends if not s[0].completed]

    def _send_batch(self, p: Peer, msgs: list) -> None:
        """One tagged control message, or several when one would pass ``max_control_bytes``."""
        wire = pack_batch(self.id, p.secret, msgs)
        if len(wire) > self.max_control_bytes and len(msgs) > 1:
            half = len(msgs) // 2
            self._send_batch(p, msgs[:half])
            self._send_batch(p, msgs[half:])
            return
        buf = np.frombuffer(wire, np.uint8)
        p.last_send = p.ep.tag_send(Array(buf), ucx_api.UCXXTag(CTRL_TAG))
        self._ctrl_sends.append((p.last_send, buf))

    def _poll_ctrl(self) -> None:
        while (res := self._worker.tag_probe(ucx_api.UCXXTag(CTRL_TAG), ucx_api.UCXXTagMask(KIND_MASK),
                                             remove=True)).matched:
            if res.length > self.max_control_bytes:   # received into one byte: UCX drops the rest unread
                self.grants.reject("?", f"too large: a control message of {res.length} bytes")
                junk = np.empty(1, np.uint8)
                self._zombies.append((self._worker.tag_recv_with_handle(Array(junk), res), junk))
                continue
            buf = np.empty(max(res.length, 1), np.uint8)
            self._ctrl_recvs.append((self._worker.tag_recv_with_handle(Array(buf), res), buf, res.length))
        # In arrival order: an ANNOUNCE still streaming in must not be overtaken by its DONE.
        while self._ctrl_recvs and self._ctrl_recvs[0][0].completed:
            req, buf, length = self._ctrl_recvs.pop(0)
            self._acts += 1
            try:
                req.check_error()
                sender, secret, msgs = parse_batch(buf[:length].tobytes(), self.max_control_bytes)
            except Exception as e:
                self.grants.reject("?", f"malformed message: {type(e).__name__}: {e}"[:200])
                continue
            for m in msgs:
                try:
                    self._on_message(sender, secret, m)
                except Exception as e:   # a bug met by one message: counted, the loop goes on
                    log.exception("UCX transport %s: handling a control message", self.id[:8])
                    self.grants.reject("?", f"internal error: {type(e).__name__}")

    def _on_message(self, sender: str, secret: bytes, raw) -> None:
        """One control message from a batch: who sent it, then what it is, then act on it."""
        p = self._peers.get(sender)
        if p is None and kind_of(raw) == HELLO:
            if len(self._peers) >= self.max_peers:
                self.grants.reject("?", f"too many peers: {len(self._peers)} already")
                return
            try:
                hello = parse_message(raw, self.max_control_bytes)
                p = self._add_peer(sender, hello.address, hello.secret)
            except Exception as e:   # Malformed, or an address UCX refuses
                self.grants.reject("?", f"malformed message: HELLO: {e}"[:200])
                return
        if p is None or not hmac.compare_digest(secret, p.secret):
            self.grants.reject("?", f"unknown peer: message from {sender[:40]!r} without its channel")
            return
        try:
            m = parse_message(raw, self.max_control_bytes)
        except Malformed as e:
            if e.answer is not None:
                xid, rid = e.answer
                self._refuse(p, xid, rid, 0, b"", self.grants.reject(rid, str(e)))
            else:
                self.grants.reject("?", str(e)[:200])
            return
        p.clock.touch()
        p.gone = False
        self._handle(p, m)

    def _handle(self, p: Peer, m: Message) -> None:
        if isinstance(m, Announce):
            self._on_announce(p, m)
        elif isinstance(m, (Go, Ack, Fail)):
            o = self._out.get(m.xid)
            if o is None or o.peer is not p:
                return  # a late answer for a transfer that already ended here
            if isinstance(m, Go) and o.state == "wait_go":
                self._start_puts(o, m.dtag)
            elif isinstance(m, Ack) and (o.state == "wait_ack" or o.state == "wait_go" and not o.puts
                                         and o.staging is None and o.iov is None):
                del self._out[o.xid]
                o.handle.finish(release=True)   # puts flushed before DONE, or there were none
            elif isinstance(m, Fail):
                self._fail_out(o, (RejectedWrite if m.why.startswith(_REFUSALS) else PeerError)(
                    f"request {o.handle.request_id}: receiver refused the transfer: {m.why}"), tell=False)
        elif isinstance(m, (Done, Abort)) and (rid := self._landing.pop((p.id, m.xid), None)) is not None:
            self._landed(rid)   # its puts are flushed: nothing more of it lands
        elif isinstance(m, (Done, Abort)) and (i := self._in.get((p.id, m.xid))) is not None:
            if isinstance(m, Abort):   # sent once no put of it is left: nothing more lands
                self._fail_in(i, f"aborted by the sender: {m.why}", tell=False, puts_left=False)
            else:
                i.done = True
                self._try_finish(i)
        elif isinstance(m, Bye):
            p.bye_at = p.clock.heard
            self._peer_gone(p, "peer closed its transport")

    # ---- deadlines and heartbeats ---------------------------------------------------------
    def _housekeeping(self, now: float) -> None:
        for o in self._holding:
            if self._puts_settled(o):
                self._release_and_abort(o)
        self._holding = [o for o in self._holding if not o.handle.source_released]
        for o in [o for o in self._out.values() if now > o.handle.deadline]:
            self._fail_out(o, TransferTimeout(f"transfer for request {o.handle.request_id} passed its deadline "
                                              f"({o.state.replace('_', ' ')})"))
        for i in [i for i in self._in.values() if now > i.deadline]:
            self._fail_in(i, self.grants.reject(i.rid, "deadline passed: the sender did not finish in time"))
        for p in list(self._peers.values()):
            if not p.gone and p.clock.silent(now, self.peer_timeout):
                self._peer_gone(p, f"peer silent for {p.clock.silent_for(now):.1f}s (dead or stalled)")
            # Ping only once the last message left: sends to a dead peer may never complete.
            if now >= p.next_ping and (p.last_send is None or p.last_send.completed):
                p.next_ping = now + self.heartbeat
                self._send(p, Ping())
        self._drop_closed_peers(now)

    def _drop_closed_peers(self, now: float) -> None:
        """Forget peers that said BYE a while ago and that nothing refers to any more: their
        transport closed (ids are per transport), and kept they would count against max_peers."""
        busy = {o.peer.id for o in (*self._out.values(), *self._holding, *self._flushing)} | \
            {key[0] for key in (*self._in, *self._landing)} | {e[0] for e in self._draining} | set(self._unflushed)
        for p in [p for p in self._peers.values() if p.bye_at is not None and now - p.bye_at > self.peer_timeout
                  and p.id not in busy and p.clock.heard <= p.bye_at]:
            del self._peers[p.id]
            for h in p.rkeys:
                if h:
                    ucp.rkey_destroy(h)
            p.rkeys, p.outbox = [], []
            p.ep.close()   # no flush: the peer is gone (error handling is off)

    def _peer_gone(self, p: Peer, why: str) -> None:
        p.gone = True
        for key in [k for k in self._landing if k[0] == p.id]:
            self._landed(self._landing.pop(key))
        for entry in [e for e in self._draining if e[0] == p.id]:   # its frames will not come (see puts)
            self._draining.remove(entry)
            self._zombies.append((entry[2], None))
            self._landed(entry[1])
        for o in [o for o in self._out.values() if o.peer is p]:
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"), tell=False)
        for i in [i for i in self._in.values() if i.peer is p]:
            self._fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"), tell=False)
