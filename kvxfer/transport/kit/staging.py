"""Staging frames for packed runs: a fixed ring, allocated up front (see ``kvxfer.transport.kit``)."""
from __future__ import annotations

import threading
from typing import Any

import torch

from ...errors import ConfigError, TransportError
from ...metrics import record_staging


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
            raise ConfigError(f"a staging ring needs frames >= 1 and frame_bytes >= 1 (got {frames}, {frame_bytes})")
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
        if self._busy:   # each ``until`` read once: another thread may complete it between two reads
            ended = [until is None or until.done for _, until in self._busy]
            done = [k for (k, _), e in zip(self._busy, ended) if e]
            if done:
                self._busy = [b for b, e in zip(self._busy, ended) if not e]
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
                raise ConfigError(f"a staging ring holds frames of {self.frame_bytes} bytes on {self.device}: "
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
