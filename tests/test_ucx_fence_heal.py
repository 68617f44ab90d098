"""A sender the receiver fenced, though the sender never saw the receiver silent (issue 17: the
first request after a healed partition ended Aborted on one decode rank).

Silence is seen per direction: here the sender's I/O thread stalls for longer than the
receiver's ``peer_timeout`` but shorter than its own, so the receiver fences it while the
sender, reading the receiver's pings as soon as it wakes, never takes the receiver for silent.
The first transfer after the stall must still land byte-exact: the sender re-handshakes (flush,
HELLO with a new epoch) before its announce is taken, and the receiver reports no failure.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow   # stalls or stops a peer and waits (the full tier)

from waiting import arrivals_of, until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.kit import Call  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

POOL, N, CANARY = 1 << 20, 256 << 10, 0xA5
STALL = 1.5


def plan(n: int) -> TransferPlan:
    z = np.zeros(1, np.int64)
    return TransferPlan((RunGroup(z, z, z, z, np.array([0]), np.array([4096]), np.array([n]), False),))


@pytest.fixture
def pair():
    rx = get_transport("ucx", heartbeat=0.1, peer_timeout=0.6)
    tx = get_transport("ucx", heartbeat=0.1, peer_timeout=30.0)
    dst = torch.full((POOL,), CANARY, dtype=torch.uint8)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    rx.register([dst])
    tx.register([src])
    peer = tx.connect(rx.descriptor())
    try:
        yield rx, tx, peer, src, dst
    finally:
        tx.close()
        rx.close()


def stall_sender(rx, tx) -> None:
    """Stall the sender's I/O thread until the receiver has fenced it."""
    tx.commands.put(Call(time.sleep, (STALL,)))
    assert until(lambda: rx.fencing()["fenced_peers"] == 1, STALL), rx.fencing()


def transfer_lands(rx, tx, peer, src, dst, rid: str) -> None:
    rx.expect(rid, ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    # Submitted while the sender stalls: queued behind the stall, its announce leaves in the
    # sender's first turn after it, before the receiver's word that it fenced us can arrive.
    h = tx.submit(peer, rid, plan(N), timeout=10)
    assert h.wait(12), f"the first transfer after the fence failed: {h.error}"
    arrived = arrivals_of(rx, rid)
    assert len(arrived) == 1 and arrived[0].ok, arrived
    assert torch.equal(dst[4096: 4096 + N], src[:N]), "bytes differ"
    assert bool((dst[:4096] == CANARY).all()) and bool((dst[4096 + N:] == CANARY).all())
    assert rx.fencing()["fenced_peers"] == 0, rx.fencing()
    assert tx.peers[peer].my_epoch >= 1, "the sender never re-handshook"


def test_announce_right_after_the_fence_is_announced_again_after_the_rehandshake(pair):
    rx, tx, peer, src, dst = pair
    stall_sender(rx, tx)
    transfer_lands(rx, tx, peer, src, dst, "heal.1")


def test_receiver_tells_a_fenced_sender_before_its_next_announce(pair):
    rx, tx, peer, src, dst = pair
    stall_sender(rx, tx)
    # The sender wakes and pings; the receiver answers "fenced" at once, so the sender
    # re-handshakes before it has anything to announce.
    assert until(lambda: tx.peers[peer].my_epoch >= 1, 5.0), "the sender never learned it was fenced"
    assert until(lambda: rx.fencing()["fenced_peers"] == 0, 5.0), rx.fencing()
    transfer_lands(rx, tx, peer, src, dst, "heal.2")


def test_a_go_for_an_announce_older_than_the_rehandshake_puts_nothing(pair):
    """The sender begins a re-handshake (here called directly, as a FENCED word would) while an
    announce of the old epoch waits for GO. That GO must not start puts (they would follow the
    flush and could land after the HELLO released the receiver's fence): the transfer fails,
    ABORT releases the receiver's hold, nothing lands, and the next transfer lands byte-exact."""
    rx, tx, peer, src, dst = pair
    rx.expect("old.1", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, POOL, np.int64)))
    rx.commands.put(Call(time.sleep, (0.5,)))     # the receiver answers the announce only later
    h = tx.submit(peer, "old.1", plan(N), timeout=10)
    assert until(lambda: any(o.state == "wait_go" for o in list(tx.sender.outgoing.values())), 2.0)
    tx.call_io(tx.rehandshake.begin, tx.peers[peer], "the test")
    assert h.wait(10) is False and "re-handshaking" in str(h.error), h.error
    assert bool((dst == CANARY).all()), "a put of the old epoch landed"
    rx.forget("old.1")
    assert until(lambda: not rx.writes_pending("old.1"), 5.0), rx.fencing()
    transfer_lands(rx, tx, peer, src, dst, "new.1")
