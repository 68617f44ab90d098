"""UCX transport between real processes, continued from ``test_ucx.py`` (the same peer processes'
fixtures, imported): which runs are put and which packed, head-slice rows, and a peer killed
mid-transfer. Every transfer is checked byte for byte against what was sent."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ucxx")

import test_ucx  # noqa: E402
from test_ucx import CANARY, POOL, KiB, MiB, plan_of, whole  # noqa: E402

from kvxfer.errors import PeerError, TransferTimeout  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import FEW_RUNS  # noqa: E402
from kvxfer.transport.base import TransferStatus  # noqa: E402

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

pair = test_ucx.pair   # the same fixture, over this module's own peer processes:


@pytest.fixture(scope="module")
def peers():
    """Receivers without eager writes: the killed-peer case is white box about GO (the peer dies
    after its GO, before our puts). ``test_ucx.py`` runs the same receivers with the default."""
    started = {name: test_ucx.Peer(tls, eager_writes=False) for name, tls in test_ucx.TLS.items()}
    yield started
    for p in started.values():
        p.stop()


def test_mid_size_runs_are_put_in_small_plans_and_packed_in_large_ones(pair):
    """16 KiB runs: a plan of a few is put (no frame's rendezvous); a plan of many travels
    packed (no system call per run). Both land exactly, nothing else changes."""
    t, src, peer, pid = pair
    assert t.options.put_below <= 16 * KiB < t.options.put_below_many
    rng = np.random.default_rng(8)
    for k, rid in ((4, "r-mid-few"), (48, "r-mid-many")):
        so = rng.choice(POOL // (16 * KiB), k, replace=False) * 16 * KiB
        do = rng.choice(POOL // (16 * KiB), k, replace=False) * 16 * KiB
        plan = plan_of([(so, do, 16 * KiB, False)])
        prepare = t.planner.prepare_few if k <= FEW_RUNS else t.planner.prepare
        _, _, nput, packed = prepare(t.peers[pid], plan)[:4]   # prepare_few: and the inline bytes
        assert (nput, packed is None) == ((k, True) if k <= FEW_RUNS else (0, False))
        peer("expect", rid, whole(POOL))
        h = t.submit(pid, rid, plan, timeout=30)
        assert h.wait(30), h.error
        assert peer("arrivals", 10, 1)[0][2]
        got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
        for a, b in zip(so.tolist(), do.tolist()):
            want[b: b + 16 * KiB] = src[a: a + 16 * KiB]
        assert np.array_equal(got, want)
        peer("forget", rid)
        peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


@pytest.mark.parametrize("strided", ["source", "destination"])
def test_head_slice_rows_announce_whole_pages(pair, strided):
    """Token-major head slices: 512 B rows, strided on one side and back to back within a page
    on the other (TP 2 -> 4 and 4 -> 2). Each side posts and checks the page, not 16 rows; a few
    put runs ride along. Bytes land exactly and nothing else changes."""
    t, src, peer, pid = pair
    pages = np.random.default_rng(5).choice(POOL // (32 * KiB) - 2, 40, replace=False) * 32 * KiB
    strided_off = (pages[:, None] + np.arange(16) * 1024).ravel()    # 512 B of every 1 KiB row
    whole_off = (pages[::-1, None] + 16 * KiB + np.arange(16) * 512).ravel()   # pages of 8 KiB
    so, do = (strided_off, whole_off) if strided == "source" else (whole_off, strided_off)
    n = np.full(len(so), 512)
    big = ([POOL - 64 * KiB], [POOL - 64 * KiB], [64 * KiB], False)   # one put
    plan = plan_of([(so, do, n, False), big])
    puts, announced, nput, packed = t.planner.prepare(t.peers[pid], plan)
    runs = np.frombuffer(announced, "<i8").reshape(3, -1)
    assert nput == 1 and len(puts) == 40   # one put: a row of 5 int64
    assert runs.shape[1] == 1 + (40 if strided == "source" else 640)   # the put, then the packed runs
    assert len(packed[2]) == (640 if strided == "source" else 40)
    peer("expect", "r-rows", whole(POOL))
    h = t.submit(pid, "r-rows", plan, timeout=30)
    assert h.wait(30), h.error
    assert peer("arrivals", 10, 1)[0][2]
    got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
    for a, b, c in zip([*so.tolist(), *big[0]], [*do.tolist(), *big[1]], [*n.tolist(), *big[2]]):
        want[b: b + c] = src[a: a + c]
    assert np.array_equal(got, want)
    peer("forget", "r-rows")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_killed_peer_mid_transfer_fails_both_ways(pair):
    """Runs last per TLS: kills the pair's peer while a transfer to it and one from it are in flight.

    White box, to hit the worst moments deterministically: the peer dies after it sent GO
    and before our puts (over shared memory UCX would abort() on the dead pid without the
    transport's log hook), and the peer's own transfer to us is stuck after its GO.
    """
    t, src, peer, pid = pair
    t.expect("r-from-dead", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, MiB)))
    my_id = peer("connect", t.descriptor())
    peer("submit", my_id, "r-from-dead", [([0], [0], [MiB], False)], 30.0, True)
    end = time.monotonic() + 10
    while not t.receiver.incoming and time.monotonic() < end:  # its ANNOUNCE arrived and we answered GO
        time.sleep(0.005)
    assert t.receiver.incoming, "the peer's transfer never started"
    peer("expect", "r-to-dead", whole(POOL))
    real_start_puts = t.sender.start_puts

    def kill_then_put(out, dtag):
        peer.kill()
        real_start_puts(out, dtag)
    t.sender.start_puts = kill_then_put
    start = time.monotonic()
    h = t.submit(pid, "r-to-dead", plan_of([([0], [0], [8 * MiB], False), ([0], [9 * MiB], [4 * KiB], True)]),
                 timeout=30)
    assert not h.wait(30)
    assert isinstance(h.error, PeerError | TransferTimeout), h.error
    got = []
    while not got and time.monotonic() - start < 30:
        got = t.arrivals(0.1)
    assert [(a.request_id, a.ok) for a in got] == [("r-from-dead", False)], got
    assert time.monotonic() - start < 10, "a dead peer must be noticed by heartbeats, well before the deadline"
    t.sender.start_puts = real_start_puts
    h2 = t.submit(pid, "r-to-dead", plan_of([([0], [0], [4096], False)]), timeout=2)
    assert not h2.wait(10) and h2.poll() == TransferStatus.FAILED
