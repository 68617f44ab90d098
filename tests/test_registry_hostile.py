"""Hostile clients at the bootstrap registry, written with urllib, raw sockets and hmac by hand
(never kvxfer's client), and the bind/advertise split of the registry and the control channel.

Each test states what it attacks; all of them leave the registry serving honest clients.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from kvxfer.addresses import advertise_address, routable_address
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import ControlChannel, Heartbeat
from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import RankInfo
from kvxfer.layout import token_major_layout
from kvxfer.ranks import RankSpec

LAYOUT = token_major_layout(layers=2, heads=2, head_dim=8, dtype="float16", num_slots=64, page_size=4).to_dict()
SECRET = b"s3cret"


def record(tp_rank=0, tp_size=1, **kw) -> dict:
    return RankInfo(spec=RankSpec(role="prefill", num_kv_heads=2, num_layers=2, tp_rank=tp_rank, tp_size=tp_size, **kw),
                    control=f"tcp://127.0.0.1:{5000 + tp_rank}", data={"zmq": {"endpoint": "tcp://127.0.0.1:1"}},
                    layout=LAYOUT, aux_bytes=64).to_dict()


def http(url: str, method: str = "GET", body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 5.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def signed(method: str, path: str, body: bytes, secret: bytes = SECRET) -> dict:
    """The auth header, from its description: <time>:<nonce>:<hex hmac of time\\nnonce\\nMETHOD\\npath\\n + body>."""
    t, n = str(int(time.time())), os.urandom(16).hex()
    digest = hmac.new(secret, f"{t}\n{n}\n{method}\n{path}\n".encode() + body, hashlib.sha256).hexdigest()
    return {"X-KVXfer-Auth": f"{t}:{n}:{digest}"}


@pytest.fixture
def server():
    made = []

    def make(**kw):
        s = BootstrapServer(BootstrapConfig(**kw)).start()
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


# ------------------------------------------------------------------------------------
# Bad bodies: short 400s, never a 500 with a traceback
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                  b"\xff\xfe", b"[1, 2]"])
def test_bad_json_is_a_short_400(server, body):
    s = server()
    for method, path in (("PUT", "/register"), ("POST", "/heartbeat"), ("DELETE", "/register")):
        status, reply = http(s.url + path, method, body)
        assert status == 400 and len(reply) < 1024, (method, status, reply[:200])
    assert http(s.url + "/health")[0] == 503


@pytest.mark.parametrize("field,value,words", [
    ("instance", "a\n", "instance"),                                     # log injection: a trailing newline
    ("tp_size", 65536, "tp_size"), ("dp_size", 2048, "dp_size"),
    ("control", "tcp://", "control"), ("control", "tcp://0.0.0.0:5", "wildcard"),
])
def test_bad_record_fields_are_refused(server, field, value, words):
    s = server()
    status, reply = http(s.url + "/register", "PUT", {**record(), field: value})
    assert status == 400 and words in json.loads(reply)["error"], reply


def test_a_layout_of_the_wrong_types_is_refused(server):
    s = server()
    rec = record()
    rec["layout"] = json.loads(json.dumps(rec["layout"]))
    rec["layout"]["parts"][0]["layer"] = "0"
    status, reply = http(s.url + "/register", "PUT", rec)
    assert status == 400 and "layer" in json.loads(reply)["error"], reply


# ------------------------------------------------------------------------------------
# Bounded work and bounded state
# ------------------------------------------------------------------------------------
def test_sizes_past_what_the_registry_holds_are_refused_and_health_stays_fast(server):
    s = server()
    status, reply = http(s.url + "/register", "PUT", record(tp_size=1024, pp_size=1024))
    assert status == 400 and "max_ranks" in json.loads(reply)["error"], reply
    assert http(s.url + "/register", "PUT", record(tp_size=1024, pp_size=4))[0] == 200
    before = s.registry.computations
    t0 = time.monotonic()
    for _ in range(25):
        assert http(s.url + "/topology")[0] == 200
        status, reply = http(s.url + "/health")
        assert status == 503
    assert time.monotonic() - t0 < 5.0
    assert s.registry.computations - before <= 1, "readiness is computed once per change, not per request"
    missing = json.loads(reply)["missing"]
    assert len(missing) <= 65 and missing[-1] == "... and 4031 more", missing[-3:]


def test_registrations_and_record_size_are_capped(server):
    s = server(max_ranks=3, max_record=16 << 10)
    for inst, t in (("A", 0), ("A", 1), ("B", 0)):
        assert http(s.url + "/register", "PUT", record(tp_rank=t, tp_size=2, instance=inst))[0] == 200
    assert http(s.url + "/register", "PUT", record(tp_rank=1, tp_size=2, instance="B"))[0] == 507
    assert http(s.url + "/register", "PUT", record(tp_size=4, instance="C"))[0] == 400   # can never be complete
    big = {**record(), "data": {"zmq": {"endpoint": "tcp://127.0.0.1:1", "pad": "x" * (32 << 10)}}}
    assert http(s.url + "/register", "PUT", big)[0] == 413


def test_slow_headers_are_cut_and_connections_are_capped(server):
    s = server(max_connections=4, reserved_connections=0, header_timeout=0.5)
    idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
    for c in idle:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")       # headers never finish
    extra = socket.create_connection(("127.0.0.1", s.port))
    extra.settimeout(2)
    assert extra.recv(1) == b"", "a connection past max_connections is closed at once"
    for c in idle:
        c.settimeout(3)
        assert c.recv(1) == b"", "a connection whose headers did not arrive within header_timeout is closed"
        c.close()
    extra.close()
    assert http(s.url + "/health")[0] == 503


# ------------------------------------------------------------------------------------
# Replays and ownership
# ------------------------------------------------------------------------------------
def test_a_replayed_delete_is_refused(server):
    s = server(secret=SECRET)
    reg = Registration(BootstrapClient(s.url, SECRET), RankInfo.from_dict(record()), ttl=5.0).start()
    try:
        body = json.dumps({"key": "default/dp0/pp0/tp0", "owner": reg.owner}).encode()
        headers = signed("DELETE", "/register", body)
        assert http(s.url + "/register", "DELETE", body, headers)[0] == 200        # the captured DELETE
        BootstrapClient(s.url, SECRET).register(RankInfo.from_dict(record()), reg.owner)
        status, reply = http(s.url + "/register", "DELETE", body, headers)        # replayed
        assert status == 401 and "replayed" in json.loads(reply)["error"]
        assert http(s.url + "/health")[0] == 200
    finally:
        reg.stop()


def test_a_second_owner_cannot_take_or_delete_a_live_key(server):
    s = server(secret=SECRET)
    victim = Registration(BootstrapClient(s.url, SECRET), RankInfo.from_dict(record()), ttl=5.0).start()
    try:
        hijack = {**record(), "control": "tcp://127.0.0.1:6666", "owner": "x" * 32}
        raw = json.dumps(hijack).encode()
        status, reply = http(s.url + "/register", "PUT", raw, signed("PUT", "/register", raw))
        assert status == 409 and "another owner" in json.loads(reply)["error"]
        raw = json.dumps({"key": "default/dp0/pp0/tp0", "owner": "x" * 32}).encode()
        assert http(s.url + "/register", "DELETE", raw, signed("DELETE", "/register", raw))[0] == 403
        ranks = BootstrapClient(s.url).topology()[1]
        assert [r.control for r in ranks] == ["tcp://127.0.0.1:5000"]
    finally:
        victim.stop()


def test_readiness_is_per_instance(server):
    """Instance A complete can be joined while instance B is half registered."""
    s = server()
    c = BootstrapClient(s.url)
    c.register(RankInfo.from_dict(record(instance="A")), "a" * 32)
    c.register(RankInfo.from_dict(record(tp_size=2, instance="B")), "b" * 32)
    ranks = c.wait_ready(timeout=2, instance="A")
    assert [r.spec.instance for r in ranks] == ["A"]
    assert json.loads(http(s.url + "/topology?instance=B")[1])["ready"] is False
    assert http(s.url + "/health?instance=A")[0] == 200 and http(s.url + "/health")[0] == 503


# ------------------------------------------------------------------------------------
# Bind and advertise
# ------------------------------------------------------------------------------------
def test_binding_every_interface_never_advertises_the_wildcard(server):
    s = server(host="0.0.0.0")
    assert "0.0.0.0" not in s.url
    assert http(s.url + "/health")[0] == 503
    ch = ControlChannel(_Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://0.0.0.0:0")
    try:
        assert ch.alive and "0.0.0.0" not in ch.address and ch.address.rsplit(":", 1)[1] == ch.bound.rsplit(":", 1)[1]
    finally:
        ch.close()


class _Quiet:
    def on_message(self, peer, msg):
        pass

    def on_peer_lost(self, peer, why):
        pass

    def on_tick(self, now):
        return 0.05


def test_advertise_takes_an_address_or_an_interface_name():
    assert advertise_address("tcp://0.0.0.0:5555", "lo") == "tcp://127.0.0.1:5555"
    assert advertise_address("tcp://0.0.0.0:5555", "10.1.2.3") == "tcp://10.1.2.3:5555"
    assert advertise_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    with pytest.raises(ValueError, match=r"loopback '127\.0\.0\.1'.*advertise="):
        advertise_address("tcp://127.0.0.1:5555", remote=True)
    with pytest.raises(ValueError, match=r"loopback 'lo'.*advertise="):
        advertise_address("tcp://0.0.0.0:5555", "lo", remote=True)
    with pytest.raises(ValueError, match=r"wildcard '0\.0\.0\.0'"):
        advertise_address("tcp://127.0.0.1:5555", "0.0.0.0")
    ip = routable_address()
    if ip is not None:
        assert advertise_address("tcp://0.0.0.0:5555", remote=True) == f"tcp://{ip}:5555"


def test_a_rank_on_another_host_advertising_loopback_is_refused(server):
    ip = routable_address()
    if ip is None:
        pytest.skip("no routable interface address on this host")
    s = server(host="0.0.0.0")
    status, reply = http(f"http://{ip}:{s.port}/register", "PUT", record())
    assert status == 400 and "127.0.0.1" in json.loads(reply)["error"] and "advertise" in json.loads(reply)["error"]
    data_loopback = {**record(), "control": f"tcp://{ip}:5000"}                 # its zmq data endpoint is loopback
    status, reply = http(f"http://{ip}:{s.port}/register", "PUT", data_loopback)
    assert status == 400 and "data.zmq.endpoint" in json.loads(reply)["error"]
    ok = {**data_loopback, "data": {"zmq": {"endpoint": f"tcp://{ip}:1"}}}
    assert http(f"http://{ip}:{s.port}/register", "PUT", ok)[0] == 200


def test_a_restarted_rank_takes_its_key_once_the_old_registration_expires(server):
    """A killed rank (no DELETE) holds its key until ttl; its restart (a new owner) waits for that."""
    s = server(ttl=0.6)
    old = Registration(BootstrapClient(s.url), RankInfo.from_dict(record()), ttl=0.6).start()
    old.stop(deregister=False)                       # killed: heartbeats stop, the key is still held
    moved = RankInfo.from_dict({**record(), "control": "tcp://127.0.0.1:7777"})
    t0 = time.monotonic()
    new = Registration(BootstrapClient(s.url), moved, ttl=0.6).start()
    try:
        assert 0.3 < time.monotonic() - t0 < 3.0
        assert [r.control for r in BootstrapClient(s.url).topology()[1]] == ["tcp://127.0.0.1:7777"]
    finally:
        new.stop()


def test_a_body_that_never_comes_is_cut(server):
    s = server(body_timeout=0.5)
    c = socket.create_connection(("127.0.0.1", s.port))
    c.settimeout(5)
    c.sendall(b"PUT /register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    t0 = time.monotonic()
    reply = c.recv(4096)
    c.close()
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3.0, reply[:100]


# ------------------------------------------------------------------------------------
# The scale API (issue 38): watches, layouts by digest
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {}, {"since": []}, {"since": {}}, {"since": {"a b": 0}}, {"since": {"x": "1"}}, {"since": {"x": True}},
    {"since": {f"i{n}": 0 for n in range(1025)}}, {"since": {"x": 0}, "wait": -1}, {"since": {"x": 0}, "wait": "9"},
])
def test_bad_watch_bodies_are_short_400s(server, body):
    s = server()
    status, reply = http(s.url + "/watch", "POST", body)
    assert status == 400 and len(reply) < 1024 and json.loads(reply)["code"] == "bad", (status, reply[:200])


def test_a_watch_is_held_until_its_instance_changes_and_never_past_max_wait(server):
    s = server(max_wait=1.0)
    t0 = time.monotonic()
    status, reply = http(s.url + "/watch", "POST", {"since": {"w": 0}, "wait": 3600})
    assert status == 200 and json.loads(reply)["changed"] == {} and time.monotonic() - t0 < 3.0
    assert http(s.url + "/register", "PUT", record(instance="w"))[0] == 200
    status, reply = http(s.url + "/watch", "POST", {"since": {"w": 0}, "wait": 30})
    snap = json.loads(reply)["changed"]["w"]
    assert snap["ready"] and snap["version"] > 0 and snap["ranks"][0]["layout_digest"]
    assert "layout" not in snap["ranks"][0]
    # an epoch from another life of the registry: everything is answered again, at once
    status, reply = http(s.url + "/watch", "POST", {"since": {"w": snap["version"]}, "epoch": "stale", "wait": 30})
    assert json.loads(reply)["changed"]["w"]["version"] == snap["version"]


def test_layouts_are_named_by_their_digest(server):
    """A record naming a layout by digest the registry does not hold is 428 (send it); a layout sent
    with a digest that is not its own is refused; a stored layout hashes to its name."""
    s = server()
    rec = record()
    layout = rec.pop("layout")
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    status, reply = http(s.url + "/register", "PUT", {**rec, "layout_digest": digest})
    assert status == 428 and json.loads(reply)["code"] == "layout"
    status, reply = http(s.url + "/register", "PUT", {**rec, "layout": layout, "layout_digest": "0" * 64})
    assert status == 400
    status, reply = http(s.url + "/register", "PUT", {**rec, "layout": layout})
    assert status == 200 and json.loads(reply)["layout_digest"] == digest
    other = {**rec, "tp_rank": 1, "tp_size": 2}
    assert http(s.url + "/register", "PUT", {**record(instance="B", tp_rank=1, tp_size=2), "layout_digest": digest}
                )[0] == 200, other
    status, raw = http(s.url + f"/layout?digest={digest}")
    assert status == 200 and hashlib.sha256(raw).hexdigest() == digest
    for bad_digest in ("0" * 64, "../../etc", "A" * 64, ""):
        assert http(s.url + f"/layout?digest={bad_digest}")[0] == 404
    status, reply = http(s.url + "/topology?instance=default")
    assert json.loads(reply)["ranks"][0]["layout"] == layout, "operators' /topology keeps the layout in its records"
