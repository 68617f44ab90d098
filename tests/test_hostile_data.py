"""Hostile third parties on the ZMQ data plane, and the prefill lease (issue 16).

The attacker (``hostile_wire.DataClient``) is a raw zmq DEALER on decode's data ROUTER, knowing
only what anyone on the network can: the endpoint (published in the registry) and request ids,
which are ``room.gen`` with a small counter. The victims are a real prefill/decode pair in this
process. After each attack: threads alive, an honest request lands byte-exact, the canary outside
grants untouched, fds/threads bounded.
"""
from __future__ import annotations

import itertools

import hostile_wire as hw
import pytest
from hostile_victims import Pair, after_attack, snapshot
from waiting import until

# kvxfer names used here (update here after a module move)
from kvxfer.endpoint.base import KVPoll

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

xids = itertools.count(1 << 50)


@pytest.fixture
def pair(registry):
    p = Pair(registry.url)
    yield p
    p.close()


@pytest.fixture
def attacker(pair):
    """An admitted sender (another prefill rank decode said HELLO to: an insider) with no grant and no
    capability for the live requests it attacks; a stranger never gets past the ZMTP handshake
    (``test_a_stranger_gets_no_answer_at_all``)."""
    token = pair.d.ep.transport.admit({"id": "mallory-prefill"})
    c = hw.DataClient(pair.d.ep.info.data["zmq"]["endpoint"], user="mallory-prefill", token=token)
    yield c
    c.close()


def test_a_stranger_gets_no_answer_at_all(pair):
    before = snapshot()
    c = hw.DataClient(pair.d.ep.info.data["zmq"]["endpoint"])
    try:
        assert c.exchange([hw.data_header("1.1", 1, dl=5.0)], timeout=1.0) is None   # not even its ping
    finally:
        c.close()
    after_attack(pair, before)


def test_frames_for_an_unknown_request_write_nothing(pair, attacker):
    before = snapshot()
    for rid in ("999.1", "nobody", ""):
        replies = attacker.exchange([hw.data_header(rid, next(xids), hw.runs_field((0, 0, 64))), bytes(64)])
        assert replies is not None and replies and replies[0]["t"] == "n", replies
    after_attack(pair, before)


def test_a_third_party_cannot_complete_a_live_request(pair, attacker):
    before = snapshot()
    r, d_slots = pair.receiver()
    meta = hw.chunk_meta(r.room, r.gen, (0, 0), chunk=0, total=1, nbytes=0)
    replies = attacker.exchange([hw.data_header(r.request_id, next(xids), end=(0, 0), notify=meta)])
    assert replies is not None, "decode's data thread stopped answering"
    assert r.wait(0.5) != KVPoll.Success, "Success with nothing written: decode holds the canary as KV"
    assert pair.finish(r, d_slots), "the honest prefill could not deliver the request afterwards"
    after_attack(pair, before)


def test_probes_of_live_and_unknown_ids_get_the_same_answer(pair, attacker):
    before = snapshot()
    r, _ = pair.receiver()
    try:
        answers = []
        for rid in (r.request_id, f"{r.room + 10_000}.{r.gen}"):
            replies = attacker.exchange([hw.data_header(rid, next(xids))])
            assert replies is not None
            answers.append([{k: v for k, v in h.items() if k != "x"} for h in replies])
        assert answers[0] == answers[1], f"live id answered {answers[0]}, unknown id {answers[1]}"
    finally:
        r.abort("probed")
    after_attack(pair, before)


@pytest.mark.parametrize("bad", ["length mismatch", "outside grant", "unknown region"])
def test_one_bad_frame_does_not_fail_a_live_request(pair, attacker, bad):
    before = snapshot()
    r, d_slots = pair.receiver()
    runs, payload = {"length mismatch": (hw.runs_field((0, 0, 100)), bytes(99)),
                     "outside grant": (hw.runs_field((0, 1 << 40, 64)), bytes(64)),
                     "unknown region": (hw.runs_field((99, 0, 64)), bytes(64))}[bad]
    replies = attacker.exchange([hw.data_header(r.request_id, next(xids), runs), payload])
    assert replies is not None, "decode's data thread stopped answering"
    assert r.wait(0.3) != KVPoll.Failed, f"the live request failed: {r.reason}"
    assert pair.finish(r, d_slots)
    after_attack(pair, before)


def test_kv_releasable_only_after_on_release_returned(pair):
    before = snapshot()
    r, d_slots = pair.receiver()
    p_slots = pair.p.alloc.alloc(len(d_slots))
    seen = []
    s = pair.p.ep.sender(r.room, on_release=lambda outcome: seen.append(s.kv_releasable))
    try:
        s.send(p_slots, last=True)
        assert r.wait(8) == KVPoll.Success and s.wait(8) == KVPoll.Success
        pair.moves.append((p_slots, d_slots))
        assert until(lambda: seen, 8), "on_release never ran"
        assert seen == [False], "kv_releasable was already True inside on_release"
        assert s.kv_releasable
    finally:
        if until(lambda: seen, 1):
            pair.p.alloc.free(p_slots)
    after_attack(pair, before)
