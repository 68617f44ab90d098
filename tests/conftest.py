"""Shared test set-up: make the helpers next to the tests (``xfer_peer``, ``request_peer``,
``waiting``) importable in any pytest import mode, and the ``transport`` fixture of the request
tests (each network transport, skipped where it cannot run; ``parametrize`` overrides it)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module", params=["zmq", "ucx"])
def transport(request):
    import request_peer as rp
    why = rp.transport_skip_reason(request.param)
    if why:
        pytest.skip(why)
    return request.param
