"""A PREGRANT carries the request's granted ranges, and a UCX sender puts eagerly only inside
them (``transports/ucx/eager.py``): a transfer with a run outside is announced and refused
before a byte is put, as without eager writes. Also: the ranges' wire form and its checks, the
sender's memory bound for what it was pregranted, grants too large to send, and PREGRANTs that
join. On an in-process pair of real UCX transports; every transfer's bytes are checked, and
every byte outside what it may write keeps the canary. A submit that comes before its
PREGRANT waits for it (bounded), then goes eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import arrivals_of, until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
POOL = 4 * MiB
CANARY = 0xA5
OPTS = {"heartbeat": 0.2, "peer_timeout": 30.0, "eager_writes": True}


@pytest.fixture(scope="module")
def pair():
    rx, tx = get_transport("ucx", **OPTS), get_transport("ucx", **OPTS)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.full((POOL,), CANARY, dtype=torch.uint8)
    rx.register([dst])
    tx.register([src])
    pid = tx.connect(rx.descriptor())
    sent: list[str] = []
    orig = rx.outbox.send
    rx.outbox.send = lambda p, m, **kw: (sent.append(type(m).__name__), orig(p, m, **kw))[1]   # what the receiver sends
    yield rx, tx, pid, src, dst, sent
    tx.close()
    rx.close()


def grant(offs, n) -> ByteRanges:
    offs, n = np.asarray(offs, np.int64), np.asarray(n, np.int64)
    return ByteRanges(np.zeros(len(offs), np.int64), offs, n)


def plan(src_offs, dst_offs, n) -> TransferPlan:
    s, d, k = (np.asarray(x, np.int64) for x in (src_offs, dst_offs, n))
    z = np.zeros(len(k), np.int64)
    return TransferPlan((RunGroup(z, z, z, z, s, d, k, False),))


def pregranted(tx, pid, rid) -> None:
    assert until(lambda: rid in tx.peers[pid].pregranted, 10.0), "no PREGRANT reached the sender"


def reset(dst) -> None:
    dst.fill_(CANARY)


def test_ranges_round_trip_and_refuse_what_packed_never_makes():
    r = ByteRanges(np.array([0, 0, 1, 0]), np.array([4096, 0, 64, 8192]), np.array([4096, 100, 16, 1]))
    back = ByteRanges.from_packed(r.packed())
    assert len(back) == len(r) == 3 and back.nbytes == r.nbytes   # [0, 100) and [4096, 8193) in 0, one in 1
    for run in ((0, 0, 100), (0, 4096, 4097), (1, 64, 16), (0, 100, 1), (1, 60, 8), (2, 0, 1)):
        assert back.covers_run(*run) == r.covers_run(*run), run
    one = np.array([[0, 10]], "<i8")
    for bad in (b"x" * 15, np.array([[10, 10]], "<i8").tobytes(), np.array([[-1, 10]], "<i8").tobytes(),
                np.array([[20, 30], [0, 10]], "<i8").tobytes(),                   # not sorted
                np.array([[(1 << 40) - 1, (1 << 40) + 1]], "<i8").tobytes(),        # crosses into region 1
                np.array([[0, (1 << 62) + 1]], "<i8").tobytes()):
        with pytest.raises(ValueError):
            ByteRanges.from_packed(bad)
    assert ByteRanges.from_packed(one.tobytes()).covers_run(0, 0, 10)
    assert len(ByteRanges.from_packed(b"")) == 0


def test_many_ranges_take_the_array_path_with_the_same_checks():
    starts = np.arange(40, dtype=np.int64) * 1000
    good = np.stack([starts, starts + 100], 1).astype("<i8")
    back = ByteRanges.from_packed(good.tobytes())
    assert len(back) == 40 and back.nbytes == 4000 and back.packed() == good.tobytes()
    assert back.covers(np.zeros(3, np.int64), np.array([0, 1000, 150]), np.array([100, 50, 10])).tolist() == \
        [True, True, False]
    for defect in ("swap", "empty", "negative", "crosses"):
        bad = good.copy()
        if defect == "swap":
            bad[[3, 4]] = bad[[4, 3]]
        elif defect == "empty":
            bad[7, 1] = bad[7, 0]
        elif defect == "negative":
            bad[0, 0] = -1
        else:
            bad[-1] = [(1 << 40) - 10, (1 << 40) + 10]
        with pytest.raises(ValueError):
            ByteRanges.from_packed(bad.tobytes())


def test_pregrant_wire_is_checked():
    from kvxfer_transports.ucx.protocol import MAX_PREGRANT_BYTES, PREGRANT, Malformed, Pregrant, parse_message
    ok = parse_message([PREGRANT, ["a", "b"], [b"", b"\0" * 16]], 1 << 20)
    assert ok == Pregrant(("a", "b"), (b"", b"\0" * 16))
    for bad in ([PREGRANT, ["a"]], [PREGRANT, ["a"], []], [PREGRANT, ["a"], ["x" * 16]], [PREGRANT, ["a"], b""],
                [PREGRANT, ["a"], [b"\0" * 15]], [PREGRANT, ["a"], [b"\0" * (MAX_PREGRANT_BYTES + 16)]]):
        with pytest.raises(Malformed):
            parse_message(bad, 1 << 30)
    with pytest.raises(ValueError):
        Pregrant(("a",), ())


@pytest.mark.parametrize("runs", [2, 40], ids=["few runs", "many runs"])
def test_eager_puts_stay_inside_the_pregranted_ranges(pair, runs):
    """A sender whose plan has a run outside the grant does not put it eagerly: it announces,
    the receiver refuses before GO, and no byte anywhere changes (the in-grant runs neither).
    Plans of up to ``few_runs`` runs are checked with Python ints, longer ones with arrays."""
    rx, tx, pid, src, dst, sent = pair
    reset(dst)
    rid = f"out.{runs}"
    offs = np.arange(runs) * 64 * KiB
    rx.expect(rid, grant(offs[:-1], np.full(runs - 1, 32 * KiB)))   # the last run is not granted
    pregranted(tx, pid, rid)
    del sent[:]
    h = tx.submit(pid, rid, plan(offs, offs, np.full(runs, 32 * KiB)), timeout=10)
    assert not h.wait(10) and "refused" in str(h.error), h.error   # in no-oracle words
    (a,) = arrivals_of(rx, rid)
    assert not a.ok and a.reason.startswith("outside grant"), a
    assert (dst.numpy() == CANARY).all(), "an eager put landed outside (or before the check of) its grant"
    assert "Go" not in sent
    rx.forget(rid)


def test_eager_transfer_inside_the_ranges_needs_no_go_and_is_exact(pair):
    rx, tx, pid, src, dst, sent = pair
    reset(dst)
    offs = np.arange(8) * 256 * KiB + 4 * KiB   # 8 granted runs, apart
    rx.expect("in.1", grant(offs, np.full(8, 64 * KiB)))
    pregranted(tx, pid, "in.1")
    del sent[:]
    so = offs[::-1] + 128 * KiB
    h = tx.submit(pid, "in.1", plan(so, offs, np.full(8, 64 * KiB)), timeout=10)
    assert h.wait(10), h.error
    (a,) = arrivals_of(rx, "in.1")
    assert a.ok, a
    assert "Go" not in sent, sent   # it went eager: no ANNOUNCE/GO round trip
    want = np.full(POOL, CANARY, np.uint8)
    for s, d in zip(so.tolist(), offs.tolist()):
        want[d:d + 64 * KiB] = src.numpy()[s:s + 64 * KiB]
    assert np.array_equal(dst.numpy(), want)
    rx.forget("in.1")


def test_grant_too_large_to_send_is_announced_and_exact(pair, monkeypatch):
    """A grant of more intervals than a PREGRANT carries is not pregranted (its PREGRANT has no
    ranges, so the sender does not wait for one): its transfer goes through ANNOUNCE/GO and
    lands exactly."""
    from kvxfer_transports.ucx import eager
    rx, tx, pid, src, dst, sent = pair
    reset(dst)
    monkeypatch.setattr(eager, "MAX_PREGRANT_BYTES", 16 * 16)   # 16 intervals at most
    offs = np.arange(17) * 8 * KiB
    rx.expect("big.1", grant(offs, np.full(17, 4 * KiB)))
    rx.expect("small.1", grant([1 * MiB], [4 * KiB]))   # after it: its PREGRANT shows big.1's was handled
    pregranted(tx, pid, "small.1")
    assert len(tx.peers[pid].pregranted["big.1"]) == 0   # a PREGRANT without ranges: announce
    monkeypatch.setattr(tx.eager, "pregrant_wait", 60.0)   # so it must not wait for another one
    del sent[:]
    h = tx.submit(pid, "big.1", plan(offs + 2 * MiB, offs, np.full(17, 4 * KiB)), timeout=10)
    assert h.wait(10), h.error
    assert arrivals_of(rx, "big.1")[0].ok
    assert "Go" in sent, sent
    want = np.full(POOL, CANARY, np.uint8)
    for o in offs.tolist():
        want[o:o + 4 * KiB] = src.numpy()[o + 2 * MiB:o + 2 * MiB + 4 * KiB]
    assert np.array_equal(dst.numpy(), want)
    rx.forget("big.1")
    rx.forget("small.1")


def test_sender_bounds_what_it_remembers_and_refuses_bad_ranges(pair, monkeypatch):
    from kvxfer_transports.ucx import eager
    from kvxfer_transports.ucx.protocol import Pregrant
    rx, tx, pid, *_ = pair
    monkeypatch.setattr(eager, "MAX_PREGRANTED_BYTES", 100 * eager.INTERVAL_COST)
    ten = np.stack([np.arange(10) * 100, np.arange(10) * 100 + 10], 1).astype("<i8").tobytes()
    bad = np.array([[50, 60], [0, 10]], "<i8").tobytes()
    before = tx.grants.rejected["malformed message"]

    def feed():
        p = tx.peers[pid]
        for k in range(30):
            tx.sender.on_pregrant(p, Pregrant((f"b{k}",), (ten,)))
        tx.sender.on_pregrant(p, Pregrant(("bad",), (bad,)))
        return list(p.pregranted), p.pregranted_bytes

    ids, used = tx.call_io(feed)
    assert used <= 100 * eager.INTERVAL_COST and used == sum(len(tx.peers[pid].pregranted[r]) for r in ids) * 96
    assert [r for r in ids if r.startswith("b")][-10:] == [f"b{k}" for k in range(20, 30)]   # the newest kept
    assert "bad" not in ids and tx.grants.rejected["malformed message"] == before + 1
    tx.call_io(lambda: tx.sender.on_fence(tx.peers[pid], __import__("kvxfer_transports.ucx.protocol",
                                                                  fromlist=["Fence"]).Fence(tuple(ids))))
    assert tx.call_io(lambda: tx.peers[pid].pregranted_bytes) == 0
    # a re-handshake forgets every pregrant, and what they took
    tx.call_io(lambda: [tx.sender.on_pregrant(tx.peers[pid], Pregrant((f"c{k}",), (ten,))) for k in range(3)])
    tx.call_io(lambda: tx.rehandshake.begin(tx.peers[pid], "the test"))
    assert tx.call_io(lambda: (dict(tx.peers[pid].pregranted), tx.peers[pid].pregranted_bytes)) == ({}, 0)
    assert until(lambda: tx.call_io(lambda: tx.peers[pid].rehello is None), 10.0), "the re-handshake never ended"


def test_pregrants_join_within_the_byte_bound(pair):
    from kvxfer_transports.ucx.outbox import MERGE_GRANT_BYTES
    from kvxfer_transports.ucx.protocol import Ping, Pregrant
    rx, tx, pid, *_ = pair
    half = b"\0" * (MERGE_GRANT_BYTES // 2)

    def sends():   # on the I/O thread, inside one turn; the outbox is read and emptied before it leaves
        p = tx.peers[pid]
        p.outbox = []
        for m in (Pregrant(("a",), (half,)), Pregrant(("b",), (half,)), Pregrant(("c",), (b"\0" * 16,)), Ping(),
                  Pregrant(("d",), (b"",)), Pregrant(("e",), (b"\0" * 32,))):
            tx.outbox.send(p, m)
        out, p.outbox = p.outbox, []
        return out

    out = tx.call_io(sends)
    assert [m.rids for m in out[:2]] == [("a", "b"), ("c",)] and out[0].grants == (half, half)
    assert out[3].rids == ("d", "e") and out[3].grants == (b"", b"\0" * 32)


def warm(rx, tx, pid) -> None:
    """The receiver has pregranted the sender once: the sender now waits for PREGRANTs (``_park``)."""
    rx.expect("warm", grant([3 * MiB], [4 * KiB]))
    pregranted(tx, pid, "warm")
    rx.forget("warm")


def parked(tx) -> int:
    return tx.call_io(lambda: sum(map(len, tx.eager.parked.values())) + len(tx.eager.park_order))


@pytest.mark.parametrize("size,runs", [(96 * KiB, 3), (4 * KiB, 1)], ids=["3 runs of 96 KiB", "one 4 KiB run"])
def test_submit_before_its_pregrant_waits_for_it_and_goes_eager(pair, monkeypatch, size, runs):
    """The request reached the sender before the receiver's PREGRANT did (it was expected after
    the submit here): the transfer waits for the PREGRANT, then puts eagerly, exactly, no GO.
    Announced at once instead, it would be refused (the request was not granted yet). A small
    run is put too (not packed inline), or it could not go eager."""
    rx, tx, pid, src, dst, sent = pair
    warm(rx, tx, pid)
    reset(dst)
    monkeypatch.setattr(tx.eager, "pregrant_wait", 60.0)
    rid = f"race.{size}"
    offs = np.array([0, 512 * KiB, 2 * MiB])[:runs]
    h = tx.submit(pid, rid, plan(offs + 64 * KiB, offs, np.full(runs, size)), timeout=30)
    assert until(lambda: tx.call_io(lambda: (pid, rid) in tx.eager.parked), 10.0), "the transfer did not wait"
    del sent[:]
    rx.expect(rid, grant(offs, np.full(runs, size)))
    assert h.wait(10), h.error
    (a,) = arrivals_of(rx, rid)
    assert a.ok, a
    assert "Go" not in sent, sent
    want = np.full(POOL, CANARY, np.uint8)
    for o in offs.tolist():
        want[o:o + size] = src.numpy()[o + 64 * KiB:o + 64 * KiB + size]
    assert np.array_equal(dst.numpy(), want)
    assert parked(tx) == 0
    rx.forget(rid)


def test_wait_for_a_pregrant_is_bounded(pair, monkeypatch):
    """No PREGRANT comes (the request was never expected): the transfer is announced once
    ``pregrant_wait`` ran out and refused by the receiver, long before its deadline."""
    rx, tx, pid, src, dst, sent = pair
    warm(rx, tx, pid)
    reset(dst)
    monkeypatch.setattr(tx.eager, "pregrant_wait", 0.2)
    h = tx.submit(pid, "never.1", plan([0], [0], [64 * KiB]), timeout=60)
    assert not h.wait(20) and "refused" in str(h.error), h.error
    assert (dst.numpy() == CANARY).all()
    assert until(lambda: parked(tx) == 0, 5.0)


def test_transfer_failing_while_it_waits_sends_no_abort(pair, monkeypatch):
    """A parked transfer that passes its deadline fails there; it was never announced, so no
    ABORT goes, and nothing of it stays parked."""
    rx, tx, pid, src, dst, _ = pair
    warm(rx, tx, pid)
    reset(dst)
    monkeypatch.setattr(tx.eager, "pregrant_wait", 60.0)
    from kvxfer.errors import TransferTimeout
    tx_sent: list[str] = []
    orig = tx.outbox.send
    monkeypatch.setattr(tx.outbox, "send", lambda p, m, **kw: (tx_sent.append(type(m).__name__), orig(p, m, **kw))[1])
    h = tx.submit(pid, "late.1", plan([0], [0], [64 * KiB]), timeout=0.5)
    assert not h.wait(20) and isinstance(h.error, TransferTimeout), h.error
    assert until(lambda: parked(tx) == 0, 5.0), "a failed transfer stayed parked"
    assert "Abort" not in tx_sent and "Announce" not in tx_sent, tx_sent
    assert (dst.numpy() == CANARY).all()


def test_fence_ends_the_wait(pair, monkeypatch):
    """A FENCE of the request (the receiver ended it) ends a parked transfer's wait at once:
    it is announced, refused, and nothing lands."""
    from kvxfer_transports.ucx.protocol import Fence
    rx, tx, pid, src, dst, _ = pair
    warm(rx, tx, pid)
    reset(dst)
    monkeypatch.setattr(tx.eager, "pregrant_wait", 60.0)
    h = tx.submit(pid, "fenced.1", plan([0], [0], [64 * KiB]), timeout=30)
    assert until(lambda: tx.call_io(lambda: (pid, "fenced.1") in tx.eager.parked), 10.0)
    tx.call_io(lambda: tx.sender.on_fence(tx.peers[pid], Fence(("fenced.1",))))
    assert not h.wait(10) and "refused" in str(h.error), h.error
    assert (dst.numpy() == CANARY).all() and parked(tx) == 0


def test_pregrants_go_only_to_the_named_senders(pair):
    """``expect(..., senders=)``: only the named peers are told of the grant (PREGRANT, and the
    FENCE at ``forget``); with none named, every eager peer is. Another peer may still write it,
    announced (GO), and lands exactly."""
    rx, tx, pid, src, dst, sent = pair
    other = get_transport("ucx", **OPTS)
    try:
        other.register([src])
        opid = other.connect(rx.descriptor())
        reset(dst)
        rx.expect("named.1", grant([0], [64 * KiB]), senders=frozenset({tx.id}))
        rx.expect("all.1", grant([1 * MiB], [4 * KiB]))
        pregranted(other, opid, "all.1")   # PREGRANTs to one peer go in order: named.1's came first, if any
        pregranted(tx, pid, "named.1")
        assert "named.1" not in other.peers[opid].pregranted
        assert rx.call_io(lambda: dict(rx.pregrants.granted)) == {"named.1": {tx.id}, "all.1": {tx.id, other.id}}
        h = other.submit(opid, "named.1", plan([128 * KiB], [0], [64 * KiB]), timeout=10)
        assert h.wait(10), h.error
        assert arrivals_of(rx, "named.1")[0].ok
        want = np.full(POOL, CANARY, np.uint8)
        want[:64 * KiB] = src.numpy()[128 * KiB:192 * KiB]
        assert np.array_equal(dst.numpy(), want)
        for rid in ("named.1", "all.1"):
            rx.forget(rid)
        assert until(lambda: not rx.writes_pending("named.1") and not rx.writes_pending("all.1"), 10.0)
    finally:
        other.close()
