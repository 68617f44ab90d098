"""Tests of the test-host harness itself (``tests/hosts.py``, ``tests/relay.py``).

Real processes in real network namespaces: a tiny echo server and client (below, run with
``Host.popen`` / ``Host.run``) talk TCP between hosts. Skipped where namespaces cannot be
made (``hosts_skip_reason``).
"""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import TestHosts, hosts_fixture, hosts_skip_reason, qdisc_available, sweep_stale

pytestmark = [pytest.mark.slow, pytest.mark.multihost,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason()))]

HERE = Path(__file__).parent
three = hosts_fixture(3)

# Echo server: prints {"port": P} when listening, echoes every connection until EOF.
SERVER = r"""
import json, socket, sys, threading
s = socket.create_server((sys.argv[1], 0))
print(json.dumps({"port": s.getsockname()[1]}), flush=True)
def echo(c):
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        c.sendall(b)
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""

# Client: "rtt N": N one-byte round trips, prints their seconds; "bulk N": N random bytes
# through the echo, prints whether they came back identical. Exit 3 if it cannot connect.
CLIENT = r"""
import hashlib, json, os, socket, sys, threading, time
addr, port, mode, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
try:
    c = socket.create_connection((addr, port), timeout=float(sys.argv[5]) if len(sys.argv) > 5 else 3)
except OSError as e:
    print(json.dumps({"error": str(e)})); sys.exit(3)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.settimeout(30)
if mode == "rtt":
    out = []
    for _ in range(n):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); out.append(time.perf_counter() - t)
    print(json.dumps({"rtt": out}))
else:
    data = os.urandom(n)
    threading.Thread(target=lambda: (c.sendall(data), c.shutdown(socket.SHUT_WR)), daemon=True).start()
    got = bytearray()
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        got += b
    print(json.dumps({"same": hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), "n": len(got)}))
"""


def start_server(host) -> int:
    p = host.popen([sys.executable, "-c", SERVER, host.addr], stdout=subprocess.PIPE, text=True)
    return json.loads(p.stdout.readline())["port"]


def client(host, addr: str, port: int, mode: str, n: int, timeout: float = 3.0) -> tuple[int, dict]:
    r = host.run([sys.executable, "-c", CLIENT, addr, str(port), mode, str(n), str(timeout)], timeout=120)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {"stderr": r.stderr})


def test_namespaces_addresses_and_no_way_out(three):
    nets = {h.addr.rsplit(".", 1)[0] for h in three}
    assert len(nets) == 1 and next(iter(nets)).startswith("10.213.")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for h in three:
        assert h.ns in listed
        addrs = h.run(["ip", "-o", "-4", "addr"]).stdout
        assert f"inet {h.addr}/24" in addrs and "inet 127.0.0.1/8" in addrs
        assert "UP" in h.run(["ip", "-o", "link", "show", "lo"]).stdout
        routes = h.run(["ip", "route"]).stdout.strip().splitlines()
        assert len(routes) == 1 and routes[0].startswith(f"{h.addr.rsplit('.', 1)[0]}.0/24 dev veth0 "), routes
        assert "default" not in h.run(["ip", "route", "show", "table", "all"]).stdout
    # the root namespace has no address or route into the test network
    assert "10.213." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "10.213." not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout


def test_tcp_between_hosts(three):
    port = start_server(three[0])
    rc, out = client(three[1], three[0].addr, port, "bulk", 1 << 20)
    assert rc == 0 and out == {"same": True, "n": 1 << 20}, out
    rc, out = client(three[2], three[0].addr, port, "rtt", 5)
    assert rc == 0 and len(out["rtt"]) == 5, out


def test_link_down_blocks_and_link_up_restores(three):
    port = start_server(three[0])
    assert client(three[1], three[0].addr, port, "rtt", 1)[0] == 0
    three[0].link_down()
    try:
        rc, out = client(three[1], three[0].addr, port, "rtt", 1, timeout=1.0)
        assert rc == 3, f"connected across a cut link: {out}"
    finally:
        three[0].link_up()
    assert client(three[1], three[0].addr, port, "rtt", 1, timeout=5.0)[0] == 0


def test_teardown_when_the_body_raises():
    hosts = TestHosts(2)
    with pytest.raises(RuntimeError, match="boom"):
        with hosts:
            p = hosts[0].popen([sys.executable, "-c", "import time; time.sleep(60)"])
            assert len(hosts.leftovers()) == 5    # 2 namespaces, 2 veths, 1 bridge
            raise RuntimeError("boom")
    assert hosts.leftovers() == []
    assert p.poll() is not None, "a process inside a host outlived its teardown"


def test_sigterm_tears_down_and_sweep_removes_what_sigkill_left():
    code = ("import sys, time; sys.path.insert(0, %r); from hosts import TestHosts\n"
            "with TestHosts(1) as h:\n    print(h[0].ns, h[0].link, h.bridge, flush=True); time.sleep(60)") % str(HERE)
    names = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        names[sig] = p.stdout.readline().split()
        assert len(names[sig]) == 3, names
        p.send_signal(sig)
        p.wait(20)

    def present(ns, link, bridge):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [x for x in (ns,) if x in listed] + [x for x in (link, bridge) if f": {x}" in links]

    assert present(*names[signal.SIGTERM]) == []
    assert len(present(*names[signal.SIGKILL])) == 3       # SIGKILL: nothing could run
    gone = sweep_stale()
    ns, _, bridge = names[signal.SIGKILL]     # the veth pair goes with its namespace
    assert {ns, bridge} <= set(gone) and present(*names[signal.SIGKILL]) == []


def test_netem_absent_tbf_present():
    """What this kernel offers (the relay stands in for netem). Fails when netem appears, so
    the harness can switch to it."""
    assert qdisc_available("tbf", ["rate", "1gbit", "burst", "64kb", "latency", "50ms"])
    assert not qdisc_available("netem", ["delay", "5ms"])


def test_relay_adds_delay_and_keeps_bytes(three):
    port = start_server(three[0])
    relay = three[1].popen([sys.executable, str(HERE / "relay.py"), "--listen", f"{three[1].addr}:0",
                            "--target", f"{three[0].addr}:{port}", "--delay", "0.005"],
                           stdout=subprocess.PIPE, text=True)
    rport = json.loads(relay.stdout.readline())["port"]
    rc, direct = client(three[2], three[0].addr, port, "rtt", 20)
    rc2, relayed = client(three[2], three[1].addr, rport, "rtt", 20)
    assert rc == rc2 == 0, (direct, relayed)
    d, r = statistics.median(direct["rtt"]), statistics.median(relayed["rtt"])
    assert r >= d + 2 * 0.005 * 0.9, f"relay rtt {r * 1e3:.2f} ms vs direct {d * 1e3:.2f} ms"
    assert r < d + 0.1, f"relay rtt {r * 1e3:.2f} ms: far more than the 10 ms it adds"
    rc, out = client(three[2], three[1].addr, rport, "bulk", 4 << 20)
    assert rc == 0 and out == {"same": True, "n": 4 << 20}, out


def test_relay_loss_stalls_but_delivers(three):
    port = start_server(three[0])
    relay = three[1].popen([sys.executable, str(HERE / "relay.py"), "--listen", f"{three[1].addr}:0",
                            "--target", f"{three[0].addr}:{port}", "--delay", "0", "--loss", "0.5",
                            "--stall", "0.2", "--seed", "1"], stdout=subprocess.PIPE, text=True)
    rport = json.loads(relay.stdout.readline())["port"]
    rc, out = client(three[2], three[1].addr, rport, "rtt", 10)
    assert rc == 0, out
    stalled = [t for t in out["rtt"] if t >= 0.18]
    assert 2 <= len(stalled) <= 10, out["rtt"]     # each round trip crosses 2 chunks, p=0.5 each
    t = time.monotonic()
    rc, out = client(three[2], three[1].addr, rport, "bulk", 1 << 20)
    assert rc == 0 and out == {"same": True, "n": 1 << 20}, out
    assert time.monotonic() - t < 60
