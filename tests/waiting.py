"""Waiting on another thread or process, for tests: poll a condition until it holds."""
from __future__ import annotations

import time
from collections.abc import Callable


def until(cond: Callable[[], object], timeout: float, step: float = 0.01) -> bool:
    """True as soon as ``cond()`` is true; False if it is still false after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())



def collect_arrivals(t, enough: Callable[[list], object], timeout: float = 10.0) -> list:
    """Arrivals on transport ``t``, gathered until ``enough(gathered)`` or ``timeout`` seconds:
    an arrival is handed over after its turn's control sends, so a sender's handle (or the
    receiver's own state) may show the end a moment before the arrival is queued."""
    end, got = time.monotonic() + timeout, []
    while True:
        got += t.arrivals(0.05)
        if enough(got) or time.monotonic() >= end:
            return got + t.arrivals()


def arrivals_of(t, rid: str, timeout: float = 10.0) -> list:
    """The arrivals of request ``rid`` on transport ``t`` (others are drained and dropped),
    waiting up to ``timeout`` seconds for the first (see ``collect_arrivals``)."""
    got = collect_arrivals(t, lambda got: any(a.request_id == rid for a in got), timeout)
    return [a for a in got if a.request_id == rid]
