"""Identity before resources on the zmq data path (issue 34): ``admit`` tokens, checked at the
ZMTP handshake, and every sender charged its own share of the receiver's transfer table.

The attackers are raw pyzmq DEALERs speaking the data protocol with their own msgpack frames
(``hostile_wire``, never kvxfer's encoders). After each case: the receiver's I/O thread alive,
an honest admitted sender's transfer byte-exact, every byte outside the honest moves still the
canary, fds and threads within the slack below.
"""
from __future__ import annotations

import itertools
import os
import threading
import time

import hostile_wire as hw
import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvxfer.errors import ConfigError, ConnectError
from kvxfer.grant import ByteRanges
from kvxfer.plan import RunGroup, TransferPlan
from kvxfer.transport.registry import get_transport

REGION, MOVE, CANARY = 8 << 20, 256 << 10, 0xA5
FD_SLACK, THREAD_SLACK = 8, 1
xids = itertools.count(1 << 40)


class Victim:
    """A receiver that requires admission, and an honest admitted sender."""

    def __init__(self, **options):
        self.rx = get_transport("zmq", admission="required", **options)
        self.tx = get_transport("zmq", admission="required")
        self.src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        self.dst = torch.full((REGION,), CANARY, dtype=torch.uint8)
        self.want = self.dst.clone()
        self.tx.register([self.src])
        self.rx.register([self.dst])
        self.peer = self.tx.connect(self.rx.descriptor(), self.rx.admit(self.tx.descriptor()))
        self.moves = itertools.count()
        self.before = (len(os.listdir("/proc/self/fd")), threading.active_count())

    def honest(self, timeout: float = 10.0) -> str:
        """An honest transfer to a fresh range: '' when it landed byte-exact, else why not."""
        k = next(self.moves)
        off, rid = (k * MOVE) % REGION, f"honest.{k}"
        self.rx.expect(rid, ByteRanges(np.zeros(1), np.array([off]), np.array([MOVE])))
        z = np.zeros(1, np.int64)
        plan = TransferPlan((RunGroup(z, np.array([off]), z, np.array([off]), z, z, np.array([MOVE]), False),))
        h = self.tx.submit(self.peer, rid, plan, timeout=timeout)
        ok = h.wait(timeout)
        self.rx.forget(rid)
        if not ok:
            return f"the honest transfer failed: {h.error}"
        self.want[off: off + MOVE] = self.src[off: off + MOVE]
        return ""

    def check(self) -> None:
        """The invariants after an attack."""
        assert self.rx.broken is None and self.rx.io.alive, f"the receiver's I/O thread died: {self.rx.broken}"
        why = self.honest()
        assert not why, why
        assert torch.equal(self.dst, self.want), "bytes outside the honest moves changed"
        end = time.monotonic() + 3   # the receiver's end of a closed attacker connection closes soon after
        while len(os.listdir("/proc/self/fd")) - self.before[0] > FD_SLACK and time.monotonic() < end:
            time.sleep(0.05)
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        assert fds - self.before[0] <= FD_SLACK, f"fds {self.before[0]} -> {fds}"
        assert threads - self.before[1] <= THREAD_SLACK, f"threads {self.before[1]} -> {threads}"

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture
def victim():
    v = Victim()
    yield v
    v.close()


class Raw:
    """A raw DEALER on the receiver's data port: NULL, or PLAIN with any user and password."""

    def __init__(self, ctx: zmq.Context, endpoint: str, user: bytes | None = None, password: bytes = b""):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if user is not None:
            self.sock.plain_username, self.sock.plain_password = user, password
        self.sock.connect(endpoint)

    def pong(self, timeout: float = 1.0) -> bool:
        """Whether a ping is answered (the connection got past the handshake and is served)."""
        n = next(xids)
        try:   # a refused connection leaves the DEALER without a peer: a blocking send would wait forever
            self.sock.send(msgpack.packb({"t": "p", "n": n}), zmq.NOBLOCK)
        except zmq.Again:
            return False
        end = time.monotonic() + timeout
        while self.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
            if msgpack.unpackb(self.sock.recv(), raw=False).get("n") == n:
                return True
        return False


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_only_an_admitted_sender_with_its_token_gets_past_the_handshake(victim, ctx):
    rx, endpoint = victim.rx, victim.rx.endpoint
    token = rx.admit({"id": "mallory"})   # mallory is admitted; others guess
    strangers = [Raw(ctx, endpoint), Raw(ctx, endpoint, b"mallory", b"guess"), Raw(ctx, endpoint, b"eve", token),
                 Raw(ctx, endpoint, victim.tx.id.encode(), b"wrong")]
    assert not any(s.pong(0.3) for s in strangers), "a peer without its token was served"
    assert Raw(ctx, endpoint, b"mallory", token).pong(), "the admitted peer was not served"
    assert rx.grants.rejected == {}, "refused handshakes reached the receiver's message checks"
    ctx.destroy(linger=0)
    victim.check()


@pytest.mark.slow   # waits seconds for what never comes
def test_a_sender_without_a_token_cannot_connect():
    v = Victim(connect_timeout=1.0)
    try:
        stranger = get_transport("zmq", connect_timeout=1.0)
        with pytest.raises(ConnectError, match="admission token"):
            stranger.connect(v.rx.descriptor())
        with pytest.raises(ConnectError, match="admission token"):
            stranger.connect(v.rx.descriptor(), b"x" * 32)
        stranger.close()
        v.check()
    finally:
        v.close()


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_admitting_again_stops_the_old_token(ctx):
    v = Victim(heartbeat_timeout=2.0)
    try:
        old = v.rx.admit({"id": "p1"})
        first = Raw(ctx, v.rx.endpoint, b"p1", old)
        assert first.pong()
        new = v.rx.admit({"id": "p1"})
        assert new != old
        assert not first.pong(0.5), "a connection made with the replaced token is still served"
        assert v.rx.rejected["unknown peer"] >= 1
        assert not Raw(ctx, v.rx.endpoint, b"p1", old).pong(0.5), "the replaced token still opens a connection"
        assert Raw(ctx, v.rx.endpoint, b"p1", new).pong()
        ctx.destroy(linger=0)
        v.check()
    finally:
        v.close()


def test_a_sender_cannot_spend_the_shares_of_others(ctx):
    """The issue's attack: zero-run transfers kept open by pings, 4,500 of them over five
    connections. Before: the table's 4,096 were spent, and an honest request failed "too many
    transfers: 4096 open, 0 from this peer". Now the attacker, though admitted, holds its own
    share (one admission, whatever its connections), and the honest sender is served."""
    v = Victim()
    try:
        token = v.rx.admit({"id": "greedy"})
        socks = [Raw(ctx, v.rx.endpoint, b"greedy", token) for _ in range(5)]
        refused = 0
        for s in socks:
            for _ in range(900):
                s.sock.send(hw.data_header(f"hold.{next(xids)}", next(xids)))   # no runs, no totals: stays open
        for s in socks:   # each pong comes after the replies to what that connection sent before it
            n = next(xids)
            s.sock.send(msgpack.packb({"t": "p", "n": n}))
            while True:
                assert s.sock.poll(10_000), "the receiver stopped answering"
                h = msgpack.unpackb(s.sock.recv(), raw=False)
                if h.get("t") == "p" and h.get("n") == n:
                    break
                refused += h.get("t") == "n" and h.get("why", "").startswith("too many transfers")
        assert refused == 5 * 900 - 1024, f"{refused} refused: one admission holds max_incoming_per_peer (1024)"
        assert v.honest() == "", "the honest sender was refused while the attacker held its transfers open"
        assert all(s.pong() for s in socks), "the attacker's connections are cut: its pings keep them open"
        ctx.destroy(linger=0)
        v.check()
    finally:
        v.close()


def test_an_admission_table_is_bounded():
    with get_transport("zmq", admission="required", max_admitted=2) as rx:
        tokens = [rx.admit({"id": f"p{i}"}) for i in range(3)]
        assert len(rx.admissions) == 2 and all(len(t) == 32 for t in tokens)
        assert rx.admissions.check("p0", tokens[0]) is None, "the least recently admitted is forgotten"
        assert rx.admissions.check("p2", tokens[2]) is not None
        for bad in ({"id": ""}, {"id": "x" * 300}, {"id": 5}, {}, "not a dict"):
            with pytest.raises(ConnectError, match="cannot admit"):
                rx.admit(bad)   # type: ignore[arg-type]


def test_an_open_receiver_admits_everyone_and_needs_no_token():
    with get_transport("zmq") as rx:
        assert rx.admit({"id": "anyone"}) == b""


@pytest.mark.parametrize("bad, match", [({"admission": "sometimes"}, "admission"), ({"window": 0}, "window"),
                                        ({"window": True}, "window"), ({"frame_bytes": 1024}, "frame_bytes"),
                                        ({"heartbeat_ivl": 5.0, "heartbeat_timeout": 1.0}, "heartbeat"),
                                        ({"connect_timeout": 0}, "connect_timeout"), ({"nonsense": 1}, "unknown"),
                                        ({"ports": (10, 5)}, "ports=")])
def test_a_bad_option_is_a_config_error_naming_it(bad, match):
    with pytest.raises(ConfigError, match=match):
        get_transport("zmq", **bad)
