"""Soak (issue 16): a long-lived process with 1,000 extra open fds opens and closes 50 endpoints of
each transport (local, zmq, ucx) and runs 2,000 small requests; fds, threads and RSS stay flat.

The bulk is the cheapest path: transport-level submits between two transports of one process
(50 open/close rounds per transport, 14 requests per round: 2,100 requests). A handful more go
through real endpoints (25 prefill/decode pairs = 50 endpoints per transport, 2 requests each).

Bounds (after a warm-up round, measured after ``gc.collect()``): fds +8, threads +2, RSS +64 MiB
over the whole run; and, per open/close round with the garbage collector off (close() must free
what it created by itself), fds +2. Marked ``slow`` (about 75 s on 2 cores): deselect with ``-m "not slow"``.
"""
from __future__ import annotations

import gc
import itertools
import os
import resource
import threading

import numpy as np
import pytest
import request_peer as rp
import torch
from hostile_victims import fds, rss

from kvxfer.endpoint.base import KVPoll, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.grant import ByteRanges
from kvxfer.plan import RunGroup, TransferPlan

# kvxfer names used here (update here after a module move)
from kvxfer.ranks import RankSpec
from kvxfer.transport.registry import get_transport

pytestmark = pytest.mark.slow

EXTRA_FDS, ROUNDS, PER_ROUND, PAIRS, PAIR_REQUESTS = 1000, 50, 14, 25, 2
FD_SLACK, THREAD_SLACK, RSS_SLACK, ROUND_FD_SLACK = 8, 2, 64 << 20, 2
REGION, CANARY = 1 << 20, 0xA5
OPTS = {"ucx": {"heartbeat": 0.5, "peer_timeout": 5.0}, "zmq": {}, "local": {}}
_rids = itertools.count(1)


def _usable(name: str) -> str | None:
    if name == "ucx":
        try:
            import ucxx  # noqa: F401
        except Exception as e:
            return f"import ucxx failed: {type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def extra_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * EXTRA_FDS:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * EXTRA_FDS), hard))
    opened = [os.open("/dev/null", os.O_RDONLY) for _ in range(EXTRA_FDS)]
    yield opened
    for fd in opened:
        os.close(fd)


def measure() -> tuple[int, int, int]:
    gc.collect()
    return fds(), threading.active_count(), rss()


def report(name: str, before, after, leaks) -> str:
    line = (f"soak {name}: fds {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]}, RSS "
            f"{before[2] >> 20} -> {after[2] >> 20} MiB; fds left per round with gc off: max {max(leaks)}")
    print(line)
    return line


def check_bounds(name, before, after, leaks) -> None:
    line = report(name, before, after, leaks)
    assert after[0] - before[0] <= FD_SLACK, line
    assert after[1] - before[1] <= THREAD_SLACK, line
    assert after[2] - before[2] <= RSS_SLACK, line
    assert max(leaks) <= ROUND_FD_SLACK, line


def one_run(off: int, n: int) -> TransferPlan:
    z = np.zeros(1, np.int64)
    a = lambda v: np.array([v], np.int64)  # noqa: E731
    return TransferPlan((RunGroup(z, z, z, z, a(off), a(off), a(n), False),))


def transport_round(name: str, src: torch.Tensor, requests: int) -> int:
    """Open a sender and a receiver, run ``requests`` small transfers, close both, with the
    collector off; the fds left open afterwards."""
    gc.disable()
    try:
        f0 = fds()
        a, b = get_transport(name, **OPTS[name]), get_transport(name, **OPTS[name])
        dst = torch.full((REGION,), CANARY, dtype=torch.uint8)
        want = np.full(REGION, CANARY, np.uint8)
        a.register([src])
        b.register([dst])
        peer = a.connect(b.descriptor())
        for k in range(requests):
            rid, off, n = f"soak.{next(_rids)}", k * 8192, 4096 + k
            b.expect(rid, ByteRanges(np.array([0]), np.array([off]), np.array([n])))
            assert a.submit(peer, rid, one_run(off, n), timeout=10.0).wait(10.0), f"{name} request {k} failed"
            want[off: off + n] = src.numpy()[off: off + n]
            b.arrivals()
            b.forget(rid)
        assert np.array_equal(dst.numpy(), want), f"{name}: bytes differ from the requests' runs"
        a.close()
        b.close()
        del a, b
        return fds() - f0
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["local", "zmq", "ucx"])
def test_soak_transports(name, extra_fds):
    if why := _usable(name):
        pytest.skip(why)
    src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    transport_round(name, src, 2)   # warm-up: first-use allocations are not a leak
    before = measure()
    leaks = [transport_round(name, src, PER_ROUND) for _ in range(ROUNDS)]
    check_bounds(f"{name} transports ({ROUNDS} rounds, {ROUNDS * PER_ROUND} requests)", before, measure(), leaks)


def endpoint_round(name: str, cfg: dict) -> int:
    """A prefill and a decode endpoint: connect, 2 requests byte-exact, close; fds left (gc off)."""
    gc.disable()
    try:
        f0 = fds()
        t = Timeouts(bootstrap=5, waiting=5, transfer=5, lease=5, handshake=5)
        p_kv, _ = rp.make_pools(cfg, cfg["seed"])
        d_kv, _ = rp.make_pools(cfg, None)
        before = [b.clone() for b in d_kv.buffers]
        spec = dict(num_kv_heads=cfg["pool"]["heads"], num_layers=cfg["pool"]["layers"])
        p = PrefillEndpoint(RankSpec(role="prefill", **spec), p_kv, transport=name, transport_options=OPTS[name],
                            timeouts=t)
        d = DecodeEndpoint(RankSpec(role="decode", **spec), d_kv, transport=name, transport_options=OPTS[name],
                           timeouts=t)
        try:
            d.connect(peers=[p.info])
            moves = []
            for room in range(PAIR_REQUESTS):
                slots = np.arange(16 + room * 16, 24 + room * 16)   # page 0 is padding
                r = d.receiver(room)
                r.init(slots)
                s = p.sender(room)
                s.send(slots, last=True)
                assert r.wait(10) == KVPoll.Success and s.wait(10) == KVPoll.Success, (r.reason, s.reason)
                moves.append((slots, slots))
            assert rp.same_bytes(d_kv.buffers, rp.reference(cfg, before, moves))
        finally:
            d.close()
            p.close()
        del p, d, p_kv, d_kv
        return fds() - f0
    finally:
        gc.enable()


@pytest.mark.parametrize("name", [
    "local",
    "zmq",
    "ucx",
])
def test_soak_endpoints(name, extra_fds):
    if why := _usable(name):
        pytest.skip(why)
    cfg = rp.config(name, pool={"num_pages": 64})
    endpoint_round(name, cfg)   # warm-up
    before = measure()
    leaks = [endpoint_round(name, cfg) for _ in range(PAIRS)]
    check_bounds(f"{name} endpoints ({2 * PAIRS} endpoints, {PAIRS * PAIR_REQUESTS} requests)", before, measure(),
                 leaks)
