"""Eager writes (issue 20): a pregranted sender puts without the ANNOUNCE/GO round trip, and the
memory of a forgotten request waits for its FENCED (``transports/ucx/eager.py``).

The receiver is a ``UCXTransport(eager_writes=True)`` in this process; the sender a
``UCXTransport`` in a child process (``tests/xfer_peer.py``). Every test checks the receiver's
bytes: what was granted holds the sender's pattern, everything else keeps the canary.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

try:
    import ucxx  # noqa: F401
    _NO_UCX = ""
except Exception as e:  # ImportError, or a missing libucx underneath
    _NO_UCX = f"import ucxx failed: {type(e).__name__}: {e}"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_NO_UCX), reason=_NO_UCX or "ucxx imports")]

import torch  # noqa: E402
from waiting import arrivals_of, collect_arrivals, until  # noqa: E402
from xfer_peer import CANARY, PeerProcess, pattern, plan_to_json, raw_plan, region_seed  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

REGION = 8 << 20
SEED = 5
RX_OPTS = {"heartbeat": 0.1, "peer_timeout": 30.0, "fence_grace": 0.5, "eager_writes": True}
TX_OPTS = {"heartbeat": 0.1, "peer_timeout": 30.0}


def runs(base: int, inline: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One 1 MiB put run at ``base`` (and four 1 KiB runs after it, packed inline)."""
    offs = [base] + ([base + (1 << 20) + k * 4096 for k in range(4)] if inline else [])
    n = [1 << 20] + [1024] * (len(offs) - 1)
    return np.array(offs, np.int64), np.array(n, np.int64)


def plan_json(offs: np.ndarray, n: np.ndarray) -> list:
    z = np.zeros(len(offs), np.int64)
    return plan_to_json(raw_plan(z, offs, z, offs, n))


def grant(offs: np.ndarray, n: np.ndarray) -> ByteRanges:
    return ByteRanges(np.zeros(len(offs), np.int64), offs, n)


def mask(offs: np.ndarray, n: np.ndarray) -> np.ndarray:
    m = np.zeros(REGION, bool)
    for o, k in zip(offs.tolist(), n.tolist()):
        m[o:o + k] = True
    return m


def src() -> np.ndarray:
    return pattern(region_seed(SEED, 0), REGION)


@pytest.fixture
def rx(request):
    t = get_transport("ucx", **{**RX_OPTS, **getattr(request, "param", {})})   # a test's own options: indirect
    region = torch.full((REGION,), CANARY, dtype=torch.uint8)
    t.register([region])
    t.region = region
    sent: list[str] = []
    orig = t.outbox.send
    t.outbox.send = lambda p, m, **kw: (sent.append(type(m).__name__), orig(p, m, **kw))[1]  # what the receiver answers
    t.sent = sent
    yield t
    t.close()


@pytest.fixture
def tx(rx, tmp_path):
    p = PeerProcess(tmp_path / "tx.err")
    p.call("init", transport="ucx", sizes=[REGION], fill="seed", seed=SEED, options=TX_OPTS)
    p.peer = p.call("connect", descriptor=rx.descriptor())["peer"]
    yield p
    p.close()


def pregranted(tx, rx, rid: str) -> None:
    assert until(lambda: rid in tx.call("pregranted", peer=tx.peer)["rids"], 5.0), "no PREGRANT reached the sender"


@pytest.mark.parametrize("inline", [False, True], ids=["puts", "puts+inline"])
def test_pregranted_transfer_puts_without_go_and_lands_exact(rx, tx, inline):
    offs, n = runs(0, inline)
    rx.expect("e.1", grant(offs, n))
    pregranted(tx, rx, "e.1")
    tx.call("submit", peer=tx.peer, request_id="e.1", plan=plan_json(offs, n), timeout=10.0)
    res = tx.call("wait", request_ids=["e.1"], wait_s=10)["results"]["e.1"]
    assert res["status"] == "DONE", res
    (a,) = arrivals_of(rx, "e.1")
    assert a.ok and a.nbytes == int(n.sum()), a
    assert "Go" not in rx.sent and "Ack" in rx.sent, rx.sent   # no round trip before the puts
    m = mask(offs, n)
    assert np.array_equal(rx.region.numpy()[m], src()[m]), "eager bytes differ"
    assert (rx.region.numpy()[~m] == CANARY).all(), "a byte outside the grant changed"
    # forget: the memory waits for the sender's FENCED (after its flush), then it is free
    tx.call("stall", seconds=0.5)   # so that its FENCED cannot come at once
    rx.forget("e.1")
    assert rx.writes_pending("e.1"), "forgotten before the pregranted sender said FENCED"
    time.sleep(0.2)
    assert rx.writes_pending("e.1"), "forgotten before the pregranted sender said FENCED"
    assert until(lambda: not rx.writes_pending("e.1"), 5.0), rx.fencing()
    assert "Fence" in rx.sent and rx.fencing()["eager_fences"] == 0, rx.fencing()


@pytest.fixture
def plain(tx):
    """A second receiver, without eager_writes, the sender connected to it (``plain.peer``)."""
    t = get_transport("ucx", **{**RX_OPTS, "eager_writes": False})
    t.region = torch.full((REGION,), CANARY, dtype=torch.uint8)
    t.register([t.region])
    t.peer = tx.call("connect", descriptor=t.descriptor())["peer"]
    yield t
    t.close()


def test_without_a_pregrant_the_sender_announces_first(tx, plain):
    """A receiver without eager_writes pregrants nothing: the sender waits for GO as before."""
    offs, n = runs(0)
    plain.expect("n.1", grant(offs, n))
    time.sleep(0.2)
    assert tx.call("pregranted", peer=plain.peer)["rids"] == []
    tx.call("submit", peer=plain.peer, request_id="n.1", plan=plan_json(offs, n), timeout=10.0)
    assert tx.call("wait", request_ids=["n.1"], wait_s=10)["results"]["n.1"]["status"] == "DONE"
    m = mask(offs, n)
    assert np.array_equal(plain.region.numpy()[m], src()[m])
    plain.forget("n.1")
    assert not plain.writes_pending("n.1"), "nothing was pregranted: nothing to fence"


def test_eager_announce_without_pregrant_is_refused(tx, plain):
    """A (buggy) sender that puts eagerly to a receiver that pregranted nothing: its announce is
    refused, counted, and the request fails there."""
    offs, n = runs(0)
    plain.expect("b.1", grant(offs, n))
    tx.call("pregrant", peer=plain.peer, request_id="b.1")
    tx.call("submit", peer=plain.peer, request_id="b.1", plan=plan_json(offs, n), timeout=10.0)
    (a,) = arrivals_of(plain, "b.1")
    assert not a.ok and "pregrant" in a.reason, a
    assert plain.rejected["malformed header"] == 1, plain.rejected
    assert (plain.region.numpy()[~mask(offs, n)] == CANARY).all(), "a byte outside the grant changed"


def test_eager_runs_outside_the_grant_are_refused_and_counted(rx, tx):
    offs, n = runs(0)
    rx.expect("o.1", grant(offs, n))
    pregranted(tx, rx, "o.1")
    bad = offs + (2 << 20)   # the same run, outside the grant
    tx.call("submit", peer=tx.peer, request_id="o.1", plan=plan_json(bad, n), timeout=10.0)
    (a,) = arrivals_of(rx, "o.1")
    assert not a.ok and a.reason.startswith("outside grant"), a
    assert rx.rejected["outside grant"] == 1, rx.rejected
    untouched = ~(mask(offs, n) | mask(bad, n))
    assert (rx.region.numpy()[untouched] == CANARY).all(), "a byte outside both runs changed"


def test_stalled_sender_keeps_a_forgotten_grant_until_it_flushes(rx, tx):
    """Silence is not death: a forgotten request's memory stays held while its pregranted sender
    is stalled. Awake again, the sender may still put the submit queued meanwhile (a FENCE is
    handled when its message is in, which may be a turn later): it lands in the held grant, all
    or nothing, and the FENCED that frees the memory follows its flush; nothing changes after."""
    offs, n = runs(1 << 20)
    rx.expect("s.1", grant(offs, n))
    pregranted(tx, rx, "s.1")
    tx.call("stall", seconds=2.0)
    tx.call("submit", peer=tx.peer, request_id="s.1", plan=plan_json(offs, n), timeout=10.0)
    rx.forget("s.1")
    time.sleep(1.0)
    assert rx.writes_pending("s.1"), "a stalled pregranted sender was taken as done"
    assert rx.fencing()["eager_fences"] == 1, rx.fencing()
    assert until(lambda: not rx.writes_pending("s.1"), 10.0), f"never fenced after the stall: {rx.fencing()}"
    res = tx.call("wait", request_ids=["s.1"], wait_s=10)["results"]["s.1"]
    assert res["status"] in ("DONE", "FAILED"), res
    r, m = rx.region.numpy().copy(), mask(offs, n)
    assert (r[~m] == CANARY).all(), "a byte outside the grant changed"
    assert (r[m] == CANARY).all() or np.array_equal(r[m], src()[m]), "the grant holds part of a transfer"
    time.sleep(0.3)
    assert np.array_equal(rx.region.numpy(), r), "a write landed after FENCED"
    # the FENCE took the pregrant away: a later submit for the request is announced and refused
    tx.call("submit", peer=tx.peer, request_id="s.1", plan=plan_json(offs, n), timeout=5.0)
    res = tx.call("wait", request_ids=["s.1"], wait_s=10)["results"]["s.1"]
    assert res["status"] == "FAILED", res
    assert np.array_equal(rx.region.numpy(), r), "a submit after FENCED was put"


def test_forget_mid_transfer_holds_until_the_flush(rx, tx):
    """A forget while eager puts are on their way: the memory is held until the sender's flush
    (FENCED); nothing lands afterwards."""
    offs = np.arange(0, REGION, 1 << 20, dtype=np.int64)
    n = np.full(len(offs), 1 << 20, np.int64)
    for k in range(3):
        rid = f"m.{k}"
        rx.region.fill_(CANARY)
        rx.expect(rid, grant(offs, n))
        pregranted(tx, rx, rid)
        tx.call("submit", peer=tx.peer, request_id=rid, plan=plan_json(offs, n), timeout=10.0)
        rx.forget(rid)
        assert until(lambda rid=rid: not rx.writes_pending(rid), 10.0), rx.fencing()
        res = tx.call("wait", request_ids=[rid], wait_s=10)["results"][rid]
        assert res["status"] in ("DONE", "FAILED"), res
        after = rx.region.numpy().copy()
        if res["status"] == "DONE":
            assert np.array_equal(after, src()), "a flushed eager transfer did not land whole"
        time.sleep(0.2)
        assert np.array_equal(rx.region.numpy(), after), "a write landed after FENCED"


@pytest.mark.parametrize("rx", [{"peer_timeout": 0.8}], ids=["silent after 0.8 s"], indirect=True)
def test_killed_sender_is_proven_dead_and_its_fences_end(rx, tx):
    # peer_timeout 0.8: silent, then proven dead (its pid is gone)
    offs, n = runs(0)
    rx.expect("k.1", grant(offs, n))
    pregranted(tx, rx, "k.1")
    tx.call("stall", seconds=30.0)
    rx.forget("k.1")
    time.sleep(0.3)
    assert rx.writes_pending("k.1")
    tx.signal(signal.SIGKILL)
    tx.proc.wait(10)
    assert until(lambda: not rx.writes_pending("k.1"), 10.0), f"a dead sender's fence leaks: {rx.fencing()}"
    assert rx.fencing()["released"] == 1 and rx.fencing()["eager_fences"] == 0, rx.fencing()
    assert (rx.region.numpy() == CANARY).all(), "a dead sender wrote"


def test_closing_sender_says_fenced_for_everything(rx, tx):
    """A sender closing with nothing in flight tells the receiver (FENCED for all) before BYE:
    forgotten requests it never answered for are free at once."""
    offs, n = runs(0)
    for rid in ("c.1", "c.2"):
        rx.expect(rid, grant(offs + (2 << 20) * int(rid[-1]), n))
        pregranted(tx, rx, rid)
    tx.call("stall", seconds=1.0)   # the FENCEs wait; then close() handles no message before BYE
    rx.forget("c.1")
    rx.forget("c.2")
    tx.send("close")
    assert until(lambda: not rx.writes_pending("c.1") and not rx.writes_pending("c.2"), 10.0), rx.fencing()
    assert (rx.region.numpy() == CANARY).all()


@pytest.mark.parametrize("rx", [{"pregrant_window_bytes": (5 << 20) // 2}, {"pregrant_window_requests": 2}],
                         ids=["bytes", "requests"], indirect=True)
def test_a_stalled_sender_holds_at_most_its_window_and_requests_beyond_it_complete(rx, tx):
    """Exposure is bounded: a receiver pregrants a peer at most its window (2.5 MiB, or 2
    requests; four 1 MiB requests here), counted until that peer says FENCED. While the sender
    stalls, forgetting its requests keeps their memory held, still within the window, and a new
    request is not pregranted to it. Requests beyond the window are announced (GO) and land
    byte-exact, as the pregranted ones do, once the sender wakes."""
    from kvxfer.metrics import REGISTRY

    def gauge() -> float:
        return REGISTRY.get_sample_value("kvxfer_pregranted_bytes") or 0.0
    base = gauge()
    rids = [f"w.{k}" for k in range(4)]
    grants = {rid: runs(k * (2 << 20)) for k, rid in enumerate(rids)}
    for rid in rids:
        rx.expect(rid, grant(*grants[rid]))
    pregranted(tx, rx, "w.1")
    snap = rx.fencing()
    assert snap["pregranted_peer_max_requests"] == 2 and snap["pregranted_peer_max_bytes"] == 2 << 20, snap
    assert gauge() - base == 2 << 20, "kvxfer_pregranted_bytes"
    assert sorted(rx.call_io(lambda: list(rx.pregrants.granted))) == ["w.0", "w.1"]
    tx.call("stall", seconds=2.0)                     # stalled, as a hung prefill process is
    for rid in rids:
        tx.call("submit", peer=tx.peer, request_id=rid, plan=plan_json(*grants[rid]), timeout=15.0)
    rx.forget("w.0")                                  # decode gave up on one: held until FENCED
    rx.expect("w.4", grant(*runs(7 << 20)))
    time.sleep(0.5)
    snap = rx.fencing()
    assert rx.writes_pending("w.0") and snap["pregranted_peer_max_requests"] == 2, snap
    assert "w.4" not in rx.call_io(lambda: list(rx.pregrants.granted)), "pregranted beyond the window"
    res = tx.call("wait", request_ids=rids, wait_s=20)["results"]
    assert res["w.0"]["status"] in ("DONE", "FAILED") and all(res[r]["status"] == "DONE" for r in rids[1:]), res
    region, m0 = rx.region.numpy(), mask(*grants["w.0"])
    assert (region[m0] == CANARY).all() or np.array_equal(region[m0], src()[m0]), "w.0 holds part of a transfer"
    got = collect_arrivals(rx, lambda got: {a.request_id for a in got} >= set(rids[1:]), 10.0)
    assert sorted((a.request_id, a.ok) for a in got if a.request_id != "w.0") == [(r, True) for r in rids[1:]], got
    for rid in rids[1:]:
        m = mask(*grants[rid])
        assert np.array_equal(region[m], src()[m]), f"{rid}: bytes differ"
    every = np.logical_or.reduce([mask(*g) for g in grants.values()])
    assert (region[~every] == CANARY).all(), "a byte outside the grants changed"
    assert "Go" in rx.sent, "the requests beyond the window were not announced"
    assert until(lambda: not rx.writes_pending("w.0"), 10.0), rx.fencing()
    for rid in rids[1:] + ["w.4"]:
        rx.forget(rid)
    assert until(lambda: rx.fencing()["pregranted_bytes"] == 0, 10.0), rx.fencing()
    assert gauge() == base, "kvxfer_pregranted_bytes"
