"""Fixtures more than one test file uses, registered for every test by ``conftest.py``
(``pytest_plugins``): a test asks for one by name.

``registry``: a bootstrap registry in this process (no secret, records live 30 s), one per test
module; the hostile-peer suites find their victims through it.
``server``: ``server(**BootstrapConfig fields)`` makes a registry of the test's own, stopped after
the test (the registry tests: each needs its own settings).
"""
from __future__ import annotations

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
