"""The control channel: one ZMQ ROUTER (answers) and a DEALER per peer (requests) served by
one I/O thread, with heartbeats that find a silent peer.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future

import msgpack
import zmq

from ..errors import ConnectError
from .wire import MAX_MESSAGE, decode, encode

log = logging.getLogger("kvxfer.control")


# ------------------------------------------------------------------------------------
# The control channel
# ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    interval: float = 1.0    # decode pings each prefill rank this often; prefill answers
    timeout: float = 5.0     # a peer silent this long is lost (its requests fail)

    def __post_init__(self):
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"heartbeat interval {self.interval}s must be > 0 and below timeout {self.timeout}s")


class ControlChannel:
    """One rank's control sockets and the thread that owns them (ZMQ sockets are not thread-safe).

    ``handler`` gets, on the channel thread: ``on_message(peer, msg)``, ``on_peer_lost(peer, why)``
    and ``on_tick(now) -> seconds until it wants the next tick``. It must not block.
    Prefill passes ``bind``; decode calls ``connect`` per prefill rank and is the side that pings.
    """

    def __init__(self, handler, *, secret: bytes | None, heartbeat: Heartbeat, bind: str | None = None,
                 identity: str = "", name: str = "ctl"):
        self.handler, self.secret, self.heartbeat = handler, secret, heartbeat
        self.identity = identity
        self.dropped: collections.Counter[str] = collections.Counter()
        self._ctx = zmq.Context(io_threads=1)
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._by_sock: dict[zmq.Socket, str] = {}
        self._seen: dict[str, float] = {}        # peer -> last message time (watched peers only)
        self._lost: set[str] = set()
        self._outbox: collections.deque = collections.deque()
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.address = ""
        if bind is not None:
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unknown peer: an error, not a silent drop
            try:
                self._router.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise ConnectError(f"control channel cannot bind {bind}: {e}") from None
            self.address = self._router.last_endpoint.decode()
            self._poller.register(self._router, zmq.POLLIN)
        self._closed = self._signaled = False
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-{name}", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 0
        s.sndhwm = s.rcvhwm = 1 << 17   # 1,000s of requests in flight, each a few messages
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE + 64)
        return s

    # -- any thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        # One byte per wake-up, not per message: each write hands the GIL to the channel thread,
        # so a burst of sends costs one hand-over. The channel thread needs no wake from itself.
        if self._signaled or threading.current_thread() is self._thread:
            return
        self._signaled = True
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:   # pipe full: the thread is awake anyway
            pass

    def connect(self, peer: str, address: str) -> None:
        """Decode side: open a DEALER to a prefill rank's control address (idempotent)."""
        self._outbox.append(("connect", peer, address))
        self._wake()

    def send(self, peer: str, msg: Mapping, urgent: bool = True) -> None:
        """Queue a message for ``peer``; never blocks. Lost if the peer is gone (heartbeats tell).
        ``urgent=False`` leaves it for the channel's next turn (within a tick, <= 50 ms) instead of
        waking the channel thread, which costs the caller a GIL hand-over on the hot path."""
        self._outbox.append(("send", peer, msg))
        if urgent:
            self._wake()

    def call(self, peer: str, msg: dict, timeout: float) -> dict:
        """Send ``msg`` and wait for the reply that names it (``re``); ConnectError on timeout."""
        fut: Future = Future()
        i = next(self._ids)
        self._calls[i] = fut
        self.send(peer, {**msg, "i": i})
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise ConnectError(f"no answer from {peer} within {timeout}s") from None
        finally:
            self._calls.pop(i, None)

    def watch(self, peer: str) -> None:
        """Start heartbeat accounting for ``peer`` (prefill: after an accepted HELLO)."""
        self._outbox.append(("watch", peer, None))
        self._wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- channel thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_ping, wait = 0.0, 0.0
        try:
            while not self._closed:
                events = dict(self._poller.poll(max(0, int(wait * 1000))))
                self._signaled = False    # before the outbox is flushed: a later send wakes us again
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._flush()
                for sock in [s for s in events if s is not self._wake_r]:
                    self._receive(sock)
                now = time.monotonic()
                if now >= next_ping:
                    self._heartbeat(now)
                    next_ping = now + self.heartbeat.interval / 2
                wait = min(max(self.handler.on_tick(now), 0.0), next_ping - now)
        except Exception:
            log.exception("control channel thread crashed")
        finally:
            try:
                self._flush()    # what close() left behind (e.g. the aborts of a closing endpoint)
            except Exception:
                pass
            for s in [self._router, *self._dealers.values()]:
                if s is not None:
                    s.close(linger=0)
            self._ctx.term()

    def _flush(self) -> None:
        while self._outbox:
            op, peer, arg = self._outbox.popleft()
            if op == "connect":
                if peer not in self._dealers:
                    s = self._socket(zmq.DEALER)
                    s.setsockopt(zmq.IDENTITY, self.identity.encode())
                    s.connect(arg)
                    self._dealers[peer] = s
                    self._by_sock[s] = peer
                    self._poller.register(s, zmq.POLLIN)
                self._seen[peer] = time.monotonic()
            elif op == "watch":
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            else:
                self._send_now(peer, arg)

    def _send_now(self, peer: str, msg: Mapping) -> None:
        frames = encode(msg, self.secret)
        try:
            if peer in self._dealers:
                self._dealers[peer].send_multipart(frames, zmq.NOBLOCK)
            elif self._router is not None:
                self._router.send_multipart([peer.encode()] + frames, zmq.NOBLOCK)
            else:
                self.dropped["unknown peer"] += 1
        except zmq.ZMQError as e:   # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.dropped[f"send failed: {e.strerror}"] += 1

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(4096):   # bounded, so a flood cannot starve ticks and heartbeats
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if sock is self._router:
                rid, frames = frames[0], frames[1:]
                try:
                    peer = rid.decode()
                except UnicodeDecodeError:
                    self.dropped["bad identity"] += 1
                    continue
            else:
                peer = self._by_sock[sock]
            try:
                msg = decode(frames, self.secret)
            except ValueError as e:
                self.dropped[str(e).split(":")[0]] += 1
                log.warning("dropped control message from %s: %s", peer, e)
                if len(frames) == 2:
                    self._on_refused(sock, peer, frames[1], str(e))
                continue
            if peer in self._seen:
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            t = msg["t"]
            if t == "ping":
                if peer in self._seen:
                    self._send_now(peer, {"t": "pong"})
                continue
            if t == "pong":
                continue
            if "re" in msg and msg["re"] in self._calls:
                fut = self._calls.get(msg["re"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            try:
                self.handler.on_message(peer, msg)
            except Exception:
                log.exception("control handler failed on %s from %s", t, peer)

    def _on_refused(self, sock: zmq.Socket, peer: str, body: bytes, why: str) -> None:
        """A handshake message failed its checks: say why, so launch fails loudly, not by timeout.
        Only the message's id is read from the untrusted body; nothing else is used."""
        try:
            msg = msgpack.unpackb(body, raw=False, max_str_len=1 << 20, max_bin_len=MAX_MESSAGE,
                                  max_array_len=1 << 16, max_map_len=1 << 16, max_ext_len=0)
        except Exception:
            return
        if not isinstance(msg, dict):
            return
        if sock is self._router and msg.get("t") == "hello" and isinstance(msg.get("i"), int):
            self._send_now(peer, {"t": "refuse", "re": msg["i"], "why": [why]})
        elif sock is not self._router and isinstance(msg.get("re"), int) and msg["re"] in self._calls:
            fut = self._calls.get(msg["re"])
            if fut is not None and not fut.done():
                fut.set_exception(ConnectError(f"prefill rank {peer} answered the handshake with a message "
                                               f"that fails our checks ({why}): is the shared secret the same "
                                               f"on both sides?"))

    def _heartbeat(self, now: float) -> None:
        for peer in self._dealers:
            self._send_now(peer, {"t": "ping"})
        for peer, seen in list(self._seen.items()):
            if peer not in self._lost and now - seen > self.heartbeat.timeout:
                self._lost.add(peer)
                try:
                    self.handler.on_peer_lost(peer, f"silent for {now - seen:.1f}s (heartbeat timeout "
                                                    f"{self.heartbeat.timeout}s)")
                except Exception:
                    log.exception("control handler failed on a lost peer")
