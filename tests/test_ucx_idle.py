"""An idle UCX transport dozes (``transports.ucx.loop.IDLE_TICK``): with no peer and nothing in
flight, held or landing, its loop ticks once a second, not ten times; a connect wakes it, the tick
comes back to its pace at once (pings and silence checks of the new peer), and a transfer lands
byte-exact."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from ucx_pair import CANARY  # noqa: E402
from waiting import until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

RUN = 64 << 10


def count_ticks(t) -> list[float]:
    """When ``t``'s loop ticks from now on (the loop calls ``self.tick``: an instance attribute wins)."""
    seen: list[float] = []
    tick = t.loop.tick
    t.loop.tick = lambda now: (seen.append(now), tick(now))[1]
    return seen


def ticks_within(seconds: float, *seen: list[float]) -> tuple[int, ...]:
    """Ticks of each transport over the same ``seconds``."""
    start = [len(s) for s in seen]
    time.sleep(seconds)
    return tuple(len(s) - a for s, a in zip(seen, start))


@pytest.mark.slow   # ~4 s of watching ticks: the full tier (keeps the fast tier under 90 s)
def test_an_idle_transport_ticks_once_a_second_and_a_connect_brings_the_pace_back():
    rx, tx = get_transport("ucx"), get_transport("ucx")
    try:
        src = torch.randint(0, 256, (4 * RUN,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        dst = torch.full((4 * RUN,), CANARY, dtype=torch.uint8)
        rx.register([dst])
        tx.register([src])
        rx_ticks, tx_ticks = count_ticks(rx), count_ticks(tx)
        time.sleep(1.2)   # both quiet since they started
        idle = ticks_within(2.0, rx_ticks, tx_ticks)
        assert max(idle) <= 4, f"idle transports ticked {idle} times in 2 s (at the busy pace: ~20)"
        pid = tx.connect(rx.descriptor())
        # a peer each: pings and silence checks at the busy pace again, not after the dozing tick
        busy = ticks_within(0.6, rx_ticks, tx_ticks)
        assert min(busy) >= 3, f"connected transports ticked {busy} times in 0.6 s"
        z, off, n = np.zeros(1, np.int64), np.array([RUN]), np.array([RUN])
        rx.expect("r1", ByteRanges(z, off, n))
        h = tx.submit(pid, "r1", TransferPlan((RunGroup(z, z, z, z, off, off, n, False),)), timeout=10)
        assert h.wait(10), h.error
        got: list = []
        assert until(lambda: got.extend(rx.arrivals()) or got, 10.0), "no arrival"
        assert [(a.request_id, a.ok) for a in got] == [("r1", True)], got
        assert torch.equal(dst[RUN:2 * RUN], src[RUN:2 * RUN]), "the run's bytes differ"
        assert bool((dst[:RUN] == CANARY).all()) and bool((dst[2 * RUN:] == CANARY).all()), "a write outside the run"
    finally:
        tx.close()
        rx.close()
