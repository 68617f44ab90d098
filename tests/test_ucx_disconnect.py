"""``UCXTransport.disconnect(peer)``: the prefill endpoint ends a decode peer that re-handshook
or was lost, so a peer's endpoint, rkeys and records do not leak per re-handshake.

An in-process pair (shared memory). Every transfer is checked byte for byte.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import arrivals_of, until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

POOL, CANARY = 8 << 20, 0xA5


def plan(n: int, dst: int = 4096) -> TransferPlan:
    z = np.zeros(1, np.int64)
    return TransferPlan((RunGroup(z, z, z, z, np.array([0]), np.array([dst]), np.array([n]), False),))


@pytest.fixture
def pair(request):
    """(receiver, sender, source, destination); the receiver pregrants (``eager_writes``) when the
    test passes ``pair`` the parameter True."""
    rx = get_transport("ucx", heartbeat=0.1, peer_timeout=3.0, eager_writes=getattr(request, "param", False))
    tx = get_transport("ucx", heartbeat=0.1, peer_timeout=3.0)
    dst = torch.full((POOL,), CANARY, dtype=torch.uint8)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    rx.register([dst])
    tx.register([src])
    try:
        yield rx, tx, src, dst
    finally:
        tx.close()
        rx.close()


def transfer_lands(rx, tx, peer, src, dst, rid: str, n: int = 256 << 10) -> None:
    dst.fill_(CANARY)
    rx.expect(rid, ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    h = tx.submit(peer, rid, plan(n), timeout=10)
    assert h.wait(12), h.error
    assert [a.ok for a in arrivals_of(rx, rid)] == [True]
    assert torch.equal(dst[4096: 4096 + n], src[:n]), "bytes differ"
    assert bool((dst[:4096] == CANARY).all()) and bool((dst[4096 + n:] == CANARY).all())


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_connect_disconnect_200_times_leaks_nothing(pair):
    rx, tx, src, dst = pair
    desc = rx.descriptor()
    peer = tx.connect(desc)
    transfer_lands(rx, tx, peer, src, dst, "d.0")
    base = None
    for k in range(200):
        tx.disconnect(peer)
        assert until(lambda: peer not in tx.peers, 5.0), f"cycle {k}: the disconnected peer was never freed"
        assert tx.connect(desc) == peer
        if k == 9:   # UCX allocates some things once: measure after a few cycles
            base = (fds(), threading.active_count(), len(rx.peers))
    # closing endpoints give their sockets back on UCX's own time: a leak stays, a close settles
    settled = until(lambda: fds() <= base[0] + 2 and threading.active_count() <= base[1]
                    and len(rx.peers) <= base[2], 5.0)   # each bound on its own (a tuple compares its first)
    assert settled, (base, (fds(), threading.active_count(), len(rx.peers)))
    assert len(tx.peers) == 1 and len(tx.peers.retired) == 0 and not tx.lifecycle.closing
    transfer_lands(rx, tx, peer, src, dst, "d.1")
    assert sum(rx.grants.rejected.values()) == 0, rx.grants.rejected   # no HELLO refused on the way


@pytest.mark.parametrize("pair", [False, True], ids=["checked", "eager"], indirect=True)
def test_disconnect_fails_in_flight_transfers_and_frees_after_the_flush(pair, monkeypatch):
    """The transfer in flight fails; the receiver holds its memory until the sender says that no
    put of it is left: ABORT after the flush (checked), FENCED-all once every flush to it ended
    (eager: the transfer was never announced). Its record (secret, epoch, what may still land)
    is kept before it leaves ``peers``: a thread that sees it gone finds the record (CI read it
    in between once)."""
    rx, tx, src, dst = pair
    kept_first, drop = [], tx.peers.drop
    monkeypatch.setattr(tx.peers, "drop", lambda p: (kept_first.append(p.id in tx.peers.retired), drop(p))[1])
    peer = tx.connect(rx.descriptor())
    rx.expect("x.1", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    h = tx.submit(peer, "x.1", plan(POOL - 4096), timeout=10)
    tx.disconnect(peer)   # most often before its puts are done
    h.wait(10)
    if h.error is not None:   # it did not finish first: failed with the reason, source held until flushed
        assert "disconnected" in str(h.error), h.error
        assert until(lambda: h.source_released, 5.0), tx.fencing()
        rx.forget("x.1")
        assert until(lambda: not rx.writes_pending("x.1"), 5.0), f"no ABORT or FENCED came: {rx.fencing()}"
    assert until(lambda: peer not in tx.peers, 5.0), "never freed"
    assert kept_first == [True], kept_first
    assert tx.fencing()["sources"] == 0
    assert tx.peers.retired[peer][2] is None   # flushed: the next connect's HELLO says every older epoch landed
    # Submitting to a disconnected peer fails at once; connect() brings it back.
    h2 = tx.submit(peer, "x.2", plan(4096), timeout=5)
    assert h2.wait(1) is False and "not connected" in str(h2.error), h2.error
    peer = tx.connect(rx.descriptor())
    transfer_lands(rx, tx, peer, src, dst, "x.3")


@pytest.mark.parametrize("pair", [True], ids=["eager"], indirect=True)
def test_a_pregrant_still_on_its_way_at_disconnect_holds_nothing(pair, monkeypatch):
    """The receiver pregranted the sender, which disconnects before it read that PREGRANT (here:
    never reads it): its FENCED-all (nothing of ours is on its way) still frees the request's
    memory once forgotten. Without it the receiver waits for a FENCED no one sends (forever: no
    quarantine_timeout). Seen under load: the in-flight test above, 5 failures in 14 runs."""
    rx, tx, src, dst = pair
    monkeypatch.setattr(tx.sender, "on_pregrant", lambda p, m: None)
    peer = tx.connect(rx.descriptor())
    assert until(lambda: any(p.sends_eager for p in rx.peers.values()), 5.0), "no HELLO"   # it may pregrant us
    rx.expect("p.1", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    assert until(lambda: rx.pregrants.granted.get("p.1"), 1.0), "no PREGRANT sent"
    tx.disconnect(peer)
    assert until(lambda: peer not in tx.peers, 5.0), "never freed"
    rx.forget("p.1")
    assert until(lambda: not rx.writes_pending("p.1"), 5.0), f"the memory stays held: {rx.fencing()}"


@pytest.mark.parametrize("pair", [True], ids=["eager"], indirect=True)
def test_after_a_failed_flush_the_receiver_keeps_the_memory(pair, monkeypatch):
    """A flush of our eager puts failed: what it covered may still land, so neither the FENCE of
    its request nor the disconnect tells the receiver FENCED; its memory stays held."""
    from kvxfer_transports.ucx import bindings
    rx, tx, src, dst = pair
    peer = tx.connect(rx.descriptor())
    transfer_lands(rx, tx, peer, src, dst, "f.0")   # pregranted, eager: the receiver expects FENCEDs of us
    ep, real = tx.peers[peer].ep.handle, bindings.ep_flush
    monkeypatch.setattr(bindings, "ep_flush", lambda e, param: 2**64 - 3 if e == ep else real(e, param))
    rx.expect("f.1", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    h = tx.submit(peer, "f.1", plan(64 << 10), timeout=5)
    assert h.wait(5) is False and "flush failed" in str(h.error), h.error
    rx.forget("f.1")
    tx.disconnect(peer)
    assert until(lambda: peer not in tx.peers, 5.0), "never freed"
    time.sleep(0.5)
    assert rx.writes_pending("f.1"), f"FENCED after a failed flush: {rx.fencing()}"
    epoch = tx.peers.retired[peer][1]
    assert tx.peers.retired[peer][2] == epoch, "not flushed: the epoch must be kept undrained"
    monkeypatch.undo()
    peer = tx.connect(rx.descriptor())   # a new epoch whose HELLO says that one may still land
    transfer_lands(rx, tx, peer, src, dst, "f.2")
    time.sleep(0.5)
    assert rx.writes_pending("f.1"), f"released at the reconnect: {rx.fencing()}"


def test_disconnect_is_idempotent_unknown_is_a_noop_and_connect_may_come_at_once(pair):
    rx, tx, src, dst = pair
    tx.disconnect("no-such-peer")
    desc = rx.descriptor()
    peer = tx.connect(desc)
    tx.disconnect(peer)
    tx.disconnect(peer)
    assert tx.connect(desc) == peer          # while its disconnect may still be pending
    transfer_lands(rx, tx, peer, src, dst, "i.1")
    assert rx.fencing()["fenced_peers"] == 0, rx.fencing()
    tx.disconnect(peer)
    assert until(lambda: peer not in tx.peers, 5.0)
    # The receiver had our BYE and fenced us; reconnecting re-handshakes with a higher epoch.
    assert tx.connect(desc) == peer
    transfer_lands(rx, tx, peer, src, dst, "i.2")


@pytest.mark.slow   # a receiver stalls for seconds (the full tier)
def test_disconnect_holds_the_source_until_the_puts_are_flushed(tmp_path):
    """Over TCP a put reads the source until the receiver takes it. Disconnecting a receiver
    that stalls (GO in hand, then silent) fails the transfer at once, but the source and the
    peer's endpoint stay until the flush completes; then both go, and every put did land."""
    from xfer_peer import digest_of, stalled_receiver
    with stalled_receiver(tmp_path) as (tx, rx, peer, region, plan):
        h = tx.submit(peer, "t.1", plan, timeout=20.0)
        assert until(lambda: any(o.state == "flushing" for o in list(tx.sender.outgoing.values())), 5.0), "no GO came"
        tx.disconnect(peer)
        assert h.wait(2.0) is False and "disconnected" in str(h.error), h.error
        time.sleep(1.5)   # past peer_timeout, the receiver still stalled
        assert not h.source_released, "the source was released while puts of it were in flight"
        assert peer in tx.peers, "the endpoint was closed while puts of it were in flight"
        assert until(lambda: h.source_released, 15.0), f"never released after the receiver woke: {tx.fencing()}"
        assert until(lambda: peer not in tx.peers, 5.0), "the peer was never freed"
        assert rx.call("digest", regions=[0])["digests"]["0"] == digest_of(region), \
            "the stalled receiver did not get every put once it woke"
