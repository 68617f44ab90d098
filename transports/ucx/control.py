"""UCX control plane of a transport: peers, control batches in and out, heartbeats, silence.

``UCXControl`` is a mixin of ``UCXTransport``; every method runs on the I/O thread. Each loop
turn ``_poll_ctrl`` receives control batches (dropping one over ``max_control_bytes`` unread),
``_on_message`` checks who sent each message (its channel secret) and what it is
(``protocol.parse_message``) before ``_handle`` acts on it; ``_send`` queues replies, which
``_flush_outboxes`` sends as one batch per peer. ``_housekeeping`` (a few times a second) fails
transfers past their deadline, pings peers, and ends those silent past ``peer_timeout``.

Fencing (silence is not death). A peer silent past ``peer_timeout`` has its transfers failed on
both sides within their deadlines, but what it could still write or read stays held:

* receiver: ended transfers it had GO for stay in ``_landing`` and posted frame receives in
  ``_draining``, so ``writes_pending`` stays True; the peer is *fenced*: its ANNOUNCEs are
  refused until it re-handshakes. An entry ends when the peer sends DONE or ABORT for it (sent
  only after its endpoint flush completed, so its puts have landed), when it re-handshakes
  (a HELLO with a higher epoch, sent only after a flush of its endpoint completed: every put
  issued before it has landed), when it is proven dead, or, only if the operator set
  ``quarantine_timeout``, when that expires (counted in ``fencing()["expired"]``). Proven dead
  (``fencing``): on our kernel, in our PID and network namespaces, its process is gone (pid
  check); elsewhere (another host or network namespace, no user-chosen TLS: ``Peer.err``,
  endpoints with UCX error handling on both sides) UCX reported its endpoint failed: its
  connection was reset or closed, which its process's death does. Either way ``fence_grace``
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
  (``_rehello``): announces wait for that HELLO, so no write of the old epoch follows it.
  Silence is seen per direction, so a receiver may fence a sender that never saw it silent:
  hearing a peer it fenced, the receiver tells it (FAIL, transfer id 0, "peer fenced"); an
  announce it refused as fenced fails no request there and goes again after the new HELLO
  (``_requeue``); a GO for an announce older than the re-handshake starts no put (ABORT).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.errors import PeerError, RejectedWrite, TransferTimeout

from . import bindings as ucp
from .protocol import (
    CTRL_TAG,
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
    Ping,
    Pregrant,
    Welcome,
    pack_batch,
    parse_message,
)
from .state import Incoming, Outgoing, Peer

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable
    from kvxfer.transport.base import Arrival


log = logging.getLogger("kvxfer.transport.ucx")

_REFUSALS = ("outside", "unknown", "ended", "malformed", "refused")  # GrantTable reasons: RejectedWrite
FENCED = "peer fenced"   # the FAIL a fenced peer's ANNOUNCE gets: flush, then HELLO with a higher epoch
_MERGED = (Pregrant, Fence, Fenced)   # consecutive ones to a peer in a turn go as one (``_send``)
MERGE_RIDS = 512   # ids per merged message (joining copies the tuple: bounded, and below MAX_RIDS)
MERGE_GRANT_BYTES = 1 << 20   # PREGRANTs join while their grants stay this small (one may be MAX_PREGRANT_BYTES)


def host_identity() -> str:
    """This process's kernel and namespaces (boot id, PID and network namespace): a peer with the
    same identity can tell whether our process is alive by its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of process ``pid``, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None





class _FailOut(Protocol):
    """``UCXSender._fail_out``, as the other halves of ``UCXTransport`` see it."""
    def __call__(self, o: Outgoing, err: Exception, tell: bool = True) -> None: ...


class _FailIn(Protocol):
    """``UCXReceiver._fail_in``, as the other halves of ``UCXTransport`` see it."""
    def __call__(self, i: Incoming, reason: str, tell: bool = True, puts_left: bool = True) -> None: ...


class _Refuse(Protocol):
    """``UCXReceiver._refuse``, as the other halves of ``UCXTransport`` see it."""
    def __call__(self, p: Peer, xid: int, rid: str, nbytes: int, notify: bytes, reason: str,
                 quiet: bool = False) -> None: ...


class UCXControl:
    """Control half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only: set in ``UCXTransport.__init__`` or defined by the
    # other halves (``UCXSender``, ``UCXReceiver``, ``UCXTransport``). Annotations, no values,
    # so nothing here shadows the real attributes at run time.
    id: str
    grants: GrantTable
    heartbeat: float
    peer_timeout: float
    fence_grace: float
    quarantine_timeout: float | None
    max_control_bytes: int
    max_peers: int
    _host_id: str
    _fence_released: int
    _fence_expired: int
    _worker: Any                      # ucx_api.UCXWorker
    _workers: list                    # it, and the FAR_TLS worker once made
    _flush_param: ucp.RequestParam
    _peers: dict[str, Peer]
    _out: dict[int, Outgoing]
    _in: dict[tuple[str, int], Incoming]
    _unflushed: dict[str, list]
    _flushing: list
    _holding: list
    _ctrl_sends: list
    _ctrl_recvs: list
    _zombies: list
    _landing: dict[tuple[str, int], tuple[str, int, float]]
    _draining: list
    _retired: collections.OrderedDict[str, tuple[bytes, int]]
    _acts: int
    _deliver: Callable[[Arrival], None]
    _address: bytes
    _front_worker: Any
    _by_tag: dict[int, Peer]
    _retired_tags: collections.OrderedDict[int, None]
    _junk: collections.Counter
    _on_join: Callable[[str, bytes, list], None]       # UCXJoin
    _on_welcome: Callable[[Peer, Welcome], None]
    _hello: Callable[[Peer], Hello]
    _start_out: Callable[[Outgoing], None]
    _start_puts: Callable[[Outgoing, int], None]
    _fail_out: _FailOut
    _release_and_abort: Callable[[Outgoing], None]
    _puts_settled: Callable[[Outgoing], bool]
    _on_announce: Callable[[Peer, Announce], None]
    _refuse: _Refuse
    _try_finish: Callable[[Incoming], None]
    _fail_in: _FailIn
    _landed: Callable[[str], None]
    _peer_gone: Callable[[Peer, str], None]          # UCXFencing
    _fence_check: Callable[[Peer, float], None]
    _expire_quarantine: Callable[[float], None]
    _drop_closed_peers: Callable[[float], None]
    _check_failed: Callable[[float], None]
    _on_pregrant: Callable[[Peer, Pregrant], None]   # UCXEager
    _on_fence: Callable[[Peer, Fence], None]
    _on_fenced: Callable[[Peer, Fenced], None]
    _refence: Callable[[Peer], None]

    def _send(self, p: Peer, msg: Message) -> None:
        """Queue a control message; each peer's queue leaves as one tagged message per turn. A
        PREGRANT, FENCE or FENCED (not "all") right after one of its kind joins it, up to
        ``MERGE_RIDS`` ids: the sender answers each FENCE with an endpoint flush and a FENCED, and
        the receiver sends one per forgotten request (a turn of forgets: one flush, not one each)."""
        if not p.outbox:
            self._acts += 1
        elif isinstance(msg, _MERGED) and not (isinstance(msg, Fenced) and msg.all):
            last = p.outbox[-1]
            same = type(last) is type(msg) and not (isinstance(last, Fenced) and last.all)
            if same and len(last.rids) + len(msg.rids) <= MERGE_RIDS:
                if not isinstance(msg, Pregrant):
                    p.outbox[-1] = type(msg)(last.rids + msg.rids)
                    return
                if sum(map(len, last.grants)) + sum(map(len, msg.grants)) <= MERGE_GRANT_BYTES:
                    p.outbox[-1] = Pregrant(last.rids + msg.rids, last.grants + msg.grants)
                    return
        p.outbox.append(msg)

    def _flush_outboxes(self) -> None:
        for p in self._peers.values():
            if p.outbox:
                self._send_batch(p, p.outbox)
                p.outbox = []
        self._ctrl_sends = [s for s in self._ctrl_sends if not s[0].completed]

    def _send_batch(self, p: Peer, msgs: list) -> None:
        """One tagged control message, or several when one would pass ``max_control_bytes``; under
        the control tag ``p`` gave us (0 while we join it: its front worker)."""
        wire = pack_batch(self.id, p.secret, msgs)
        if len(wire) > self.max_control_bytes and len(msgs) > 1:
            half = len(msgs) // 2
            self._send_batch(p, msgs[:half])
            self._send_batch(p, msgs[half:])
            return
        buf = np.frombuffer(wire, np.uint8)
        p.last_send = p.ep.tag_send(Array(buf), ucx_api.UCXXTag(CTRL_TAG | p.tag_out))
        self._ctrl_sends.append((p.last_send, buf))

    def _on_message(self, p: Peer, raw) -> None:
        """One control message of a batch from ``p`` (its channel checked): what it is, then act."""
        try:
            m = parse_message(raw, self.max_control_bytes)
        except Malformed as e:
            if e.answer is not None:
                # An ANNOUNCE with valid ids and a bad field: counted and dropped like any
                # malformed message, and never used to end the request it names (that would let
                # anyone fail a live request by its id). Its sender's transfer fails (FAIL, which
                # reads the same for live and unknown ids: no oracle); the request goes on.
                xid, rid = e.answer
                self._refuse(p, xid, rid, 0, b"", self.grants.reject(rid, str(e)), quiet=True)
            else:
                self.grants.reject("?", str(e)[:200])
            return
        p.clock.touch()
        back = p.gone
        if back:   # back after silence: whatever we sent it may be lost; flush, then re-handshake
            p.gone = False
            self._rehello(p)
        self._handle(p, m)
        if back and p.fenced and not isinstance(m, Announce):
            # We fenced it; it may not know (its own view of us never went silent). Tell it now,
            # so it re-handshakes before its next announce instead of having that refused.
            self._send(p, Fail(0, f"{FENCED}: flush, then HELLO with a new epoch"))

    def _handle(self, p: Peer, m: Message) -> None:
        if isinstance(m, Announce):
            if p.fenced:   # a write of the epoch we fenced: refused until the peer re-handshakes
                # No arrival: the request is not failed here. Its sender re-handshakes and
                # announces it again (``_requeue``); if it never does, the request's own deadline ends it.
                self._send(p, Fail(m.xid, f"{FENCED}: flush, then HELLO with a new epoch"))
                return
            self._on_announce(p, m)
        elif isinstance(m, Hello):
            p.tag_out = m.ctag
            self._on_hello(p, m)
            self._send(p, Welcome(self._address, p.tag_in))   # its connect() waits for a round trip here
        elif isinstance(m, Welcome):
            self._on_welcome(p, m)
        elif isinstance(m, (Go, Ack, Fail)):
            o = self._out.get(m.xid)
            if isinstance(m, Fail) and m.why.startswith(FENCED):
                # The receiver fenced us (we never saw it silent, or not yet): flush, then HELLO
                # with a new epoch; an announce it refused for that goes again after the HELLO.
                self._rehello(p)
                if o is not None and o.peer is p and o.state == "wait_go":
                    self._requeue(o)
                return
            if o is None or o.peer is not p:
                return  # a late answer for a transfer that already ended here
            if isinstance(m, Go) and o.state == "wait_go" and o.stale:
                # Announced before a re-handshake began: a put of it now would follow the flush
                # and belong to neither epoch. ABORT (nothing issued) lets the receiver let go.
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: the receiver fenced us; "
                                            "re-handshaking"))
            elif isinstance(m, Go) and o.state == "wait_go":
                self._start_puts(o, m.dtag)
            elif isinstance(m, Ack) and (o.state == "wait_ack" or o.state == "wait_go" and not o.puts
                                         and o.staging is None and o.iov is None):
                del self._out[o.xid]
                o.handle.finish(release=True)   # puts flushed before DONE, or there were none
            elif isinstance(m, Fail):
                self._fail_out(o, (RejectedWrite if m.why.startswith(_REFUSALS) else PeerError)(
                    f"request {o.handle.request_id}: receiver refused the transfer: {m.why}"), tell=False)
        elif isinstance(m, (Done, Abort)) and (e := self._landing.pop((p.id, m.xid), None)) is not None:
            self._landed(e[0])   # its puts are flushed: nothing more of it lands
        elif isinstance(m, (Done, Abort)) and (i := self._in.get((p.id, m.xid))) is not None:
            if isinstance(m, Abort):   # sent once no put of it is left: nothing more lands
                self._fail_in(i, f"aborted by the sender: {m.why}", tell=False, puts_left=False)
            else:
                i.done = True
                self._try_finish(i)
        elif isinstance(m, Pregrant):
            self._on_pregrant(p, m)
        elif isinstance(m, Fence):
            self._on_fence(p, m)
        elif isinstance(m, Fenced):
            self._on_fenced(p, m)
        elif isinstance(m, Bye):
            # Its transport closed after flushing (bounded) and sending ABORTs for what it held;
            # anything still held here was not proven flushed: it stays fenced.
            p.bye_at = p.clock.heard
            self._peer_gone(p, "peer closed its transport")

    def _on_hello(self, p: Peer, m: Hello) -> None:
        """A HELLO from a known peer (same channel secret). With a higher epoch it re-handshakes:
        it sent it only after a flush of its endpoint to us completed, so every put it issued
        before has landed. The fence lifts and its held transfers are released."""
        p.host, p.pid, p.start, p.sends_eager = m.host, m.pid, m.start, m.eager
        if m.epoch <= p.epoch:
            return
        p.epoch, p.fenced, p.dead_since = m.epoch, False, None
        for key in [k for k in self._landing if k[0] == p.id]:
            self._landed(self._landing.pop(key)[0])
        self._refence(p)   # eager: a FENCE it may have missed while silent goes again

    def _rehello(self, p: Peer) -> None:
        """Sender: flush our endpoint to ``p``, then (``_check_rehello``) HELLO with a new epoch.
        Transfers waiting for GO are marked stale: each gets one answer (control is ordered): a
        GO fails it without a put (ABORT), a FENCED refusal announces it again after the HELLO
        (``_requeue``). New announces wait for the HELLO, so no put issued after the flush
        began belongs to the old epoch."""
        if p.rehello is not None or p.sizes is None or p.closing:   # flushing already, or we never write to it
            return
        for o in self._out.values():
            if o.peer is p and o.state == "wait_go":
                o.stale = True
        p.pregranted.clear()   # maybe stale after silence: announced (GO) until pregranted again
        p.pregranted_bytes = 0
        p.rehello = ucp.Flush(ucp.ep_flush(p.eph, ctypes.byref(self._flush_param)))

    def _requeue(self, o: Outgoing) -> None:
        """Sender: ``o``'s announce was refused because the receiver fenced us. Nothing of it
        was issued (no GO): it is announced again, same transfer id, after our new HELLO."""
        del self._out[o.xid]
        o.state, o.stale = "queued", False
        self._start_out(o)   # waits in p.waiting while the re-handshake flush runs

    def _check_rehello(self, p: Peer) -> None:
        """Sender, each tick: the re-handshake flush completed? Then HELLO, then the waiting announces."""
        st = p.rehello.poll()
        if st is None:
            for o in [o for o in p.waiting if o.handle.poll() != 0]:   # timed out waiting: never read
                o.handle.release_source()
                p.waiting.remove(o)
            return
        p.rehello = None
        if st != 0:   # not flushed: try again (a dead peer never completes one)
            self._rehello(p)
            return
        p.my_epoch += 1
        self._send(p, self._hello(p))
        waiting, p.waiting = p.waiting, []
        for o in waiting:
            self._start_out(o)

    # ---- deadlines and heartbeats ---------------------------------------------------------
    def _housekeeping(self, now: float) -> None:
        ucp.log_cma_failures()
        self._check_failed(now)
        for o in self._holding:
            if self._puts_settled(o):
                self._release_and_abort(o)
        self._holding = [o for o in self._holding if not o.handle.source_released]
        for o in [o for o in self._out.values() if now > o.handle.deadline]:
            self._fail_out(o, TransferTimeout(f"transfer for request {o.handle.request_id} passed its deadline "
                                              f"({o.state.replace('_', ' ')})"))
        for i in [i for i in self._in.values() if now > i.deadline]:
            self._fail_in(i, self.grants.reject(i.rid, "deadline passed: the sender did not finish in time"))
        # peers that memory here waits for: their death is looked for every tick, silent or not
        # (a killed sender on this kernel is proven dead by its pid a tick later, not after peer_timeout)
        waited = {k[0] for k in self._landing} | {e[0] for e in self._draining} if self._landing or \
            self._draining else set()
        for p in list(self._peers.values()):
            if p.rehello is not None:
                self._check_rehello(p)
            if not p.gone and p.clock.silent(now, self.peer_timeout):
                self._peer_gone(p, f"peer silent for {p.clock.silent_for(now):.1f}s (dead or stalled)")
            if p.gone or p.fenced or p.id in waited:
                self._fence_check(p, now)
            # Ping only once the last message left: sends to a dead peer may never complete.
            if now >= p.next_ping and (p.last_send is None or p.last_send.completed) and not p.closing \
                    and not p.joining:   # joining: its front worker takes our HELLO only
                p.next_ping = now + self.heartbeat
                self._send(p, Ping())
        if self.quarantine_timeout is not None:
            self._expire_quarantine(now)
        self._drop_closed_peers(now)
