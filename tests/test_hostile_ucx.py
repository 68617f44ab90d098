"""Hostile peers on the UCX transport's control messages, and UCX close() (issue 16).

The attacker is ``hostile_ucx_wire.Attacker``: a UCX worker of its own (with kvxfer's FIFO size:
it shares this process) that joins the victim as a sender does (HELLO to its front worker, then
its data worker under the control tag the WELCOME gave) and sends control batches
``[sender id, secret, [messages]]`` under any sender id, secret or tag it likes. The victim is a
``UCXTransport`` in this process holding one 1 MiB region (canary outside grants); the honest
peer is a second ``UCXTransport`` connected after the attack. Skipped when ``import ucxx`` fails.
Peers with other UCX settings, in processes of their own: ``test_ucx_hostile_peers.py``.
"""
from __future__ import annotations

import gc
import itertools
import logging
import struct
import threading
import time

import numpy as np
import pytest
import torch

try:
    import ucxx  # noqa: F401
    _NO_UCX = ""
except Exception as e:  # ImportError, or a missing libucx underneath
    _NO_UCX = f"import ucxx failed: {type(e).__name__}: {e}"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_NO_UCX), reason=_NO_UCX or "ucxx imports")]

import hostile_ucx_wire as hw  # noqa: E402
from hostile_victims import fds, rss  # noqa: E402
from waiting import until  # noqa: E402

from kvxfer.endpoint.decode import DecodeEndpoint  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.pools import MHAPool  # noqa: E402

# kvxfer names used here (update here after a module move)
from kvxfer.ranks import RankSpec  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

REGION, CANARY = 1 << 20, 0xA5
GRANTED = "granted.1"                   # the attacker's target: region 0 [0, 64 KiB)
SAME_FIFO = {"SYSV_FIFO_SIZE": "4096"}  # the attacker shares this process: kvxfer's FIFO size
OPTS = {"heartbeat": 0.2, "peer_timeout": 30.0}
_honest = itertools.count(0)
_attackers: list = []   # closed after their victim


def one_run_plan(src: int, dst: int, n: int) -> TransferPlan:
    z = np.zeros(1, np.int64)
    a = lambda v: np.array([v], np.int64)  # noqa: E731
    return TransferPlan((RunGroup(z, z, z, z, a(src), a(dst), a(n), False),))


@pytest.fixture
def victim(request):
    t = get_transport("ucx", **{**OPTS, **getattr(request, "param", {})})   # a test's own options: indirect
    region = torch.full((REGION,), CANARY, dtype=torch.uint8)
    t.register([region])
    t.expect(GRANTED, ByteRanges(np.array([0]), np.array([0]), np.array([64 << 10])))
    t.want = np.full(REGION, CANARY, np.uint8)   # what the region must hold: canary + honest writes
    t.region = region
    yield t
    try:
        t.close()
    except Exception:   # a poisoned outbox makes close() raise too
        pass
    while _attackers:
        _attackers.pop().close()


def honest(t) -> bool:
    """A fresh honest UCX peer moves a put run and a packed run into a fresh grant: byte-exact?"""
    s = get_transport("ucx", **OPTS)
    try:
        src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        s.register([src])
        pid = s.connect(t.descriptor(), t.admit(s.descriptor()))
        k = next(_honest)
        base = (512 << 10) + k * (32 << 10)
        rid = f"honest.{k}"
        t.expect(rid, ByteRanges(np.array([0, 0]), np.array([base, base + (16 << 10)]),
                                 np.array([16 << 10, 1 << 10])))
        for off, n in ((base, 16 << 10), (base + (16 << 10), 1 << 10)):   # a put, then an inline packed run
            if not s.submit(pid, rid, one_run_plan(off, off, n), timeout=5.0).wait(5.0):
                return False
            t.want[off: off + n] = src.numpy()[off: off + n]
        t.forget(rid)
        return True
    finally:
        s.close()


def after_attack(t) -> None:
    assert any(th.name == f"kvxfer-ucx-{t.id[:6]}" and th.is_alive() for th in threading.enumerate()), \
        "the victim's I/O thread died"
    assert honest(t), "an honest transfer no longer completes"
    assert np.array_equal(t.region.numpy(), t.want), "the region differs from the honest writes"


def announce_put(xid: int, rid: str = GRANTED, n: int = 16 << 10) -> list:
    """An ANNOUNCE of one put run at region 0 offset 0: the receiver answers GO and waits for DONE."""
    return [hw.ANNOUNCE, xid, rid, 10.0, b"notify", hw.runs_field((0, 0, n)), 1, 4096, b""]


def join(v, sender: str, **kw):
    """A fresh attacker joined to ``v`` under ``sender`` (asserted: it was welcomed)."""
    a = hw.Attacker(SAME_FIFO)
    _attackers.append(a)
    c = a.join(v.descriptor()["address"], sender, token=v.admit({"id": sender}), **kw)   # admitted, and hostile
    assert c is not None, f"{sender} was not welcomed: {dict(v.rejected)}"
    return c


def test_garbage_control_batches_are_refused(victim):
    c = join(victim, "mallory")
    c.send([[hw.ANNOUNCE, 1, GRANTED, "x"], [hw.DONE], ["?"], 7])
    c.send([[hw.ANNOUNCE, 2, GRANTED, 1.0, b"", b"", 0, 4096, b""]], sender="nobody")   # not its channel
    c.send([[hw.ANNOUNCE, 3, GRANTED, 1.0, b"", hw.runs_field((0, 1 << 20, 64)), 1, 4096, b""]])
    assert until(lambda: sum(victim.rejected.values()) >= 4, 3), dict(victim.rejected)
    after_attack(victim)


def test_a_float_xid_does_not_poison_the_outbox(victim):
    c = join(victim, "mallory")
    # Today the victim's loop raises and logs a traceback every turn: keep that quiet, and stop the
    # victim before asserting (Python 3.11 formats tracebacks with ast, which is not thread-safe
    # against pytest formatting this test's failure on the main thread).
    ucx_log = logging.getLogger("kvxfer.transport.ucx")
    level, ucx_log.level = ucx_log.level, logging.CRITICAL
    try:
        c.send([[hw.ANNOUNCE, 1e30, "nobody", 5.0, b"", b"", 0, 4096, b""]])
        handled = until(lambda: victim.rejected["malformed message"] >= 1, 3)   # counted, not answered
        alive = any(th.name == f"kvxfer-ucx-{victim.id[:6]}" and th.is_alive() for th in threading.enumerate())
        ok = handled and honest(victim)
        intact = np.array_equal(victim.region.numpy(), victim.want)
    finally:
        try:
            victim.close()
        except Exception:
            pass
        ucx_log.setLevel(level)
    assert handled, "the ANNOUNCE was not handled"
    assert alive, "the victim's I/O thread died"
    assert ok, "an honest transfer no longer completes"
    assert intact, "the region differs from the honest writes"


def third_party_sends(third, s, msgs: list) -> None:
    """``msgs`` in ``s``'s name by a third party, every way it can try: its own channel, the
    channel's tag with its own secret, guessed tags, and the front worker (tag 0)."""
    third.send(msgs, sender=s.sender)
    for tag in (s.tag, 1, 2, s.tag ^ 1):   # it does not know s's tag: these are guesses (the first: a lucky one)
        third.att.send(third.ep, hw.CTRL_TAG | tag, hw.batch(s.sender, third.secret, msgs))
    third.att.send(third.att.connect(bytes.fromhex(third.front)), hw.CTRL_TAG, hw.batch(s.sender, third.secret, msgs))


def test_a_third_party_done_does_not_complete_a_transfer(victim):
    s = join(victim, "sender-s")
    third = join(victim, "third")
    third.front = victim.descriptor()["address"]
    s.send([announce_put(7)])
    assert s.wait_for(hw.GO), "no GO for a granted ANNOUNCE"
    third_party_sends(third, s, [[hw.DONE, 7]])
    got, end = [], time.monotonic() + 1.0
    while time.monotonic() < end:
        got += victim.arrivals(0.05)
    ok = [a for a in got if a.request_id == GRANTED and a.ok]
    assert not ok, f"an ok Arrival with nothing written: {ok}"
    after_attack(victim)


def test_a_spoofed_abort_keeps_writes_pending(victim):
    s = join(victim, "sender-s")
    third = join(victim, "third")
    third.front = victim.descriptor()["address"]
    s.send([announce_put(9)])
    assert s.wait_for(hw.GO), "no GO for a granted ANNOUNCE"
    victim.forget(GRANTED)   # decode ends the request: the sender had GO, its puts may still land
    assert until(lambda: victim.writes_pending(GRANTED), 3)
    third_party_sends(third, s, [[hw.ABORT, 9, "spoofed"]])
    until(lambda: not victim.writes_pending(GRANTED), 1.0)
    assert victim.writes_pending(GRANTED), "a third party's ABORT released memory the sender can still write"
    after_attack(victim)


# a victim that pregrants to eager peers (``eager_writes``)
eager = pytest.mark.parametrize("victim", [{"eager_writes": True}], ids=["eager"], indirect=True)


@eager
def test_malformed_eager_messages_are_refused(victim):
    """PREGRANT / FENCE / FENCED of the wrong shape, and an eager ANNOUNCE nobody pregranted:
    counted and dropped (the ANNOUNCE refused), the victim's thread and memory intact."""
    v = victim
    c = join(v, "mallory", eager=True)
    eager_put = announce_put(4) + [b"", 0, 1]       # 12 fields: puts done, flushed
    started_put = announce_put(4) + [b"", 0, 2]     # puts started, DONE to follow
    unsorted = struct.pack("<4q", 100, 200, 0, 10)   # ranges: (start, end) pairs out of order
    for m in ([hw.PREGRANT, "x"], [hw.FENCE, [1, 2]], [hw.FENCED, [], 5], [hw.FENCED, ["a" * 5000], 0],
              [hw.FENCE, ["r"] * 5000], [hw.FENCED], eager_put, started_put, announce_put(4) + [b"", 0, 3],
              [hw.PREGRANT, ["p"]], [hw.PREGRANT, ["p"], [b"\0" * 15]], [hw.PREGRANT, ["p", "q"], [b""]],
              [hw.PREGRANT, ["p"], [unsorted]]):
        c.send([m])   # one batch each: a 5000-character id fails the whole batch
    assert until(lambda: sum(v.rejected.values()) >= 13, 3), dict(v.rejected)
    # the eager ANNOUNCEs without a pregrant, flushed or started, and one with an eager flag of 3
    assert v.rejected["malformed header"] >= 3, dict(v.rejected)
    assert not v.receiver.incoming, "an eager ANNOUNCE nobody pregranted opened a transfer"
    after_attack(v)


@eager
def test_a_spoofed_fenced_keeps_a_forgotten_grant_held(victim):
    """Only the pregranted peer's own FENCED (its channel secret) ends the fence of a forgotten
    request: a third party's, under its id, does not."""
    v = victim
    s = join(v, "sender-s", eager=True)
    third = join(v, "third")
    third.front = v.descriptor()["address"]
    rid = "pre.1"
    v.expect(rid, ByteRanges(np.array([0]), np.array([128 << 10]), np.array([64 << 10])))
    assert (m := s.wait_for(hw.PREGRANT)) and m[1] == [rid], m
    v.forget(rid)
    assert s.wait_for(hw.FENCE), "no FENCE after forget"
    third_party_sends(third, s, [[hw.FENCED, [rid], 0]])
    third_party_sends(third, s, [[hw.FENCED, [], 1]])
    until(lambda: not v.writes_pending(rid), 1.0)
    assert v.writes_pending(rid), "a third party's FENCED released memory the pregranted peer can still write"
    s.send([[hw.FENCED, [rid], 0]])
    assert until(lambda: not v.writes_pending(rid), 3.0), v.fencing()
    after_attack(v)


def test_close_frees_ucx_resources_without_the_garbage_collector():
    """Open and close a UCX decode endpoint 3 times with the collector off: bounds +4 fds, +32 MiB RSS
    (today: about +11 fds and +33 MiB per round, all back after gc.collect())."""
    gc.collect()
    f0, r0 = fds(), rss()
    gc.disable()
    try:
        for _ in range(3):
            pool = MHAPool(layers=2, heads=2, head_dim=8, dtype="float16", num_pages=64, page_size=4)
            ep = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2), pool, transport="ucx",
                                transport_options=OPTS)
            ep.close()
            del ep
        f1, r1 = fds(), rss()
    finally:
        gc.enable()
        gc.collect()
    assert f1 - f0 <= 4, f"+{f1 - f0} fds after 3 open/close rounds (gc off); {fds() - f0:+d} after gc"
    assert r1 - r0 <= 32 << 20, f"RSS +{(r1 - r0) >> 20} MiB after 3 rounds (gc off)"
