"""Hostile input at a live ZMQ receiver: raw frames from a raw zmq DEALER that speaks (or
abuses) the wire protocol of ``kvxfer_transports.zmq`` (``protocol.py`` there).

Each bad message must be refused whole with a counted reason, leave the destination byte
for byte unchanged, and leave the receiver serving good transfers. A hypothesis test then
drives random frames and checks that no byte outside the grant ever changes.

Synchronisation: messages from one DEALER are handled in order, and the receiver answers a
ping only after everything sent before it, so ``exchange`` (message, then ping, then read
replies up to the pong) returns once the receiver has dealt with the message.
"""
from __future__ import annotations

import itertools
import math

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.grant import ByteRanges
from kvxfer.plan import RunGroup, TransferPlan

REGION = 64 * 1024
CANARY = 0xA5
GRANTED = "granted"            # request id granted: region 0 [0, 4096) and region 1 [100, 200)
GRANT = (np.array([0, 1]), np.array([0, 100]), np.array([4096, 100]))
I64_MAX = (1 << 63) - 1
GRANT_REFUSALS = {"unknown request", "ended request", "outside grant", "unknown region", "outside region"}
xids = itertools.count(10**12)   # far from the small ids the fuzz likes: a failed id stays dead


@pytest.fixture(scope="module")
def rx():
    from kvxfer.transport.registry import get_transport
    t = get_transport("zmq")
    t.memory = [torch.full((REGION,), CANARY, dtype=torch.uint8) for _ in range(2)]
    t.register(t.memory)
    t.expect(GRANTED, ByteRanges(*GRANT))
    yield t
    t.close()


@pytest.fixture(scope="module")
def dealer(rx):
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(rx.endpoint)
    yield d
    d.close()
    ctx.term()


@pytest.fixture
def clean(rx):
    """Regions back to canary and the counters read, before a test."""
    for r in rx.memory:
        r.fill_(CANARY)
    rx.arrivals()
    return rx


def runs(*triples) -> bytes:
    """(region, offset, nbytes) triples as the wire's int64 LE arrays."""
    a = np.array(triples, dtype=object).T if triples else np.zeros((3, 0), object)
    return b"".join(int(v).to_bytes(8, "little", signed=True) for v in np.concatenate(list(a)))


def header(r=GRANTED, x=None, run_bytes=b"", dl=10.0, end=None, **extra) -> bytes:
    h = {"t": "d", "r": r, "x": next(xids) if x is None else x, "dl": dl, "runs": run_bytes, **extra}
    if end is not None:
        h.update(nruns=end[0], nbytes=end[1], notify=b"")
    return msgpack.packb(h)


def exchange(dealer, parts: list[bytes]) -> list[dict]:
    """Send one message, then a ping; return the replies that came before its pong (other
    pongs, e.g. answers to fuzzed pings, are skipped)."""
    nonce = next(xids)
    dealer.send_multipart(parts)
    dealer.send(msgpack.packb({"t": "p", "n": nonce}))
    out = []
    while True:
        assert dealer.poll(10_000), "the receiver stopped answering"
        h = msgpack.unpackb(dealer.recv())
        if h["t"] == "p":
            if h.get("n") == nonce:
                return out
        else:
            out.append(h)


def unchanged(rx) -> bool:
    return all(bool((r == CANARY).all()) for r in rx.memory)


def good_transfer(rx, dealer) -> None:
    """A well-formed two-message transfer still lands and is acked."""
    x = next(xids)
    data = np.arange(300, dtype=np.uint8)
    exchange(dealer, [header(x=x, run_bytes=runs((0, 10, 200))), data[:200].tobytes()])
    replies = exchange(dealer, [header(x=x, run_bytes=runs((1, 150, 50), (0, 3000, 50)), end=(3, 300)),
                                data[200:].tobytes()])
    while not any(h["t"] == "a" and x in h["x"] for h in replies):   # acks are batched
        replies = exchange(dealer, [msgpack.packb({"t": "p"})])
    assert bytes(rx.memory[0][10:210].numpy()) == data[:200].tobytes()
    assert bytes(rx.memory[1][150:200].numpy()) == data[200:250].tobytes()
    assert bytes(rx.memory[0][3000:3050].numpy()) == data[250:].tobytes()
    assert any(a.request_id == GRANTED and a.ok and a.nbytes == 300 for a in rx.arrivals(timeout=1.0))


# (label, message parts, expected counted reason)
P100 = bytes(100)
CASES = [
    ("offset past the grant", [header(run_bytes=runs((0, 4000, 100))), P100], "outside grant"),
    ("offset past the region", [header(run_bytes=runs((0, REGION - 50, 100))), P100], "outside grant"),
    ("negative offset", [header(run_bytes=runs((0, -50, 100))), P100], "outside grant"),
    ("region id too large", [header(run_bytes=runs((2, 0, 100))), P100], "unknown region"),
    ("negative region id", [header(run_bytes=runs((-1, 0, 100))), P100], "unknown region"),
    ("offset + nbytes overflows int64", [header(run_bytes=runs((0, I64_MAX - 10, 100))), P100], "outside grant"),
    ("nbytes sum overflows int64", [header(run_bytes=runs(*[(0, 0, 1 << 62)] * 4, (0, 0, 100))), P100],
     "length mismatch"),
    ("negative nbytes", [header(run_bytes=runs((0, 0, 150), (0, 200, -50))), P100], "length mismatch"),
    ("zero nbytes", [header(run_bytes=runs((0, 0, 100), (0, 200, 0))), P100], "length mismatch"),
    ("payload shorter than runs", [header(run_bytes=runs((0, 0, 100))), bytes(99)], "length mismatch"),
    ("payload longer than runs", [header(run_bytes=runs((0, 0, 100))), bytes(101)], "length mismatch"),
    ("part lengths differ from runs", [header(run_bytes=runs((0, 0, 50), (0, 100, 50))), bytes(60), bytes(40)],
     "length mismatch"),
    ("truncated: no payload frame", [header(run_bytes=runs((0, 0, 100)))], "malformed message"),
    ("extra frame", [header(run_bytes=runs((0, 0, 100))), P100, b"x"], "malformed message"),
    ("extra frames for two runs", [header(run_bytes=runs((0, 0, 50), (0, 100, 50))), bytes(50), bytes(50), b"z"],
     "malformed message"),
    ("payload without runs", [header(run_bytes=b""), P100], "malformed message"),
    ("runs field not a multiple of 24", [header(run_bytes=runs((0, 0, 100))[:-3]), P100], "malformed message"),
    ("request never granted", [header(r="nobody", run_bytes=runs((0, 0, 100))), P100], "unknown request"),
    ("garbage bytes", [b"\xc1\xc1 not msgpack at all", P100], "malformed header"),
    ("empty frame", [b""], "malformed header"),
    ("msgpack list, not a map", [msgpack.packb([1, 2, 3]), P100], "malformed header"),
    ("truncated msgpack", [header(run_bytes=runs((0, 0, 100)))[:-5], P100], "malformed header"),
    ("unknown message type", [msgpack.packb({"t": "z", "r": GRANTED, "x": 1}), P100], "malformed header"),
    ("request id not a string", [msgpack.packb({"t": "d", "r": 5, "x": 1, "dl": 1.0, "runs": b""})],
     "malformed header"),
    ("transfer id a string", [msgpack.packb({"t": "d", "r": GRANTED, "x": "1", "dl": 1.0, "runs": b""})],
     "malformed header"),
    ("transfer id a bool", [msgpack.packb({"t": "d", "r": GRANTED, "x": True, "dl": 1.0, "runs": b""})],
     "malformed header"),
    ("negative transfer id", [msgpack.packb({"t": "d", "r": GRANTED, "x": -4, "dl": 1.0, "runs": b""})],
     "malformed header"),
    ("deadline not finite", [header(dl=math.nan, run_bytes=runs((0, 0, 100))), P100], "malformed header"),
    ("runs as a string", [msgpack.packb({"t": "d", "r": GRANTED, "x": 1, "dl": 1.0, "runs": "0" * 24}), P100],
     "malformed header"),
    ("half the totals", [msgpack.packb({"t": "d", "r": GRANTED, "x": 1, "dl": 1.0, "runs": b"", "nruns": 0})],
     "malformed header"),
    ("map with an ext type", [msgpack.packb({"t": "d", "r": msgpack.ExtType(1, b"x")}), P100], "malformed header"),
]


@pytest.mark.parametrize("parts,reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_message_is_refused_whole(clean, dealer, parts, reason):
    rx = clean
    before = dict(rx.rejected)
    replies = exchange(dealer, parts)
    after = dict(rx.rejected)
    assert after.get(reason, 0) == before.get(reason, 0) + 1, (before, after)
    assert sum(after.values()) == sum(before.values()) + 1, (before, after)
    assert unchanged(rx), "a refused message wrote bytes"
    if reason != "malformed header":   # the transfer is identifiable: nack and a failed arrival
        told = "refused" if reason in GRANT_REFUSALS else reason   # no oracle: grant refusals read alike
        assert [h["t"] for h in replies] == ["n"] and replies[0]["why"].startswith(told), replies
        failed = rx.arrivals(timeout=1.0)
        assert len(failed) == 1 and not failed[0].ok and failed[0].reason.startswith(reason), failed
    good_transfer(rx, dealer)


def test_write_after_forget_is_dropped(clean, dealer):
    rx = clean
    rx.expect("short-lived", ByteRanges(np.array([0]), np.array([0]), np.array([1000])))
    assert rx.forget("short-lived")
    replies = exchange(dealer, [header(r="short-lived", run_bytes=runs((0, 0, 100))), P100])
    assert replies and replies[0]["t"] == "n" and replies[0]["why"].startswith("refused")
    assert unchanged(rx)
    assert rx.rejected["ended request"] >= 1


def test_unknown_ended_and_live_ids_get_the_same_answer(clean, dealer):
    """No oracle: an empty transfer and a write outside the grant are answered alike whether the
    request id is live, ended or never seen; only a live request's empty transfer arrives."""
    rx = clean
    rx.expect("oracle-live", ByteRanges(np.array([0]), np.array([0]), np.array([1000])))
    rx.expect("oracle-ended", ByteRanges(np.array([0]), np.array([0]), np.array([1000])))
    rx.forget("oracle-ended")

    def answers(r):
        empty = exchange(dealer, [header(r=r, x=next(xids), end=(0, 0))])
        bad = exchange(dealer, [header(r=r, x=next(xids), run_bytes=runs((0, 5000, 100))), P100])
        return [{k: v for k, v in h.items() if k != "x"} for h in empty + bad]
    seen = {r: answers(r) for r in ("oracle-live", "oracle-ended", "oracle-nobody")}
    assert seen["oracle-live"] == seen["oracle-ended"] == seen["oracle-nobody"], seen
    got = rx.arrivals(timeout=0.5)
    assert [(a.request_id, a.ok) for a in got if a.ok] == [("oracle-live", True)], got
    assert unchanged(rx)
    rx.forget("oracle-live")


def test_message_size_is_capped_per_message_not_per_part():
    """zmq's MAXMSGSIZE bounds one part; a message of many parts under it is refused whole."""
    from kvxfer.transport.registry import get_transport
    with get_transport("zmq", max_message_bytes=64 * 1024, frame_bytes=16 * 1024, frames_per_message=1) as t:
        part = 30 * 1024   # each part far below the cap; the three together above it
        region = torch.full((4 * part,), CANARY, dtype=torch.uint8)
        t.register([region])
        t.expect("big", ByteRanges(np.array([0]), np.array([0]), np.array([4 * part])))
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.connect(t.endpoint)
        try:
            hdr = header(r="big", run_bytes=runs(*[(0, k * part, part) for k in range(3)]), end=(3, 3 * part))
            replies = exchange(d, [hdr, *[bytes([k]) * part for k in range(3)]])
            assert [h["t"] for h in replies] == ["n"] and replies[0]["why"].startswith("too large"), replies
            assert t.rejected["too large"] == 1
            assert bool((region == CANARY).all())
        finally:
            d.close()
            ctx.term()


def test_the_largest_packed_message_fits_zmqs_part_limit():
    """zmq drops a connection whose part exceeds MAXMSGSIZE, and the receiver sets it to the largest
    part its options make: a packed frame is fuller than frame_bytes * frames_per_message when its
    last run starts just below that (here 5 runs of 1.9 MiB with 2 MiB frames: a 9.5 MiB frame)."""
    from xfer_peer import raw_plan

    from kvxfer.transport.registry import get_transport
    opts = dict(frame_bytes=2 << 20, frames_per_message=4, zero_copy_min=1 << 30, few_runs=0, connect_timeout=2.0)
    with get_transport("zmq", **opts) as rx, get_transport("zmq", **opts) as tx:
        n, k = 1900 << 10, 5
        src = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        dst = torch.full((n * k,), CANARY, dtype=torch.uint8)
        tx.register([src]), rx.register([dst])
        off = np.arange(k) * n
        rx.expect("full", ByteRanges(np.zeros(k), off, np.full(k, n)))
        assert tx.submit(tx.connect(rx.descriptor()), "full", raw_plan(np.zeros(k), off, np.zeros(k), off,
                                                                        np.full(k, n)), timeout=10).wait(10)
        assert torch.equal(dst, src)


def test_bad_message_fails_the_transfer_and_later_frames_are_dropped(clean, dealer):
    """The good first message lands; the bad second one does not, nor does anything after it."""
    rx = clean
    x = next(xids)
    exchange(dealer, [header(x=x, run_bytes=runs((0, 0, 100))), bytes(range(100))])
    replies = exchange(dealer, [header(x=x, run_bytes=runs((0, 5000, 100))), bytes(100)])
    assert [h["t"] for h in replies] == ["n"]
    before = sum(rx.rejected.values())
    assert exchange(dealer, [header(x=x, run_bytes=runs((0, 200, 100)), end=(3, 300)), bytes([7]) * 100]) == []
    assert sum(rx.rejected.values()) == before       # dropped quietly: the transfer already failed
    assert bytes(rx.memory[0][:100].numpy()) == bytes(range(100))
    assert bool((rx.memory[0][100:] == CANARY).all()) and bool((rx.memory[1] == CANARY).all())
    arr = rx.arrivals(timeout=1.0)
    assert len(arr) == 1 and not arr[0].ok and arr[0].reason.startswith("outside grant")


def test_wrong_totals_fail_the_transfer(clean, dealer):
    rx = clean
    replies = exchange(dealer, [header(run_bytes=runs((0, 0, 100)), end=(1, 150)), P100])
    assert replies and replies[0]["t"] == "n" and replies[0]["why"].startswith("incomplete transfer")
    (a,) = rx.arrivals(timeout=1.0)
    assert not a.ok and a.reason.startswith("incomplete transfer")


def test_passed_deadline_fails_the_transfer(clean, dealer):
    rx = clean
    replies = exchange(dealer, [header(dl=-1.0, run_bytes=runs((0, 0, 100))), P100])
    assert [h["t"] for h in replies] == ["n"]
    arr = rx.arrivals(timeout=3.0)
    assert len(arr) == 1 and not arr[0].ok and arr[0].reason.startswith("deadline passed"), arr
    assert unchanged(rx)


def test_real_sender_still_served(clean):
    """After all of the above, a real ZMQ sender moves a plan into the same receiver."""
    from kvxfer.transport.registry import get_transport
    rx = clean
    src = torch.arange(REGION, dtype=torch.int64).to(torch.uint8)
    with get_transport("zmq") as tx:
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        rx.expect("real", ByteRanges(np.array([1]), np.array([0]), np.array([REGION])))
        z = np.zeros(1, np.int64)
        plan = TransferPlan((RunGroup(z, z, z + 1, z, np.array([0, 5000]), np.array([10, 20000]),
                                      np.array([3000, 40000]), False),))
        assert tx.submit(peer, "real", plan, timeout=10).wait(), "transfer failed"
    assert torch.equal(rx.memory[1][10:3010], src[:3000]) and torch.equal(rx.memory[1][20000:60000],
                                                                          src[5000:45000])
    assert rx.forget("real")


# -- fuzz --------------------------------------------------------------------------------
EDGES = [0, 1, 99, 100, 101, 199, 200, 4095, 4096, 4097, REGION - 1, REGION, REGION + 1, 1 << 31, 1 << 62,
         I64_MAX, -1, -(1 << 63)]
ints = st.one_of(st.sampled_from(EDGES), st.integers(-(1 << 63), I64_MAX))
triples = st.tuples(st.integers(-2, 3), ints, ints)
fields = st.fixed_dictionaries({}, optional={
    "t": st.sampled_from(["d", "p", "a", "", 3]),
    "r": st.sampled_from([GRANTED, "nobody", "", 7, None]),
    "x": st.one_of(st.integers(-5, 1 << 64 - 1), st.sampled_from(["1", True, None, 2.5])),
    "dl": st.sampled_from([10.0, 0.0, -1.0, math.inf, math.nan, 5, "soon"]),
    "runs": st.one_of(st.lists(triples, max_size=6).map(lambda t: runs(*t)), st.binary(max_size=60)),
    "nruns": ints, "nbytes": ints, "notify": st.one_of(st.binary(max_size=8), ints),
})
messages = st.tuples(st.one_of(fields.map(msgpack.packb), st.binary(max_size=80)),
                     st.lists(st.one_of(st.binary(max_size=300), st.integers(0, 9000).map(bytes)), max_size=4))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=messages)
def test_fuzz_never_writes_outside_the_grant(rx, dealer, msg):
    head, payload = msg
    for r in rx.memory:
        r.fill_(CANARY)
    exchange(dealer, [head, *payload])
    r0, r1 = rx.memory[0].numpy(), rx.memory[1].numpy()
    assert (r0[4096:] == CANARY).all() and (r1[:100] == CANARY).all() and (r1[200:] == CANARY).all()
    known = {"malformed header", "malformed message", "length mismatch", "unknown request", "ended request",
             "unknown region", "outside grant", "outside region", "too many transfers"}
    assert set(rx.rejected) <= known, rx.rejected
    rx.arrivals()


def test_after_fuzz_the_receiver_still_serves(clean, dealer):
    good_transfer(clean, dealer)


edge_runs = st.lists(st.one_of(
    st.tuples(st.just(0), st.integers(-3, 4200), st.integers(1, 300)),
    st.tuples(st.just(1), st.integers(90, 210), st.integers(1, 40))), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(triples=edge_runs, split=st.booleans(), data=st.data())
def test_fuzz_runs_at_the_grant_edges(rx, dealer, triples, split, data):
    """Well-formed messages with runs around the grant's edges: all inside lands exactly;
    any run outside refuses the whole message (nothing written, a nack)."""
    for r in rx.memory:
        r.fill_(CANARY)
    region, offset, nbytes = (np.array(c, np.int64) for c in zip(*triples))
    # Runs must not overlap each other, or the expected image would depend on write order.
    ends = {}
    for r, o, n in triples:
        if any(r == r2 and o < o2 + n2 and o2 < o + n for r2, o2, n2 in ends):
            return
        ends[(r, o, n)] = True
    payload = data.draw(st.binary(min_size=int(nbytes.sum()), max_size=int(nbytes.sum())))
    parts = ([payload[a:b] for a, b in zip(np.r_[0, np.cumsum(nbytes)[:-1]], np.cumsum(nbytes))] if split
             else [payload])
    replies = exchange(dealer, [header(run_bytes=runs(*triples), end=(len(triples), len(payload))), *parts])
    inside = ByteRanges(*GRANT).covers(region, offset, nbytes).all()
    if inside:
        assert not any(h["t"] == "n" for h in replies), replies
        pos = 0
        for r, o, n in triples:
            assert bytes(rx.memory[r][o: o + n].numpy()) == payload[pos: pos + n]
            pos += n
    else:
        assert [h["t"] for h in replies] == ["n"] and replies[0]["why"].startswith("refused"), replies
        assert unchanged(rx)
    rx.arrivals()


def test_open_transfers_per_sender_are_capped():
    """One sender cannot hold every incoming slot: past max_incoming_per_peer its new transfers
    are refused, while another sender is still served."""
    from kvxfer.transport.registry import get_transport
    with get_transport("zmq", max_incoming_per_peer=2) as t:
        region = torch.full((REGION,), CANARY, dtype=torch.uint8)
        t.register([region])
        t.expect("held", ByteRanges(np.array([0]), np.array([0]), np.array([REGION])))
        ctx = zmq.Context()
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for d in (a, b):
                d.linger = 0
                d.connect(t.endpoint)
            # transfers opened and never finished (no totals), each with one landed run
            replies = [exchange(a, [header(r="held", run_bytes=runs((0, k * 100, 100))), P100]) for k in range(3)]
            assert [[h["t"] for h in r] for r in replies] == [[], [], ["n"]], replies
            assert replies[2][0]["why"].startswith("too many transfers") and t.rejected["too many transfers"] == 1
            assert bytes(region[200:300].numpy()) == bytes([CANARY]) * 100   # the refused one wrote nothing
            done = exchange(b, [header(r="held", run_bytes=runs((0, 1000, 100)), end=(1, 100)), P100])
            assert [h["t"] for h in done] == ["a"]                              # another sender is served
            assert bytes(region[1000:1100].numpy()) == P100
        finally:
            a.close()
            b.close()
            ctx.term()


def test_close_frees_sockets_and_threads():
    """20 rounds of open, transfer, close, with the transports still referenced: fds and
    threads stay flat (close frees the context, sockets, pipe and I/O thread itself)."""
    import gc
    import os
    import threading

    from kvxfer.transport.registry import get_transport
    kept = []

    def round_trip() -> None:
        rx, tx = get_transport("zmq"), get_transport("zmq")
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        dst = torch.full((src.numel(),), CANARY, dtype=torch.uint8)
        rx.register([dst])
        tx.register([src])
        rx.expect("r", ByteRanges(np.array([0]), np.array([0]), np.array([src.numel()])))
        z = np.zeros(1, np.int64)
        plan = TransferPlan((RunGroup(z, z, z, z, z, z, np.array([src.numel()]), False),))
        assert tx.submit(tx.connect(rx.descriptor()), "r", plan, timeout=10).wait(10)
        assert torch.equal(dst, src)
        tx.close()
        rx.close()
        kept.append((rx, tx))
    gc.disable()
    try:
        round_trip()
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        for _ in range(20):
            round_trip()
        assert len(os.listdir("/proc/self/fd")) <= fds + 2 and threading.active_count() <= threads
    finally:
        gc.enable()
