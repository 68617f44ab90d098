"""Data-plane capability (issue 16): only the granted peer writes or completes a request.

A grant made with ``expect(rid, ranges, capability=CAP)`` takes data and completions only from
a transfer that carries ``CAP`` (``submit(..., capability=CAP)``). The third party is written
without kvxfer's encoders (``tests/hostile_wire.py``: raw zmq + msgpack, raw ucxx + msgpack):
it knows the request id and the data endpoint, not the capability. Each attack must

- change no byte of the receiver's region (canary),
- deliver no arrival for the request (neither a failure nor a completion: the request is not touched),
- keep the grant live, and count the message (``grants.bad_capability``),
- get the same answer as a message for an unknown request id (no oracle),

and afterwards the granted sender (kvxfer, with the capability) lands byte-exact; the same
sender without it is refused.
"""
from __future__ import annotations

import itertools
import time

import hostile_wire as hw
import numpy as np
import pytest
import torch
from waiting import until

from kvxfer.grant import ByteRanges
from kvxfer.plan import RunGroup, TransferPlan
from kvxfer.transport.registry import get_transport

REGION, CANARY, N = 1 << 20, 0xA5, 64 << 10
CAP, WRONG = bytes(range(16)), bytes(range(1, 17))
RID = "7.1"
xids = itertools.count(1 << 50)


def ucx_ok() -> str:
    try:
        import ucxx  # noqa: F401
        return ""
    except Exception as e:
        return f"import ucxx failed: {type(e).__name__}: {e}"


def one_run_plan(src: int, dst: int, n: int) -> TransferPlan:
    z = np.zeros(1, np.int64)
    a = lambda v: np.array([v], np.int64)  # noqa: E731
    return TransferPlan((RunGroup(z, z, z, z, a(src), a(dst), a(n), False),))


def make(name: str, **opts):
    t = get_transport(name, **opts)
    region = torch.full((REGION,), CANARY, dtype=torch.uint8)
    t.register([region])
    t.region = region
    return t


def untouched(rx) -> None:
    assert (rx.region.numpy() == CANARY).all(), "a third party wrote into the grant"
    got = [a for a in rx.arrivals(0.2) if a.request_id == RID]
    assert not got, f"a third party touched the request: {got}"
    assert rx.grants.is_live(RID), "the grant ended"


def honest(rx, name: str, **opts) -> None:
    """kvxfer's sender: without the capability refused (no arrival), with it byte-exact."""
    tx = make(name, **opts)
    try:
        src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        tx.region.copy_(src)
        peer = tx.connect(rx.descriptor())
        for plan in (one_run_plan(0, 0, N), one_run_plan(N, N, 1024)):   # a put / zero-copy run, a small one
            h = tx.submit(peer, RID, plan, timeout=5.0)
            assert not h.wait(5.0), "a transfer without the capability completed"
        untouched(rx)
        rx.expect("8.1", ByteRanges(np.array([0]), np.array([0]), np.array([N + 1024])), capability=CAP)
        for plan in (one_run_plan(0, 0, N), one_run_plan(N, N, 1024)):
            h = tx.submit(peer, "8.1", plan, timeout=5.0, capability=CAP)
            assert h.wait(5.0), f"the granted sender failed: {h.error}"
        want = np.full(REGION, CANARY, np.uint8)
        want[: N + 1024] = src.numpy()[: N + 1024]
        assert np.array_equal(rx.region.numpy(), want)
        got: list = []
        end = time.monotonic() + 5.0
        while len([a for a in got if a.request_id == "8.1"]) < 2 and time.monotonic() < end:
            got += rx.arrivals(0.2)   # arrivals() returns what came so far: gather both
        ok = [a for a in got if a.request_id == "8.1"]
        assert len(ok) == 2 and all(a.ok for a in ok) and sum(a.nbytes for a in ok) == N + 1024, ok
    finally:
        tx.close()


# ---- zmq -----------------------------------------------------------------------------
@pytest.fixture
def zrx():
    t = make("zmq")
    t.expect(RID, ByteRanges(np.array([0]), np.array([0]), np.array([N + 1024])), capability=CAP)
    yield t
    t.close()


def test_zmq_third_party_without_capability_touches_nothing(zrx):
    c = hw.DataClient(zrx.descriptor()["endpoint"])
    try:
        def send(rid, cap, runs=True):
            hdr = hw.data_header(rid, next(xids), hw.runs_field((0, 0, 64)) if runs else b"",
                                 end=(1, 64) if runs else (0, 0), cap=cap)
            return c.exchange([hdr, b"\x11" * 64] if runs else [hdr])

        def shape(replies):
            return [(r["t"], r.get("why")) for r in replies]

        unknown = shape(send("nobody.1", None))
        unknown_empty = shape(send("nobody.2", None, runs=False))
        assert unknown and unknown[0][0] == "n", unknown
        for cap in (None, WRONG, b""):
            assert shape(send(RID, cap)) == unknown, "a live id without its capability answers differently"
            assert shape(send(RID, cap, runs=False)) == unknown_empty, "a zero-run 'completion' answers differently"
        assert zrx.grants.bad_capability == 6, zrx.grants.bad_capability
        untouched(zrx)
    finally:
        c.close()
    honest(zrx, "zmq")


# ---- ucx -----------------------------------------------------------------------------
@pytest.fixture
def urx():
    t = make("ucx", heartbeat=0.2, peer_timeout=30.0)
    t.expect(RID, ByteRanges(np.array([0]), np.array([0]), np.array([N + 1024])), capability=CAP)
    yield t
    t.close()


@pytest.mark.skipif(bool(ucx_ok()), reason=ucx_ok() or "ucxx imports")
def test_ucx_third_party_without_capability_touches_nothing(urx):
    c = hw.UcxClient(urx.descriptor()["address"])
    secret = b"m" * 16
    try:
        def announce(rid, cap, runs=True):
            xid = next(xids)
            m = [hw.ANNOUNCE, xid, rid, 5.0, b"", hw.runs_field((0, 0, 64)) if runs else b"", 0, 4096,
                 b"\x11" * 64 if runs else b""]
            if cap is not None:
                m.append(cap)
            c.send("mallory", [m], secret=secret)
            got = []
            end = time.monotonic() + 2.0
            while time.monotonic() < end and not got:
                batch = c.recv(0.5)
                got = [x for x in (batch or [[]])[-1] if x and x[0] in (hw.FAIL, hw.ACK, hw.GO) and x[1] == xid]
            return [(x[0], x[2] if x[0] == hw.FAIL else None) for x in got]

        c.send("mallory", [[hw.HELLO, c.address, secret]], secret=secret)
        unknown = announce("nobody.1", None)
        unknown_empty = announce("nobody.2", None, runs=False)
        assert unknown and unknown[0][0] == hw.FAIL, unknown
        assert unknown_empty and unknown_empty[0][0] == hw.ACK, unknown_empty
        for cap in (None, WRONG, b""):
            assert announce(RID, cap) == unknown, "a live id without its capability answers differently"
            assert announce(RID, cap, runs=False) == unknown_empty, "an empty 'completion' answers differently"
        assert until(lambda: urx.grants.bad_capability == 6, 2.0), urx.grants.bad_capability
        untouched(urx)
    finally:
        c.close()
    honest(urx, "ucx", heartbeat=0.2, peer_timeout=30.0)


def test_grant_table_capability_rules():
    from kvxfer.grant import GrantTable
    g = GrantTable([1024])
    g.expect("a", ByteRanges(np.array([0]), np.array([0]), np.array([64])), capability=CAP)
    g.expect("b", ByteRanges(np.array([0]), np.array([64]), np.array([64])))
    assert g.check("a", [0], [0], [64], CAP) is None
    assert g.check("a", [0], [0], [64]).startswith("unknown request")
    assert g.check("a", [0], [0], [64], WRONG) == g.check("zzz", [0], [0], [64])
    assert g.check("b", [0], [64], [64]) is None        # no capability: today's behaviour
    assert not g.is_live("a", b"") and g.is_live("a", CAP) and g.is_live("b", b"")
    assert g.capability_ok("zzz", WRONG) and not g.capability_ok("a", WRONG)
    from kvxfer.errors import TransportError
    with pytest.raises(TransportError):
        g.expect("c", ByteRanges(np.array([0]), np.array([0]), np.array([1])), capability=b"x" * 65)


def test_req_carries_an_optional_16_byte_capability():
    import secrets

    from kvxfer.control.messages import Req, WireError
    d = dict(t="req", room=1, gen=1, kv=b"", prefix=0, state=b"", aux=False, dummy=False)
    cap = secrets.token_bytes(16)
    assert Req.from_dict({**d, "cap": cap}).cap == cap
    assert Req.from_dict(d).cap is None                  # older decode ranks: no capability
    for bad in (b"x" * 15, b"x" * 17, "x" * 16):
        with pytest.raises(WireError):
            Req.from_dict({**d, "cap": bad})
