"""ZMQ ``connect`` proves the data path with a ping round trip: an address where nothing listens,
or one that takes the connection and never answers, fails at connect with a ``ConnectError``
naming it (not at the first request). Pings cannot be abused: pongs per sender are rate-limited."""
from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest
import torch
import zmq
from support.ports import free_port
from waiting import until
from xfer_peer import raw_plan

from kvxfer.errors import ConnectError
from kvxfer.grant import ByteRanges
from kvxfer.transport.registry import get_transport

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

QUICK = 1.0   # connect_timeout in these tests


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def tx():
    t = get_transport("zmq", connect_timeout=QUICK)
    t.register([torch.arange(1 << 16, dtype=torch.int64).view(torch.uint8)])
    yield t
    t.close()


def _refused(tx, endpoint: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConnectError) as e:
        tx.connect({"endpoint": endpoint})
    took = time.monotonic() - start
    assert endpoint in str(e.value) and "no answer on the data socket" in str(e.value), e.value
    assert QUICK - 0.1 <= took <= QUICK + 2, f"connect took {took:.2f}s for a {QUICK}s timeout"


def test_nothing_listens(tx):
    before = _fds()
    for _ in range(3):
        _refused(tx, f"tcp://127.0.0.1:{free_port()}")
    assert until(lambda: _fds() <= before, 5), "a failed connect left its socket open"


def test_black_hole_tcp(tx):
    """A socket that accepts the TCP connection and never speaks (no ZMTP greeting)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    try:
        _refused(tx, f"tcp://127.0.0.1:{hole.getsockname()[1]}")
    finally:
        hole.close()


def test_black_hole_zmq(tx):
    """A zmq ROUTER that takes the ping and never answers."""
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.linger = 0
    try:
        _refused(tx, f"tcp://127.0.0.1:{mute.bind_to_random_port('tcp://127.0.0.1')}")
    finally:
        mute.close()
        ctx.term()


def test_a_listening_receiver_connects_and_bytes_arrive(tx):
    with get_transport("zmq") as rx:
        dst = torch.zeros(1 << 19, dtype=torch.uint8)
        rx.register([dst])
        peer = tx.connect(rx.descriptor())
        plan = raw_plan([0], [1000], [0], [64], [300_000])
        rx.expect("ok", ByteRanges(*(getattr(plan.runs(), f) for f in ("dst_region", "dst_offset", "nbytes"))))
        tx.submit(peer, "ok", plan, timeout=10).result(10)
        src = torch.arange(1 << 16, dtype=torch.int64).view(torch.uint8)
        assert torch.equal(dst[64: 64 + 300_000], src[1000: 301_000]) and not dst[:64].any()


def test_ping_flood_is_rate_limited():
    """A peer that floods pings gets at most the burst plus the rate in pongs, the rest are
    dropped and counted, and an honest connect still gets its answer."""
    from transports.zmq.receiver import PING_BURST, PINGS_PER_S
    with get_transport("zmq") as rx:
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.connect(rx.descriptor()["endpoint"])
        try:
            start, flood = time.monotonic(), 4 * PING_BURST
            for i in range(flood):
                d.send(msgpack.packb({"t": "p", "n": i}))
            # every ping is answered or counted as rejected; on a loaded machine the receiver
            # may still be working through the flood after a quiet half second, so wait for
            # the two to add up (a deadline, not a quiet period)
            pongs, deadline = 0, time.monotonic() + 30
            while pongs + rx.rejected["other"] < flood and time.monotonic() < deadline:
                if d.poll(100):
                    pongs += msgpack.unpackb(d.recv())["t"] == "p"
            while d.poll(200):
                pongs += msgpack.unpackb(d.recv())["t"] == "p"
            allowed = PING_BURST + (time.monotonic() - start) * PINGS_PER_S
            assert pongs <= allowed, f"{pongs} pongs for {flood} pings (at most {allowed:.0f} allowed)"
            assert pongs >= PING_BURST, pongs
            assert rx.rejected["other"] >= flood - pongs
            with get_transport("zmq", connect_timeout=5) as honest:
                honest.connect(rx.descriptor())
        finally:
            d.close()
            ctx.term()


def test_connect_waits_off_the_io_thread(tx):
    """A connect waiting for a black hole does not stall transfers to other peers."""
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.linger = 0
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    with get_transport("zmq") as rx:
        rx.register([torch.zeros(1 << 16, dtype=torch.uint8)])
        peer = tx.connect(rx.descriptor())
        t = threading.Thread(target=lambda: pytest.raises(ConnectError, tx.connect,
                                                          {"endpoint": f"tcp://127.0.0.1:{port}"}), daemon=True)
        t.start()
        time.sleep(0.1)
        plan = raw_plan([0], [0], [0], [0], [4096])
        rx.expect("busy", ByteRanges(*(getattr(plan.runs(), f) for f in ("dst_region", "dst_offset", "nbytes"))))
        start = time.monotonic()
        tx.submit(peer, "busy", plan, timeout=10).result(10)
        assert time.monotonic() - start < QUICK / 2
        t.join(5)
    mute.close()
    ctx.term()
