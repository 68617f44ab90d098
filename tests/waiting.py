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


def arrivals_of(t, rid: str, timeout: float = 10.0) -> list:
    """The arrivals of request ``rid`` on transport ``t`` (others are drained and dropped), waiting
    up to ``timeout`` seconds for the first: an arrival is handed over after the turn's control
    sends, so a sender's handle may succeed a moment before its receiver's arrival is queued."""
    end = time.monotonic() + timeout
    while True:
        got = [a for a in t.arrivals(0.05) if a.request_id == rid]
        if got or time.monotonic() >= end:
            return got + [a for a in t.arrivals() if a.request_id == rid]
