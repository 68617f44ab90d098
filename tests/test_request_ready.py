"""Ready before read: ``KVSender.send(..., ready=event)`` holds a chunk until ``event.query()``
is True, over every transport (local, zmq, ucx where ucxx imports).

The stand-in event completes late, the way a CUDA event recorded after the forward would: the
prefill pool holds a placeholder pattern when ``send`` is called, the test then writes the
final pattern and completes the event. The decode pool must hold the final pattern, and
nothing may land (no byte, no Success) while the event is pending. Removing the guard (the
sender submitting at once) makes these tests fail: local copies the placeholder inside
``send``; zmq and ucx deliver it while the test still waits.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import request_peer as rp
from manual_clock import ManualClock
from request_pair import LENIENT, Pair, fill
from support.deps import need
from waiting import until

from kvxfer.endpoint import KVPoll, Outcome

PLACEHOLDER = 0x5A
PENDING_WINDOW = 0.3   # real seconds the test watches the destination while the event is pending


class LateEvent:
    """Stands in for ``torch.cuda.Event``: ``query()`` is False until ``complete()``."""

    def __init__(self):
        self.done, self.queries = threading.Event(), 0

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()

    def complete(self) -> None:
        self.done.set()


def _usable(transport: str) -> None:
    need(transport)


@pytest.mark.parametrize("transport", ["local", "zmq", "ucx"])
def test_no_transport_reads_a_chunk_before_its_event_completes(transport):
    _usable(transport)
    pair = Pair(transport)
    try:
        ps, ds = np.arange(4, 16), np.arange(20, 32)
        r, s = pair.de.receiver(1), pair.pe.sender(1)
        r.init(ds)
        assert s.wait(10, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        for b in pair.p_pool.buffers:            # the forward has not written the KV yet
            b.fill_(PLACEHOLDER)
        ev = LateEvent()
        assert s.send(ps[:8], ready=ev)          # chunk 0 waits for its event...
        assert s.send(ps[8:], start=8, last=True)   # ...and chunk 1 (no event) waits behind it
        assert r.wait(PENDING_WINDOW) == KVPoll.WaitingForInput, r     # nothing arrived
        assert rp.same_bytes(pair.d_pool.buffers, pair.before), "bytes landed before the event completed"
        assert ev.queries >= 2                   # polled by send and by the ticks, never blocking
        fill(pair.p_pool, 7)                     # the forward writes the final KV, then the event completes
        ev.complete()
        assert r.wait(10) == KVPoll.Success, r.reason
        assert s.wait(10) == KVPoll.Success, s.reason
        assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)])), "stale KV was sent"
    finally:
        pair.close()


def test_chunks_queued_before_the_grant_wait_for_their_event_too():
    pair = Pair()
    try:
        ps, ds = np.arange(4, 12), np.arange(20, 28)
        s = pair.pe.sender(2)
        for b in pair.p_pool.buffers:
            b.fill_(PLACEHOLDER)
        ev = LateEvent()
        s.send(ps, last=True, ready=ev)          # before decode asked: queued
        r = pair.de.receiver(2)
        r.init(ds)
        assert s.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        assert r.wait(PENDING_WINDOW) == KVPoll.WaitingForInput
        fill(pair.p_pool, 8)
        ev.complete()
        assert r.wait(10) == KVPoll.Success, r.reason
        assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)]))
    finally:
        pair.close()


def test_an_event_that_never_completes_fails_the_request_at_its_deadline():
    """On an injected clock: no waiting for the real deadline. Nothing of the chunk is read."""
    clock = ManualClock()
    pair = Pair(p_clock=clock)
    try:
        r, s = pair.de.receiver(3), pair.pe.sender(3)
        r.init(np.arange(20, 28))
        assert s.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        never = LateEvent()
        s.send(np.arange(4, 12), last=True, ready=never)
        time.sleep(0.05)
        assert s.poll() == KVPoll.WaitingForInput
        clock.advance(LENIENT.waiting + 1)
        assert s.wait(5) == KVPoll.Failed and s.outcome is Outcome.TimedOut
        assert "ready event of the chunk of tokens 0..7 did not complete" in s.reason, s.reason
        assert r.wait(5) == KVPoll.Failed and "ready event" in r.reason
        assert until(lambda: s.kv_releasable, 5)   # nothing read it: released at once
        assert rp.same_bytes(pair.d_pool.buffers, pair.before)
    finally:
        pair.close()


def test_a_failing_event_fails_the_request_and_a_non_event_is_refused():
    class Broken:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pair = Pair()
    try:
        r, s = pair.de.receiver(4), pair.pe.sender(4)
        r.init(np.arange(20, 28))
        assert s.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        with pytest.raises(TypeError, match="query"):
            s.send(np.arange(4, 12), last=True, ready=object())
        assert not s.send(np.arange(4, 12), last=True, ready=Broken())
        assert s.poll() == KVPoll.Failed and "illegal memory access" in s.reason
        assert r.wait(5) == KVPoll.Failed
        assert rp.same_bytes(pair.d_pool.buffers, pair.before)
    finally:
        pair.close()
