"""A control channel thread that dies of a bug (issue 16): no zombie rank.

The bug is injected by making the endpoint's ``on_tick`` (which the channel thread calls every
turn, outside any catch: a bug there is a bug of the thread) raise. Then every request the
endpoint owned ends Failed with the reason, each grant / KV is released exactly once, the
endpoint says it is broken, a prefill rank leaves the registry, new requests are refused with
the reason, and the peer process's requests end too (it hears no heartbeat any more).
"""
from __future__ import annotations

import time

import pytest
from test_request_faults import (
    Pair,
    assert_ended,
    assert_released_once,
    assert_remote_clean,
    decode_states,
    prefill_states,
)
from waiting import until

from kvxfer.control.client import BootstrapClient
from kvxfer.control.messages import Ping
from kvxfer.errors import RequestError

pytestmark = pytest.mark.slow

REASON = r"endpoint broken: control channel thread died: RuntimeError\('injected bug'\)"


@pytest.fixture
def pairs():
    made = []
    yield made
    for p in made:
        p.close()


def _bug(now: float) -> float:
    raise RuntimeError("injected bug")


def registered(url: str) -> list[str]:
    return [r.spec.key for r in BootstrapClient(url).topology()[1]]


def test_prefill_channel_thread_dies(pairs, monkeypatch):
    pair = Pair("zmq", "prefill")
    pairs.append(pair)
    ep = pair.local.ep
    reqs = prefill_states(pair, 200)
    assert len(registered(pair.server.url)) == 1
    t0 = time.monotonic()
    monkeypatch.setattr(ep, "on_tick", _bug)
    ep.channel.send("nobody", Ping())            # wake the thread: its next turn ticks
    assert_ended(reqs, t0, REASON, limit=2.0)
    assert ep.broken is not None and "injected bug" in ep.broken
    assert not ep.channel.alive
    assert_released_once(pair.local, reqs)
    assert all(s.kv_releasable for s in reqs.values())
    assert until(lambda: registered(pair.server.url) == [], 5), "the broken prefill rank is still registered"
    with pytest.raises(RequestError, match=REASON.split(": ", 1)[1]):
        ep.sender(999)
    with pytest.raises(RequestError, match="broken"):
        ep.register(pair.server.url)
    assert_remote_clean(pair.remote, [201, 202])        # decode's requests end: no heartbeat answers


def test_decode_channel_thread_dies(pairs, monkeypatch):
    pair = Pair("zmq", "decode")
    pairs.append(pair)
    ep = pair.local.ep
    reqs = decode_states(pair, 100)
    t0 = time.monotonic()
    monkeypatch.setattr(ep, "on_tick", _bug)
    ep.channel.send("default/dp0/pp0/tp0", Ping())   # the prefill rank: wake the thread
    assert_ended(reqs, t0, REASON, limit=2.0)
    assert ep.broken is not None and not ep.channel.alive
    assert_released_once(pair.local, reqs)
    with pytest.raises(RequestError, match="broken: control channel thread died"):
        ep.receiver(999)
    assert_remote_clean(pair.remote, [101, 102])        # prefill's senders: decode went silent
