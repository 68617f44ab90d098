"""The fault-injecting transport: each fault fires as asked, and without faults it is the inner one.

Also the kit's I/O-thread death on the ZMQ transport (the UCX one is in test_ucx_guards.py).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from waiting import until

from kvxfer.errors import PeerError
from kvxfer.grant import ByteRanges
from kvxfer.plan import RunGroup, TransferPlan
from kvxfer.transport.base import TransferStatus
from kvxfer.transport.kit import Crash
from kvxfer.transport.registry import get_transport
from kvxfer_transports.faulty import Faults, FaultyTransport

N = 64 * 1024
CANARY = 0xA5


def plan(n: int = N) -> TransferPlan:
    z = np.zeros(1, np.int64)
    return TransferPlan((RunGroup(z, z, z, z, np.array([0]), np.array([128]), np.array([n]), False),))


def grant() -> ByteRanges:
    return ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, 2 * N, np.int64))


@pytest.fixture(params=["local", "zmq"])
def pair(request):
    tx = FaultyTransport(inner=request.param)
    rx = FaultyTransport(inner=request.param)
    src = torch.randint(0, 256, (2 * N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = torch.full((2 * N,), CANARY, dtype=torch.uint8)
    tx.register([src])
    rx.register([dst])
    peer = tx.connect(rx.descriptor())
    yield tx, rx, peer, src, dst
    tx.close()
    rx.close()


def landed(src, dst, n: int = N) -> bool:
    return bool(torch.equal(dst[128: 128 + n], src[:n]) and (dst[:128] == CANARY).all()
                and (dst[128 + n:] == CANARY).all())


def test_without_faults_it_is_the_inner_transport(pair):
    tx, rx, peer, src, dst = pair
    rx.expect("a", grant())
    assert tx.submit(peer, "a", plan(), timeout=10).wait(10)
    assert [(a.request_id, a.ok, a.nbytes) for a in rx.arrivals(5.0)] == [("a", True, N)]
    assert landed(src, dst)
    assert rx.forget("a") and not rx.writes_pending("a")


def test_failed_submit_moves_nothing(pair):
    tx, rx, peer, src, dst = pair
    rx.expect("b", grant())
    tx.faults.fail_submits = 1
    h = tx.submit(peer, "b", plan(), timeout=10)
    assert h.poll() == TransferStatus.FAILED and isinstance(h.error, PeerError) and h.source_released
    assert rx.arrivals(0.3) == [] and bool((dst == CANARY).all())
    assert tx.submit(peer, "b", plan(), timeout=10).wait(10)   # only the next one failed
    assert landed(src, dst)


def test_delayed_submit_lands_late(pair):
    tx, rx, peer, src, dst = pair
    rx.expect("c", grant())
    tx.faults.submit_delay = 0.3
    start = time.monotonic()
    h = tx.submit(peer, "c", plan(), timeout=10)
    assert h.poll() == TransferStatus.PENDING
    assert h.wait(10) and time.monotonic() - start >= 0.3
    assert until(lambda: h.source_released, 5.0)
    assert landed(src, dst)


def test_held_writes_and_dropped_arrivals(pair):
    tx, rx, peer, src, dst = pair
    rx.faults.drop_arrivals.add("d")
    rx.faults.hold_pending.add("d")
    rx.expect("d", grant())
    assert tx.submit(peer, "d", plan(), timeout=10).wait(10)
    assert landed(src, dst)
    assert rx.arrivals(0.5) == [] and until(lambda: rx.dropped == 1, 5.0)
    rx.forget("d")
    assert rx.writes_pending("d")
    rx.faults.hold_pending.clear()
    assert not rx.writes_pending("d")


def test_faults_given_at_construction():
    t = FaultyTransport(inner="local", faults=Faults(fail_requests={"x"}))
    try:
        t.register([torch.zeros(16, dtype=torch.uint8)])
        h = t.submit(t.connect(t.descriptor()), "x", plan(8), timeout=1)
        assert h.poll() == TransferStatus.FAILED
    finally:
        t.close()


def test_zmq_io_thread_death_fails_its_transfers_and_marks_the_transport_broken():
    """A bug in the I/O thread (injected through the kit's fault hook) fails every transfer it
    owned at once, with the reason, and every later submit; nothing lands."""
    import zmq
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)          # a receiver that answers connect's ping, then nothing
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")

    def pong_once() -> None:
        rid, ping = silent.recv_multipart()
        silent.send_multipart([rid, ping])   # a pong has the ping's shape (protocol.Ping)
    answer = threading.Thread(target=pong_once, daemon=True)
    answer.start()
    tx = FaultyTransport(inner="zmq")
    try:
        tx.register([torch.ones(N, dtype=torch.uint8)])
        peer = tx.connect({"endpoint": f"tcp://127.0.0.1:{port}"})
        answer.join(5)
        h = tx.submit(peer, "open", plan(N // 2), timeout=30)
        assert not h.wait(0.3)   # in flight: no answer comes
        start = time.monotonic()
        tx.crash_io(RuntimeError("injected bug"))
        assert not h.wait(5) and time.monotonic() - start < 5
        assert "injected bug" in str(h.error), h.error
        assert until(lambda: h.source_released, 5.0)
        assert tx.broken and "injected bug" in tx.broken
        h2 = tx.submit(peer, "later", plan(16), timeout=30)
        assert h2.poll() == TransferStatus.FAILED and "injected bug" in str(h2.error)
    finally:
        tx.close()
        silent.close()
        ctx.term()


def test_crash_needs_an_io_thread():
    t = FaultyTransport(inner="local")
    try:
        with pytest.raises(TypeError):
            t.crash_io()
    finally:
        t.close()


def test_crash_command_reaches_a_bare_transport():
    """The hook is the kit's, not the wrapper's: a plain ZMQ transport takes it too."""
    t = get_transport("zmq")
    try:
        t.commands.put(Crash(RuntimeError("direct")))
        assert until(lambda: t.broken is not None, 5.0) and "direct" in t.broken
    finally:
        t.close()


def test_disconnect_reaches_the_inner_transport():
    """``disconnect`` is forwarded: the inner zmq transport forgets the peer, so a later submit
    to it fails at once; a fresh connect to the same receiver works, byte-exact."""
    rx = get_transport("zmq")
    tx = FaultyTransport(inner="zmq")
    try:
        dst = torch.zeros(2 * N, dtype=torch.uint8)
        src = torch.arange(N, dtype=torch.int64).to(torch.uint8)
        rx.register([dst])
        tx.register([src])
        tx.disconnect(tx.connect(rx.descriptor()))
        old = tx.connect(rx.descriptor())
        tx.disconnect(old)
        h = tx.submit(old, "gone", plan(16), timeout=5)
        assert not h.wait(5) and "unknown peer" in str(h.error), h.error
        rx.expect("back", grant())
        tx.submit(tx.connect(rx.descriptor()), "back", plan(N // 2), timeout=10).result(10)
        assert torch.equal(dst[128: 128 + N // 2], src[: N // 2])   # plan(): source 0 -> destination 128
        assert not dst[:128].any() and not dst[128 + N // 2:].any()
    finally:
        tx.close()
        rx.close()
