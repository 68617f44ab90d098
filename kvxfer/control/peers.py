"""Per-connection replay state of a control channel, bounded: which sender, nonce and sequence
numbers each connection has used, and the nonces of connections already forgotten.

Who calls what: only ``ControlChannel`` (``kvxfer.control.channel``), on its thread, once per
message received (``admit``), per heartbeat (``evict_idle``) and when a peer is dropped (``drop``).
``PendingCalls``: the calls a channel's caller waits on (``ControlChannel.call`` opens one in the
caller's thread; the channel thread answers or fails it).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import ConfigError
from .messages import Drop, WireError
from .wire import Head


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChannelLimits:
    """Caps on what peers can make a channel hold."""
    max_peers: int = 4096          # identities with replay state at once (watched ones included)
    idle_timeout: float = 30.0     # a peer that never handshaked is forgotten after this silence
    spent_nonces: int = 65536      # nonces of forgotten connections still refused (replays)

    def __post_init__(self):
        if self.max_peers < 1 or self.idle_timeout <= 0 or self.spent_nonces < 1:
            raise ConfigError(f"channel limits must be positive, got {self}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    interval: float = 1.0    # decode pings each prefill rank this often; prefill answers
    timeout: float = 5.0     # a peer silent this long is lost (its requests fail)

    def __post_init__(self):
        if not 0 < self.interval < self.timeout:
            raise ConfigError(f"heartbeat interval {self.interval}s must be > 0 and below timeout {self.timeout}s")


REPLAY_WINDOW = 8192    # a message overtaken by more than this many later ones is refused as a replay


class _Rx:
    """What we accept from one sending connection: any seq above the highest seen, or one of the
    ``REPLAY_WINDOW`` below it not seen yet (bit i of ``mask``: seq - i seen), as IPsec does, so
    messages delayed and overtaken in the network still count, each once."""
    __slots__ = ("sender", "nonce", "seq", "mask", "last")

    def __init__(self, sender: str, nonce: bytes, seq: int, now: float):
        self.sender, self.nonce, self.seq, self.mask, self.last = sender, nonce, seq, 1, now

    def admit(self, seq: int) -> bool:
        if seq > self.seq:
            self.mask = ((self.mask << (seq - self.seq)) | 1) & ((1 << REPLAY_WINDOW) - 1) \
                if seq - self.seq < REPLAY_WINDOW else 1
            self.seq = seq
            return True
        back = self.seq - seq
        if back >= REPLAY_WINDOW or self.mask >> back & 1:
            return False
        self.mask |= 1 << back
        return True


class ReplayGuard:
    """``(side, peer)`` -> the connection it speaks on; at most ``limits.max_peers`` of them."""

    def __init__(self, limits: ChannelLimits):
        self.limits = limits
        self._rx: collections.OrderedDict[tuple[str, str], _Rx] = collections.OrderedDict()
        self._spent: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rx)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._rx

    def _spend(self, nonce: bytes) -> None:
        self._spent[nonce] = None
        while len(self._spent) > self.limits.spent_nonces:
            self._spent.popitem(last=False)

    def is_new_connection(self, key: tuple[str, str], head: Head) -> bool:
        """``head`` opens a connection on ``key`` (none known, or another nonce than the known one)."""
        rx = self._rx.get(key)
        return rx is None or rx.nonce != head.nonce

    def admit(self, key: tuple[str, str], head: Head, now: float, *, same_sender: bool,
              keep: Callable[[str], bool], spare: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
        """Accept ``head`` on connection ``key`` or raise WireError (REPLAY, PEERS); returns the
        connections forgotten to make room. ``same_sender``: the signed sender may not change within
        a connection; ``keep(peer)``: peers not evicted when idle; ``spare(peer)``: peers not evicted
        even when the table is full (else ``keep``)."""
        rx = self._rx.get(key)
        if rx is not None and rx.nonce == head.nonce:
            if (same_sender and head.sender != rx.sender) or not rx.admit(head.seq):
                raise WireError(Drop.REPLAY, f"seq {head.seq} (highest {rx.seq})")
            rx.last = now
            self._rx.move_to_end(key)
            return []
        if head.nonce in self._spent:
            raise WireError(Drop.REPLAY, "a connection nonce already used")
        gone: list[tuple[str, str]] = []
        if rx is None and len(self._rx) >= self.limits.max_peers:
            gone = self.evict_idle(now, keep, force=True) or self.evict_idle(now, spare or keep, force=True)
            if len(self._rx) >= self.limits.max_peers:
                raise WireError(Drop.PEERS, f"{len(self._rx)} peers (ChannelLimits.max_peers)")
        if rx is not None:
            self._spend(rx.nonce)     # the peer's new connection: the old one cannot come back
        self._rx[key] = _Rx(head.sender, head.nonce, head.seq, now)
        self._rx.move_to_end(key)
        return gone

    def drop(self, key: tuple[str, str]) -> bool:
        rx = self._rx.pop(key, None)
        if rx is not None:
            self._spend(rx.nonce)
        return rx is not None

    def evict_idle(self, now: float, keep: Callable[[str], bool], force: bool = False) -> list[tuple[str, str]]:
        """Forget connections of peers not kept (no handshake) once idle ``idle_timeout``;
        ``force``: the least recently heard one now. Returns the keys forgotten."""
        out = []
        for key, rx in list(self._rx.items()):
            if keep(key[1]):
                continue
            if force or now - rx.last > self.limits.idle_timeout:
                self.drop(key)
                out.append(key)
                if force:
                    break
        return out


class Call:
    """One call in flight (``ControlChannel.start_call``): ``future`` gets the reply, or the
    channel's ConnectError; ``close`` forgets it (a reply after that is dropped). A context manager."""

    def __init__(self, calls: "PendingCalls", peer: str, i: int, future: Future,
                 no_answer: Callable[[float], Exception]):
        self.peer, self.id, self.future = peer, i, future
        self._calls, self._no_answer = calls, no_answer

    def result(self, timeout: float):
        """Wait for the reply; ConnectError ("no answer from ...") when none came within ``timeout`` s."""
        try:
            return self.future.result(timeout)
        except TimeoutError:
            raise self._no_answer(timeout) from None

    def timed_out(self, timeout: float) -> Exception:
        """The error of this call when its reply did not come within ``timeout`` seconds."""
        return self._no_answer(timeout)

    def close(self) -> None:
        self._calls.close(self.id)

    def __enter__(self) -> "Call":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PendingCalls:
    """Calls waiting for the reply that names them (``re``), by call id: each is (peer, future).
    ``open``/``close`` run in the caller's thread, the rest on the channel thread; a dict's single
    operations are atomic, so no lock is needed."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[str, Future]] = {}
        self._ids = itertools.count(1)

    def open(self, peer: str, no_answer: Callable[[float], Exception]) -> Call:
        i, fut = next(self._ids), Future[object]()
        self._calls[i] = (peer, fut)
        return Call(self, peer, i, fut, no_answer)

    def close(self, i: int) -> None:
        self._calls.pop(i, None)

    def waiting(self, peer: str, i: object) -> Future | None:
        """The future of call ``i`` to ``peer`` if it is still waiting (``i`` comes from a peer: any value)."""
        call = self._calls.get(i) if type(i) is int else None
        return call[1] if call is not None and call[0] == peer and not call[1].done() else None

    def answer(self, peer: str, i: object, reply: object) -> bool:
        """Give call ``i`` its reply; False when ``peer`` has no such call (a late duplicate of an
        answered one is ignored, True)."""
        call = self._calls.get(i) if type(i) is int else None
        if call is None or call[0] != peer:
            return False
        if not call[1].done():
            call[1].set_result(reply)
        return True

    def fail(self, exc: Exception, peer: str | None = None) -> None:
        """Fail every waiting call (to ``peer``, or to anyone) with ``exc``."""
        for p, fut in list(self._calls.values()):
            if (peer is None or p == peer) and not fut.done():
                fut.set_exception(exc)
