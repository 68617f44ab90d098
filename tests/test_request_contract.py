"""The request contract an engine relies on, in-process over the local transport (each test
failed on the code before it): ``on_release(outcome)`` on both sides, ``kv_releasable`` only
after ``on_release`` returned, aux rows cleared at the grant, ``connect(timeout=)`` honoured
end to end, several prefill instances need ``instance=``, ``Outcome`` values, phase deadlines
on an injected clock (milliseconds instead of seconds), and chunks of any size.

Every transfer compares every byte of the decode pool with the reference executor's result.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import request_peer as rp
from manual_clock import ManualClock
from request_pair import LENIENT, Pair, pool
from waiting import until

from kvxfer.endpoint import AuxBuffer, AuxRecord, DecodeEndpoint, KVPoll, Outcome, PrefillEndpoint, Timeouts
from kvxfer.errors import ConnectError
from kvxfer.ranks import RankSpec


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _move(pair: Pair, room: int, ps, ds, *, aux=None, aux_slot=None, chunks=None, **callbacks):
    """One request; returns (receiver, sender) at Success, bytes checked."""
    r = pair.de.receiver(room, on_release=callbacks.get("d_release"))
    s = pair.pe.sender(room, on_release=callbacks.get("p_release"))
    r.init(ds, aux_slot=aux_slot)
    bounds = chunks or [len(ps)]
    start = 0
    for i, end in enumerate(bounds):
        last = i == len(bounds) - 1
        s.send(ps[start:end], start=start, last=last, aux=aux if last else None)
        start = end
    assert r.wait(10) == KVPoll.Success, r.reason
    assert s.wait(10) == KVPoll.Success, s.reason
    return r, s


# ------------------------------------------------------------------------------------
# on_release(outcome), kv_releasable
# ------------------------------------------------------------------------------------
def test_on_release_receives_the_outcome_on_both_sides(pair):
    got: dict[str, list] = {"d": [], "p": []}
    ps, ds = np.arange(4, 12), np.arange(8, 16)
    r, s = _move(pair, 1, ps, ds, d_release=got["d"].append, p_release=got["p"].append)
    assert until(lambda: got["d"] and got["p"], 5)
    assert got == {"d": [Outcome.Success], "p": [Outcome.Success]}   # decode keeps its slots on Success
    assert r.outcome is Outcome.Success and s.outcome is Outcome.Success
    assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)]))

    got = {"d": [], "p": []}
    r = pair.de.receiver(2, on_release=got["d"].append)
    s = pair.pe.sender(2, on_release=got["p"].append)
    r.init(np.arange(16, 20))
    assert s.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.abort("engine dropped it")
    assert until(lambda: got["d"] and got["p"], 5)
    assert got == {"d": [Outcome.Aborted], "p": [Outcome.Aborted]}
    assert r.outcome is Outcome.Aborted and s.outcome is Outcome.Aborted and r.poll() == KVPoll.Failed


def test_kv_releasable_turns_true_only_after_on_release_returned(pair):
    """A scheduler that polls ``kv_releasable`` must never see True while ``on_release`` still runs
    (both would free the same KV)."""
    entered, leave, seen_inside = threading.Event(), threading.Event(), []

    def slow_release(outcome):
        seen_inside.append(s.kv_releasable)
        entered.set()
        leave.wait(10)

    ps, ds = np.arange(4, 8), np.arange(8, 12)
    r = pair.de.receiver(3)
    s = pair.pe.sender(3, on_release=slow_release)
    r.init(ds)
    s.send(ps, last=True)
    assert r.wait(10) == KVPoll.Success and s.wait(10) == KVPoll.Success
    assert entered.wait(10)
    assert seen_inside == [False] and not s.kv_releasable   # on_release is running
    leave.set()
    assert until(lambda: s.kv_releasable, 5)
    assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)]))


# ------------------------------------------------------------------------------------
# aux rows
# ------------------------------------------------------------------------------------
def test_an_aux_row_is_cleared_when_its_request_is_granted(pair):
    """Row 2 holds an earlier request's first token: after the next request's grant it must not
    read as valid before (or without) that request's own record."""
    assert AuxBuffer(2).read(0) is None                      # a fresh buffer holds no record either
    ps, ds = np.arange(4, 8), np.arange(8, 12)
    _move(pair, 4, ps, ds, aux=AuxRecord(1111, -0.5), aux_slot=2)
    assert pair.aux.read(2) == AuxRecord(1111, -0.5)
    r, s = pair.de.receiver(5), pair.pe.sender(5)
    r.init(np.arange(12, 16), aux_slot=2)
    assert pair.aux.read(2) is None                          # the stale 1111 is gone at the grant
    assert bool((pair.aux.tensor[2] == 0xFF).all())          # what an engine reading the tensor sees
    s.send(np.arange(16, 20), last=True, aux=AuxRecord(2222))
    assert r.wait(10) == KVPoll.Success, r.reason
    assert pair.aux.read(2) == AuxRecord(2222) == AuxRecord.unpack(r.aux)
    assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds), (np.arange(16, 20), np.arange(12, 16))]))


# ------------------------------------------------------------------------------------
# connect
# ------------------------------------------------------------------------------------
def test_connect_timeout_bounds_the_handshake():
    """A prefill rank whose control address answers nothing: ``connect(timeout=0.5)`` gives up
    after about 0.5 s, not after ``Timeouts.handshake`` (10 s)."""
    import socket
    pair = Pair(connect=False)
    try:
        with socket.socket() as sock:   # a port with nothing behind it: the HELLO is never answered
            sock.bind(("127.0.0.1", 0))
            silent = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConnectError):
            pair.de.connect(peers=[replace(pair.pe.info, control=silent)], timeout=0.5)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(ValueError, match="timeout"):
            pair.de.connect(peers=[pair.pe.info], timeout=0)
    finally:
        pair.close()


def test_several_instances_need_instance_and_the_error_lists_them():
    pair = Pair(connect=False, instance="alpha")
    other = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=2, num_layers=2, instance="beta"),
                            pair.p_pool, transport="local", timeouts=LENIENT)
    try:
        other.register(pair.server.url, ttl=5.0)
        with pytest.raises(ConnectError, match=r"several prefill instances.*alpha, beta.*instance="):
            pair.de.connect(bootstrap=pair.server.url, timeout=5)
        with pytest.raises(ConnectError, match=r"alpha, beta"):
            pair.de.connect(peers=[pair.pe.info, other.info], timeout=5)
        pair.de.connect(bootstrap=pair.server.url, instance="alpha", timeout=5)
        ps, ds = np.arange(4, 10), np.arange(8, 14)
        _move(pair, 6, ps, ds)
        assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)]))
    finally:
        other.close()
        pair.close()


# ------------------------------------------------------------------------------------
# Deadlines on an injected clock
# ------------------------------------------------------------------------------------
def test_phase_deadlines_run_on_the_injected_clock():
    """Every phase times out when the clock passes its deadline, with Outcome.TimedOut and a
    reason naming the phase; nothing waits for real seconds."""
    pc, dc = ManualClock(), ManualClock()
    t = Timeouts(bootstrap=30, waiting=300, transfer=30, lease=30, heartbeat=LENIENT.heartbeat)
    pair = Pair(timeouts=t, p_clock=pc, d_clock=dc)
    try:
        pe, de = pair.pe, pair.de
        r_boot = de.receiver(10)                          # init() never called
        s_boot = pe.sender(11)                            # decode never asks
        r_wait, s_wait = de.receiver(12), pe.sender(12)   # granted, no chunk
        r_wait.init(np.arange(8, 12))
        assert s_wait.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        assert r_wait.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        t0 = time.monotonic()
        pc.advance(31)
        dc.advance(31)
        assert r_boot.wait(5) == KVPoll.Failed and s_boot.wait(5) == KVPoll.Failed
        assert r_boot.outcome is s_boot.outcome is Outcome.TimedOut
        assert "init() was not called" in r_boot.reason and "no request from any decode rank" in s_boot.reason
        assert r_wait.poll() == s_wait.poll() == KVPoll.WaitingForInput   # 300 s for the first chunk
        pc.advance(300)
        assert s_wait.wait(5) == KVPoll.Failed and s_wait.outcome is Outcome.TimedOut
        assert "WaitingForInput: no chunk was sent" in s_wait.reason
        assert r_wait.wait(5) == KVPoll.Failed   # prefill told decode
        assert time.monotonic() - t0 < 3.0
        assert rp.same_bytes(pair.d_pool.buffers, pair.before)   # nothing was written
    finally:
        pair.close()


# ------------------------------------------------------------------------------------
# Chunks of any size
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layouts", [("page_major", "page_major"), ("token_major", "hnd")])
def test_chunks_need_not_be_whole_pages(layouts):
    """Chunks are planned per token: 1-token and page-splitting chunks land byte-exact (whole
    pages only save runs on page-major pools; see ``kvxfer.endpoint.prefill``)."""
    pair = Pair(p_layout=layouts[0], d_layout=layouts[1])
    try:
        ps, ds = np.arange(4, 4 + 21), np.arange(40, 40 + 21)
        _move(pair, 7, ps, ds, chunks=[1, 3, 10, 11, 21])
        assert rp.same_bytes(pair.d_pool.buffers, pair.expected([(ps, ds)]))
    finally:
        pair.close()


def test_a_decode_endpoint_rejects_a_bad_clock():
    with pytest.raises(TypeError, match="clock must be a callable"):
        DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2), pool(None), transport="local",
                       clock=5.0)


def test_a_mis_sized_pool_is_refused_with_what_it_should_hold():
    """A TP-2 rank of a 4-KV-head model holds 2 heads; a pool of 4 is named at construction, with
    the rule (``heads_held``), instead of a planner error at the first request."""
    from kvxfer import DecodeEndpoint, LayoutError, MHAPool, RankSpec
    pool = MHAPool(layers=2, heads=4, head_dim=8, dtype="float16", num_pages=8, page_size=4)
    spec = RankSpec(role="decode", num_kv_heads=4, num_layers=2, tp_size=2, tp_rank=1)
    with pytest.raises(LayoutError, match=r"holds 4 heads per layer, but TP rank 1 of 2 with 4 KV heads holds 2 "
                                          r"\(heads 2..3\).*heads_held\(4, 2, 1\)"):
        DecodeEndpoint(spec, pool, transport="local")
