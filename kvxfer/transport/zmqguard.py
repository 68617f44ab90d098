"""What every ZMQ socket a peer can reach needs: authentication at the ZMTP handshake (a ZAP
handler, ZeroMQ RFC 27, for one ``zmq.Context``), and memory given back once a connection ends.

Why: libzmq buffers a message whole before the application sees any of it, and its high-water
mark counts whole messages, so the parts of a message that never ends are buffered without a
bound (measured: 1 GiB of 1 MiB parts, MORE set, took a ROUTER with ``RCVHWM`` 16 from 16 MiB to
1,044 MiB RSS). A socket that authenticates at the handshake buffers nothing from a peer that
has not proven who it is: before the handshake's end, libzmq holds at most the one frame being
read (at most ``ZMQ_MAXMSGSIZE`` bytes) per connection, for at most ``ZMQ_HANDSHAKE_IVL``, and a
peer speaking another mechanism (or ZMTP 1.0/2.0) is dropped after its greeting (measured: four
connections each 62 MiB into a 63 MiB handshake frame held 248 MiB; with ``MAXMSGSIZE`` 1 MiB
nothing measurable).

Who calls what, and when:
    ``ZapHandler(ctx, check)``   the thread that owns ``ctx``'s sockets, before any server socket
                                 of ``ctx`` binds (without a handler, ``server_socket`` sockets
                                 refuse every peer: fail closed).
    ``server_socket(sock)``      that thread, before ``bind``: ZAP on, with domain ``DOMAIN``.
    ``handler.socket``           polled (POLLIN) next to the thread's other sockets.
    ``handler.serve()``          when it is readable: answers the queued requests, each with
                                 ``check(mechanism, credentials)`` -> the peer's user id (str), or
                                 None to refuse. ``check`` runs on this thread and must be quick.
    ``handler.close()``          that thread, when it closes the context's sockets.
Every message from an accepted connection carries the user id ``check`` gave it:
``frame.get("User-Id")`` on a frame received with ``copy=False``.

Connections to peers that vanished are closed by TCP, not by ZMTP heartbeats (``close_vanished``).

Memory after a connection ends (``FreeAfterClose``): what libzmq buffered for a connection is freed
when it closes, but glibc keeps freed heap memory in its arenas (measured: a victim that took a
512 MiB flood on a port open to anyone stayed 512 MiB larger after the attacker left, with or
without raised malloc thresholds; ``malloc_trim(0)`` gave it all back in well under a
millisecond per call when little is free). So the thread that owns a socket watches it for ended
connections and then trims, at most every ``TRIM_EVERY`` seconds:
    ``FreeAfterClose(sock)``     that thread, after the socket is made.
    ``watch.socket``             polled (POLLIN) next to the thread's other sockets.
    ``watch.on_events()``        when it is readable.
    ``watch.tick(now)``          on each of the thread's ticks: trims when a connection ended,
                                 ``SETTLE`` s after it (``due`` until then: the thread ticks on).
    ``watch.close(sock)``        before ``sock`` is closed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable, Sequence

import zmq

log = logging.getLogger("kvxfer.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # fixed by RFC 27: one handler per context
DOMAIN = b"kvxfer"
_PER_TURN = 256          # requests answered per ``serve`` call, so a connect flood cannot starve the loop
TRIM_EVERY = 5.0         # seconds between two trims at most
SETTLE = 0.1             # seconds from a connection's end to the trim: libzmq frees its buffers when the
                         # owning thread next touches the socket (a trim at once found them still held)

Check = Callable[[bytes, Sequence[bytes]], "str | None"]


def close_vanished(sock: zmq.Socket, timeout: float) -> None:
    """Close ``sock``'s connections to peers that vanished (host down, cable cut), so their fds
    are freed: TCP keepalive probes an idle one (after ``timeout``, 1 s apart), and ``TCP_MAXRT``
    (Linux's ``TCP_USER_TIMEOUT``: 3 x ``timeout``) ends one whose data or probes went
    unacknowledged that long. The kernel answers both, so a peer process that is only stopped
    keeps its connections: whether it is dead is the heartbeats' business (silence is not death).
    3 x ``timeout``, not less: Linux also ends a connection whose peer advertised a zero window
    (back-pressure: the peer reads slower than we write) for that long.

    Not ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL``): libzmq 4.3.5 aborts the process with them
    (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``) when a connection whose
    input is stopped by the high-water mark is reset and the heartbeat timer fires next: the
    reset marks the engine failed without ending it, and the timer writes a PING on it
    (``tests/test_zmq_reset.py``: 8 of 8 victims aborted; seen in CI when a partition healed).
    A peer that stops reading is exactly what the high-water mark is for, so that must not kill
    us."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, round(timeout)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.TCP_MAXRT, max(1000, int(3 * timeout * 1000)))


def server_socket(sock: zmq.Socket) -> None:
    """Ask ZAP about every peer of ``sock`` (set before ``bind``); refused when no handler answers."""
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


class ZapHandler:
    """The ZAP handler of one context, served by the thread that owns the context's sockets.
    ``accepted`` and ``refused`` count handshakes (read from any thread: a snapshot)."""

    def __init__(self, ctx: zmq.Context, check: Check):
        self._check = check
        self.accepted = self.refused = 0
        self.socket = ctx.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)

    def serve(self) -> None:
        """Answer the requests queued now (at most ``_PER_TURN``), never waiting."""
        for _ in range(_PER_TURN):
            try:
                req = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(req))

    def _answer(self, req: list[bytes]) -> list[bytes]:
        # [version, request id, domain, address, routing id, mechanism, credentials...]: libzmq's own
        # request (only this process can reach an inproc endpoint); checked all the same.
        if len(req) < 6 or req[0] != b"1.0":
            return [b"1.0", req[1] if len(req) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        user = None
        if req[2] == DOMAIN:
            try:
                user = self._check(req[5], req[6:])
            except Exception:   # a bug in the check refuses the peer; it never takes the thread down
                log.exception("ZAP check failed")
        if user is None:
            self.refused += 1
            return [b"1.0", req[1], b"400", b"not admitted", b"", b""]
        self.accepted += 1
        return [b"1.0", req[1], b"200", b"OK", user.encode(), b""]

    def close(self) -> None:
        self.socket.close(linger=0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc: nothing to give back this way
        return None


_TRIM = _malloc_trim()


class FreeAfterClose:
    """Give freed heap memory back to the OS once a connection of ``sock`` ended (see the module
    docstring). Owned by the thread that owns ``sock``."""

    def __init__(self, sock: zmq.Socket):
        self.socket = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.due, self._due_at, self._last = False, 0.0, 0.0
        self.trims = 0

    def on_events(self) -> None:
        for _ in range(_PER_TURN):
            try:
                self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.due, self._due_at = True, time.monotonic() + SETTLE

    def tick(self, now: float) -> None:
        """``now``: ``time.monotonic()``."""
        if self.due and now >= self._due_at and now - self._last >= TRIM_EVERY:
            self.due, self._last = False, now
            self.trims += 1
            if _TRIM is not None:
                _TRIM(0)

    def close(self, sock: zmq.Socket) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)
