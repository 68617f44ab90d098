"""A connection reset while its input is stopped must not abort the process (libzmq 4.3.5).

Seen in CI: a prefill rank died with ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)`` as a partition healed. libzmq stops reading a connection
whose messages reach the high-water mark (the owner reads slower than the peer writes); a reset
then marks that connection failed without ending it, and with ZMTP heartbeats on, the heartbeat
timer writes a PING on it next: the assertion. Measured before the fix, with this test's attack:
8 of 8 victims (4 of each kind) aborted within two heartbeat intervals; plain pyzmq ROUTERs with
heartbeats off, 0 of 10.

Each victim is a process of its own holding one ROUTER made by kvxfer's own code, and its owner
does not read it (a busy thread): the control channel (its thread stalled in a handler), and the
zmq transport's data ROUTER (``Sockets``). The attacker speaks raw ZMTP 3.0 (NULL, as a peer
that passed the handshake), floods small messages, then resets the connection (``SO_LINGER``
0). The victims must be alive two heartbeat intervals later.

What ZMTP heartbeats did is done by TCP now (``zmqguard.close_vanished``): a peer that vanished
(its host cut off, test hosts) has its connection closed in seconds, so its fd is freed."""
from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import hosts_fixture
from test_zmq_flood import frame, greeting, ready_dealer

pytestmark = pytest.mark.slow   # victim processes

IVL, TIMEOUT = 0.2, 1.0   # heartbeat interval and timeout the victims' sockets are made with
VICTIMS = 4               # of each kind: each one the fault aborted before the fix


two_hosts = hosts_fixture(2)


def _control_victim(host: str, stalled: bool) -> str:
    import threading

    from kvxfer.control.channel import ControlChannel
    from kvxfer.control.peers import Heartbeat

    stall = threading.Event()

    class Busy:   # a handler whose tick blocks: the channel thread stops reading its ROUTER
        def on_message(self, peer, msg):
            pass

        def on_peer_lost(self, peer, why):
            pass

        def on_tick(self, now):
            if stall.is_set():
                time.sleep(3600)
            return 0.05

    ch = ControlChannel(Busy(), secret=None, heartbeat=Heartbeat(interval=IVL, timeout=TIMEOUT),
                        bind=f"tcp://{host}:0")
    if stalled:
        stall.set()
        time.sleep(0.2)   # the thread is in its stalled tick
    return ch.bound


def _data_victim(host: str) -> str:
    import zmq

    from kvxfer.transport.admission import Admissions
    from kvxfer_transports.zmq.options import ZMQOptions
    from kvxfer_transports.zmq.sockets import Sockets

    opts = ZMQOptions.of({"heartbeat_ivl": IVL, "heartbeat_timeout": TIMEOUT, "window": 16})
    router = Sockets(opts, Admissions(False), "victim").socket(zmq.ROUTER)
    router.bind(f"tcp://{host}:*")
    globals()["_keep"] = router   # never read: its owner is busy
    return router.last_endpoint.decode()


def _victim(kind: str, host: str = "127.0.0.1", stalled: bool = True) -> None:
    address = _control_victim(host, stalled) if kind == "control" else _data_victim(host)
    print(address, flush=True)
    time.sleep(120)


def _greet(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(greeting(b"NULL") + ready_dealer())
    return s


def _start(kind: str, n: int, popen=subprocess.Popen, args=()) -> tuple[list[subprocess.Popen], list[str]]:
    procs = [popen([sys.executable, str(Path(__file__)), kind, *args], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True) for _ in range(n)]
    addresses = [p.stdout.readline().strip() for p in procs]
    assert all(a.startswith("tcp://") for a in addresses), [p.stderr.read() for p in procs if p.poll()]
    return procs, addresses


def _reset_while_stopped(addresses: list[str]) -> None:
    """Greet each victim, flood it past its high-water mark, then reset the connection."""
    socks = [_greet(a) for a in addresses]
    time.sleep(0.1)   # the handshakes completed: the heartbeat timers run
    for s in socks:
        s.sendall(frame(b"x" * 100) * 2000)
    time.sleep(0.1)   # input stopped at the high-water mark
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()     # RST


@pytest.mark.parametrize("kind", ["control", "data"])
def test_a_reset_connection_whose_input_stopped_does_not_abort_the_process(kind):
    procs, addresses = _start(kind, VICTIMS)
    try:
        _reset_while_stopped(addresses)
        time.sleep(2 * IVL + 0.6)
        died = [(p.returncode, p.stderr.read().strip()[-300:]) for p in procs if p.poll() is not None]
        assert not died, f"{len(died)} of {VICTIMS} victims died: {died}"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("kind", ["control", "data"])
def test_a_vanished_peers_connection_is_closed(two_hosts, kind):
    """The victim on host 0 (its owner reading), a peer on host 1 that connects, greets, then is
    cut off (its link down: no FIN, no RST): the victim's connection to it ends within
    ``TCP_MAXRT`` (3 x ``TIMEOUT``; keepalive probes from ``TIMEOUT`` on), not the kernel's 2 hours."""
    victim, peer = two_hosts[0], two_hosts[1]
    procs, (address,) = _start(kind, 1, popen=victim.popen, args=(victim.addr, "reading"))
    attacker = peer.popen([sys.executable, str(Path(__file__)), "peer", address], stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().strip() == "greeted"

        def established() -> int:
            out = victim.run(["ss", "-tnH", "state", "established", "dst", peer.addr]).stdout
            return len(out.splitlines())

        assert established() == 1
        peer.link_down()
        t0 = time.monotonic()
        while established() and time.monotonic() - t0 < 30:
            time.sleep(0.25)
        took = time.monotonic() - t0
        assert not established(), f"the connection to the vanished peer is still open after {took:.0f} s"
        assert took < 3 * TIMEOUT + 5, took   # TCP_MAXRT after the last answered segment; slack
        assert procs[0].poll() is None
    finally:
        peer.link_up()
        for p in (*procs, attacker):
            p.kill()
            p.wait(10)


if __name__ == "__main__":
    if sys.argv[1] == "peer":   # a peer that greets, then idles until it is cut off
        keep = _greet(sys.argv[2])
        print("greeted", flush=True)
        time.sleep(120)
    else:
        _victim(sys.argv[1], *sys.argv[2:3], stalled=sys.argv[3:4] != ["reading"])
