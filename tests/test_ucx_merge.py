"""UCX control messages that carry request ids (PREGRANT, FENCE, FENCED) join the one before them
when it is of their kind, within a turn (``Outbox.send``): a turn of forgets costs the sender
one endpoint flush and one FENCED, not one per request. On an in-process pair: the merge itself,
and eager transfers whose forgets are merged, byte-exact, fenced (writes_pending False) after."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
POOL = 1 * MiB
CANARY = 0xA5
OPTS = {"heartbeat": 0.2, "peer_timeout": 30.0, "eager_writes": True}


@pytest.fixture(scope="module")
def pair():
    rx, tx = get_transport("ucx", **OPTS), get_transport("ucx", **OPTS)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = torch.full((POOL,), CANARY, dtype=torch.uint8)
    rx.register([dst])
    tx.register([src])
    pid = tx.connect(rx.descriptor())
    yield rx, tx, pid, src, dst
    tx.close()
    rx.close()


def test_consecutive_id_messages_join(pair):
    from kvxfer_transports.ucx.outbox import MERGE_RIDS
    from kvxfer_transports.ucx.protocol import Fence, Fenced, Ping, Pregrant
    rx, tx, pid, _, _ = pair

    def sends():   # on the I/O thread, inside one turn; the outbox is read and emptied before it leaves
        p = tx.peers[pid]
        p.outbox = []
        for m in (Fence(("a",)), Fence(("b",)), Ping(), Fence(("c",)), Fenced((), True), Fenced(("x",)),
                  Fenced(("y",)), Fenced((), True), Pregrant(tuple(map(str, range(MERGE_RIDS))), (b"",) * MERGE_RIDS),
                  Pregrant(("z",), (b"",))):
            tx.outbox.send(p, m)
        out, p.outbox = p.outbox, []
        return out

    out = tx.call_io(sends)
    assert [type(m).__name__ for m in out] == ["Fence", "Ping", "Fence", "Fenced", "Fenced", "Fenced", "Pregrant",
                                               "Pregrant"]
    assert out[0].rids == ("a", "b") and out[2].rids == ("c",)
    assert out[3].all and out[4].rids == ("x", "y") and not out[4].all and out[5].all   # "all" joins nothing
    assert len(out[6].rids) == MERGE_RIDS and out[7].rids == ("z",)


def test_eager_transfers_whose_forgets_merge_are_fenced_and_exact(pair):
    rx, tx, pid, src, dst = pair
    z = np.zeros(1, np.int64)
    rids = [f"m{k}" for k in range(40)]
    for k, rid in enumerate(rids):   # each request its own 4 KiB of the pool
        rx.expect(rid, ByteRanges(z, np.array([k * 4 * KiB]), np.array([4 * KiB])))
    assert until(lambda: all(r in tx.peers[pid].pregranted for r in rids), 10.0), "PREGRANTs never came"
    so = np.random.default_rng(2).choice(POOL // (4 * KiB), len(rids), replace=False) * 4 * KiB
    hs = [tx.submit(pid, rid, TransferPlan((RunGroup(z, z, z, z, np.array([s]), np.array([k * 4 * KiB]),
                                                     np.array([4 * KiB]), False),)), timeout=30)
          for k, (rid, s) in enumerate(zip(rids, so.tolist()))]
    assert all(h.wait(30) for h in hs), [h.error for h in hs if h.error]
    arrs = []
    assert until(lambda: arrs.extend(rx.arrivals()) or len(arrs) == len(rids), 10.0), arrs
    assert all(a.ok for a in arrs)
    want = np.full(POOL, CANARY, np.uint8)
    for k, s in enumerate(so.tolist()):
        want[k * 4 * KiB:(k + 1) * 4 * KiB] = src.numpy()[s:s + 4 * KiB]
    assert np.array_equal(dst.numpy(), want)
    for rid in rids:   # one turn of the receiver's I/O thread sends most of these FENCEs as one
        rx.forget(rid)
    assert until(lambda: not any(rx.writes_pending(r) for r in rids), 10.0), rx.fencing()
