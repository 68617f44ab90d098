"""A transfer whose puts take longer than ``peer_timeout`` is not a silent peer.

A sender's puts ran inside one call of ucxx's worker progress, which drains until nothing moves:
cma puts into a receiver's memory that was never touched fault it in page by page (64 MiB took
3.5 s on this machine's 2 cores), and that one call held the sender's I/O loop for all of it: no
tick, no heartbeat, and the receiver declared the sender silent in the middle of a transfer that
was progressing. The loop's progress is bounded now (``Workers.progress``), so its ticks keep
their time. Without the bound both cases fail ("peer silent for 1.1s").
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ucxx")

import torch  # noqa: E402
from waiting import collect_arrivals  # noqa: E402
from xfer_peer import PeerProcess, pattern, plan_to_json, raw_plan, region_seed  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 64 << 10
PAGES = 1024                # 64 MiB moved
DST = 4 * PAGES * PAGE      # the receiver's region: 256 MiB, never touched before the transfer
SEED = 9


@pytest.mark.parametrize("eager", [False, True], ids=["announced", "eager"])
def test_puts_into_cold_memory_outlasting_the_peer_timeout_complete(tmp_path, eager):
    rx = get_transport("ucx", heartbeat=0.2, peer_timeout=1.0, eager_writes=eager)
    tx = PeerProcess(tmp_path / "tx.err")
    try:
        # calloc'd, never touched: 4 KiB pages the kernel maps at the first write, one by one (torch's
        # own allocator asks for huge pages, which fault in 512 times fewer)
        dst = torch.from_numpy(np.zeros(DST, np.uint8))
        rx.register([dst])
        tx.call("init", transport="ucx", sizes=[PAGES * PAGE], fill="seed", seed=SEED,
                options={"heartbeat": 0.2, "peer_timeout": 1.0})
        peer = tx.call("connect", descriptor=rx.descriptor())["peer"]
        rng = np.random.default_rng(SEED)
        so = np.arange(PAGES, dtype=np.int64) * PAGE
        do = np.sort(rng.choice(4 * PAGES, PAGES, replace=False)).astype(np.int64) * PAGE
        n, z = np.full(PAGES, PAGE, np.int64), np.zeros(PAGES, np.int64)
        rx.expect("cold", ByteRanges(z, do, n))
        time.sleep(0.3)   # the PREGRANT (eager) is out
        tx.call("submit", peer=peer, request_id="cold", plan=plan_to_json(raw_plan(z, so, z, do, n)), timeout=60.0)
        res = tx.call("wait", request_ids=["cold"], wait_s=60)["results"]["cold"]
        assert res["status"] == "DONE", res
        (a,) = collect_arrivals(rx, lambda got: len(got) >= 1, 30.0)
        assert a.ok and a.nbytes == PAGES * PAGE, a
        got, src = dst.numpy(), pattern(region_seed(SEED, 0), PAGES * PAGE)
        landed = got.reshape(-1, PAGE)[do // PAGE]
        assert np.array_equal(landed, src.reshape(-1, PAGE)), "bytes differ"
        rest = np.ones(4 * PAGES, bool)
        rest[do // PAGE] = False
        assert not got.reshape(-1, PAGE)[rest].any(), "a byte outside the grant changed"
    finally:
        tx.close()
        rx.close()
