"""Quiet ranks doze (issue 39): a control channel whose owner has no request to look after waits
past its 50 ms tick (``TICK``), up to the heartbeat's pace, instead of waking 20 times a second;
a non-urgent message queued meanwhile, or work its owner takes on (``nudge``), wakes it at once.
The endpoints say when they are quiet (no request for ``LINGER`` s: a stream of requests never
dozes, so never pays the wake-up): a request begun on a dozing rank still gets its tick within
``TICK``, so its deadlines hold to the tick as before.

Measured before the change (8 idle prefill ranks in one process): the channel threads woke ~170
times a second together and took ~36 ms of CPU a second; the zmq transport threads ~20 ms.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from manual_clock import ManualClock
from request_pair import Pair
from support.channels import Quiet
from waiting import until

from kvxfer.control.channel import TICK, ControlChannel, Heartbeat
from kvxfer.control.messages import Done
from kvxfer.endpoint import KVPoll, Outcome, Timeouts

SLOW_BEAT = Heartbeat(interval=8.0, timeout=20.0)   # the channel's own turn comes every 4 s


class Dozy(Quiet):
    """An owner with nothing to look after: it asks for its next tick in 30 s."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks: list[float] = []

    def on_tick(self, now) -> float:
        self.ticks.append(time.monotonic())
        return 30.0


def test_a_dozing_channel_wakes_for_a_message_queued_and_for_a_nudge():
    sink = Quiet()
    far = ControlChannel(sink, secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0")
    owner = Dozy()
    ch = ControlChannel(owner, secret=None, heartbeat=SLOW_BEAT)
    try:
        ch.connect("far", far.address)
        assert until(lambda: ch.dozing, 3.0), "the channel of a quiet owner dozes"
        t0 = time.monotonic()
        ch.send("far", Done(room=7, gen=1), urgent=False)   # would wait for the next turn, ~4 s away
        assert until(lambda: sink.got, 1.0), "the message queued while dozing arrives at once"
        assert time.monotonic() - t0 < 1.0 and sink.got[0][1] == Done(room=7, gen=1)
        assert until(lambda: ch.dozing, 3.0), "dozing again"
        n = len(owner.ticks)
        t1 = time.monotonic()
        ch.nudge()
        assert until(lambda: len(owner.ticks) > n, 1.0), "a nudge brings the owner's tick at once"
        assert owner.ticks[n] - t1 < 1.0
        time.sleep(0.5)   # a quiet owner's ticks are rare: the heartbeat's pace, not 20 a second
        assert len(owner.ticks) <= n + 3, owner.ticks
    finally:
        ch.close()
        far.close()


def test_a_busy_owner_is_never_left_dozing():
    """An owner that asks for a tick within ``TICK`` gets it: the channel does not doze."""
    ticks: list[float] = []

    class Busy(Quiet):
        def on_tick(self, now):
            ticks.append(time.monotonic())
            return TICK

    ch = ControlChannel(Busy(), secret=None, heartbeat=SLOW_BEAT)
    try:
        time.sleep(0.6)
        assert not ch.dozing and len(ticks) >= 6, len(ticks)
    finally:
        ch.close()


@pytest.mark.slow   # it waits out LINGER twice (~2.4 s): the fast tier stays under its 90 s
def test_a_request_begun_on_a_dozing_rank_gets_its_tick_within_one_tick(monkeypatch):
    """Both endpoints idle (past ``LINGER``), their channels doze (one turn in 4 s here: the quiet tick
    is made longer than the heartbeat's). A receiver and a sender that nobody serves are made; the injected clocks
    pass their bootstrap deadline; both fail as the next tick sees it, well within a second: making
    them woke the dozing channels (``guard``'s nudge)."""
    from kvxfer.endpoint import base
    monkeypatch.setattr(base, "IDLE_TICK", 30.0)
    pc, dc = ManualClock(), ManualClock()
    t = Timeouts(bootstrap=30, waiting=300, transfer=30, lease=30, heartbeat=SLOW_BEAT)
    pair = Pair(timeouts=t, p_clock=pc, d_clock=dc)
    try:
        pe, de = pair.pe, pair.de
        assert until(lambda: pe.channel.dozing and de.channel.dozing, 5.0), "idle endpoints doze"
        assert pe.quiet() and de.quiet()
        r = de.receiver(10)   # init() is never called: no message leaves, only the tick ends it
        s = pe.sender(11)     # decode never asks for room 11
        assert not de.quiet() and not pe.quiet()
        pc.advance(31)
        dc.advance(31)
        t0 = time.monotonic()
        assert r.wait(2.0) == KVPoll.Failed and s.wait(2.0) == KVPoll.Failed
        assert time.monotonic() - t0 < 1.0
        assert r.outcome is s.outcome is Outcome.TimedOut
        assert until(lambda: de.quiet() and pe.quiet(), 3.0), "quiet again once both ended"
        looks = []   # for LINGER s the channels tick on (the next request is near): dozing only in a tick
        for _ in range(10):
            looks.append(de.channel.dozing or pe.channel.dozing)
            time.sleep(0.03)
        assert sum(looks) <= 2, looks
        assert until(lambda: pe.channel.dozing and de.channel.dozing, 5.0), "dozing after LINGER"
        assert np.array_equal(pair.d_pool.buffers[0].numpy(), pair.before[0].numpy())   # nothing written
    finally:
        pair.close()
