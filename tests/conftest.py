"""Shared test set-up: make the helpers next to the tests (``xfer_peer``, ``request_peer``,
``waiting``, ``support``) importable in any pytest import mode, and the ``transport`` fixture of the
request tests (each network transport, skipped only where its optional dependency is missing;
``parametrize`` overrides it). Fixtures that several files share live in ``support/fixtures.py``.

Tiers: ``scripts/test --fast`` runs ``-m "not slow"``, the in-process tier (under 90 s on 2
cores); ``scripts/test`` runs everything. Each file says which of its tests are slow, where they
are: ``pytestmark = pytest.mark.slow`` for a file whose tests all start processes or wait seconds,
``@pytest.mark.slow`` on a test that does, ``pytest.param(..., marks=pytest.mark.slow)`` for a
parameter that does (a network pair of the conformance suite is two processes).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["support.fixtures"]   # fixtures shared by several files (``registry``)


@pytest.fixture(scope="module", params=["zmq", "ucx"])
def transport(request):
    from support.deps import need
    need(request.param)   # skipped only when its optional dependency is missing
    return request.param
