"""What a far peer's failed endpoint proves (issue 17): only a connection reset.

A peer in another host or network namespace is reached with UCX endpoint error handling on
(``Peer.err``). When UCX reports its endpoint failed, the transport fails its transfers and,
after ``fence_grace``, forgets it. What it could still write here is released as *writes
impossible* only when the failure is a reset (its side closed the connection: its process is
gone, ``tests/test_ucx_close_fence.py``). A timeout (a partition: the peer may be alive, its
writes queued in the network) proves nothing, so that memory stays held.

The failed endpoint is a stand-in put into a real transport's peer table on its I/O thread,
with one landing entry (a transfer the peer had GO for); ``writes_pending`` and ``fencing()``
are what decode's endpoint reads before it reuses the slots.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

pytest.importorskip("ucxx")

from ucxx._lib import libucxx as ucx_api  # noqa: E402
from waiting import until  # noqa: E402

from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx.peers import failure_of  # noqa: E402
from kvxfer_transports.ucx.state import Peer  # noqa: E402

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)


class FailedEndpoint:
    """An endpoint UCX reported failed with ``error`` (``alive`` False, so never closed again)."""
    alive = False
    handle = 0

    def __init__(self, error: type[Exception]):
        self.error = error

    def raise_on_error(self) -> None:
        raise self.error("stand-in failure")


def test_failure_of_names_a_reset_and_nothing_else_as_one():
    assert failure_of(FailedEndpoint(ucx_api.UCXConnectionResetError)) == "reset"
    assert failure_of(FailedEndpoint(ucx_api.UCXEndpointTimeoutError)) == "UCXXEndpointTimeoutError"

    class Healthy:
        def raise_on_error(self) -> None:
            pass
    assert failure_of(Healthy()) == ""


@pytest.mark.parametrize("error, still_held", [(ucx_api.UCXEndpointTimeoutError, True),
                                               (ucx_api.UCXConnectionResetError, False)])
def test_only_a_reset_releases_what_a_far_peer_could_write(error, still_held):
    t = get_transport("ucx", fence_grace=0.2, heartbeat=0.1)
    try:
        t.register([torch.zeros(4096, dtype=torch.uint8)])
        p = Peer("far-peer", FailedEndpoint(error), b"s" * 16, far=True, err=True, next_ping=math.inf)

        def inject() -> None:     # on the I/O thread, as the close callback's queue is read there
            t.peers.add(p)
            t.landing.puts[(p.id, 1)] = ("room-1", 4096, time.monotonic(), 0)
            t.landing.rids["room-1"] += 1
            t.peers.failed.append(p)
        t.call_io(inject)
        assert until(lambda: p.id not in t.peers, 5.0), "the failed peer was never forgotten"
        assert p.failure == ("reset" if error is ucx_api.UCXConnectionResetError else "UCXXEndpointTimeoutError")
        time.sleep(0.3)            # more ticks: nothing else releases it
        assert t.writes_pending("room-1") is still_held
        assert t.fencing()["transfers"] == int(still_held), t.fencing()
        assert t.broken is None
    finally:
        t.close()
