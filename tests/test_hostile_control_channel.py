"""Hostile peers at a bare ``ControlChannel`` (no endpoint: its owner is a handler of the test's own,
``support.channels.Quiet`` or a subclass): addresses refused where they enter, a thread that dies
of a bug tells its owner, idle and lost peers are forgotten within the peer limit, the MAC covers
the recipient, oversized messages are dropped part by part, and a forgotten
peer's waiting message does not kill the thread.

The attacker is ``hostile_wire.CtlClient`` (raw zmq, msgpack and hmac, never kvxfer's encoders).
Attacks on endpoints are in ``test_hostile_control.py``.
"""
from __future__ import annotations

import threading
import time

import hostile_wire as hw
import pytest
from support.channels import Quiet

# kvxfer names used here (update here after a module move)
from kvxfer.control.channel import ChannelLimits, ControlChannel, Heartbeat
from kvxfer.control.messages import Drop, Hello, Ping
from kvxfer.control.records import RankInfo
from kvxfer.errors import ConnectError

SECRET = b"s3cret"


def _until(cond, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("address", ["tcp://", "tcp://:5", "tcp://host:0", "tcp://0.0.0.0:5", "tcp://a b:5",
                                     "tcp://h:99999", "udp://h:5", "ipc://"])
def test_bad_control_addresses_are_refused_where_they_enter(address):
    rec = {"role": "prefill", "num_kv_heads": 1, "num_layers": 1, "control": address}
    with pytest.raises(ValueError, match="control"):
        RankInfo.from_dict(rec)
    ch = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat())
    try:
        with pytest.raises(ConnectError, match="address"):
            ch.connect("p", address)
        assert ch.alive
    finally:
        ch.close()


class _Buggy(Quiet):
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
# Peers the channel holds
# ------------------------------------------------------------------------------------
def test_idle_unauthenticated_peers_are_forgotten():
    ch = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat(interval=0.1, timeout=1.0), bind="tcp://127.0.0.1:0",
                        limits=ChannelLimits(max_peers=8, idle_timeout=0.3))
    peers = [hw.CtlClient(ch.address, identity=f"idle-{k}") for k in range(20)]
    try:
        for q in peers:
            q.send({"t": "ping"})
        time.sleep(0.2)
        assert ch.peers <= 8
        _until(lambda: not ch.peers)
        assert ch.peers == 0 and ch.alive
    finally:
        for q in peers:
            q.close()
        ch.close()


class _Watcher(Quiet):
    """Watches every peer that sends DONE, as prefill does after an accepted HELLO."""
    channel: ControlChannel

    def on_message(self, peer, msg):
        self.channel.watch(peer)


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_peers_lost_long_ago_make_room_for_new_ones():
    """With max_peers 2, two watched peers that went silent do not lock out a third."""
    h = _Watcher()
    ch = h.channel = ControlChannel(h, secret=None, heartbeat=Heartbeat(interval=0.1, timeout=0.3),
                                    bind="tcp://127.0.0.1:0", limits=ChannelLimits(max_peers=2))
    peers = [hw.CtlClient(ch.address, identity=f"w{k}") for k in range(3)]
    try:
        for q in peers[:2]:
            q.send({"t": "done", "room": 1, "gen": 1})
        time.sleep(0.8)                                  # both watched, then silent past the timeout
        peers[2].send({"t": "done", "room": 1, "gen": 1})
        time.sleep(0.3)
        assert ch.dropped[Drop.PEERS] == 0 and ch.peers == 2 and ch.alive
    finally:
        for q in peers:
            q.close()
        ch.close()


# ------------------------------------------------------------------------------------
# What a message must carry
# ------------------------------------------------------------------------------------
def test_a_message_for_another_rank_is_refused():
    """With ``check_recipient`` the recipient is checked: a message captured on its way to one
    rank does not work at another (same secret, same sender identity)."""
    a, b = (ControlChannel(Quiet(), secret=SECRET, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0",
                           check_recipient=True, zmtp_auth=True) for _ in range(2))
    to_a = hw.CtlClient(a.address, SECRET, identity="decode-x")
    at_b = hw.CtlClient(b.address, SECRET, identity="decode-x")
    try:
        at_b.send(frames=to_a.frames({"t": "ping"}))
        at_b.send({"t": "ping"})
        _until(lambda: b.peers != 0)
        assert b.dropped[Drop.RECIPIENT] == 1 and b.peers == 1
    finally:
        to_a.close()
        at_b.close()
        a.close()
        b.close()


def test_a_message_of_many_large_parts_is_dropped_part_by_part():
    ch = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0")
    peer = hw.CtlClient(ch.address, identity="parts")
    try:
        peer.send(frames=[b"m" * 10_000, b"h" * 10_000, b"b" * 10_000])
        peer.send(frames=[b"x"] * 1000)
        _until(lambda: sum(ch.dropped.values()) >= 2)
        assert ch.dropped[Drop.TOO_LARGE] == 1 and ch.dropped[Drop.FRAMES] == 1 and ch.alive
    finally:
        peer.close()
        ch.close()


# ------------------------------------------------------------------------------------
# The thread's own turn
# ------------------------------------------------------------------------------------
class _Gate(Quiet):
    """Holds the channel thread inside ``on_tick`` while armed, so a test can line up events
    that one turn of the thread then meets together."""

    def __init__(self):
        super().__init__()
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
    b = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0", identity="p0")
    a = ControlChannel(gate, secret=None, heartbeat=Heartbeat(), identity="d0")
    try:
        a.connect("p0", b.address)
        a.send("p0", Ping())
        _until(lambda: b.peers != 0)
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
