"""UCX inline announces, on an in-process pair: a plan of a few packed runs in host memory is read
through numpy views of the regions (sender) and written through them (receiver); a plan of more
than ``few_runs`` runs goes through ``gather_runs`` and ``copy_runs``. Both land byte-exact, in
two regions on each side, and nothing outside the runs changes (canaries)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import FEW_RUNS, RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
REGION = 1 * MiB
CANARY = 0xA5
OPTS = {"heartbeat": 0.2, "peer_timeout": 3.0}


@pytest.fixture(scope="module")
def pair():
    rx, tx = get_transport("ucx", **OPTS), get_transport("ucx", **OPTS)
    gen = torch.Generator().manual_seed(11)
    src = [torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    dst = [torch.full((REGION,), CANARY, dtype=torch.uint8) for _ in range(2)]
    rx.register(dst)
    tx.register(src)
    pid = tx.connect(rx.descriptor())
    yield rx, tx, pid, src, dst
    tx.close()
    rx.close()


def _plan(runs) -> TransferPlan:
    """``runs``: (src region, src offset, dst region, dst offset, nbytes), one packed group each."""
    z = np.zeros(1, np.int64)
    return TransferPlan(tuple(RunGroup(np.array([sr]), z, np.array([dr]), z, np.array([so]), np.array([do]),
                                       np.array([n]), True) for sr, so, dr, do, n in runs))


@pytest.mark.parametrize("count", [3, FEW_RUNS + 5])
def test_packed_runs_inline_land_exactly_in_two_regions(pair, count):
    rx, tx, pid, src, dst = pair
    rng = np.random.default_rng(count)
    slots = rng.choice(REGION // (4 * KiB), count, replace=False)
    runs = [(int(k % 2), int(rng.integers(0, REGION - 4 * KiB)), int((k + 1) % 2), int(s) * 4 * KiB,
             int(rng.integers(1, 4 * KiB))) for k, s in enumerate(slots)]
    plan = _plan(runs)
    assert plan.num_runs == count and plan.nbytes < 256 * KiB   # every packed byte inline (INLINE_BELOW)
    rid = f"r-inline-{count}"
    rx.expect(rid, ByteRanges(np.array([0, 1]), np.zeros(2, np.int64), np.full(2, REGION, np.int64)))
    h = tx.submit(pid, rid, plan, timeout=30)
    assert h.wait(30), h.error
    (arr,) = rx.arrivals(timeout=10)
    assert arr.ok and arr.nbytes == plan.nbytes
    want = [np.full(REGION, CANARY, np.uint8) for _ in range(2)]
    for sr, so, dr, do, n in runs:
        want[dr][do:do + n] = src[sr].numpy()[so:so + n]
    for r in range(2):
        assert np.array_equal(dst[r].numpy(), want[r]), f"region {r} differs"
    rx.forget(rid)
    for d in dst:
        d.fill_(CANARY)
