"""Fence before reuse (issue 17): silence is not death.

The receiver is a ``UCXTransport`` in this process; the sender a ``UCXTransport`` in a child
process (``tests/xfer_peer.py``) that announces a transfer and then stalls (``stall_s``: its I/O
thread answers nothing, as a partitioned or stopped host would), or is killed while stalled.
Each transfer moves one put run (1 MiB) and 64 packed 8 KiB runs (frames posted into the grant),
and every test checks the bytes of the receiver's region.

- a stalled sender: its transfer fails on the receiver at ``peer_timeout``, but
  ``writes_pending`` stays True and the memory is counted in ``fencing()`` until the sender,
  awake again, flushes and says DONE/ABORT; its puts do land afterwards (that is why). Its next
  announce is refused (``peer fenced``) until it re-handshakes; the one after lands byte-exact.
- a killed sender (same kernel and namespaces): proven dead by its pid, so after ``fence_grace``
  nothing is held (no slot leaks), and nothing of it landed.
- ``quarantine_timeout``: gives held memory back after that long anyway, counted.
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
from waiting import until  # noqa: E402
from xfer_peer import (  # noqa: E402
    CANARY,
    PeerProcess,
    digest_of,
    pattern,
    plan_to_json,
    raw_plan,
    region_seed,
    stalled_receiver,
)

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

REGION = 4 << 20
SEED = 11
PUT = (0, 1 << 20)                       # offset, bytes: one put run
PACKED = [(2 << 20) + k * 16384 for k in range(64)]   # 64 runs of 8 KiB, packed into frames
RX_OPTS = {"heartbeat": 0.1, "peer_timeout": 0.8, "fence_grace": 0.5}
TX_OPTS = {"heartbeat": 0.1, "peer_timeout": 30.0}


def plan_json(base: int = 0) -> list:
    offs = [PUT[0] + base] + [o + base for o in PACKED]
    n = [PUT[1]] + [8192] * len(PACKED)
    a = np.array(offs, np.int64)
    z = np.zeros(len(a), np.int64)
    return plan_to_json(raw_plan(z, a, z, a, np.array(n, np.int64)))


def grant(base: int = 0) -> ByteRanges:
    offs = [PUT[0] + base] + [o + base for o in PACKED]
    n = [PUT[1]] + [8192] * len(PACKED)
    return ByteRanges(np.zeros(len(offs), np.int64), np.array(offs, np.int64), np.array(n, np.int64))


def granted_mask(base: int = 0) -> np.ndarray:
    m = np.zeros(REGION, bool)
    m[PUT[0] + base: PUT[0] + base + PUT[1]] = True
    for o in PACKED:
        m[o + base: o + base + 8192] = True
    return m


@pytest.fixture
def rx(request):
    t = get_transport("ucx", **{**RX_OPTS, **getattr(request, "param", {})})   # a test's own options: indirect
    region = torch.full((REGION,), CANARY, dtype=torch.uint8)
    t.register([region])
    t.region = region
    yield t
    t.close()


@pytest.fixture
def tx(rx, tmp_path):
    p = PeerProcess(tmp_path / "tx.err")
    p.call("init", transport="ucx", sizes=[REGION], fill="seed", seed=SEED, options=TX_OPTS)
    p.peer = p.call("connect", descriptor=rx.descriptor())["peer"]
    # warm up: the handshake and UCX's wire-up done, so a stalled sender's ANNOUNCE still leaves
    w = REGION - 4096
    rx.expect("w.0", ByteRanges(np.array([0]), np.array([w]), np.array([4096])))
    a = np.array([w], np.int64)
    z = np.zeros(1, np.int64)
    p.call("submit", peer=p.peer, request_id="w.0", plan=plan_to_json(raw_plan(z, a, z, a, np.array([4096]))))
    assert p.call("wait", request_ids=["w.0"], wait_s=10)["results"]["w.0"]["status"] == "DONE"
    rx.forget("w.0")
    rx.region[w:].fill_(CANARY)
    rx.arrivals(0.1)
    yield p
    p.close()


def src() -> np.ndarray:
    return pattern(region_seed(SEED, 0), REGION)


def failed_arrival(rx, rid: str, wait_s: float) -> str:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        for a in rx.arrivals(0.05):
            if a.request_id == rid:
                assert not a.ok, f"{rid} completed though its sender stalled"
                return a.reason
    raise AssertionError(f"no failure for {rid} within {wait_s}s")


def test_stalled_sender_keeps_memory_fenced_until_it_flushes(rx, tx):
    rx.expect("s.1", grant())
    tx.call("submit", peer=tx.peer, request_id="s.1", plan=plan_json(), timeout=8.0, stall_s=3.0)
    reason = failed_arrival(rx, "s.1", 3.0)      # silent past peer_timeout: the request fails ...
    assert "silent" in reason, reason
    rx.forget("s.1")
    assert rx.writes_pending("s.1"), "a silent sender was taken as dead: its puts may still land"
    f = rx.fencing()
    assert f["requests"] == 1 and f["bytes"] >= PUT[1] and f["fenced_peers"] == 1, f
    assert (rx.region.numpy() == CANARY).all(), "bytes landed while the sender was stalled"
    # ... and the sender wakes up: it handles the GO, puts, flushes, says DONE: now it is over.
    assert until(lambda: not rx.writes_pending("s.1"), 15.0), f"still pending after the sender woke: {rx.fencing()}"
    r = rx.region.numpy()
    put = slice(PUT[0], PUT[0] + PUT[1])
    assert np.array_equal(r[put], src()[put]), "the stalled sender's puts should have landed late (that is the hazard)"
    assert (r[~granted_mask()] == CANARY).all(), "a byte outside the grant changed"
    assert rx.fencing()["bytes"] == 0, rx.fencing()
    res = tx.call("wait", request_ids=["s.1"], wait_s=10)["results"]["s.1"]
    assert res["status"] == "FAILED", res
    # The fenced sender's next announce is refused; it re-handshakes (flush, HELLO); then it lands.
    rx.region.fill_(CANARY)
    base = 64 << 10
    for rid in ("s.2", "s.3"):
        rx.expect(rid, grant(base))
    tx.call("submit", peer=tx.peer, request_id="s.2", plan=plan_json(base), timeout=8.0)
    r2 = tx.call("wait", request_ids=["s.2"], wait_s=10)["results"]["s.2"]
    tx.call("submit", peer=tx.peer, request_id="s.3", plan=plan_json(base), timeout=8.0)
    r3 = tx.call("wait", request_ids=["s.3"], wait_s=10)["results"]["s.3"]
    assert r2["status"] == "DONE" or "fenced" in r2["error"], r2
    assert r3["status"] == "DONE", (r2, r3)
    m = granted_mask(base)
    assert np.array_equal(rx.region.numpy()[m], src()[m]), "s.3 did not land byte-exact"
    assert (rx.region.numpy()[~m] == CANARY).all()
    assert rx.fencing()["fenced_peers"] == 0, rx.fencing()


def test_killed_sender_is_proven_dead_and_nothing_leaks(rx, tx):
    rx.expect("k.1", grant())
    tx.call("submit", peer=tx.peer, request_id="k.1", plan=plan_json(), timeout=30.0, stall_s=60.0)
    assert until(lambda: len(rx.receiver.incoming) == 1, 5.0), "the announce did not arrive"
    tx.signal(signal.SIGKILL)
    tx.proc.wait(10)
    failed_arrival(rx, "k.1", 5.0)
    rx.forget("k.1")
    assert until(lambda: not rx.writes_pending("k.1"), 10.0), f"slots of a dead sender leak: {rx.fencing()}"
    f = rx.fencing()
    assert f["released"] == 1 and f["bytes"] == 0 and f["requests"] == 0, f
    assert (rx.region.numpy() == CANARY).all(), "a dead sender wrote"


@pytest.mark.parametrize("rx", [{"quarantine_timeout": 1.0}], ids=["quarantine 1 s"], indirect=True)
def test_quarantine_timeout_gives_memory_back(tx, rx):
    rx.expect("q.1", grant())
    tx.call("submit", peer=tx.peer, request_id="q.1", plan=plan_json(), timeout=8.0, stall_s=4.0)
    failed_arrival(rx, "q.1", 3.0)
    rx.forget("q.1")
    assert rx.writes_pending("q.1")
    assert until(lambda: not rx.writes_pending("q.1"), 5.0), rx.fencing()
    assert rx.fencing()["expired"] >= 1, rx.fencing()


def test_sender_keeps_its_source_while_the_receiver_is_silent(tmp_path):
    """Over TCP a put reads the source until the receiver takes it: a receiver that stalls past
    peer_timeout fails the transfer, but the source stays held until the flush completes."""
    with stalled_receiver(tmp_path) as (tx, rx, peer, region, plan):
        h = tx.submit(peer, "t.1", plan, timeout=20.0)
        assert not h.wait(5.0), "the transfer completed though the receiver stalled"
        assert "silent" in str(h.error) or "deadline" in str(h.error), h.error
        assert not h.source_released, "the source was released while puts of it had not been taken (silence " \
                                      "taken as death)"
        assert until(lambda: tx.fencing()["sources"] == 1, 1.0), (tx.fencing(), h.error)
        assert until(lambda: h.source_released, 15.0), f"never released after the receiver woke: {tx.fencing()}"
        assert tx.fencing()["sources"] == 0
        assert rx.call("digest", regions=[0])["digests"]["0"] == digest_of(region), \
            "the stalled receiver did not get every put once it woke (the flush completed early?)"


def test_writes_pending_right_after_forget(rx, tx):
    """``forget`` fails the request's open transfers on the I/O thread a moment later; a caller
    asking ``writes_pending`` at once (decode's endpoint does, from the arrival callback, while
    the other chunks of the request are still open) must already get True."""
    rx.expect("f.1", grant())
    tx.call("submit", peer=tx.peer, request_id="f.1", plan=plan_json(), timeout=8.0, stall_s=2.0)
    assert until(lambda: len(rx.receiver.incoming) == 1, 5.0), "the announce did not arrive"
    rx.commands.put(__import__("kvxfer.transport.kit", fromlist=["Call"]).Call(time.sleep, (0.3,)))  # I/O busy
    rx.forget("f.1")
    assert rx.writes_pending("f.1"), "released while a transfer with GO was still open"
    assert until(lambda: not rx.writes_pending("f.1"), 15.0), rx.fencing()   # the sender wakes: DONE


def test_fenced_peer_must_rehandshake_with_a_new_epoch(rx):
    """A third-party-written peer (``hostile_wire.UcxClient``, not kvxfer's encoders): after it
    went silent with a GO in hand, the receiver holds the grant's memory and refuses its
    announces ("peer fenced") until it sends HELLO with a higher epoch (which it may only do
    after flushing its endpoint); that HELLO releases what it held, and it may write again."""
    import hostile_wire as hw
    c = hw.UcxClient(rx.descriptor()["address"])
    secret = b"e" * 16
    runs = hw.runs_field((0, 0, 64 << 10))
    try:
        def announce(xid, rid):
            c.send("epoch-peer", [[hw.ANNOUNCE, xid, rid, 10.0, b"", runs, 1, 4096, b""]], secret=secret)

        def hello(epoch):
            c.send("epoch-peer", [[hw.HELLO, c.address, secret, epoch, "", 0, 0]], secret=secret)

        for rid in ("e.1", "e.2", "e.3"):
            rx.expect(rid, ByteRanges(np.array([0]), np.array([0]), np.array([64 << 10])))
        hello(0)
        announce(1, "e.1")
        assert c.wait_for(hw.GO), "no GO"
        failed_arrival(rx, "e.1", 3.0)            # silent past peer_timeout
        rx.forget("e.1")
        assert rx.writes_pending("e.1")
        announce(2, "e.2")
        fail = c.wait_for(hw.FAIL)
        assert fail and fail[1] == 2 and fail[2].startswith("peer fenced"), fail
        assert rx.writes_pending("e.1"), "a fenced peer's announce released its old writes"
        hello(1)                                   # flushed, then re-handshaken
        assert until(lambda: not rx.writes_pending("e.1"), 3.0), rx.fencing()
        announce(3, "e.3")
        go = c.wait_for(hw.GO)
        assert go and go[1] == 3, go
        assert (rx.region.numpy() == CANARY).all()
    finally:
        c.close()
