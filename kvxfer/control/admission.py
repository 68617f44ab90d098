"""Who may hold a connection to the embedded registry, and for how long (issue 34: 300 connections
reopened as soon as they were closed held every slot; honest clients got no answer and a live
rank's registration expired).

Rules, checked when a connection is accepted (before a byte is read):

- every address has a share: ``per_address`` connections, plus ``per_rank`` for each rank
  registered from it (a host of eight ranks heartbeats and watches on its own connections);
- all addresses together hold at most ``max_connections``, and addresses with no registered rank
  together at most ``max_connections - reserved``: the rest is kept for registered ranks, so a
  flood from many addresses still leaves every live rank room to heartbeat;
- a connection must finish each request's headers within ``header_timeout`` of its first byte
  (and the first within ``header_timeout`` of connecting), and one idle between requests is closed
  after the server's keep-alive timeout (aiohttp's).

A connection past its share is closed at once, which costs the flooder its own share only.

Who calls what: ``BootstrapServer`` makes one ``Admission`` and wraps every accepted connection in
a ``Guard`` (event-loop thread); the registry's ``by_remote`` counts say which addresses hold ranks.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping


class Admission:
    """The connection counts per address, and the admission rule (see the module docstring)."""

    def __init__(self, *, max_connections: int, per_address: int, per_rank: int, reserved: int,
                 registered: Mapping[str, int]):
        self.max_connections, self.per_address, self.per_rank = max_connections, per_address, per_rank
        self.reserved, self.registered = reserved, registered
        self.open: collections.Counter[str] = collections.Counter()
        self.total = self.unregistered = 0
        self.refused = 0            # connections closed at accept, or cut for slow headers

    def share(self, address: str) -> int:
        return self.per_address + self.per_rank * self.registered.get(address, 0)

    def admit(self, address: str) -> bool | None:
        """None: refused; else whether the connection counts as from a registered address."""
        ranks = self.registered.get(address, 0)
        if self.open[address] >= self.share(address) or self.total >= self.max_connections or \
                (not ranks and self.unregistered >= self.max_connections - self.reserved):
            self.refused += 1
            return None
        self.open[address] += 1
        self.total += 1
        self.unregistered += not ranks
        return bool(ranks)

    def release(self, address: str, registered: bool) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]
        self.total -= 1
        self.unregistered -= not registered


class _Watched:
    """The transport aiohttp writes to: tells the guard a response went out (the next byte read
    starts a new request, whose headers are timed)."""
    __slots__ = ("_t", "_g")

    def __init__(self, transport: asyncio.Transport, guard: "Guard"):
        self._t, self._g = transport, guard

    def write(self, data) -> None:
        self._g.answered = True
        self._t.write(data)

    def writelines(self, data) -> None:
        self._g.answered = True
        self._t.writelines(data)

    def __getattr__(self, name):
        return getattr(self._t, name)


class Guard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol: admission (``Admission``) and the header timeout."""

    def __init__(self, admission: Admission, factory: Callable[[], asyncio.Protocol], header_timeout: float):
        self.admission, self.factory, self.header_timeout = admission, factory, header_timeout
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.address, self.registered = "", False
        self.headers_done, self.answered, self.tail = False, False, b""

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "local"
        admitted = self.admission.admit(self.address)
        if admitted is None:
            transport.abort()
            return
        self.registered = admitted
        self.inner = self.factory()
        self.inner.connection_made(_Watched(transport, self))
        self._arm()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.headers_done, self.answered, self.tail = False, False, b""
        self.timer = asyncio.get_running_loop().call_later(self.header_timeout, self._slow)

    def _slow(self) -> None:
        if not self.headers_done and self.transport is not None:
            self.admission.refused += 1
            self.transport.abort()

    def data_received(self, data):
        if self.inner is None:
            return
        if self.answered:     # the first byte after an answer: a new request, its headers timed
            self._arm()
        if not self.headers_done:
            seen = self.tail + data[:65536]
            if b"\r\n\r\n" in seen:
                self.headers_done = True
                self.timer.cancel()
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc):
        if self.inner is None:
            return
        self.admission.release(self.address, self.registered)
        if self.timer is not None:
            self.timer.cancel()
        self.inner.connection_lost(exc)
        self.inner = None

    def pause_writing(self):
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self):
        if self.inner is not None:
            self.inner.resume_writing()


__all__ = ["Admission", "Guard"]
