"""The zmq transport's context and sockets: made with the bounds every socket a peer can reach needs.

Who calls what: ``ZMQTransport`` makes ``Sockets`` (and its context) at construction; from then
on only the I/O thread touches it: ``bind`` once at the loop's start (the ROUTER, behind ZAP when
admission is required; ``kvxfer.transport.zmqguard``), ``dealer`` per peer the sender connects,
``on_events`` with each poll's events, ``tick`` per loop tick, ``close`` at the end.

Bounds: each part a peer sends is at most ``ZMQ_MAXMSGSIZE`` (a larger one drops the
connection): at the ROUTER the largest part our options make (``ZMQOptions.part_limit``), at a
DEALER one reply. A message's parts are not bounded by libzmq; with admission "required" only
admitted senders get that far.
"""
from __future__ import annotations

import zmq

from kvxfer.addresses import advertise_address
from kvxfer.transport.admission import Admissions
from kvxfer.transport.zmqguard import FreeAfterClose, ZapHandler, close_vanished, server_socket

from .addresses import bind
from .options import ZMQOptions
from .protocol import MAX_REPLY

_REPLY_HWM = 1 << 20             # queued replies (tiny) before a ROUTER would drop one

# The flags of the hot path as plain ints: pyzmq's are enum members, and each ``&`` or ``|`` on
# one makes a new member (~0.6 us; a dozen a transfer on each side).
POLLIN, POLLOUT, NOBLOCK, SNDMORE, EVENTS = (int(f) for f in (zmq.POLLIN, zmq.POLLOUT, zmq.NOBLOCK, zmq.SNDMORE,
                                                             zmq.EVENTS))


class Sockets:
    """``router`` (None until ``bind``), ``poller`` (every socket the loop waits on), ``bound``
    (what the ROUTER bound) and ``advertised`` (what peers are told)."""

    def __init__(self, options: ZMQOptions, admissions: Admissions, sender_id: str):
        self.options, self.admissions, self.sender_id = options, admissions, sender_id
        self.ctx = zmq.Context(io_threads=1)
        self.poller = zmq.Poller()
        self.router: zmq.Socket | None = None
        self.bound = self.advertised = ""
        self._zap: ZapHandler | None = None             # answers ZAP ("required")
        self._freed: FreeAfterClose | None = None       # trims the heap after a sender's connection ends

    def socket(self, kind: int) -> zmq.Socket:
        o = self.options
        s = self.ctx.socket(kind)
        s.linger = 0
        # Data flows DEALER -> ROUTER, bounded by the window. Replies flow back and must never
        # meet a high-water mark: there a ROUTER drops them silently (a lost ack).
        s.sndhwm, s.rcvhwm = (o.window, _REPLY_HWM) if kind == zmq.DEALER else (_REPLY_HWM, o.window)
        # A vanished peer's connection closes (its fd is freed), by TCP. A DEALER's timeout is twice
        # ours: the sender closes a silent peer's DEALER (linger 0) at heartbeat_timeout, and
        # libzmq 4.3.5 aborts the process (session_base.cpp clean_pipes, EAGAIN) when the
        # connection ends while that close is under way and a multipart message is half sent
        # (the peer stopped reading). Seen 1 in 2 suite runs, with ZMTP heartbeats' timeout.
        close_vanished(s, o.heartbeat_timeout * (2 if kind == zmq.DEALER else 1))
        s.setsockopt(zmq.MAXMSGSIZE, o.part_limit if kind == zmq.ROUTER else MAX_REPLY)
        return s

    def bind(self) -> None:
        """The ROUTER, bound where the options say (raises zmq.ZMQError or ValueError)."""
        router = self.socket(zmq.ROUTER)
        if self.admissions.required:   # the handler first: without one, the ROUTER refuses everyone
            self._zap = ZapHandler(self.ctx, self._zap_check)
            self.poller.register(self._zap.socket, zmq.POLLIN)
            router.plain_server = True
            server_socket(router)
            router.setsockopt(zmq.HANDSHAKE_IVL, int(max(self.options.connect_timeout, 5.0) * 1000))
        try:
            self.bound = bind(router, self.options.endpoint, self.options.ports)
            self.advertised = advertise_address(self.bound, self.options.advertise, remote=self.options.remote,
                                                setting="advertise= (zmq transport option)")
        except (zmq.ZMQError, ValueError):
            router.close(linger=0)
            raise
        self.router = router
        self._freed = FreeAfterClose(router)
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(self._freed.socket, zmq.POLLIN)

    def _zap_check(self, mechanism: bytes, credentials) -> str | None:
        """ZAP: a sender's PLAIN user name (its transport id) and password (its admission token)."""
        if mechanism != b"PLAIN" or len(credentials) != 2:
            return None
        try:
            sender = credentials[0].decode()
        except UnicodeDecodeError:
            return None
        return self.admissions.check(sender, credentials[1])

    def dealer(self, endpoint: str, token: bytes = b"") -> zmq.Socket:
        """A DEALER connected to a receiver (raises zmq.ZMQError for an endpoint zmq refuses)."""
        sock = self.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a connection that is down
        if token:   # the receiver requires admission: our id and its token, at the handshake (PLAIN)
            sock.plain_username, sock.plain_password = self.sender_id.encode(), token
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def on_events(self, events: dict) -> None:
        """ZAP requests and ended connections, from one poll's events."""
        if self._zap is not None and self._zap.socket in events:
            self._zap.serve()
        if self._freed is not None and self._freed.socket in events:
            self._freed.on_events()

    def tick(self, now: float) -> None:
        if self._freed is not None:
            self._freed.tick(now)

    def trim_due(self) -> bool:
        """A connection ended and the heap is not trimmed yet (``FreeAfterClose``): keep ticking."""
        return self._freed is not None and self._freed.due

    def close(self, dealers: list[zmq.Socket]) -> None:
        """Every socket, then the context (queued messages are dropped: nothing reads a source after)."""
        if self._freed is not None and self.router is not None:
            self._freed.close(self.router)
        for s in [self.router, *dealers]:
            if s is not None:
                s.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self.ctx.term()
