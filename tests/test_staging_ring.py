"""The staging ring (``kit.StagingPool(frames=...)``): fixed frames allocated once, never more;
exhausted, the I/O path waits instead of allocating; counted in kvxfer.metrics. And the zmq
transport on it: many requests in flight never take more frames than the ring has, byte-exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from xfer_peer import raw_plan

from kvxfer.copy import execute_plan
from kvxfer.grant import ByteRanges
from kvxfer.metrics import REGISTRY
from kvxfer.plan import TransferPlan
from kvxfer.transport.kit import StagingExhausted, StagingPool
from kvxfer.transport.registry import get_transport


class Until:
    def __init__(self):
        self.done = False


def _sample(name: str, transport: str) -> float:
    return REGISTRY.get_sample_value(name, {"transport": transport}) or 0.0


def test_ring_is_fixed_and_waits_when_exhausted():
    name = "ring-unit"
    frames0, waits0 = _sample("kvxfer_staging_frames", name), _sample("kvxfer_staging_waits_total", name)
    ring = StagingPool(frames=3, frame_bytes=4096, name=name)
    ring.allocate()
    assert _sample("kvxfer_staging_frames", name) == frames0 + 3
    blocks = [ring.get(4000) for _ in range(3)]
    assert len({b.data_ptr() for b in blocks}) == 3 and all(b.numel() == 4000 for b in blocks)
    assert not ring.available() and ring.stats()["waits"] == 1
    assert _sample("kvxfer_staging_waits_total", name) == waits0 + 1
    assert _sample("kvxfer_staging_in_use", name) >= 3
    with pytest.raises(StagingExhausted):
        ring.get(10)                            # never a fresh allocation
    busy = Until()
    ring.put(blocks[0], busy)                   # still read by the network
    assert not ring.available()
    busy.done = True
    assert ring.available()
    again = ring.get(100)
    assert again.data_ptr() == blocks[0].data_ptr()   # the same frame, reused
    ring.put(again), ring.put(again)            # a double put frees it once
    assert ring.stats() == {"frames": 3, "in_use": 2, "peak": 3, "waits": 2}
    with pytest.raises(ValueError):
        ring.get(4097)                          # larger than a frame
    ring.clear()
    assert _sample("kvxfer_staging_frames", name) == frames0


class Flips:
    """An ``until`` another thread completes between two reads: False the first time, then True."""
    def __init__(self):
        self.reads = 0

    @property
    def done(self) -> bool:
        self.reads += 1
        return self.reads > 1


def test_a_frame_completed_while_the_ring_reaps_is_not_lost():
    """``stats()`` reaps from any thread (``fencing()``), while the I/O thread completes what a
    given-back frame waits for: a frame is either free or still busy, never neither (a receive
    ring slot was lost so after a killed sender, CI)."""
    ring = StagingPool(frames=2, frame_bytes=64, name="ring-flip")
    ring.allocate()
    a, b = ring.get(64), ring.get(64)
    ring.put(a, Flips())
    ring.put(b)                              # done: the reap frees it, and looks at the rest again
    assert ring.stats()["in_use"] == 1       # a: not done at the reap's one read, still busy
    assert ring.stats()["in_use"] == 0       # done at the next: free
    assert len({ring.get(64).data_ptr(), ring.get(64).data_ptr()}) == 2   # both frames again


def test_growing_pool_still_works_without_arguments():
    """``StagingPool()`` (what transports/ucx constructs) keeps its get/put API."""
    pool = StagingPool()
    a = pool.get(1000)
    pool.put(a)
    assert pool.get(900).data_ptr() == a.data_ptr()
    assert pool.available() and pool.stats()["frames"] == 0


@pytest.mark.parametrize("frames", [1, 2])
def test_zmq_many_requests_never_exceed_the_ring(frames):
    """64 requests of scattered 4 KB runs (each one packed 400 KB message, handed to zmq
    zero-copy, so its frame stays busy until sent) with a ring of ``frames``: all arrive
    byte-exact, the ring never grew, and sending waited for it."""
    tx = get_transport("zmq", staging_frames=frames, frame_bytes=256 << 10, frames_per_message=2)
    rx = get_transport("zmq")
    try:
        rng = np.random.default_rng(frames)
        size, k, run, cell = 32 << 20, 100, 4000, 4096   # per request: k runs of 400 KB in all
        src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
        dst = torch.zeros(size, dtype=torch.uint8)
        tx.register([src]), rx.register([dst])
        peer = tx.connect(rx.descriptor())
        handles, plans = [], []
        for i in range(64):
            n, do = np.full(k, run), i * k * cell + np.arange(k) * cell
            plan = raw_plan(np.zeros(k), rng.integers(0, size - run, k), np.zeros(k), do, n)
            rx.expect(f"r{i}", ByteRanges(np.zeros(k), do, n))
            plans.append(plan)
            handles.append(tx.submit(peer, f"r{i}", plan, timeout=60))
        for h in handles:
            h.result(60)
        stats = tx.staging()
        assert stats["frames"] == frames and stats["peak"] <= frames, stats
        assert stats["waits"] > 0, stats
        want = torch.zeros(size, dtype=torch.uint8)
        execute_plan(TransferPlan.concat(plans), [src], [want])
        assert torch.equal(dst, want)
    finally:
        tx.close(), rx.close()


def test_allocating_again_never_frees_a_frame_in_use():
    ring = StagingPool(frames=2, frame_bytes=1024, name="ring-realloc")
    ring.allocate()
    held = ring.get(512)
    ring.allocate(pin=True) if torch.cuda.is_available() else ring.allocate()
    ring.allocate()
    other = ring.get(512)
    assert other.data_ptr() != held.data_ptr() and ring.stats()["frames"] == 2
    assert not ring.available()                # the held frame still counts: nothing was freed under it
    ring.put(held), ring.put(other)
    ring.clear()
