"""Fixtures more than one test file uses, registered for every test by ``conftest.py``
(``pytest_plugins``): a test asks for one by name.

``registry``: a bootstrap registry in this process (no secret, records live 30 s), one per test
module; the hostile-peer suites find their victims through it.
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
