"""Fixtures more than one test file uses, registered for every test by ``conftest.py``
(``pytest_plugins``): a test asks for one by name.

``registry``: a bootstrap registry in this process (no secret, records live 30 s), one per test
module; the hostile-peer suites find their victims through it.
``server``: ``server(**BootstrapConfig fields)`` makes a registry of the test's own, stopped after
the test (the registry tests: each needs its own settings).
``no_threads_left`` (every module, automatic): a test module leaves no thread of its own behind
once its fixtures are torn down (an endpoint, transport or relay a test forgot to close keeps its
threads, sockets and memory for the rest of the run, and is collected later on any thread).
"""
from __future__ import annotations

import threading
import time

import pytest

# kvxfer names used here (update here after a module move)
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer


@pytest.fixture(scope="module")
def registry():
    srv = BootstrapServer(BootstrapConfig(ttl=30.0)).start()
    yield srv
    srv.stop()


@pytest.fixture
def server():
    """``server(**BootstrapConfig fields)`` -> a registry of the test's own, stopped after it."""
    made = []

    def make(**kw):
        s = BootstrapServer(BootstrapConfig(**kw)).start()
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


# threads a library starts once and keeps for the process (pyzmq's zero-copy garbage collector)
LIBRARY_THREADS = frozenset({"GarbageCollectorThread"})


@pytest.fixture(scope="module", autouse=True)
def no_threads_left():
    before = set(threading.enumerate())
    yield
    end = time.monotonic() + 10.0
    while (left := [t for t in threading.enumerate() if t not in before and t.is_alive()
                    and type(t).__name__ not in LIBRARY_THREADS]) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, f"threads this module started are still running after its teardown: {sorted(t.name for t in left)}"
