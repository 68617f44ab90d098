"""UCX guards against hostile peers and long-lived processes (issue 16), on an in-process pair.

Two ``UCXTransport`` in this process (each with its own worker and I/O thread) talk over
shared memory. Hostile messages are sent from the sender's worker, in the sender's name or
another's, with the wire format written out here (msgpack lists), not with kvxfer's encoders.
Every case checks that the receiver counts the message under a fixed reason, lands no byte
outside a grant, and still serves an honest transfer byte-exact afterwards.
"""
from __future__ import annotations

import gc
import os
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import collect_arrivals, until  # noqa: E402

from kvxfer.errors import ConnectError, PeerError  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.kit import Crash  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
POOL = 4 * MiB
CANARY = 0xA5
ANNOUNCE, DONE = 1, 3          # message kinds, as the protocol numbers them
CTRL_TAG = 1 << 63
OPTS = {"heartbeat": 0.2, "peer_timeout": 3.0}


def plan(src: int, dst: int, n: int) -> TransferPlan:
    z = np.zeros(1, np.int64)
    return TransferPlan((RunGroup(z, z, z, z, np.array([src]), np.array([dst]), np.array([n]), False),))


def grant(n: int = POOL) -> ByteRanges:
    return ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, n, np.int64))


class Pair:
    def __init__(self, rx_opts=None, tx_opts=None):
        self.rx = get_transport("ucx", **{**OPTS, **(rx_opts or {})})
        self.tx = get_transport("ucx", **{**OPTS, **(tx_opts or {})})
        self.dst = torch.full((POOL,), CANARY, dtype=torch.uint8)
        self.src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        self.rx.register([self.dst])
        self.tx.register([self.src])
        self.pid = self.tx.connect(self.rx.descriptor())
        self.rids = iter(range(10**6))

    def raw(self, batch, *, tag: int | None = None) -> None:
        """Send ``batch`` (a Python object packed here, or bytes) from the sender's worker, under
        the control tag the receiver gave it (its WELCOME) unless ``tag`` is given."""
        from ucxx._lib import libucxx as ucx_api
        from ucxx._lib.arr import Array
        t, p = self.tx, self.tx.peers[self.pid]
        tag = CTRL_TAG | p.tag_out if tag is None else tag
        wire = batch if isinstance(batch, bytes) else msgpack.packb(batch, use_bin_type=True)

        def send():
            buf = np.frombuffer(wire, np.uint8)
            t.outbox.sends.append((p.ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))
        t.call_io(send)

    def honest(self, n: int = 256 * KiB) -> None:
        """An honest transfer lands byte-exact, and nothing around it changes."""
        rid = f"honest-{next(self.rids)}"
        self.dst.fill_(CANARY)
        self.rx.expect(rid, grant())
        h = self.tx.submit(self.pid, rid, plan(0, 4096, n), timeout=10)
        assert h.wait(10), h.error
        assert torch.equal(self.dst[4096: 4096 + n], self.src[:n])
        assert bool((self.dst[:4096] == CANARY).all()) and bool((self.dst[4096 + n:] == CANARY).all())
        arr = self.rx.arrivals(2.0)
        assert [(a.request_id, a.ok) for a in arr] == [(rid, True)], arr
        self.rx.forget(rid)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _count(t, reason: str) -> int:
    return t.rejected.get(reason, 0)


def test_announce_with_float_xid_is_dropped_and_the_outbox_stays_usable(pair):
    """An ANNOUNCE whose transfer id is a float (1e30) cannot be answered: counted, dropped.
    Before, its FAIL reply could not be packed and every later message to that peer was stuck."""
    tx, rx = pair.tx, pair.rx
    pair.rx.expect("victim", grant())
    secret = tx.peers[pair.pid].secret
    runs = np.array([[0], [0], [4096]], "<i8").tobytes()
    before = _count(rx, "malformed message")
    for xid in (1e30, 2**64 - 1, -1, True, "7"):
        pair.raw([tx.id, secret, [[ANNOUNCE, xid, "victim", 5.0, b"", runs, 1, MiB, b""]]])
    assert until(lambda: _count(rx, "malformed message") == before + 5, 5.0), rx.rejected
    assert rx.arrivals(0.3) == []                   # nothing to answer, nothing delivered
    rx.forget("victim")
    assert bool((pair.dst == CANARY).all())
    pair.honest()
    assert rx.io.alive and not rx.broken


def test_a_third_party_cannot_speak_for_a_peer(pair):
    """A DONE in the sender's name without its channel secret is refused: no Arrival with no
    bytes for a transfer whose puts never came, and writes_pending stays true after forget."""
    tx, rx = pair.tx, pair.rx
    rx.expect("stalled", grant())
    tx.sender.start_puts = lambda out, dtag: setattr(out, "state", "stalled")   # GO comes, no put, no DONE
    try:
        h = tx.submit(pair.pid, "stalled", plan(0, 0, 256 * KiB), timeout=3)
        assert until(lambda: any(o.state == "stalled" for o in list(tx.sender.outgoing.values())), 5.0)
        xid = next(o.xid for o in list(tx.sender.outgoing.values()) if o.state == "stalled")
        before = _count(rx, "unknown peer")
        for secret in (b"\0" * 16, b"", b"x" * 15):
            pair.raw([tx.id, secret, [[DONE, xid]]])
        assert until(lambda: _count(rx, "unknown peer") == before + 3, 5.0), rx.rejected
        assert rx.arrivals(0.3) == [], "a spoofed DONE completed a transfer"
        rx.forget("stalled")
        assert until(lambda: rx.writes_pending("stalled"), 5.0)   # forget() reaches the I/O thread
        pair.raw([tx.id, b"\1" * 16, [[DONE, xid]]])
        assert until(lambda: _count(rx, "unknown peer") == before + 4, 5.0), rx.rejected
        assert rx.writes_pending("stalled"), "a forged message cleared writes_pending"
        assert not h.wait(5)
        pair.raw([tx.id, tx.peers[pair.pid].secret, [[DONE, xid]]])   # the same DONE with the secret
        assert until(lambda: not rx.writes_pending("stalled"), 5.0), "the test's DONE is not one the receiver takes"
    finally:
        del tx.sender.start_puts
    rx.arrivals(1.0)
    assert bool((pair.dst == CANARY).all())
    pair.honest()


def test_control_message_size_is_capped():
    """A control message over max_control_bytes is dropped unread (one byte received) and counted."""
    p = Pair(rx_opts={"max_control_bytes": 64 * KiB})
    try:
        before = _count(p.rx, "too large")
        p.raw([p.tx.id, p.tx.peers[p.pid].secret, [[7, b"x" * (256 * KiB)]]])
        assert until(lambda: _count(p.rx, "too large") == before + 1, 5.0), p.rx.rejected
        p.honest()
    finally:
        p.close()


def test_incoming_transfers_per_peer_are_capped():
    p = Pair(rx_opts={"max_incoming_per_peer": 2})
    try:
        p.rx.expect("many", grant())
        p.tx.sender.start_puts = lambda out, dtag: setattr(out, "state", "stalled")
        hs = [p.tx.submit(p.pid, "many", plan(k * 64 * KiB, k * 64 * KiB, 64 * KiB), timeout=2) for k in range(3)]
        assert until(lambda: _count(p.rx, "too many transfers") == 1, 5.0), p.rx.rejected
        assert not hs[2].wait(5) and "too many transfers" in str(hs[2].error)
        assert [h.wait(5) for h in hs[:2]] == [False, False]   # stalled: they time out
        del p.tx.sender.start_puts
        assert until(lambda: not p.rx.receiver.incoming, 10.0)   # the receiver fails them at their deadline too
        p.rx.forget("many")
        assert sorted(a.ok for a in collect_arrivals(p.rx, lambda got: len(got) >= 3, 5.0)) == [False] * 3
        assert bool((p.dst == CANARY).all())
        p.honest()
    finally:
        p.close()


def test_a_peer_past_its_share_does_not_take_another_peers_share():
    """max_incoming 4 in all, 4 per peer: one peer holding 4 transfers open (stalled) fills the
    total, and a second peer's transfer is still taken (its share: 4 // peers with transfers
    open); a third transfer of the first peer is refused. Before, the total alone refused the
    second peer ("too many transfers: 4 open, 0 from this peer")."""
    p = Pair(rx_opts={"max_incoming": 4, "max_incoming_per_peer": 4})
    other = get_transport("ucx", **OPTS)
    try:
        other.register([p.src])
        opid = other.connect(p.rx.descriptor())
        p.rx.expect("many", grant())
        p.tx.sender.start_puts = lambda out, dtag: setattr(out, "state", "stalled")
        hs = [p.tx.submit(p.pid, "many", plan(k * 64 * KiB, k * 64 * KiB, 64 * KiB), timeout=3) for k in range(4)]
        assert until(lambda: len(p.rx.receiver.incoming) == 4, 5.0)
        p.dst.fill_(CANARY)
        p.rx.expect("fair", grant())
        h = other.submit(opid, "fair", plan(0, 1 << 20, 256 * KiB), timeout=10)
        assert h.wait(10), f"the second peer was refused its share: {h.error}"
        assert torch.equal(p.dst[1 << 20: (1 << 20) + 256 * KiB], p.src[: 256 * KiB])
        extra = p.tx.submit(p.pid, "many", plan(0, 0, 4096), timeout=3)
        assert not extra.wait(5) and "too many transfers" in str(extra.error), extra.error
        for x in hs:
            x.wait(5)
        del p.tx.sender.start_puts
        assert until(lambda: not p.rx.receiver.incoming, 10.0)
        for rid in ("many", "fair"):
            p.rx.forget(rid)
        collect_arrivals(p.rx, lambda got: len(got) >= 6, 5.0)
        p.honest()
    finally:
        other.close()
        p.close()


def test_peers_are_capped():
    """A HELLO beyond max_peers is dropped and counted (the sender's connect gets no answer: a
    ConnectError); the known peer is still served."""
    p = Pair(rx_opts={"max_peers": 1})
    other = get_transport("ucx", **OPTS, connect_timeout=1.0)
    try:
        other.register([torch.zeros(4096, dtype=torch.uint8)])
        with pytest.raises(ConnectError, match="did not answer"):
            other.connect(p.rx.descriptor())
        assert until(lambda: _count(p.rx, "too many peers") == 1, 5.0), p.rx.rejected
        assert len(p.rx.peers) == 1
        p.honest()
    finally:
        other.close()
        p.close()


def test_unknown_ended_and_live_ids_get_the_same_answer(pair):
    """No oracle: the sender sees the same outcome for a live, an ended and an unknown request id,
    for an empty transfer (acknowledged) and for a write outside the grant (refused alike)."""
    tx, rx = pair.tx, pair.rx
    rx.expect("o-live", grant(4096))
    rx.expect("o-ended", grant(4096))
    rx.forget("o-ended")
    empty = TransferPlan(())
    seen = {}
    for rid in ("o-live", "o-ended", "o-nobody"):
        h_empty = tx.submit(pair.pid, rid, empty, timeout=5)
        h_out = tx.submit(pair.pid, rid, plan(0, 8192, 4096), timeout=5)
        seen[rid] = (h_empty.wait(5), h_out.wait(5), str(h_out.error).replace(rid, "ID"))
    assert seen["o-live"] == seen["o-ended"] == seen["o-nobody"], seen
    assert seen["o-live"][:2] == (True, False)
    got = collect_arrivals(rx, lambda got: any(a.ok for a in got), 5.0)
    assert sorted((a.request_id, a.ok) for a in got if a.ok) == [("o-live", True)], got
    assert bool((pair.dst == CANARY).all())
    rx.forget("o-live")


def test_closed_peers_are_forgotten_so_the_cap_does_not_lock_out_new_ones():
    """A peer that said BYE is forgotten after peer_timeout: with max_peers 1, a second sender
    is served once the first one closed (before, the first kept its slot forever)."""
    p = Pair(rx_opts={"max_peers": 1, "peer_timeout": 0.5})
    try:
        p.honest()
        p.tx.close()
        assert until(lambda: not p.rx.peers, 5.0), "a closed peer was kept"
        p.tx = get_transport("ucx", **OPTS)
        p.tx.register([p.src])
        p.pid = p.tx.connect(p.rx.descriptor())
        p.honest()
        assert p.rx.rejected.get("too many peers", 0) == 0
    finally:
        p.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def test_close_frees_ucx_resources_without_the_garbage_collector():
    """20 rounds of open, transfer, close with every transport still referenced (as an endpoint
    <-> transport cycle keeps it) and the collector off: fds, threads and RSS stay flat.
    Before, each round kept ~22 fds and ~65 MB until the collector ran."""
    kept = []
    gc.disable()
    try:
        def round_trip(check: bool) -> None:
            p = Pair()
            if check:
                p.honest(64 * KiB)
            p.close()
            p.src = p.dst = None   # the pools are the test's; the transports are what is kept
            kept.append(p)
        round_trip(True)
        round_trip(False)
        fds, threads, rss = _fds(), threading.active_count(), _rss_mib()
        for k in range(20):
            round_trip(k == 19)
        assert _fds() <= fds + 2, (fds, _fds())
        assert threading.active_count() <= threads, (threads, threading.active_count())
        assert _rss_mib() - rss < 64, (rss, _rss_mib())
    finally:
        gc.enable()


def test_io_thread_death_fails_its_transfers_and_marks_the_transport_broken(pair):
    tx, rx = pair.tx, pair.rx
    rx.expect("doomed", grant())
    tx.sender.start_puts = lambda out, dtag: setattr(out, "state", "stalled")
    h = tx.submit(pair.pid, "doomed", plan(0, 0, 256 * KiB), timeout=30)
    assert until(lambda: any(o.state == "stalled" for o in list(tx.sender.outgoing.values())), 5.0)
    start = time.monotonic()
    tx.commands.put(Crash(RuntimeError("injected bug")))
    assert not h.wait(5) and time.monotonic() - start < 5
    assert isinstance(h.error, PeerError) and "injected bug" in str(h.error), h.error
    assert until(lambda: not tx.io.alive, 5.0)
    assert tx.broken and "injected bug" in tx.broken
    h2 = tx.submit(pair.pid, "doomed", plan(0, 0, 4096), timeout=30)
    assert not h2.wait(1) and "broken" in str(h2.error)
    rx.forget("doomed")
    assert bool((pair.dst == CANARY).all())


# -- structured fuzzing through the live I/O thread ------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

FUZZ_GRANT = (64 * KiB, 64 * KiB)   # the fuzz request may write [64 KiB, 128 KiB) of the pool
_values = st.one_of(
    st.integers(-3, 3), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=8), st.binary(max_size=64), st.lists(st.integers(0, 9), max_size=3),
)
_runs = st.lists(st.tuples(st.sampled_from([0, 1, -1]), st.integers(-4096, POOL + 4096),
                           st.integers(-16, 128 * KiB)), max_size=4).map(
    lambda t: np.asarray([[r for r, _, _ in t], [o for _, o, _ in t], [n for _, _, n in t]], "<i8").tobytes())
_announce = st.tuples(st.just(ANNOUNCE), st.one_of(st.integers(0, 50), _values),
                      st.sampled_from(["fuzz", "nobody", ""]), st.one_of(st.floats(0, 10), _values),
                      st.one_of(st.binary(max_size=8), _values), st.one_of(_runs, _values),
                      st.one_of(st.integers(0, 4), _values), st.one_of(st.sampled_from([4096, MiB]), _values),
                      st.one_of(st.binary(max_size=512), _values)).map(list)
_message = st.one_of(_announce, st.lists(_values, max_size=10),
                     st.tuples(st.integers(0, 9), st.one_of(st.integers(0, 50), _values), _values).map(list))


@pytest.fixture(scope="module")
def fuzz_pair():
    p = Pair()
    p.rx.expect("fuzz", ByteRanges(np.zeros(1, np.int64), np.full(1, FUZZ_GRANT[0], np.int64),
                                   np.full(1, FUZZ_GRANT[1], np.int64)))
    yield p
    p.close()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(_message, min_size=1, max_size=4), wrap=st.sampled_from(["ok", "secret", "shape"]))
def test_fuzzed_control_messages_never_kill_the_thread_or_write_outside_a_grant(fuzz_pair, msgs, wrap):
    p = fuzz_pair
    secret = p.tx.peers[p.pid].secret
    try:
        batch = {"ok": [p.tx.id, secret, msgs], "secret": [p.tx.id, b"\0" * 16, msgs],
                 "shape": [p.tx.id, msgs]}[wrap]
        wire = msgpack.packb(batch, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):   # not packable: nothing to send
        return
    p.raw(wire)
    assert p.rx.io.alive and p.rx.broken is None


def test_after_fuzzing_the_receiver_is_alive_and_untouched_outside_the_grant(fuzz_pair):
    p = fuzz_pair
    time.sleep(0.5)   # the last fuzzed batches are handled
    assert p.rx.io.alive and p.rx.broken is None and p.tx.io.alive
    lo, hi = FUZZ_GRANT[0], FUZZ_GRANT[0] + FUZZ_GRANT[1]
    assert bool((p.dst[:lo] == CANARY).all()) and bool((p.dst[hi:] == CANARY).all()), "a byte outside the grant"
    assert set(p.rx.rejected) <= {"malformed message", "malformed header", "unknown peer", "unknown request",
                                  "outside grant", "unknown region", "outside region", "internal error"}
    assert p.rx.rejected.get("internal error", 0) == 0, p.rx.rejected
    p.rx.forget("fuzz")
    while p.rx.arrivals(0.2):   # the fuzzed announces' arrivals (refused, or empty and ok)
        pass
    p.honest()
