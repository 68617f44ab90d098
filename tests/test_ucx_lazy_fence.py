"""Lazy fences (``Outbox.send(lazy=True)``): a FENCE (receiver, at ``forget``) and a FENCED
(sender, after its flush) wait for the next control batch to their peer, or for the loop's
tick. On an in-process pair:

- in a stream of requests, each request's FENCE leaves with the next request's PREGRANT and its
  FENCED with the next transfer's batch (one batch each way per request, not two), every
  transfer lands byte-exact, and the last FENCE, which no batch takes along, still leaves at
  the tick: its memory is released;
- a FENCE and a PREGRANT of the same request id queued after it (the id expected again) leave
  in that order: the sender ends up holding the new pregrant, and a transfer of it lands;
- a peer's queue of lazy messages leaves at once when it holds ``LAZY_HELD`` of them (a flood
  of FENCEs is answered as it comes, never held for a tick).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

pytest.importorskip("ucxx")

from ucx_pair import CANARY, connected_pair  # noqa: E402
from waiting import until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402

KiB = 1 << 10
RUN = 64 * KiB
REQUESTS = 12
# Pings every 5 s (none in the test); the tick stays at a tenth of a second
OPTS = {"heartbeat": 5.0, "peer_timeout": 30.0, "eager_writes": True}


@pytest.fixture
def pair():
    yield from connected_pair(REQUESTS * RUN, seed=11, **OPTS)


@pytest.fixture
def batches(monkeypatch):
    """Every control batch either transport packs, as (transport id, message type names)."""
    import kvxfer_transports.ucx.outbox as outbox
    got: list[tuple[str, list[str]]] = []
    orig = outbox.pack_batch
    monkeypatch.setattr(outbox, "pack_batch", lambda sender, secret, msgs: (
        got.append((sender, [type(m).__name__ for m in msgs])), orig(sender, secret, msgs))[1])
    return got


def one_run(k: int) -> tuple[np.ndarray, ...]:
    z = np.zeros(1, np.int64)
    return z, np.array([k * RUN]), np.array([RUN])


def transfer(rx, tx, pid, rid: str, k: int) -> None:
    """Grant ``rid`` request ``k``'s run, wait for its PREGRANT at the sender, send the source's
    run ``k`` there, wait for the arrival."""
    z, off, n = one_run(k)
    rx.expect(rid, ByteRanges(z, off, n))
    assert until(lambda: rid in tx.peers[pid].pregranted, 10.0), "no PREGRANT reached the sender"
    h = tx.submit(pid, rid, TransferPlan((RunGroup(z, z, z, z, off, off, n, False),)), timeout=10)
    assert h.wait(10), h.error
    got: list = []
    assert until(lambda: got.extend(rx.arrivals()) or got, 10.0), f"no arrival for {rid}"
    assert [(a.request_id, a.ok) for a in got] == [(rid, True)], got


def test_a_stream_of_requests_fences_each_one_with_the_next_ones_batches(pair, batches):
    rx, tx, pid, src, dst = pair
    rids = [f"s{k}" for k in range(REQUESTS)]
    for k, rid in enumerate(rids):
        transfer(rx, tx, pid, rid, k)
        rx.forget(rid)
    assert np.array_equal(dst.numpy(), src.numpy()), "a transfer's bytes differ"
    # the last FENCE had no batch to ride with: it left at a tick, and so did its FENCED
    assert until(lambda: not any(rx.writes_pending(r) for r in rids), 5.0), rx.fencing()
    by = collections.defaultdict(list)
    for sender, kinds in batches:
        by[sender].append(kinds)
    fences = [kinds for kinds in by[rx.id] if "Fence" in kinds]
    fenced = [kinds for kinds in by[tx.id] if "Fenced" in kinds]
    # A tick may fall between a forget and the next expect (~1 ms apart, ticks 100 ms apart):
    # that FENCE leaves alone. Without lazy fences none rides along.
    rode = sum("Pregrant" in kinds for kinds in fences)
    assert rode >= REQUESTS - 3, f"{rode} of {REQUESTS - 1} FENCEs rode with a PREGRANT: {fences}"
    rode = sum("Announce" in kinds for kinds in fenced)
    assert rode >= REQUESTS - 3, f"{rode} of {REQUESTS - 1} FENCEDs rode with a transfer's batch: {fenced}"
    assert len(by[rx.id]) <= 2 * REQUESTS + 2, by[rx.id]   # per request: PREGRANT (+ the FENCE before), ACK


def test_a_fence_and_a_later_pregrant_of_the_same_id_keep_their_order(pair, batches):
    rx, tx, pid, src, dst = pair
    transfer(rx, tx, pid, "again", 0)
    rx.forget("again")                                        # its FENCE waits for company
    z, off, n = one_run(1)
    rx.expect("again", ByteRanges(z, off, n))                 # ... and leaves with this PREGRANT, first
    assert until(lambda: not rx.writes_pending("again"), 5.0), rx.fencing()   # the sender said FENCED
    sent = [kinds for sender, kinds in batches if sender == rx.id and "Fence" in kinds]
    assert sent and sent[-1].index("Fence") < sent[-1].index("Pregrant"), sent
    assert until(lambda: "again" in tx.peers[pid].pregranted, 5.0), "the new pregrant was fenced away"
    h = tx.submit(pid, "again", TransferPlan((RunGroup(z, z, z, z, off, off, n, False),)), timeout=10)
    assert h.wait(10), h.error
    got: list = []
    assert until(lambda: got.extend(rx.arrivals()) or got, 10.0), "no arrival"
    assert [(a.request_id, a.ok) for a in got] == [("again", True)], got
    m = np.zeros(dst.numel(), bool)
    m[:2 * RUN] = True
    assert np.array_equal(dst.numpy()[m], src.numpy()[m]), "the bytes differ"
    assert (dst.numpy()[~m] == CANARY).all(), "a byte outside the grants changed"


def test_a_queue_of_lazy_messages_leaves_once_it_holds_lazy_held_of_them(pair):
    """A flood of FENCEs from a peer is answered as it comes: lazy messages wait for company only
    while the peer's queue is short (``LAZY_HELD`` messages of up to ``MERGE_RIDS`` ids each)."""
    from kvxfer_transports.ucx.outbox import LAZY_HELD, MERGE_RIDS
    from kvxfer_transports.ucx.protocol import Fenced
    rx, tx, pid, _, _ = pair

    def queue() -> list[bool]:   # on the I/O thread, inside one turn
        p = tx.peers[pid]
        p.outbox, p.outbox_due, due = [], False, []
        for k in range(LAZY_HELD + 1):   # each one a message of its own: a full one before it
            tx.outbox.send(p, Fenced(tuple(f"{k}.{i}" for i in range(MERGE_RIDS))), lazy=True)
            due.append(p.outbox_due)
        p.outbox, p.outbox_due = [], False
        return due

    assert tx.call_io(queue) == [False] * LAZY_HELD + [True]
