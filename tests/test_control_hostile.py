"""Hostile peers at a live control channel: a raw zmq DEALER that writes msgpack and HMAC by
hand (never kvxfer's encoders), against a real prefill endpoint (local transport).

Each test checks that the victim's channel thread is still alive and that an honest decode
rank still handshakes afterwards. The raw peer speaks both the envelope ``[mac, head, body]``
and the older ``[mac, body]``, so the same input reaches the parser of either version.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time

import hostile_wire as hw
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.control.channel import ChannelLimits, ControlChannel, Heartbeat
from kvxfer.control.handshake import hello
from kvxfer.control.messages import Drop, Hello, Ping
from kvxfer.control.records import RankInfo
from kvxfer.endpoint.base import Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.errors import ConnectError
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec

FAST = Timeouts(handshake=3.0, heartbeat=Heartbeat(interval=0.2, timeout=2.0))
SECRET = b"s3cret"


def _pool():
    return MHAPool(layers=4, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4)


def _prefill(secret=None) -> PrefillEndpoint:
    return PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=4), _pool(), transport="local",
                           timeouts=FAST, secret=secret)


def _decode(secret=None) -> DecodeEndpoint:
    """A decode endpoint these tests say HELLO for by hand: its data port admits anyone (no token)."""
    return DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=4), _pool(), transport="local",
                          timeouts=FAST, secret=secret, transport_options={"admission": "open"})


# ------------------------------------------------------------------------------------
# A peer written from the wire description, not from kvxfer's code
# ------------------------------------------------------------------------------------
class RawPeer:
    def __init__(self, address: str, identity: bytes, secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.linger = 0
        self.s.setsockopt(zmq.IDENTITY, identity)
        if secret is not None:   # a secret holder passes the ZMTP handshake (CURVE keys from the secret)
            hw.curve_dial(self.s, secret)
        self.s.connect(address)
        self.address, self.identity, self.secret = address, identity, secret
        self.nonce, self.seq = os.urandom(16), 0

    def frames(self, msg, *, body: bytes | None = None, seq: int | None = None, sender: str | None = None) -> list:
        body = msgpack.packb(msg, use_bin_type=True) if body is None else body
        if seq is None:
            self.seq += 1
            seq = self.seq
        head = msgpack.packb([1, self.identity.decode() if sender is None else sender, self.address, self.nonce, seq],
                             use_bin_type=True)
        tag = hmac.new(self.secret, len(head).to_bytes(4, "little") + head + body, hashlib.sha256).digest() \
            if self.secret else b""
        return [tag, head, body]

    def legacy(self, msg) -> list:
        body = msgpack.packb(msg, use_bin_type=True)
        return [hmac.new(self.secret, body, hashlib.sha256).digest() if self.secret else b"", body]

    def send_both(self, msg) -> None:
        self.s.send_multipart(self.legacy(msg))
        self.s.send_multipart(self.frames(msg))

    def replies(self, wait: float = 1.0, until: str | None = None) -> list[dict]:
        """Replies within ``wait`` seconds (or up to the first of type ``until``)."""
        out, deadline = [], time.monotonic() + wait
        while self.s.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            out.append(msgpack.unpackb(self.s.recv_multipart()[-1], raw=False))
            if until is not None and isinstance(out[-1], dict) and out[-1].get("t") == until:
                break
        return out

    def close(self):
        self.s.close()
        self.ctx.term()


def _hello(info: dict, i: int = 7) -> dict:
    return {"t": "hello", "i": i, "info": info, "nonce": os.urandom(16)}


def _still_serves(p: PrefillEndpoint, secret=None) -> None:
    """The victim's channel thread lives and an honest decode rank handshakes."""
    assert p.channel.alive
    d = _decode(secret)
    try:
        d.connect(peers=[p.info], timeout=5)
    finally:
        d.close()
    assert p.channel.alive


@pytest.fixture
def victim():
    made = []

    def make(secret=None):
        p = _prefill(secret)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


# ------------------------------------------------------------------------------------
# No input kills the thread
# ------------------------------------------------------------------------------------
BAD = [
    {"t": [1]},                                   # TypeError (unhashable) in the old schema lookup
    {"t": {"x": 1}},
    {"t": "ping", "re": [1]},                     # TypeError in the old call lookup
    {"t": "welcome", "re": [1], "info": {}},
    {"t": "hello", "i": 1.5, "info": {}, "nonce": b"x" * 16},
    {"t": "req", "room": 1e30, "gen": 1, "kv": b"", "prefix": 0, "state": b"", "aux": False, "dummy": True},
    [1, 2, 3], "text", None,
]


def test_no_message_kills_the_channel_thread(victim):
    p = victim()
    peer = RawPeer(p.info.control, b"attacker")
    try:
        for msg in BAD:
            peer.send_both(msg)
        peer.s.send_multipart([b"x"] * 50)                 # many parts: only a few are kept
        peer.s.send_multipart([b"", b"\xc1", b"\xc1"])      # not msgpack at all
        peer.replies(0.5)
        assert p.channel.alive
        assert set(p.channel.dropped) <= set(Drop), p.channel.dropped
        _still_serves(p)
    finally:
        peer.close()


VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                   st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=24),
                   st.lists(st.integers(-9, 9), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(-9, 9), max_size=2))
FIELDS = ["i", "re", "info", "nonce", "why", "room", "gen", "kv", "prefix", "state", "aux", "dummy", "swa", "swa_n",
          "meta"]
MESSAGES = st.fixed_dictionaries({"t": st.one_of(st.sampled_from(["hello", "welcome", "refuse", "req", "ack", "nack",
                                                                  "abort", "done", "fin", "ping", "pong"]), VALUES)},
                                 optional={f: VALUES for f in FIELDS})


@pytest.fixture(scope="module")
def fuzz_target():
    p = _prefill()
    peer = RawPeer(p.info.control, b"fuzzer")
    yield p, peer
    peer.close()
    p.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(MESSAGES, min_size=1, max_size=4))
def test_fuzzed_messages_of_every_schema_never_kill_the_thread(fuzz_target, msgs):
    """Structured fuzzing: maps shaped like each message type, fields of every wrong type."""
    p, peer = fuzz_target
    for m in msgs:
        peer.send_both(m)
    peer.s.send_multipart(peer.frames({"t": "ping"}))
    assert p.channel.alive and set(p.channel.dropped) <= set(Drop)


def test_the_fuzzed_victim_still_serves(fuzz_target):
    p, _ = fuzz_target
    time.sleep(0.3)
    _still_serves(p)


def test_dropped_is_keyed_by_a_fixed_enum(victim):
    """A peer that sends 200 different message types adds no counter key of its choosing."""
    p = victim()
    peer = RawPeer(p.info.control, b"spray")
    try:
        for k in range(200):
            peer.send_both({"t": f"type-{k}"})
        peer.send_both({"t": "ping"})
        deadline = time.monotonic() + 3
        while sum(p.channel.dropped.values()) < 400 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(p.channel.dropped) <= set(Drop) and len(p.channel.dropped) <= 3, p.channel.dropped
        assert p.channel.dropped[Drop.TYPE] == 200
    finally:
        peer.close()


def test_a_process_with_300_extra_fds_still_works(victim):
    """fds above 256 are distinct int objects: comparing them with ``is`` killed the thread."""
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(300)]
    try:
        p = victim()
        _still_serves(p)
    finally:
        for fd in extra:
            os.close(fd)


@pytest.mark.parametrize("address", ["tcp://", "tcp://:5", "tcp://host:0", "tcp://0.0.0.0:5", "tcp://a b:5",
                                     "tcp://h:99999", "udp://h:5", "ipc://"])
def test_bad_control_addresses_are_refused_where_they_enter(address):
    rec = {"role": "prefill", "num_kv_heads": 1, "num_layers": 1, "control": address}
    with pytest.raises(ValueError, match="control"):
        RankInfo.from_dict(rec)
    ch = ControlChannel(_Quiet(), secret=None, heartbeat=Heartbeat())
    try:
        with pytest.raises(ConnectError, match="address"):
            ch.connect("p", address)
        assert ch.alive
    finally:
        ch.close()


class _Buggy:
    def on_message(self, peer, msg):
        pass

    def on_peer_lost(self, peer, why):
        pass

    def on_tick(self, now):
        raise RuntimeError("a bug in the handler")


def test_a_thread_that_dies_of_a_bug_tells_its_owner():
    died = threading.Event()
    seen = []

    def on_dead(exc):
        seen.append(exc)
        died.set()
    ch = ControlChannel(_Buggy(), secret=None, heartbeat=Heartbeat(), on_dead=on_dead)
    try:
        assert died.wait(5), "on_dead was not called"
        assert isinstance(seen[0], RuntimeError) and not ch.alive and ch.broken is seen[0]
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="broken"):
            ch.call("p", lambda i: Hello(i=i, info={}, nonce=b"x" * 16), 5.0)
        assert time.monotonic() - t0 < 1.0, "a call on a dead channel fails at once"
    finally:
        ch.close()


# ------------------------------------------------------------------------------------
# Bounded work per message
# ------------------------------------------------------------------------------------
_OPEN: list[DecodeEndpoint] = []


def _record(**spec) -> dict:
    """An honest decode rank's record (the rank stays open, so its data plane can be reached)."""
    d = _decode()
    _OPEN.append(d)
    rec = d.info.to_dict()
    rec.update(spec)
    return rec


@pytest.fixture(autouse=True)
def _close_decodes():
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.mark.parametrize("tp", [65536, 1024])
def test_a_huge_hello_is_answered_in_milliseconds(victim, tp):
    """A decode rank 0 claiming TP 65,536 (refused by the size bound) or 1,024 (allowed: the
    topology work is O(sources), not O(tp x tp)) is answered well within a heartbeat."""
    p = victim()
    peer = RawPeer(p.info.control, b"huge")
    try:
        t0 = time.monotonic()
        peer.send_both(_hello(_record(tp_size=tp)))
        got = [r for r in peer.replies(3.0, until="refuse") if isinstance(r, dict) and r.get("t") in ("refuse",
                                                                                                     "welcome")]
        assert got and time.monotonic() - t0 < 1.0, (got, time.monotonic() - t0)
        if tp > 1024:
            assert any("tp_size" in w and "1..1024" in w for w in got[0]["why"]), got[0]["why"]
        _still_serves(p)
    finally:
        peer.close()


@pytest.mark.slow   # waits seconds for what never comes
def test_a_layout_of_the_wrong_types_gets_a_refuse(victim):
    p = victim()
    rec = _record()
    rec["layout"]["parts"][0]["layer"] = "0"
    peer = RawPeer(p.info.control, b"typo")
    try:
        peer.send_both(_hello(rec))
        got = [r for r in peer.replies(2.0) if isinstance(r, dict) and r.get("t") == "refuse"]
        assert got and any("layer" in w for w in got[0]["why"]), got
        assert p.channel.alive
    finally:
        peer.close()


# ------------------------------------------------------------------------------------
# Replay and ownership
# ------------------------------------------------------------------------------------
@pytest.mark.slow   # seconds
def test_a_replayed_hello_does_not_make_peers(victim):
    """One captured HELLO replayed from 20 identities (and again from its own) gets one WELCOME."""
    p = victim(SECRET.decode())
    honest = RawPeer(p.info.control, b"decode-1", SECRET)
    captured_new, captured_old = honest.frames(_hello(_record())), None
    captured_old = honest.legacy(_hello(_record()))
    others = [RawPeer(p.info.control, f"replay-{k}".encode(), SECRET) for k in range(20)]
    try:
        honest.s.send_multipart(captured_new)
        honest.s.send_multipart(captured_old)
        welcomes = [r for r in honest.replies(1.0) if r.get("t") == "welcome"]
        assert len(welcomes) == 1
        honest.s.send_multipart(captured_new)                  # the same identity, again
        assert not [r for r in honest.replies(0.5) if r.get("t") == "welcome"]
        for o in others:
            o.s.send_multipart(captured_new)
            o.s.send_multipart(captured_old)
        more = [r for o in others for r in o.replies(0.2) if r.get("t") == "welcome"]
        assert more == [], f"{len(more)} replays were welcomed"
        assert p.channel.dropped[Drop.SENDER] + p.channel.dropped[Drop.FRAMES] >= 20
        assert p.channel.dropped[Drop.REPLAY] >= 1
        _still_serves(p, SECRET.decode())
    finally:
        for o in [honest, *others]:
            o.close()


def test_idle_unauthenticated_peers_are_forgotten():
    ch = ControlChannel(_Quiet(), secret=None, heartbeat=Heartbeat(interval=0.1, timeout=1.0), bind="tcp://127.0.0.1:0",
                        limits=ChannelLimits(max_peers=8, idle_timeout=0.3))
    peers = [RawPeer(ch.address, f"idle-{k}".encode()) for k in range(20)]
    try:
        for q in peers:
            q.s.send_multipart(q.frames({"t": "ping"}))
        time.sleep(0.2)
        assert ch.peers <= 8
        deadline = time.monotonic() + 3
        while ch.peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ch.peers == 0 and ch.alive
    finally:
        for q in peers:
            q.close()
        ch.close()


class _Quiet:
    def on_message(self, peer, msg):
        pass

    def on_peer_lost(self, peer, why):
        pass

    def on_tick(self, now):
        return 0.05


def test_a_message_for_another_rank_is_refused():
    """With ``check_recipient`` the recipient is checked: a message captured on its way to one
    rank does not work at another (same secret, same sender identity)."""
    a, b = (ControlChannel(_Quiet(), secret=SECRET, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0",
                           check_recipient=True, zmtp_auth=True) for _ in range(2))
    to_a = RawPeer(a.address, b"decode-x", SECRET)
    at_b = RawPeer(b.address, b"decode-x", SECRET)
    try:
        at_b.s.send_multipart(to_a.frames({"t": "ping"}))
        at_b.s.send_multipart(at_b.frames({"t": "ping"}))
        deadline = time.monotonic() + 3
        while b.peers == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.dropped[Drop.RECIPIENT] == 1 and b.peers == 1
    finally:
        to_a.close()
        at_b.close()
        a.close()
        b.close()


def test_the_mac_covers_the_envelope(victim):
    """A signed message whose head is altered (another seq, another sender) fails authentication."""
    p = victim(SECRET.decode())
    peer = RawPeer(p.info.control, b"decode-y", SECRET)
    try:
        tag, head, body = peer.frames({"t": "ping"})
        forged = msgpack.packb([1, "decode-y", p.info.control, peer.nonce, 99], use_bin_type=True)
        peer.s.send_multipart([tag, forged, body])
        deadline = time.monotonic() + 3
        while not p.channel.dropped[Drop.AUTH] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.channel.dropped[Drop.AUTH] == 1 and p.channel.alive
    finally:
        peer.close()


def test_a_message_of_many_large_parts_is_dropped_part_by_part():
    ch = ControlChannel(_Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0")
    peer = RawPeer(ch.address, b"parts")
    try:
        peer.s.send_multipart([b"m" * 10_000, b"h" * 10_000, b"b" * 10_000])
        peer.s.send_multipart([b"x"] * 1000)
        deadline = time.monotonic() + 3
        while sum(ch.dropped.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ch.dropped[Drop.TOO_LARGE] == 1 and ch.dropped[Drop.FRAMES] == 1 and ch.alive
    finally:
        peer.close()
        ch.close()


class _Watcher(_Quiet):
    """Watches every peer that sends DONE, as prefill does after an accepted HELLO."""
    channel: ControlChannel

    def on_message(self, peer, msg):
        self.channel.watch(peer)


def test_peers_lost_long_ago_make_room_for_new_ones():
    """With max_peers 2, two watched peers that went silent do not lock out a third."""
    h = _Watcher()
    ch = h.channel = ControlChannel(h, secret=None, heartbeat=Heartbeat(interval=0.1, timeout=0.3),
                                    bind="tcp://127.0.0.1:0", limits=ChannelLimits(max_peers=2))
    peers = [RawPeer(ch.address, f"w{k}".encode()) for k in range(3)]
    try:
        for q in peers[:2]:
            q.s.send_multipart(q.frames({"t": "done", "room": 1, "gen": 1}))
        time.sleep(0.8)                                  # both watched, then silent past the timeout
        peers[2].s.send_multipart(peers[2].frames({"t": "done", "room": 1, "gen": 1}))
        time.sleep(0.3)
        assert ch.dropped[Drop.PEERS] == 0 and ch.peers == 2 and ch.alive
    finally:
        for q in peers:
            q.close()
        ch.close()


def test_a_new_connection_to_the_same_rank_gets_answers(victim):
    """Decode forgets a silent prefill rank and handshakes again with the same process (a healed
    partition): the ROUTER sees a new connection nonce and answers on a new one too (decode has
    spent the old one, so replies on it would be dropped as replays)."""
    p = victim(secret="s")
    d = _decode(secret="s")
    try:
        key = p.spec.key
        for _ in range(3):
            d.channel.forget(key)
            d.channel.connect(key, p.info.control)
            assert hello(d.channel, key, d.info, 3.0).control == p.info.control
    finally:
        d.close()


def test_connect_to_a_new_address_replaces_the_connection(victim):
    """A prefill rank restarted on a new port: the same peer name, a new address, a new handshake."""
    old, new = victim(), victim()
    d = _decode()
    try:
        key = old.spec.key   # both answer to the same rank key: the restarted rank
        d.channel.connect(key, old.info.control)
        assert hello(d.channel, key, d.info, 3.0).control == old.info.control
        d.channel.connect(key, new.info.control)
        assert hello(d.channel, key, d.info, 3.0).control == new.info.control
    finally:
        d.close()


class _Gate(_Quiet):
    """Holds the channel thread inside ``on_tick`` while armed, so a test can line up events
    that one turn of the thread then meets together."""

    def __init__(self):
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()

    def on_tick(self, now):
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(5)
        return 0.05


def test_forgetting_a_peer_whose_message_is_waiting_keeps_the_thread_alive():
    """A peer forgotten in the same turn as its message arrives: the turn closes its DEALER
    first, and must not then read from the closed socket (the thread died of ENOTSOCK)."""
    gate = _Gate()
    b = ControlChannel(_Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0", identity="p0")
    a = ControlChannel(gate, secret=None, heartbeat=Heartbeat(), identity="d0")
    try:
        a.connect("p0", b.address)
        a.send("p0", Ping())
        deadline = time.monotonic() + 3
        while b.peers == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.peers == 1
        gate.armed = True
        assert gate.entered.wait(3)
        b.send("d0", Ping())      # lands in a's DEALER while a's thread is held
        time.sleep(0.3)
        a.forget("p0")                    # queued for the same turn
        gate.release.set()
        time.sleep(0.5)
        assert a.alive and a.broken is None, f"channel thread died: {a.broken!r}"
    finally:
        a.close()
        b.close()
