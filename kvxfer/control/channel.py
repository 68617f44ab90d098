"""The control channel: one ZMQ ROUTER (answers) and a DEALER per peer (requests) served by
one I/O thread, with heartbeats that find a silent peer.

Who calls what, and when
------------------------
Owner (an endpoint), any thread: ``ControlChannel(handler, secret=, heartbeat=, bind=, advertise=,
    identity=, on_dead=, limits=)``; ``connect(peer, address)`` (decode, once per prefill rank;
    ConnectError at once for an address no peer can reach); ``send(peer, msg)`` (never blocks);
    ``call(peer, msg, timeout)`` (blocks for the reply); ``watch(peer)`` (prefill, after an
    accepted HELLO); ``forget(peer)`` (drop a peer: its DEALER, its replay state); ``nudge()``
    (the owner took on work its tick looks after); ``close()``.
Channel thread -> handler: ``on_message(peer, msg)`` (a checked ``Message``), ``on_peer_lost(peer,
    why)``, ``on_tick(now) -> seconds until the next tick`` (past ``TICK`` only with nothing to look
    after: then the owner calls ``nudge`` when that changes). None may block.
Channel thread -> owner, at most once: ``on_dead(exc)`` when the thread ended by an exception (a
    bug: input never kills it). Then ``alive`` is False and ``broken`` holds the exception; every
    pending ``call`` fails at once.

What the thread guarantees: every message is authenticated (``kvxfer.control.wire``), parsed
into its dataclass, and checked against the connection (signed sender = routing identity,
recipient = us, a fresh nonce and a growing seq) before the handler sees it; anything else is
counted in ``dropped`` under a fixed ``Drop`` reason. State per peer is bounded (``ChannelLimits``):
peers that never completed a handshake are forgotten after ``idle_timeout``.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import cast

import zmq

from ..addresses import advertise_address, check_address, split_address
from ..errors import ConfigError, ConnectError
from ..transport.kit import IOThread, PipeWaker
from .messages import Drop, Hello, Message, Ping, Pong, Refuse, WireError, call_id
from .peers import Call, ChannelLimits, Heartbeat, PendingCalls, ReplayGuard
from .wire import MAX_IDENTITY, MAX_MESSAGE, Head, open_frames, peek_call, recv_bounded, seal
from .zmtp import ChannelGuard

log = logging.getLogger("kvxfer.control")
TICK = 0.05   # seconds: the longest a turn waits while its owner has a request to look after (``on_tick``)



class ControlChannel:
    """One rank's control sockets and the thread that owns them (ZMQ sockets are not thread-safe).

    ``bind`` (prefill): where the ROUTER listens (``tcp://0.0.0.0:0`` binds every interface);
    ``advertise``: the address or interface name peers are told (``address``), see
    ``kvxfer.addresses.advertise_address``. Decode passes no ``bind`` and ``connect``s.
    ``check_recipient``: the ROUTER refuses a message signed for anyone but itself: DEALERs sign
    the name they ``connect``ed the peer under (a rank's key), which the ROUTER knows as its
    ``identity`` (or its addresses), so a message captured on its way to one rank cannot be
    replayed at another, whatever proxy or NAT sits between. The endpoints turn it on; DEALERs
    always check that replies are signed for their own identity.

    ``zmtp_auth`` (with a ``secret``): authenticate every connection at the ZMTP handshake (CURVE,
    keys derived from the secret, ``kvxfer.control.zmtp``), so nothing a peer without the secret
    sends is buffered (beyond one frame per connection during its handshake). Every channel of a
    deployment must agree: a channel with it and one without cannot connect. Without a secret it
    does nothing: such a ROUTER takes anyone, and libzmq buffers a multipart message whole before
    the channel sees it, without a bound on its parts."""

    def __init__(self, handler, *, secret: bytes | None, heartbeat: Heartbeat, bind: str | None = None,
                 identity: str = "", name: str = "ctl", advertise: str | None = None,
                 on_dead: Callable[[BaseException], None] | None = None, limits: ChannelLimits = ChannelLimits(),
                 check_recipient: bool = False, zmtp_auth: bool = False):
        self.handler, self.secret, self.heartbeat, self.limits = handler, secret, heartbeat, limits
        self.identity = identity
        self._me = identity or f"anon-{os.urandom(8).hex()}"    # what our DEALERs sign as sender
        if len(self._me.encode()) > MAX_IDENTITY:
            raise ConfigError(f"identity of {len(self._me.encode())} bytes: at most {MAX_IDENTITY}")
        self.on_dead, self.check_recipient = on_dead, check_recipient
        self.dropped: collections.Counter[Drop] = collections.Counter()
        self._ctx = zmq.Context(io_threads=1)
        self._poller = zmq.Poller()
        self._guard = ChannelGuard(self._ctx, self._poller, secret, zmtp_auth, MAX_MESSAGE + 64)
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._dealer_at: dict[str, str] = {}      # peer -> address connected
        self._by_sock: dict[zmq.Socket, str] = {}
        self._bad_address: dict[str, str] = {}    # peer -> why its DEALER could not connect
        self._seen: dict[str, float] = {}         # peer -> last message time (watched peers only)
        self._lost: set[str] = set()
        self._rx = ReplayGuard(limits)                                                   # (side, peer)
        self._tx: dict[tuple[str, str], list] = {}                                          # -> [nonce, seq]
        self._outbox: collections.deque = collections.deque()
        self._calls = PendingCalls()
        self._logged: dict[Drop, float] = {}
        self._waker = PipeWaker()
        self._poller.register(self._waker.fd, zmq.POLLIN)
        self.address = ""
        self.bound = ""
        self._names: set[str] = set()
        if bind is not None:
            self._router = self._guard.router(heartbeat.timeout)
            try:
                split_address(bind)
                self._router.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
                self.bound = cast(bytes, self._router.last_endpoint).decode()   # pyzmq types sockopts as a union
                self.address = advertise_address(self.bound, advertise, setting="advertise (the control address)")
            except (zmq.ZMQError, ValueError) as e:
                self._ctx.destroy(linger=0)
                self._waker.close()
                raise ConnectError(f"control channel cannot bind {bind}: {e}") from None
            self._names = {self.address, self.bound, bind} | ({identity} if identity else set())
            self._poller.register(self._router, zmq.POLLIN)
            self._guard.bound(self._router)
        self._closed = False
        self.dozing = False   # the thread sleeps past a TICK: ``send`` and ``nudge`` wake it (see ``_run``)
        # the kit's thread: a bug that escapes the loop is logged and kept (``broken``), then
        # ``_finish`` closes the sockets and tells the owner
        self.io = IOThread(f"kvxfer-{name}", self._run, on_crash=lambda why: None, on_exit=self._finish)
        self.io.start()

    @property
    def broken(self) -> BaseException | None:
        """The exception the channel thread died of (a bug), or None."""
        return self.io.error

    @property
    def alive(self) -> bool:
        """False once the channel thread ended (closed, or died of a bug: see ``broken``)."""
        return self.broken is None and not self._closed and self.io.alive

    @property
    def peers(self) -> int:
        """Connections (identities) the channel holds replay state for: bounded by ``limits.max_peers``."""
        return len(self._rx)

    # -- any thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        if threading.current_thread() is not self.io.thread:   # the channel thread needs no wake from itself
            self._waker.wake()

    def connect(self, peer: str, address: str) -> None:
        """Decode side: open a DEALER to a prefill rank's control address (idempotent for the same
        address; a new address replaces the old connection: a restarted rank). ConnectError,
        naming the address, when it is not one a peer can connect to."""
        try:
            check_address(address)
        except ValueError as e:
            raise ConnectError(f"cannot connect to control address of {peer}: {e}") from None
        self._outbox.append(("connect", peer, address))
        self._wake()

    def send(self, peer: str, msg: Message, urgent: bool = True) -> None:
        """Queue a message for ``peer``; never blocks. Lost if the peer is gone (heartbeats tell).
        ``urgent=False`` leaves it for the channel's next turn (within a tick, <= ``TICK``) instead of
        waking the channel thread, which costs the caller a GIL hand-over on the hot path; a thread
        dozing past a tick (``dozing``) is woken all the same.
        ``msg`` was checked against its schema when it was built; TypeError for anything else."""
        if not isinstance(msg, Message):
            raise TypeError(f"send() takes a control message object (kvxfer.control.messages), got "
                            f"{type(msg).__name__}")
        self._outbox.append(("send", peer, msg))
        if urgent or self.dozing:
            self._wake()

    def nudge(self) -> None:
        """The owner has work for its ``on_tick`` again (a request began): wake the channel thread if
        it is dozing, so the tick comes within ``TICK``. Any thread; free when it is not dozing."""
        if self.dozing:
            self._wake()

    def call(self, peer: str, build: Callable[[int], Message], timeout: float) -> Message:
        """Send ``build(call_id)`` and wait for the reply that names that id (``re``); ConnectError
        on timeout."""
        with self.start_call(peer, build) as c:
            return c.result(timeout)

    def start_call(self, peer: str, build: Callable[[int], Message]) -> Call:
        """``call`` without the wait: send ``build(call_id)`` now; the ``Call``'s future gets the
        reply. Many calls go out from one thread and are waited for together; the caller closes each."""
        if self.broken is not None:
            raise ConnectError(f"control channel is broken: {self.broken!r}")
        c = self._calls.open(peer, lambda t: self._no_answer(peer, t))
        self.send(peer, build(c.id))
        return c

    def _no_answer(self, peer: str, timeout: float) -> ConnectError:
        where = self._dealer_at.get(peer, "")
        return ConnectError(f"no answer from {peer}{f' at {where}' if where else ''} within {timeout}s")

    def watch(self, peer: str) -> None:
        """Start heartbeat accounting for ``peer`` (prefill: after an accepted HELLO)."""
        self._outbox.append(("watch", peer, None))
        self._wake()

    def forget(self, peer: str) -> None:
        """Drop everything held for ``peer``: heartbeat state, replay state, its DEALER."""
        self._outbox.append(("forget", peer, None))
        self._wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self.io.join(5)   # not when close() runs on the thread (from on_dead)
        self._waker.close()

    # -- channel thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_ping, wait = 0.0, 0.0
        while not self._closed:
            events = dict(self._poller.poll(max(0, int(wait * 1000))))
            self.dozing = False
            self._waker.clear()    # before the outbox is flushed: a later send wakes us again
            self._flush()
            for sock in [s for s in events if isinstance(s, zmq.Socket)]:   # fds are ints: == not is
                guarded, failed = self._guard.handle(sock)
                if failed is not None:
                    self._handshake_failed(failed)
                elif not guarded and not sock.closed:   # _flush may have forgotten its peer (closed it)
                    self._receive(sock)
            now = time.monotonic()
            if now >= next_ping:
                self._heartbeat(now)
                self._guard.tick(now)
                next_ping = now + self.heartbeat.interval / 2
            # Dozing from before the owner's tick looks at its state: work it takes on after that
            # look (``nudge``), or a message queued (``send``), wakes the thread. Busy, it turns
            # every TICK; idle (no request), at the heartbeat's pace (issue 39: 64 idle prefill
            # ranks on one host took ~1/3 of a core in wake-ups, 20 a second each).
            self.dozing = True
            wait = min(max(self.handler.on_tick(now), 0.0), next_ping - now)
            if wait <= TICK or self._outbox:
                self.dozing = False
                if self._outbox:   # queued while the tick ran: flushed in the next turn
                    wait = 0.0

    def _finish(self) -> None:
        """After the loop (``IOThread.on_exit``), closed or dead: sockets, then the owner is told."""
        try:
            self._flush()    # what close() left behind (e.g. the aborts of a closing endpoint)
        except Exception:
            pass
        self._guard.close(self._router)
        for s in [self._router, *self._dealers.values()]:
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
        if self.broken is not None:
            self._died(self.broken)

    def _died(self, exc: BaseException) -> None:
        self._calls.fail(ConnectError(f"control channel thread died: {exc!r}"))
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:
                log.exception("on_dead callback failed")

    def _count(self, reason: Drop, peer: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) > 10.0:    # one line per reason per 10 s: no log flood
            self._logged[reason] = now
            log.warning("dropped control message from %r: %s %s (counted in dropped[%s])", peer[:128], reason.value,
                        detail[:256], reason.name)

    def _flush(self) -> None:
        while self._outbox:
            op, peer, arg = self._outbox.popleft()
            if op == "connect":
                if peer in self._dealers and self._dealer_at.get(peer) != arg:
                    self._drop_peer(peer)      # the peer moved (a restarted rank): a new connection
                if peer not in self._dealers:
                    self._open_dealer(peer, arg)
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            elif op == "watch":
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            elif op == "forget":
                self._drop_peer(peer)
            else:
                self._send_now(peer, arg)

    def _open_dealer(self, peer: str, address: str) -> None:
        s = self._guard.dealer()
        try:
            s.setsockopt(zmq.IDENTITY, self._me.encode())
            s.connect(address)
        except zmq.ZMQError as e:
            s.close(linger=0)
            self._bad_address[peer] = f"cannot connect to {address}: {e}"
            self._count(Drop.CONNECT, peer, address)
            return
        self._bad_address.pop(peer, None)
        self._dealers[peer], self._dealer_at[peer] = s, address
        self._by_sock[s] = peer
        self._poller.register(s, zmq.POLLIN)
        self._guard.connected(peer, s)

    def _handshake_failed(self, peer: str) -> None:
        """Our DEALER's ZMTP handshake with ``peer`` failed (zmtp_auth): its pending calls fail at
        once, naming the likely cause, instead of timing out."""
        why = (f"the ZMTP handshake with {self._dealer_at.get(peer, '?')} failed: with zmtp_auth both sides "
               f"need the same secret and zmtp_auth on")
        self._bad_address[peer] = why
        self._count(Drop.AUTH, peer, why)
        self._calls.fail(ConnectError(f"control channel to {peer}: {why}"), peer)

    def _drop_peer(self, peer: str) -> None:
        s = self._dealers.pop(peer, None)
        self._guard.forget(peer)
        if s is not None:
            self._poller.unregister(s)
            self._by_sock.pop(s, None)
            s.close(linger=0)
        self._dealer_at.pop(peer, None)
        self._seen.pop(peer, None)
        self._lost.discard(peer)
        for side in ("d", "r"):
            self._rx.drop((side, peer))
            self._tx.pop((side, peer), None)

    def _head(self, side: str, peer: str) -> Head:
        tx = self._tx.get((side, peer))
        if tx is None:
            tx = self._tx[(side, peer)] = [os.urandom(16), 0]
        tx[1] += 1
        if side == "d":
            return Head(self._me, peer, tx[0], tx[1])   # the peer's name (its rank key), not an address
        return Head(self.address, peer, tx[0], tx[1])

    def _send_now(self, peer: str, msg: Message) -> None:
        try:
            if peer in self._dealers:
                self._dealers[peer].send_multipart(seal(msg, self._head("d", peer), self.secret), zmq.NOBLOCK)
            elif self._router is not None and ("r", peer) in self._rx:
                self._router.send_multipart([peer.encode()] + seal(msg, self._head("r", peer), self.secret),
                                            zmq.NOBLOCK)
            else:
                self._count(Drop.UNKNOWN_PEER, peer, self._bad_address.get(peer, ""))
                fut = self._calls.waiting(peer, msg.i) if isinstance(msg, Hello) else None
                if fut is not None:
                    fut.set_exception(ConnectError(f"control channel to {peer}: "
                                                   f"{self._bad_address.get(peer, 'not connected')}"))
        except zmq.ZMQError as e:   # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self._count(Drop.SEND_FAILED, peer, e.strerror)

    def _receive(self, sock: zmq.Socket) -> None:
        router = sock is self._router
        for _ in range(4096):   # bounded, so a flood cannot starve ticks and heartbeats
            got = recv_bounded(sock, 4 if router else 3)
            if got is None:
                return
            frames, oversized = got
            rid = b""
            if router:
                rid, frames = frames[0], frames[1:]
                try:
                    peer = rid.decode()
                except UnicodeDecodeError:
                    self._count(Drop.IDENTITY, repr(rid[:16]))
                    continue
            else:
                peer = self._by_sock[sock]
            if oversized:
                self._count(Drop.TOO_LARGE, peer, "more than one large part")
                continue
            try:
                head, msg = open_frames(frames, self.secret)
                self._check_head(router, peer, head)
            except WireError as e:
                self._count(e.reason, peer, str(e))
                if len(frames) == 3 and e.reason in (Drop.AUTH, Drop.FIELD, Drop.TYPE, Drop.HEADER, Drop.RECIPIENT,
                                                     Drop.SENDER):
                    self._on_refused(router, rid, peer, frames[2], str(e))
                continue
            self._dispatch(router, peer, msg)

    def _check_head(self, router: bool, peer: str, head: Head) -> None:
        """Signed sender and recipient match this connection; nonce fresh; seq grows."""
        if router:
            if head.sender != peer:
                raise WireError(Drop.SENDER, f"signed {head.sender[:64]!r}")
            if self.check_recipient and head.recipient not in self._names:
                raise WireError(Drop.RECIPIENT, f"signed for {head.recipient[:64]!r}")
        elif head.recipient != self._me:
            raise WireError(Drop.RECIPIENT, f"signed for {head.recipient[:64]!r}")
        fresh = router and self._rx.is_new_connection(("r", peer), head)
        gone = self._rx.admit(("r" if router else "d", peer), head, time.monotonic(), same_sender=not router,
                              keep=self._keep, spare=self._live)
        if fresh:   # the peer opened a new connection (it forgot the old one): our replies open one too
            self._tx.pop(("r", peer), None)
        for key in gone:       # a peer lost long ago made room for a new one: forget it entirely
            self._tx.pop(key, None)
            if key[1] in self._lost:
                self._seen.pop(key[1], None)
                self._lost.discard(key[1])

    def _live(self, peer: str) -> bool:
        """Peers kept even when the peer table is full: our DEALERs and watched peers not lost."""
        return peer in self._dealers or (peer in self._seen and peer not in self._lost)

    def _keep(self, peer: str) -> bool:
        """Peers whose replay state is never evicted: handshaked (watched) ones and our own DEALERs."""
        return peer in self._seen or peer in self._dealers

    def _dispatch(self, router: bool, peer: str, msg: Message) -> None:
        if peer in self._seen:
            self._seen[peer] = time.monotonic()
            self._lost.discard(peer)
        if isinstance(msg, Ping):
            if peer in self._seen:
                self._send_now(peer, Pong())
            return
        if isinstance(msg, Pong):
            return
        re = call_id(msg)
        if re is not None:
            if router:
                self._count(Drop.UNEXPECTED, peer, msg.T)
                return
            if not self._calls.answer(peer, re, msg):
                self._count(Drop.UNEXPECTED, peer, msg.T)
            return
        try:
            self.handler.on_message(peer, msg)
        except Exception:
            self.dropped[Drop.HANDLER] += 1
            log.exception("control handler failed on %s from %r", msg.T, peer[:128])

    def _on_refused(self, router: bool, rid: bytes, peer: str, body: bytes, why: str) -> None:
        """A handshake message failed its checks: say why, so launch fails loudly, not by timeout.
        Only the call id is read from the untrusted body; the REFUSE goes out on a one-off nonce,
        so a refused sender leaves no state behind."""
        peeked = peek_call(body)
        if peeked is None:
            return
        t, i, re = peeked
        if router and t == "hello" and type(i) is int and 0 <= i < 1 << 63:
            head = Head(self.address, peer, os.urandom(16), 1)
            try:
                self._router.send_multipart([rid] + seal(Refuse(re=i, why=[why[:1024]]), head, self.secret),
                                            zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        elif not router and (fut := self._calls.waiting(peer, re)) is not None:
            fut.set_exception(ConnectError(
                f"prefill rank {peer} at {self._dealer_at.get(peer, '?')} answered the handshake with a message "
                f"that fails our checks ({why}): is the shared secret the same on both sides?"))

    def _heartbeat(self, now: float) -> None:
        for peer in self._dealers:
            self._send_now(peer, Ping())
        for peer, seen in list(self._seen.items()):
            if peer not in self._lost and now - seen > self.heartbeat.timeout:
                self._lost.add(peer)
                try:
                    self.handler.on_peer_lost(peer, f"silent for {now - seen:.1f}s (heartbeat timeout "
                                                    f"{self.heartbeat.timeout}s)")
                except Exception:
                    log.exception("control handler failed on a lost peer")
        self._rx.evict_idle(now, self._keep)
        for key in [k for k in self._tx if k[0] == "r" and k not in self._rx]:   # replies to forgotten peers
            del self._tx[key]
