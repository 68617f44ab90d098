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
