"""The bootstrap registry: register, look up, health, expiry by heartbeat, HMAC, the CLI (the
rank-side cases against etcd too: ``etcd_server.registry``)."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
import request_peer as rp
from etcd_server import etcd, registries, registry  # noqa: F401
from support.ports import free_port
from waiting import until

from kvxfer.control import bootstrap
from kvxfer.control.auth import AUTH_HEADER, sign_http
from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import RankInfo
from kvxfer.errors import ConnectError
from kvxfer.layout import token_major_layout
from kvxfer.ranks import RankSpec

LAYOUT = token_major_layout(layers=2, heads=2, head_dim=8, dtype="float16", num_slots=64, page_size=4).to_dict()


def rank(tp_rank=0, tp_size=2, **kw) -> RankInfo:
    return RankInfo(spec=RankSpec(role="prefill", num_kv_heads=2, num_layers=2, tp_rank=tp_rank, tp_size=tp_size, **kw),
                    control=f"tcp://127.0.0.1:{5000 + tp_rank}", data={"zmq": {"endpoint": "tcp://127.0.0.1:1"}},
                    layout=LAYOUT, aux_bytes=64)


def get(url: str) -> tuple[int, dict]:
    """What an operator's curl sees."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())



def test_not_ready_until_every_rank_registered(server):
    s = server(ttl=5.0)
    c = BootstrapClient(s.url)
    assert get(s.url + "/health") == (503, {"status": "not ready", "registered": 0, "expected": 0,
                                            "missing": ["any rank: nothing registered yet"]})
    c.register(rank(0))
    status, body = get(s.url + "/health")
    assert status == 503 and body["missing"] == ["default/dp0/pp0/tp1"]
    assert c.topology()[0] is False
    c.register(rank(1))
    assert get(s.url + "/health") == (200, {"status": "ready", "registered": 2, "expected": 2})
    ranks = c.wait_ready(timeout=1)
    assert [r.spec.tp_rank for r in ranks] == [0, 1] and ranks[1] == rank(1)
    status, body = get(s.url + "/topology?instance=default")
    assert status == 200 and body["ready"] and len(body["ranks"]) == 2 and body["ranks"][0]["layout"] == LAYOUT


def test_topology_reads_again_when_a_rank_leaves_between_its_record_and_its_layout(server):
    """A rank read in the records that deregisters before its layout is read (its layout goes with
    it): the snapshot was stale, so ``topology`` reads it again and answers what is registered now."""
    s = server()
    c = BootstrapClient(s.url)
    c.register(rank(0))
    reader = BootstrapClient(s.url)
    fetch = reader.backend.layout
    leaves = []

    def layout_after_a_leave(digest):
        if not leaves:
            leaves.append(digest)
            c.deregister("default/dp0/pp0/tp0")
        return fetch(digest)

    reader.backend.layout = layout_after_a_leave
    assert reader.topology() == (False, [])
    assert leaves, "the layout was never read"


def test_expect_overrides_the_sizes(server):
    s = server(expect=3)
    c = BootstrapClient(s.url)
    c.register(rank(0))
    c.register(rank(1))
    assert get(s.url + "/health")[1]["missing"] == ["1 more rank(s)"]


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_registrations_expire_without_heartbeats(server):
    s = server(ttl=0.5)
    c = BootstrapClient(s.url)
    kept = Registration(c, rank(0), ttl=0.5).start()    # heartbeats every ttl/3
    c.register(rank(1))                                  # never heartbeats
    try:
        assert get(s.url + "/health")[0] == 200
        time.sleep(1.0)
        status, body = get(s.url + "/health")
        assert status == 503 and body["missing"] == ["default/dp0/pp0/tp1"]
        assert [r.spec.tp_rank for r in c.topology()[1]] == [0]
        assert c.heartbeat("default/dp0/pp0/tp1") is False
    finally:
        kept.stop()
    assert c.topology()[1] == []          # stop() deregisters


def test_registration_survives_a_registry_restart(registry):  # noqa: F811
    """The embedded registry restarted (it forgot every rank) or etcd killed with -9 and restarted:
    the rank is registered again by its heartbeats."""
    r = registry(ttl=5.0, own=True)
    reg = Registration(BootstrapClient(r.url), rank(0, tp_size=1), interval=0.1, ttl=5.0).start()
    try:
        r.down().up()
        assert until(lambda: BootstrapClient(r.url).health().get("status") == "ready", 5), "not registered again"
        # The registry holds the key once ``register`` reached it; the heartbeat thread sets its
        # state when the call returns, a moment later (a full run read "expired" in between).
        assert until(lambda: reg.state == "registered", 2), reg.state
    finally:
        reg.stop()


@pytest.mark.parametrize("bad,why", [
    ({**rank(0).to_dict(), "tp_rank": 2}, "tp_rank"),
    ({**rank(0).to_dict(), "role": "decode"}, "only prefill ranks register"),
    ({**rank(0).to_dict(), "control": "http://x"}, "control"),
    ({**rank(0).to_dict(), "num_layers": "2"}, "num_layers"),
    ({**rank(0).to_dict(), "instance": "a b"}, "instance"),
])
def test_bad_records_are_refused(server, bad, why):
    s = server()
    req = urllib.request.Request(s.url + "/register", data=json.dumps(bad).encode(), method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and why in json.loads(e.value.read())["error"]


def test_conflicting_sizes_are_refused(server):
    s = server()
    c = BootstrapClient(s.url)
    c.register(rank(0, tp_size=2))
    with pytest.raises(ConnectError, match="HTTP 409"):
        c.register(rank(1, tp_size=4))


def test_registrations_need_the_secret(server):
    s = server(secret=b"s3cret")
    with pytest.raises(ConnectError, match="HTTP 401.*missing authentication"):
        BootstrapClient(s.url).register(rank(0, tp_size=1))
    with pytest.raises(ConnectError, match="HTTP 401.*wrong shared secret"):
        BootstrapClient(s.url, secret="nope").register(rank(0, tp_size=1))
    body = json.dumps(rank(0, tp_size=1).to_dict()).encode()
    stale = urllib.request.Request(s.url + "/register", data=body, method="PUT",
                                   headers={AUTH_HEADER: sign_http(b"s3cret", "PUT", "/register", body,
                                                                             now=time.time() - 3600)})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(stale, timeout=5)
    assert e.value.code == 401
    BootstrapClient(s.url, secret="s3cret").register(rank(0, tp_size=1))
    assert get(s.url + "/health")[0] == 200          # reads stay open for operators


@pytest.mark.slow   # a subprocess
def test_cli_serves_until_sigterm():
    port = free_port()
    proc = rp.context().Process(target=bootstrap.main, args=(["--host", "127.0.0.1", "--port", str(port),
                                                               "--ttl", "5"],))
    proc.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                status, body = get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.05)
        assert status == 503 and body["status"] == "not ready"
        BootstrapClient(f"http://127.0.0.1:{port}").register(rank(0, tp_size=1))
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
    assert proc.exitcode == 0


def _dead_address() -> str:
    """A control address nothing listens on: connections to it are refused."""
    return f"tcp://127.0.0.1:{free_port()}"


def _topology_controls(url: str) -> list[str]:
    return [r.control for r in BootstrapClient(url).topology()[1]]


def test_a_restarted_rank_takes_over_a_gone_predecessor(server):
    """Silent for takeover_silence and nothing listens at its control address: the key goes to the
    new owner at once, long before the ttl; not while the predecessor heartbeats recently."""
    s = server(ttl=30.0, takeover_silence=0.3)
    old = RankInfo.from_dict({**rank(0, tp_size=1).to_dict(), "control": _dead_address()})
    new = RankInfo.from_dict({**rank(0, tp_size=1).to_dict(), "control": "tcp://127.0.0.1:5999"})
    c = BootstrapClient(s.url)
    c.register(old, "a" * 32)
    with pytest.raises(ConnectError, match="HTTP 409"):   # heartbeat fresh: not provably gone
        c.register(new, "b" * 32)
    time.sleep(0.4)
    t0 = time.monotonic()
    assert c.register(new, "b" * 32) == "default/dp0/pp0/tp0"
    assert time.monotonic() - t0 < 5
    assert _topology_controls(s.url) == ["tcp://127.0.0.1:5999"]
    assert not c.heartbeat("default/dp0/pp0/tp0", "a" * 32)   # the predecessor's owner lost it


def test_a_listening_predecessor_is_never_taken_over(server):
    s = server(ttl=30.0, takeover_silence=0.1)
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        address = f"tcp://127.0.0.1:{live.getsockname()[1]}"
        c = BootstrapClient(s.url)
        c.register(RankInfo.from_dict({**rank(0, tp_size=1).to_dict(), "control": address}), "a" * 32)
        time.sleep(0.3)                                   # silent, but it listens: live
        with pytest.raises(ConnectError, match="HTTP 409"):
            c.register(rank(0, tp_size=1), "b" * 32)
        assert _topology_controls(s.url) == [address]


@pytest.mark.slow   # seconds
def test_registration_start_takes_over_well_before_the_ttl(server):
    s = server(ttl=4.0)                                   # takeover after ttl / 2 of silence
    c = BootstrapClient(s.url)
    c.register(RankInfo.from_dict({**rank(0, tp_size=1).to_dict(), "control": _dead_address()}), "a" * 32)
    t0 = time.monotonic()
    reg = Registration(c, rank(0, tp_size=1), ttl=4.0).start()   # the restarted rank
    try:
        took = time.monotonic() - t0
        assert took < 3.5, f"took {took:.1f}s: waited for the ttl instead of taking over"
        assert _topology_controls(s.url) == [rank(0, tp_size=1).control]
    finally:
        reg.stop()
