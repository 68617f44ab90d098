"""A clock a test moves by hand, for the endpoints' ``clock=`` (deadlines and leases): a test
that waited seconds for a deadline advances the clock past it instead and waits only for the
channel thread's next tick (<= 50 ms)."""
from __future__ import annotations

import threading


class ManualClock:
    """Callable like ``time.monotonic``; starts at ``start`` and moves only on ``advance``."""

    def __init__(self, start: float = 1000.0):
        self._now, self._lock = float(start), threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now
