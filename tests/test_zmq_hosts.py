"""ZMQ data plane between two test hosts (network namespaces, tests/hosts.py): the receiver binds
every interface and advertises its interface by name; the sender on the other host connects
(a ping round trip) and the bytes arrive exactly. A receiver that advertises loopback to another
host is refused at start-up (``remote=True``), and without that guard the sender's connect fails
at once, naming the address, instead of at the first request."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hosts import hosts_fixture, hosts_skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.multihost,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason()))]

two = hosts_fixture(2)

RECEIVER = r"""
import json, sys, numpy as np, torch
from kvxfer.grant import ByteRanges
from kvxfer.transport.registry import get_transport
opts = json.loads(sys.argv[1])
try:
    rx = get_transport("zmq", **opts)
except Exception as e:
    print(json.dumps({"error": str(e)}), flush=True)
    sys.exit(0)
dst = torch.zeros(1 << 20, dtype=torch.uint8)
rx.register([dst])
rx.expect("x", ByteRanges(np.array([0]), np.array([1000]), np.array([500_000])))
print(json.dumps({"descriptor": rx.descriptor(), "bound": rx.bound}), flush=True)
(a,) = rx.arrivals(60)
want = (torch.arange(500_000, dtype=torch.int64) * 7 % 251).to(torch.uint8)
print(json.dumps({"ok": a.ok, "exact": bool(torch.equal(dst[1000:501_000], want)) and not dst[:1000].any()
                  and not dst[501_000:].any()}), flush=True)
rx.close()
"""

SENDER = r"""
import json, sys, numpy as np, torch
from kvxfer.plan import RunGroup, TransferPlan
from kvxfer.transport.registry import get_transport
z = np.zeros(1, np.int64)
plan = TransferPlan((RunGroup(z, z, z, z, np.array([0]), np.array([1000]), np.array([500_000]), False),))
tx = get_transport("zmq", connect_timeout=2)
tx.register([(torch.arange(500_000, dtype=torch.int64) * 7 % 251).to(torch.uint8)])
try:
    peer = tx.connect(json.loads(sys.argv[1]))
except Exception as e:
    print(json.dumps({"connect_error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.exit(0)
tx.submit(peer, "x", plan, timeout=30).result(30)
print(json.dumps({"sent": True}), flush=True)
tx.close()
"""


def _receiver(host, **opts):
    p = host.popen([sys.executable, "-c", RECEIVER, json.dumps(opts)], stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def _send(host, descriptor) -> dict:
    r = host.run([sys.executable, "-c", SENDER, json.dumps(descriptor)], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_wildcard_bind_advertised_by_interface_name_reaches_the_other_host(two):
    p, first = _receiver(two[0], endpoint="tcp://0.0.0.0:0", advertise="veth0", remote=True, ports=[31000, 31100])
    try:
        ep = first["descriptor"]["endpoint"]
        assert first["bound"].startswith("tcp://0.0.0.0:31") and ep.startswith(f"tcp://{two[0].addr}:31"), first
        assert _send(two[1], first["descriptor"]) == {"sent": True}
        assert json.loads(p.stdout.readline()) == {"ok": True, "exact": True}
    finally:
        p.kill()
        p.wait()


def test_loopback_is_refused_for_a_remote_peer_and_fails_connect_naming_it(two):
    _, refused = _receiver(two[0], endpoint="tcp://127.0.0.1:0", remote=True)
    assert "loopback" in refused.get("error", ""), refused
    p, first = _receiver(two[0], endpoint="tcp://127.0.0.1:0")   # not told its peers are remote
    try:
        ep = first["descriptor"]["endpoint"]
        got = _send(two[1], first["descriptor"])
        assert "ConnectError" in got.get("connect_error", "") and ep in got["connect_error"], got
    finally:
        p.kill()
        p.wait()
