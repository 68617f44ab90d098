"""The machinery every network transport shares, so a transport file holds only what is its own.

Who uses what, and when
-----------------------
Caller threads (``submit``, ``connect``, ``close``, ``forget`` of a transport):
    ``CommandQueue.put(cmd)``   hand one typed command (``Submit``, ``Connect``, ``Call``,
                                ``Close``, ``Crash``) to the transport's I/O thread and wake it.
The I/O thread (one per transport; it alone touches sockets, workers and in-flight state):
    ``IOThread``                runs the transport's loop; an exception that escapes the loop is
                                a bug: it is logged, the transport is marked ``broken`` and the
                                transport's ``on_crash`` fails every transfer the thread owned.
    ``CommandQueue.take(n)``    the commands queued so far (at most ``n`` per loop turn).
    ``CommandQueue.fail_all``   on the way out: every command still queued fails (no waiter hangs).
    ``StagingPool``             a fixed ring of staging frames for packed runs, allocated up front
                                (pinned for device regions), never growing: exhausted, the I/O
                                path waits; a frame handed to the network is reused only once the
                                network let go of it (``until.done``). Counted in kvxfer.metrics.
    ``split_long_runs``         runs cut into pieces of at most one frame (vectorized).
    ``merge_in_stream``         runs of one byte stream that continue each other, as one run.
    ``runs_inside``             bounds of runs against region sizes, before a byte is read or sent.
    ``PeerClock``               when a peer was last heard from; silence past a timeout fails its
                                transfers (a dead peer is silent; a slow one may come back).
    ``peer_reason``             what a refusal tells the peer (grant refusals read alike: no oracle).
Tests (and ``kvxfer_transports.faulty``): ``CommandQueue.put(Crash(error))`` makes the I/O thread
raise ``error`` at its next turn, as a bug would.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import TransportError
from ..grant import Reason
from ..metrics import record_staging
from ..plan import merge_runs
from .base import TransferHandle, peer_failed

log = logging.getLogger("kvxfer.transport")


# ------------------------------------------------------------------------------------
# Commands: caller threads -> I/O thread. One type each, read by name, never by index.
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """A transfer to start: ``work`` is the transport's own prepared form of the plan."""
    peer: str
    request_id: str
    work: Any
    handle: TransferHandle


@dataclass(frozen=True, slots=True)
class Connect:
    """Reach a peer; ``future`` gets the peer id (or the error)."""
    target: Any
    future: Future


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(*args)`` on the I/O thread; ``future`` (when given) gets its result or error."""
    fn: Callable[..., Any]
    args: tuple = ()
    future: Future | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """Stop the loop: fail what is open, free what the thread made."""


@dataclass(frozen=True, slots=True)
class Crash:
    """Fault hook for tests: the I/O thread raises ``error`` at its next turn, as a bug would."""
    error: BaseException


Command = Submit | Connect | Call | Close | Crash


class CommandQueue:
    """Commands for one I/O thread. ``put`` from any thread; ``take`` and ``fail_all`` on the
    I/O thread only. ``wake`` (given by the transport) interrupts the thread's wait."""

    def __init__(self, wake: Callable[[], None]):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = wake

    def put(self, cmd: Command) -> None:
        self._q.put(cmd)
        self._wake()

    def empty(self) -> bool:
        return self._q.empty()

    def take(self, limit: int = 1 << 30) -> list[Command]:
        """Up to ``limit`` commands, oldest first, without waiting."""
        out: list[Command] = []
        while len(out) < limit:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                break
        return out

    def fail_all(self, why: str) -> None:
        """Every command still queued fails with ``why`` (after the loop ended)."""
        for cmd in self.take():
            fail_command(cmd, why)


def fail_command(cmd: Command, why: str) -> None:
    """A command the I/O thread will never run: its waiter learns why."""
    if isinstance(cmd, Submit):
        cmd.handle.finish(peer_failed(cmd.request_id, why), release=True)
    elif isinstance(cmd, (Connect, Call)) and cmd.future is not None and not cmd.future.done():
        cmd.future.set_exception(TransportError(why))


class PipeWaker:
    """A self-pipe an I/O thread polls next to its sockets: ``wake`` from any thread, ``clear`` on
    the I/O thread once woken, before it looks at what it was woken for. ``close`` after the
    thread ended. One byte per wake-up, not per call: each write hands the GIL to the woken
    thread, so a burst of ``wake`` calls costs one hand-over."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._signaled = False

    def wake(self) -> None:
        if self._signaled:   # a byte is on its way; ``clear`` resets this before the thread looks
            return
        self._signaled = True
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):  # full: the thread is awake already; closed: it ended
            pass

    def clear(self) -> None:
        self._signaled = False
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class IOThread:
    """The one thread of a transport that owns its network state.

    ``body()`` is the transport's loop: it returns when a ``Close`` command ended it. An
    exception that escapes ``body`` is a bug (every message is validated and refused inside the
    loop): it is logged, ``broken`` says why (``error`` is the exception), and ``on_crash(reason)``
    (still on this thread) fails every transfer the thread owned. ``on_exit()`` then frees what the
    thread made, in both cases. Callers check ``broken`` before they enqueue work.
    """

    def __init__(self, name: str, body: Callable[[], None], *, on_crash: Callable[[str], None],
                 on_exit: Callable[[], None]):
        self.broken: str | None = None
        self.error: BaseException | None = None
        self._body, self._on_crash, self._on_exit = body, on_crash, on_exit
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _main(self) -> None:
        try:
            self._body()
        except BaseException as e:  # a bug: say so, and fail everything below instead of hanging
            self.error = e
            self.broken = f"I/O thread died: {type(e).__name__}: {e}"
            log.exception("%s: I/O thread died; the transport is broken", self.thread.name)
            try:
                self._on_crash(self.broken)
            except Exception:
                log.exception("%s: failing the open transfers after a crash", self.thread.name)
        finally:
            try:
                self._on_exit()
            except Exception:
                log.exception("%s: cleaning up", self.thread.name)


# ------------------------------------------------------------------------------------
# Staging blocks
# ------------------------------------------------------------------------------------
class StagingExhausted(TransportError):
    """Every frame of a staging ring is in use: the caller waits (``available``) and retries."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    cur = torch.cuda.current_device()
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


class StagingPool:
    """Staging blocks for packed runs. Two modes:

    Ring (``StagingPool(frames=N, frame_bytes=B, name=...)``, what a transport should use):
    N blocks of B bytes, allocated once by ``allocate(pin=..., device=...)`` (pinned host memory
    when the regions are on a device and the transport stages on the host, as zmq does; on the
    device itself for UCX's device frames), never more. ``get`` takes a free one (``StagingExhausted`` when
    none is: the I/O path checks ``available()`` first and, when False, waits, counted in
    ``waits``); ``put`` gives it back, busy ``until`` an object whose ``done`` turns True (a zmq
    tracker). Counted in ``kvxfer.metrics`` (frames, in use, waits) under ``name``.

    Growing (``StagingPool()``, kept for callers not yet on the ring): ``get`` returns a block of
    at least ``nbytes`` (at most 4x), reused or new; at most ``keep`` spare blocks are kept.

    Thread-safe."""

    def __init__(self, keep: int = 4, *, pin: bool = False, frames: int = 0, frame_bytes: int = 0,
                 name: str = "?"):
        self._lock = threading.Lock()
        self._spare: list[tuple[torch.Tensor, Any]] = []
        self.keep, self.pin = keep, pin
        if frames < 0 or (frames and frame_bytes <= 0):
            raise ValueError(f"a staging ring needs frames >= 1 and frame_bytes >= 1 (got {frames}, {frame_bytes})")
        self.frames, self.frame_bytes, self.name = int(frames), int(frame_bytes), name
        self._ring: list[torch.Tensor] = []
        self._index: dict[int, int] = {}          # block address -> ring slot
        self._free: list[int] = []
        self._busy: list[tuple[int, Any]] = []     # (slot, until): given back, maybe still read
        self.device = torch.device("cpu")
        self.in_use = self.waits = self.peak = 0

    # -- ring -----------------------------------------------------------------------------
    def allocate(self, pin: bool = False, device: torch.device | str = "cpu") -> None:
        """Ring mode: allocate every frame now (on ``device``; host frames pinned with ``pin``).
        Once allocated, the ring is kept while any frame is in use (the network may still read
        it), or when it is already where and as asked."""
        if not self.frames:
            return
        device = torch.device(device)
        pin = pin and device.type == "cpu"
        with self._lock:
            if self._ring and ((self.pin == pin and self.device == device) or self.in_use):
                return
        self.clear()
        self.pin, self.device = pin, device
        ring = [torch.empty(self.frame_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
                for _ in range(self.frames)]
        with self._lock:
            self._ring, self._free, self._busy = ring, list(range(len(ring))), []
            self._index = {b.data_ptr(): k for k, b in enumerate(ring)}
        record_staging(self.name, frames=len(ring))

    def _reap(self) -> None:   # lock held: busy frames the network let go of are free again
        if self._busy:
            done = [k for k, until in self._busy if until is None or until.done]
            if done:
                self._busy = [(k, u) for k, u in self._busy if not (u is None or u.done)]
                self._free += done
                self.in_use -= len(done)
                record_staging(self.name, in_use=-len(done))

    def available(self) -> bool:
        """Ring mode: is a frame free now? False counts a wait (the caller backs off and retries)."""
        if not self.frames:
            return True
        with self._lock:
            if not self._ring:
                return True   # not allocated yet: ``get`` allocates a host ring
            self._reap()
            if self._free:
                return True
            self.waits += 1
        record_staging(self.name, waits=1)
        return False

    def stats(self) -> dict:
        with self._lock:
            self._reap()
            return {"frames": len(self._ring), "in_use": self.in_use, "peak": self.peak, "waits": self.waits}

    # -- both -----------------------------------------------------------------------------
    def get(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        device = torch.device(device)
        if self.frames:
            if not self._ring:
                self.allocate(self.pin)
            if not _same_device(device, self.device) or nbytes > self.frame_bytes:
                raise ValueError(f"a staging ring holds frames of {self.frame_bytes} bytes on {self.device}: "
                                 f"{nbytes} bytes on {device} do not fit")
            with self._lock:
                self._reap()
                if not self._free:
                    raise StagingExhausted(f"all {len(self._ring)} staging frames are in use")
                k = self._free.pop()
                self.in_use += 1
                self.peak = max(self.peak, self.in_use)
            record_staging(self.name, in_use=1)
            return self._ring[k][:nbytes]
        with self._lock:
            fits = [k for k, (b, until) in enumerate(self._spare)
                    if b.device == device and nbytes <= b.numel() <= 4 * nbytes and (until is None or until.done)]
            if fits:
                k = min(fits, key=lambda k: self._spare[k][0].numel())
                return self._spare.pop(k)[0][:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=device,
                           pin_memory=self.pin and device.type == "cpu")

    def put(self, block: torch.Tensor | None, until: Any = None) -> None:
        if block is None:
            return
        with self._lock:
            if self.frames:
                k = self._index.get(block.data_ptr())
                if k is not None and k not in self._free and all(k != j for j, _ in self._busy):
                    self._busy.append((k, until))
                return
            self._spare = (self._spare + [(block, until)])[-self.keep:]

    def clear(self) -> None:
        """Drop every block (the transport ended: nothing reads them any more)."""
        with self._lock:
            self._spare = []
            freed, in_use = len(self._ring), self.in_use
            self._ring, self._index, self._free, self._busy, self.in_use = [], {}, [], [], 0
        if freed:
            record_staging(self.name, frames=-freed, in_use=-in_use)


# ------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------
# merge keys: region id above the offset bits (regions < 16 TiB)
OFF_BITS = 44
OFF_MASK = (1 << OFF_BITS) - 1


def region_key(reg: np.ndarray, off: np.ndarray) -> np.ndarray:
    """(region, offset) as one int64 that merges never carry across regions (offsets < 2**OFF_BITS)."""
    return reg << OFF_BITS | off


def region_unkey(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return key >> OFF_BITS, key & OFF_MASK


def keyable(*sizes: np.ndarray) -> bool:
    """Whether offsets in regions of these sizes fit ``region_key``."""
    return all(not len(s) or int(np.max(s)) < 1 << OFF_BITS for s in sizes)


def merge_in_stream(reg: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive runs of one byte stream that continue each other in their region, as one
    run: (region, offset, length) arrays. A head slice of token-major pages gathers 512 B rows
    that are whole pages on the other side: 16x fewer runs to check, post or scatter."""
    key, _, n = merge_runs(region_key(reg, off), np.cumsum(n) - n, n)
    return (*region_unkey(key), n)


def split_long_runs(frame: int, n: np.ndarray, moving: Sequence[np.ndarray] = (),
                    fixed: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Runs longer than ``frame`` cut into frame-sized pieces, vectorized.

    ``moving``: columns that advance with the bytes (offsets, addresses); ``fixed``: columns
    each piece keeps (region ids). Returns (lengths, moving columns, fixed columns)."""
    pieces = np.maximum(-(-n // frame), 1)
    if not len(n) or pieces.max() <= 1:
        return n, list(moving), list(fixed)
    idx = np.repeat(np.arange(len(n)), pieces)
    step = (np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * frame
    return (np.minimum(n[idx] - step, frame), [m[idx] + step for m in moving], [f[idx] for f in fixed])


def runs_inside(reg: np.ndarray, off: np.ndarray, n: np.ndarray, sizes: np.ndarray) -> bool:
    """Every run names a region and lies inside it (non-negative offset and length). Written so
    that no sum can overflow for any int64 input."""
    if not len(n):
        return True
    if reg.min() < 0 or reg.max() >= len(sizes) or off.min() < 0 or n.min() < 0:
        return False
    return not bool((off > sizes[reg] - n).any())


def runs_inside_few(runs: Sequence[tuple[int, int, int]], sizes: Sequence[int]) -> bool:
    """``runs_inside`` for a few (region, offset, length) runs as Python ints."""
    return all(0 <= r < len(sizes) and 0 <= o and 0 <= c and o + c <= sizes[r] for r, o, c in runs)


# ------------------------------------------------------------------------------------
# What a peer is told
# ------------------------------------------------------------------------------------
REFUSED = "refused: no grant covers this transfer"
_GRANT_REASONS = frozenset(r.value for r in (Reason.UNKNOWN_REQUEST, Reason.ENDED_REQUEST, Reason.OUTSIDE_GRANT,
                                             Reason.UNKNOWN_REGION, Reason.OUTSIDE_REGION))


def peer_reason(reason: str) -> str:
    """The refusal a receiver sends back for ``reason``. No oracle: refusals because of the grant
    (unknown, ended or live request, runs outside it) all read the same, so a peer cannot probe
    which request ids are live; the local counters and arrivals keep the full reason."""
    return REFUSED if Reason.of(reason).value in _GRANT_REASONS else reason


# ------------------------------------------------------------------------------------
# Peer liveness
# ------------------------------------------------------------------------------------
class PeerClock:
    """When a peer was last heard from (or made progress). I/O thread only."""
    __slots__ = ("heard",)

    def __init__(self, now: float | None = None):
        self.heard = time.monotonic() if now is None else now

    def touch(self, now: float | None = None) -> None:
        self.heard = time.monotonic() if now is None else now

    def silent_for(self, now: float) -> float:
        return now - self.heard

    def silent(self, now: float, timeout: float) -> bool:
        return now - self.heard > timeout
