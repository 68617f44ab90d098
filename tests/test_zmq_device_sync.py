"""No arrival before the bytes are complete where they land (#18).

A receiving region on a CUDA device gets its bytes by copies enqueued on the transport's
stream; the arrival (and the sender's ack) wait for an event recorded after them, polled by the
I/O thread without blocking it. Here the event factory is injected: a stand-in that completes
late, on CPU regions, so the test runs anywhere; on a GPU, tests/test_cuda.py covers real events.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from waiting import until
from xfer_peer import raw_plan

from kvxfer.copy import execute_plan
from kvxfer.grant import ByteRanges
from kvxfer.transport.registry import get_transport

WINDOW = 0.4   # seconds the test watches while the event is pending


class LateEvent:
    """Stands in for ``torch.cuda.Event``: ``query()`` is False until ``complete()``."""
    made: list["LateEvent"] = []

    def __init__(self):
        self.done, self.recorded = threading.Event(), 0
        LateEvent.made.append(self)

    def record(self, stream=None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.done.is_set()

    def complete(self) -> None:
        self.done.set()


@pytest.fixture
def pair():
    LateEvent.made = []
    rx = get_transport("zmq", event=LateEvent)
    tx = get_transport("zmq")
    src = torch.from_numpy(np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8))
    dst = torch.zeros(4 << 20, dtype=torch.uint8)
    tx.register([src]), rx.register([dst])
    yield tx, rx, src, dst
    tx.close(), rx.close()


def _grant(plan):
    r = plan.runs()
    return ByteRanges(r.dst_region, r.dst_offset, r.nbytes)


def test_arrival_waits_for_the_write_event(pair):
    tx, rx, src, dst = pair
    plan = raw_plan([0, 0], [0, 2 << 20], [0, 0], [4096, 3 << 20], [1 << 20, 70_000])   # zero-copy and packed
    rx.expect("late", _grant(plan))
    h = tx.submit(tx.connect(rx.descriptor()), "late", plan, timeout=30)
    assert until(lambda: bool(LateEvent.made) and bool(dst[3 << 20].item() or dst[(3 << 20) + 69_999].item()), 10)
    assert not rx.arrivals(WINDOW), "an arrival was reported before its write event completed"
    assert not h.wait(0.05), "the sender was acked before the receiver's write event completed"
    assert rx.writes_pending("late")
    # the I/O thread is not blocked meanwhile: another sender connects (a ping round trip)
    with get_transport("zmq", connect_timeout=5) as other:
        other.connect(rx.descriptor())
    for ev in LateEvent.made:
        assert ev.recorded == 1
        ev.complete()
    (a,) = rx.arrivals(10)
    assert (a.request_id, a.ok, a.nbytes) == ("late", True, plan.nbytes)
    h.result(10)
    assert not rx.writes_pending("late")
    assert torch.equal(dst[4096: 4096 + (1 << 20)], src[: 1 << 20])
    assert torch.equal(dst[3 << 20: (3 << 20) + 70_000], src[2 << 20: (2 << 20) + 70_000])
    assert not dst[:4096].any() and not dst[4096 + (1 << 20): 3 << 20].any()


def test_arrivals_keep_their_order(pair):
    """Two transfers: the second's event completes first; its arrival still comes second."""
    tx, rx, src, dst = pair
    peer = tx.connect(rx.descriptor())
    plans = [raw_plan([0], [k << 20], [0], [k << 20], [300_000]) for k in (0, 1)]
    handles = []
    for k, plan in enumerate(plans):
        rx.expect(f"r{k}", _grant(plan))
        handles.append(tx.submit(peer, f"r{k}", plan, timeout=30))
        assert until(lambda k=k: len(LateEvent.made) == k + 1, 10)
    LateEvent.made[1].complete()
    assert not rx.arrivals(WINDOW)
    LateEvent.made[0].complete()
    got = rx.arrivals(10)
    got += rx.arrivals(1) if len(got) < 2 else []
    assert [a.request_id for a in got] == ["r0", "r1"] and all(a.ok for a in got)
    for h in handles:
        h.result(10)
    for k in (0, 1):
        assert torch.equal(dst[k << 20: (k << 20) + 300_000], src[k << 20: (k << 20) + 300_000])


def test_close_fails_what_waits(pair):
    tx, rx, _, _ = pair
    plan = raw_plan([0], [0], [0], [0], [100_000])
    rx.expect("closing", _grant(plan))
    tx.submit(tx.connect(rx.descriptor()), "closing", plan, timeout=30)
    assert until(lambda: bool(LateEvent.made), 10)
    time.sleep(0.1)
    rx.close()
    (a,) = rx.arrivals(1)
    assert a.request_id == "closing" and not a.ok and "closed" in a.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_region_bytes_are_complete_at_arrival():
    """Real events: the moment the arrival is reported, a read on the default stream (which
    does not wait for the transport's stream) already sees every byte."""
    size = 32 << 20
    rx, tx = get_transport("zmq"), get_transport("zmq")
    try:
        src = torch.from_numpy(np.random.default_rng(6).integers(0, 256, size, dtype=np.uint8))
        dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
        want = torch.zeros(size, dtype=torch.uint8)
        tx.register([src]), rx.register([dst])
        peer = tx.connect(rx.descriptor())
        rng = np.random.default_rng(7)
        for k in range(4):
            if k % 2:   # one long run: zero-copy parts
                plan = raw_plan([0], [k << 20], [0], [k << 22], [8 << 20])
            else:       # 200 short runs in distinct 32 KiB cells: packed frames
                n = rng.integers(1, 32 << 10, 200)
                do = rng.choice(size >> 15, 200, replace=False) << 15
                plan = raw_plan(np.zeros(200), rng.integers(0, size - (32 << 10), 200), np.zeros(200), do, n)
            rx.expect(f"c{k}", _grant(plan))
            tx.submit(peer, f"c{k}", plan, timeout=30)
            (a,) = rx.arrivals(30)
            got = dst.cpu()             # on the default stream: it does not wait for the transport's
            execute_plan(plan, [src], [want])
            assert a.ok and torch.equal(got, want), f"request {k}: bytes not complete at its arrival"
            assert not rx.writes_pending(f"c{k}")
            rx.forget(f"c{k}")
    finally:
        tx.close(), rx.close()
