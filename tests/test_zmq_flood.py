"""Memory floods at every ZMQ port a peer can reach (issue 34, "Memory exhaustion before any check").

The attacker speaks raw ZMTP 3.0 over a plain TCP socket (no kvxfer code, no zmq): a greeting,
then 1 MiB message parts with MORE set and never the last part. libzmq buffers a message whole
before kvxfer sees it, and its high-water mark counts whole messages, so on a port that takes
anyone the parts pile up without a bound (measured before the fix: a victim's RSS grew by the
whole 1 GiB). The victim runs in a process of its own (``hostile_zmq_victim.py``), so its RSS is
its own; after each flood: its threads alive, an honest request byte-exact, the canary outside
the honest moves intact, fds and threads within the slack below.

Ports: the zmq data ROUTER of a receiver and of a sender (``admission="required"``), and a prefill
rank's control ROUTER (a secret, ``zmtp_auth``). Both mechanisms are tried: the one the port does
not speak (NULL: dropped after the greeting) and the one it speaks (PLAIN or CURVE: the first
frame must be a handshake command, so a data part ends the connection).
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # a victim process per test, 1 GiB floods

MiB = 1 << 20
FLOOD = 1 << 30              # bytes each flood tries to send
GROWTH = 64 * MiB            # the victim's RSS may grow at most this much during a flood
FD_SLACK, THREAD_SLACK = 8, 2

VICTIM = Path(__file__).parent / "hostile_zmq_victim.py"
DATA_OPTIONS = {"transport": {"admission": "required"}}
CONTROL_OPTIONS = {"channel": {"zmtp_auth": True}}


class Victim:
    """The victim process: ``call("stats")`` and the other commands of hostile_zmq_victim.py."""

    def __init__(self, kind: str, options: dict):
        self.proc = subprocess.Popen([sys.executable, str(VICTIM), kind, json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        first = self._line(120)
        self.ports: dict[str, str] = first["ports"]
        assert first["warm"]["ok"], first["warm"]

    def _line(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line and self.proc.poll() is not None:
                raise AssertionError(f"the victim process exited ({self.proc.returncode})")
        raise AssertionError("the victim process did not answer")

    def call(self, cmd: str, timeout: float = 60) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


# ------------------------------------------------------------------------------------
# Raw ZMTP 3.0 (rfc.zeromq.org/spec:23): greeting, commands, frames
# ------------------------------------------------------------------------------------
def greeting(mechanism: bytes) -> bytes:
    """signature (0xFF, 8 bytes, 0x7F), version 3.0, mechanism (20 bytes), as-server 0, filler."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready_dealer() -> bytes:
    """The NULL mechanism's READY command: Socket-Type DEALER."""
    name, value = b"Socket-Type", b"DEALER"
    return frame(b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value, command=True)


def flood(address: str, mechanism: bytes, total: int = FLOOD, part: int = MiB) -> tuple[socket.socket, int]:
    """Connect, greet with ``mechanism``, then send ``total`` bytes of ``part``-byte parts, MORE set,
    never a last part. Returns the open socket and how many bytes the victim took before it closed
    the connection or stopped reading (10 s)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    sent = 0
    try:
        s.sendall(greeting(mechanism))
        if mechanism == b"NULL":
            s.sendall(ready_dealer())
        data = frame(bytes(part), more=True)
        while sent < total:
            s.sendall(data)
            sent += part
    except OSError:   # reset or closed by the victim, or it stopped reading: what it took is counted
        pass
    return s, sent


def handshake_frame(address: str, mechanism: bytes, size: int) -> tuple[socket.socket, int]:
    """Greet with the port's own mechanism, then one command frame that claims ``size`` bytes, and
    send all of them but the last: what a peer without credentials can make libzmq hold."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    sent = 0
    try:
        s.sendall(greeting(mechanism))
        s.sendall(bytes([4 | 2]) + struct.pack(">Q", size) + b"\x05HELLO")
        chunk = bytes(MiB)
        while sent < size - MiB:
            s.sendall(chunk)
            sent += MiB
    except OSError:
        pass
    return s, sent


def checked(victim: Victim, before: dict) -> None:
    """What every case checks once the attacker is gone."""
    now = victim.call("stats")
    assert now["alive"], "a victim thread died"
    honest = victim.call("honest")
    assert honest["ok"], honest["why"]
    assert now["fds"] - before["fds"] <= FD_SLACK, f"fds {before['fds']} -> {now['fds']}"
    assert now["threads"] - before["threads"] <= THREAD_SLACK, f"threads {before['threads']} -> {now['threads']}"


@pytest.fixture(scope="module")
def data_victim():
    v = Victim("data", DATA_OPTIONS)
    yield v
    v.close()


@pytest.fixture(scope="module")
def control_victim():
    v = Victim("control", CONTROL_OPTIONS)
    yield v
    v.close()


CASES = [("data", "receiver", b"NULL"), ("data", "receiver", b"PLAIN"), ("data", "sender", b"NULL"),
         ("data", "sender", b"PLAIN"), ("control", "control", b"NULL"), ("control", "control", b"CURVE")]


@pytest.mark.parametrize("kind, port, mechanism", CASES, ids=[f"{k}-{p}-{m.decode()}" for k, p, m in CASES])
def test_a_multipart_flood_of_1_gib_leaves_rss_bounded(request, kind, port, mechanism):
    victim = request.getfixturevalue(f"{kind}_victim")
    before = victim.call("stats")
    sock, sent = flood(victim.ports[port], mechanism)
    try:
        time.sleep(0.5)   # libzmq reads what the kernel still holds
        during = victim.call("stats")
    finally:
        sock.close()
    grew = during["rss"] - before["rss"]
    assert grew < GROWTH, f"RSS grew by {grew / MiB:.0f} MiB while {sent / MiB:.0f} MiB of parts were taken"
    checked(victim, before)


# One handshake frame per connection is what libzmq holds before it can refuse a peer: at most
# the port's ZMQ_MAXMSGSIZE (data ROUTER: a staging frame and a header's room, 5 MiB + 1 MiB + 64 KiB
# with the default options; control ROUTER: MAX_MESSAGE, 64 MiB), freed when the handshake fails.
HANDSHAKE = [("data", "receiver", b"PLAIN", 6 * MiB + (64 << 10), 32 * MiB),
             ("control", "control", b"CURVE", 64 * MiB + 64, 64 * MiB + 32 * MiB)]


@pytest.mark.parametrize("kind, port, mechanism, limit, bound", HANDSHAKE, ids=[h[0] for h in HANDSHAKE])
def test_a_peer_without_credentials_holds_at_most_one_handshake_frame(request, kind, port, mechanism, limit, bound):
    victim = request.getfixturevalue(f"{kind}_victim")
    before = victim.call("stats")
    big, sent_big = handshake_frame(victim.ports[port], mechanism, 1 << 30)   # over the limit: refused at once
    fit, sent_fit = handshake_frame(victim.ports[port], mechanism, limit)     # just under: held until refused
    try:
        time.sleep(0.5)   # libzmq reads what the kernel still holds
        during = victim.call("stats")
    finally:
        big.close()
        fit.close()
    assert sent_big <= 16 * MiB, f"a handshake frame over the limit was read on: {sent_big / MiB:.0f} MiB"
    grew = during["rss"] - before["rss"]
    assert grew < bound, f"RSS grew by {grew / MiB:.0f} MiB for {(sent_big + sent_fit) / MiB:.0f} MiB sent"
    checked(victim, before)


# ------------------------------------------------------------------------------------
# A port that takes anyone (no admission, no zmtp_auth) still buffers a flood whole: the
# residual. Once the attacker's connection closes, the memory goes back to the OS (before: glibc
# kept it in its arenas, and the transport had raised its trim threshold to 256 MiB).
# ------------------------------------------------------------------------------------
OPEN = {"data": {"transport": {"admission": "open"}}, "control": {"secret": ""}}   # no admission, no secret
RETURNED = 64 * MiB   # RSS above the baseline allowed once the flood's connection closed


@pytest.mark.parametrize("kind, port", [("data", "receiver"), ("control", "control")])
def test_what_a_flood_made_an_open_port_hold_is_given_back_after_it_closed(kind, port):
    victim = Victim(kind, OPEN[kind])
    try:
        before = victim.call("stats")
        sock, sent = flood(victim.ports[port], b"NULL", 512 * MiB)
        time.sleep(0.5)
        during = victim.call("stats")
        sock.close()
        assert during["rss"] - before["rss"] > 256 * MiB, "the open port did not buffer the flood: nothing to give back"
        after = during
        for _ in range(8):   # the I/O thread trims within a tick (and at most every 5 s)
            after = victim.call("trim")
            if after["rss"] - before["rss"] < RETURNED:
                break
        assert after["rss"] - before["rss"] < RETURNED, \
            f"RSS {before['rss'] / MiB:.0f} -> {during['rss'] / MiB:.0f} during -> {after['rss'] / MiB:.0f} MiB after"
        checked(victim, before)
    finally:
        victim.close()
