"""Hostile clients of the bootstrap registry (issue 16): bad bodies get short 400s, work and state
per request are bounded, signatures are checked and never accepted twice, a key belongs to its
owner, record sizes and names are capped, a wildcard bind is never advertised, and the scale API
(watches, layouts by digest) refuses what it cannot use.

The attacker is written by hand, never kvxfer's client: ``hostile_wire.http`` (urllib, signing
with hmac itself when it holds the secret, or replaying a captured signature) and raw sockets.
Each test states what it attacks; after it the registry still serves honest clients (for the
attacks on a shared registry, ``after_attack``: an honest rank registers, shows in the topology
and deregisters, and fds stay bounded).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import hostile_wire as hw
import pytest
from hostile_victims import bounded, snapshot
from support.channels import Quiet

# kvxfer names used here (update here after a module move)
from kvxfer.addresses import advertise_address, routable_address
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import ControlChannel, Heartbeat
from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import MAX_LAYOUT_ITEMS, RankInfo
from kvxfer.errors import ProtocolError
from kvxfer.layout import token_major_layout
from kvxfer.ranks import RankSpec

LAYOUT = token_major_layout(layers=2, heads=2, head_dim=8, dtype="float16", num_slots=64, page_size=4).to_dict()
SECRET = b"registry-secret"
_names = itertools.count(1)


def record(instance: str = "default", *, tp_rank: int = 0, **over) -> dict:
    """A prefill rank's record as it goes on the wire: an honest one (kvxfer's ``RankInfo``, control
    on port 5000 + ``tp_rank``) with ``over`` laid over it unchecked, as an attacker may."""
    rec = RankInfo(spec=RankSpec(role="prefill", num_kv_heads=2, num_layers=2), control="tcp://127.0.0.1:5000",
                   data={"zmq": {"endpoint": "tcp://127.0.0.1:1"}}, layout=LAYOUT, aux_bytes=64).to_dict()
    return {**rec, "instance": instance, "tp_rank": tp_rank, "control": f"tcp://127.0.0.1:{5000 + tp_rank}", **over}


def key(instance: str) -> str:
    return f"{instance}/dp0/pp0/tp0"


def owner() -> str:
    """A rank's owner token, as ``Registration`` makes one (16-64 of [A-Za-z0-9_-])."""
    return os.urandom(16).hex()


def controls(url: str, instance: str) -> list[str]:
    return [i.control for i in BootstrapClient(url).topology(instance)[1]]



@pytest.fixture(scope="module")
def signed_registry():
    """One registry with a secret, shared by the attacks on it (each checks ``after_attack``)."""
    srv = BootstrapServer(BootstrapConfig(ttl=30.0, secret=SECRET)).start()
    yield srv
    srv.stop()


def after_attack(url: str, before) -> None:
    """An honest rank still registers, shows in the topology and deregisters."""
    name = f"honest{next(_names)}"
    client = BootstrapClient(url, SECRET)
    client.register(RankInfo.from_dict(record(name)))
    assert controls(url, name) == ["tcp://127.0.0.1:5000"]
    assert "status" in client.health()
    client.deregister(key(name))
    assert not bounded(before, fd_slack=8), bounded(before, fd_slack=8)


# ------------------------------------------------------------------------------------
# Bad bodies: short 400s, never a 500 with a traceback
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                  b"\xff\xfe", b"[1, 2]"])
def test_bad_json_is_a_short_400(server, body):
    s = server()
    for method, path in (("PUT", "/register"), ("POST", "/heartbeat"), ("DELETE", "/register")):
        status, reply, _ = hw.http(s.url, method, path, raw=body)
        assert status == 400 and len(reply) < 1024, (method, status, reply[:200])
    assert hw.http(s.url, "GET", "/health")[0] == 503


@pytest.mark.parametrize("field,value,words", [
    ("instance", "a\n", "instance"),                                     # log injection: a trailing newline
    ("tp_size", 65536, "tp_size"), ("dp_size", 2048, "dp_size"),
    ("control", "tcp://", "control"), ("control", "tcp://0.0.0.0:5", "wildcard"),
])
def test_bad_record_fields_are_refused(server, field, value, words):
    s = server()
    status, reply, _ = hw.http(s.url, "PUT", "/register", {**record(), field: value})
    assert status == 400 and words in json.loads(reply)["error"], reply


def test_a_layout_of_the_wrong_types_is_refused(server):
    s = server()
    rec = record()
    rec["layout"] = json.loads(json.dumps(rec["layout"]))
    rec["layout"]["parts"][0]["layer"] = "0"
    status, reply, _ = hw.http(s.url, "PUT", "/register", rec)
    assert status == 400 and "layer" in json.loads(reply)["error"], reply


def test_a_layout_of_more_items_than_the_bound_is_refused_before_any_part_is_read():
    """A rank record (as a HELLO or the registry reads it) whose layout lists more spaces, regions
    and parts than ``MAX_LAYOUT_ITEMS`` is refused by its count, naming the bound."""
    rec = record()
    part = dict(rec["layout"]["parts"][0])
    rec["layout"] = {**rec["layout"], "parts": [{**part, "layer": k} for k in range(MAX_LAYOUT_ITEMS)]}
    with pytest.raises(ProtocolError, match=f"more than {MAX_LAYOUT_ITEMS} spaces, regions and parts"):
        RankInfo.from_dict(rec)


def test_a_layout_that_passed_is_not_walked_again_and_a_look_alike_is(monkeypatch):
    """``check_layout_record`` keeps the digests of descriptions it passed: the same bytes again
    (every HELLO of a decode rank, every record of an instance) skip the walk. A description that
    packs the same only loosely (a tuple for a list) is walked, and refused; a refused one is
    refused every time."""
    from kvxfer.control import records
    walks = []
    real = records._walk_layout_record
    monkeypatch.setattr(records, "_walk_layout_record", lambda lay: walks.append(1) or real(lay))
    rec = record()
    rec["layout"] = json.loads(json.dumps(rec["layout"]))
    rec["layout"]["parts"][0]["base"] += 64 * 1024 * 1024   # a description of this test's own
    for _ in range(3):
        RankInfo.from_dict(json.loads(json.dumps(rec)))
    assert len(walks) == 1
    loose = {**rec["layout"], "parts": tuple(rec["layout"]["parts"])}
    with pytest.raises(ProtocolError, match="'layout.parts' must be a list, got tuple"):
        RankInfo.from_dict({**rec, "layout": loose})
    bad = json.loads(json.dumps(rec))
    bad["layout"]["parts"][0]["heads"] = "2"
    for _ in range(2):
        with pytest.raises(ProtocolError, match="heads"):
            RankInfo.from_dict(bad)
    assert len(walks) == 4


@pytest.mark.slow   # the shared signed registry, attacked for seconds
def test_a_name_with_a_trailing_newline_is_refused(signed_registry):
    before = snapshot()
    name = f"newline{next(_names)}\n"
    try:
        status, body, _ = hw.http(signed_registry.url, "PUT", "/register", record(name), secret=SECRET)
        assert status == 400, f"instance {name!r} answered {status}: {body[:100]!r}"
        after_attack(signed_registry.url, before)
    finally:
        hw.http(signed_registry.url, "DELETE", "/register", {"key": key(name)}, secret=SECRET)


# ------------------------------------------------------------------------------------
# Bounded work and bounded state
# ------------------------------------------------------------------------------------
def test_sizes_past_what_the_registry_holds_are_refused_and_health_stays_fast(server):
    s = server()
    status, reply, _ = hw.http(s.url, "PUT", "/register", record(tp_size=1024, pp_size=1024))
    assert status == 400 and "max_ranks" in json.loads(reply)["error"], reply
    assert hw.http(s.url, "PUT", "/register", record(tp_size=1024, pp_size=4))[0] == 200
    before = s.registry.computations
    t0 = time.monotonic()
    for _ in range(25):
        assert hw.http(s.url, "GET", "/topology")[0] == 200
        status, reply, _ = hw.http(s.url, "GET", "/health")
        assert status == 503
    assert time.monotonic() - t0 < 5.0
    assert s.registry.computations - before <= 1, "readiness is computed once per change, not per request"
    missing = json.loads(reply)["missing"]
    assert len(missing) <= 65 and missing[-1] == "... and 4031 more", missing[-3:]


def test_registrations_and_record_size_are_capped(server):
    s = server(max_ranks=3, max_record=16 << 10)
    for inst, t in (("A", 0), ("A", 1), ("B", 0)):
        assert hw.http(s.url, "PUT", "/register", record(tp_rank=t, tp_size=2, instance=inst))[0] == 200
    assert hw.http(s.url, "PUT", "/register", record(tp_rank=1, tp_size=2, instance="B"))[0] == 507
    assert hw.http(s.url, "PUT", "/register", record(tp_size=4, instance="C"))[0] == 400   # can never be complete
    big = {**record(), "data": {"zmq": {"endpoint": "tcp://127.0.0.1:1", "pad": "x" * (32 << 10)}}}
    assert hw.http(s.url, "PUT", "/register", big)[0] == 413


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
    assert hw.http(s.url, "GET", "/health")[0] == 503


@pytest.mark.slow   # a registry in its own process
def test_health_answers_fast_after_a_record_with_huge_sizes(tmp_path):
    """In its own process under a 4 GiB address-space limit: today this request would eat the box."""
    script = textwrap.dedent("""
        import resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
        s = BootstrapServer(BootstrapConfig()).start()
        print(s.url, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), "the registry process did not start"
        status = hw.http(url, "PUT", "/register", record("huge", tp_size=65536, pp_size=65536))[0]
        assert status in (200, 400), f"the record answered {status}"
        if status == 200:   # a fixed registry may refuse such sizes outright
            t0 = time.monotonic()
            try:
                status = hw.http(url, "GET", "/health", timeout=2.0)[0]
            except OSError as e:   # urllib's timeout
                pytest.fail(f"/health did not answer within 2 s ({type(e).__name__}) after one registration")
            assert status in (200, 503) and time.monotonic() - t0 < 2.0, f"/health answered {status}"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow   # the shared signed registry, attacked for seconds
def test_an_oversized_record_is_refused(signed_registry):
    before = snapshot()
    name = f"big{next(_names)}"
    try:
        status = hw.http(signed_registry.url, "PUT", "/register", record(name, data={"zmq": {"pad": "x" * (4 << 20)}}),
                         secret=SECRET)[0]
        # (a transport descriptor is free-form, so only a size cap refuses this record, not a schema)
        assert status == 413, f"a 4 MiB record answered {status}"
        after_attack(signed_registry.url, before)
    finally:
        hw.http(signed_registry.url, "DELETE", "/register", {"key": key(name)}, secret=SECRET)


# ------------------------------------------------------------------------------------
# Replays and ownership
# ------------------------------------------------------------------------------------
def test_a_replayed_delete_is_refused(server):
    s = server(secret=SECRET)
    reg = Registration(BootstrapClient(s.url, SECRET), RankInfo.from_dict(record()), ttl=5.0).start()
    try:
        body = json.dumps({"key": "default/dp0/pp0/tp0", "owner": reg.owner}).encode()
        status, _, captured = hw.http(s.url, "DELETE", "/register", raw=body, secret=SECRET)
        assert status == 200                                                      # the captured DELETE
        BootstrapClient(s.url, SECRET).register(RankInfo.from_dict(record()), reg.owner)
        status, reply, _ = hw.http(s.url, "DELETE", "/register", raw=body, header=captured)   # replayed
        assert status == 401 and "replayed" in json.loads(reply)["error"]
        assert hw.http(s.url, "GET", "/health")[0] == 200
    finally:
        reg.stop()


def test_a_second_owner_cannot_take_or_delete_a_live_key(server):
    s = server(secret=SECRET)
    victim = Registration(BootstrapClient(s.url, SECRET), RankInfo.from_dict(record()), ttl=5.0).start()
    try:
        hijack = {**record(), "control": "tcp://127.0.0.1:6666", "owner": "x" * 32}
        raw = json.dumps(hijack).encode()
        status, reply, _ = hw.http(s.url, "PUT", "/register", raw=raw, secret=SECRET)
        assert status == 409 and "another owner" in json.loads(reply)["error"]
        raw = json.dumps({"key": "default/dp0/pp0/tp0", "owner": "x" * 32}).encode()
        assert hw.http(s.url, "DELETE", "/register", raw=raw, secret=SECRET)[0] == 403
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
    assert json.loads(hw.http(s.url, "GET", "/topology?instance=B")[1])["ready"] is False
    assert hw.http(s.url, "GET", "/health?instance=A")[0] == 200 and hw.http(s.url, "GET", "/health")[0] == 503


@pytest.mark.slow   # the shared signed registry, attacked for seconds
def test_unsigned_and_badly_signed_writes_are_refused(signed_registry):
    before = snapshot()
    name = f"unsigned{next(_names)}"
    assert hw.http(signed_registry.url, "PUT", "/register", record(name))[0] == 401
    assert hw.http(signed_registry.url, "PUT", "/register", record(name), secret=b"wrong")[0] == 401
    assert hw.http(signed_registry.url, "PUT", "/register", record(name), header="0:00")[0] == 401
    # the old two-field header (no nonce), correctly signed under the old scheme: refused
    raw = json.dumps(record(name)).encode()
    t = str(int(time.time()))
    old = hmac.new(SECRET, f"{t}\nPUT\n/register\n".encode() + raw, hashlib.sha256).hexdigest()
    assert hw.http(signed_registry.url, "PUT", "/register", raw=raw, header=f"{t}:{old}")[0] == 401
    # a valid signature for another path, and one from outside the time window
    assert hw.http(signed_registry.url, "PUT", "/register", raw=raw,
                   header=hw.sign(SECRET, "PUT", "/heartbeat", raw))[0] == 401
    assert hw.http(signed_registry.url, "PUT", "/register", raw=raw,
                   header=hw.sign(SECRET, "PUT", "/register", raw, now=time.time() - 3600))[0] == 401
    assert controls(signed_registry.url, name) == []
    after_attack(signed_registry.url, before)


@pytest.mark.slow   # the shared signed registry, attacked for seconds
def test_a_captured_signed_delete_cannot_be_replayed(signed_registry):
    """The rank's own signed DELETE (owner token included) is captured and replayed, byte for byte
    with its X-KVXfer-Auth header, after the rank registered again: 401, the rank stays."""
    before = snapshot()
    name, mine = f"replay{next(_names)}", owner()
    client = BootstrapClient(signed_registry.url, SECRET)
    client.register(RankInfo.from_dict(record(name)), mine)
    body = json.dumps({"key": key(name), "owner": mine}).encode()
    status, _, captured = hw.http(signed_registry.url, "DELETE", "/register", raw=body, secret=SECRET)
    assert status == 200 and controls(signed_registry.url, name) == []
    client.register(RankInfo.from_dict(record(name)), mine)       # the rank comes back
    try:
        # the attacker replays
        status = hw.http(signed_registry.url, "DELETE", "/register", raw=body, header=captured)[0]
        assert controls(signed_registry.url, name) == ["tcp://127.0.0.1:5000"], "the replayed DELETE removed the rank"
        assert status == 401, f"the replayed DELETE answered {status}"
        # the same capture replayed as a heartbeat or a PUT does not verify either (path and method are signed)
        assert hw.http(signed_registry.url, "POST", "/heartbeat", raw=body, header=captured)[0] == 401
        after_attack(signed_registry.url, before)
    finally:
        client.deregister(key(name), mine)


@pytest.mark.slow   # the shared signed registry, attacked for seconds
def test_a_second_put_does_not_replace_a_live_rank(signed_registry):
    """A second party holding the secret (another process of the deployment, or a stale rank) PUTs
    a live key under another owner, or none: 409, and its DELETE is 403; the record is unchanged."""
    before = snapshot()
    name, mine = f"hijack{next(_names)}", owner()
    client = BootstrapClient(signed_registry.url, SECRET)
    client.register(RankInfo.from_dict(record(name)), mine)
    try:
        for theirs in (owner(), None):
            rec = record(name, control="tcp://10.66.6.6:6666", **({"owner": theirs} if theirs else {}))
            status = hw.http(signed_registry.url, "PUT", "/register", rec, secret=SECRET)[0]
            assert controls(signed_registry.url, name) == ["tcp://127.0.0.1:5000"], "the rank's record was hijacked"
            assert status == 409, f"the hijacking PUT (owner {theirs!r}) answered {status}"
            body = {"key": key(name), **({"owner": theirs} if theirs else {})}
            status = hw.http(signed_registry.url, "DELETE", "/register", body, secret=SECRET)[0]
            assert status == 403, f"another owner's DELETE answered {status}"
            assert hw.http(signed_registry.url, "POST", "/heartbeat", body, secret=SECRET)[0] == 404
        assert controls(signed_registry.url, name) == ["tcp://127.0.0.1:5000"], "the rank was removed by another owner"
        assert client.heartbeat(key(name), mine), "the owner's heartbeat no longer keeps its record"
        after_attack(signed_registry.url, before)
    finally:
        client.deregister(key(name), mine)


# ------------------------------------------------------------------------------------
# Bind and advertise
# ------------------------------------------------------------------------------------
def test_binding_every_interface_never_advertises_the_wildcard(server):
    s = server(host="0.0.0.0")
    assert "0.0.0.0" not in s.url
    assert hw.http(s.url, "GET", "/health")[0] == 503
    ch = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat(), bind="tcp://0.0.0.0:0")
    try:
        assert ch.alive and "0.0.0.0" not in ch.address and ch.address.rsplit(":", 1)[1] == ch.bound.rsplit(":", 1)[1]
    finally:
        ch.close()


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
    status, reply, _ = hw.http(f"http://{ip}:{s.port}", "PUT", "/register", record())
    assert status == 400 and "127.0.0.1" in json.loads(reply)["error"] and "advertise" in json.loads(reply)["error"]
    data_loopback = {**record(), "control": f"tcp://{ip}:5000"}                 # its zmq data endpoint is loopback
    status, reply, _ = hw.http(f"http://{ip}:{s.port}", "PUT", "/register", data_loopback)
    assert status == 400 and "data.zmq.endpoint" in json.loads(reply)["error"]
    ok = {**data_loopback, "data": {"zmq": {"endpoint": f"tcp://{ip}:1"}}}
    assert hw.http(f"http://{ip}:{s.port}", "PUT", "/register", ok)[0] == 200


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
    status, reply, _ = hw.http(s.url, "POST", "/watch", body)
    assert status == 400 and len(reply) < 1024 and json.loads(reply)["code"] == "bad", (status, reply[:200])


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_a_watch_is_held_until_its_instance_changes_and_never_past_max_wait(server):
    s = server(max_wait=1.0)
    t0 = time.monotonic()
    status, reply, _ = hw.http(s.url, "POST", "/watch", {"since": {"w": 0}, "wait": 3600})
    assert status == 200 and json.loads(reply)["changed"] == {} and time.monotonic() - t0 < 3.0
    assert hw.http(s.url, "PUT", "/register", record(instance="w"))[0] == 200
    status, reply, _ = hw.http(s.url, "POST", "/watch", {"since": {"w": 0}, "wait": 30})
    snap = json.loads(reply)["changed"]["w"]
    assert snap["ready"] and snap["version"] > 0 and snap["ranks"][0]["layout_digest"]
    assert "layout" not in snap["ranks"][0]
    # an epoch from another life of the registry: everything is answered again, at once
    status, reply, _ = hw.http(s.url, "POST", "/watch", {"since": {"w": snap["version"]}, "epoch": "stale", "wait": 30})
    assert json.loads(reply)["changed"]["w"]["version"] == snap["version"]


def test_layouts_are_named_by_their_digest(server):
    """A record naming a layout by digest the registry does not hold is 428 (send it); a layout sent
    with a digest that is not its own is refused; a stored layout hashes to its name."""
    s = server()
    rec = record()
    layout = rec.pop("layout")
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    status, reply, _ = hw.http(s.url, "PUT", "/register", {**rec, "layout_digest": digest})
    assert status == 428 and json.loads(reply)["code"] == "layout"
    status, reply, _ = hw.http(s.url, "PUT", "/register", {**rec, "layout": layout, "layout_digest": "0" * 64})
    assert status == 400
    status, reply, _ = hw.http(s.url, "PUT", "/register", {**rec, "layout": layout})
    assert status == 200 and json.loads(reply)["layout_digest"] == digest
    other = {**rec, "tp_rank": 1, "tp_size": 2}
    assert hw.http(s.url, "PUT", "/register", {**record(instance="B", tp_rank=1, tp_size=2), "layout_digest": digest}
                )[0] == 200, other
    status, raw, _ = hw.http(s.url, "GET", f"/layout?digest={digest}")
    assert status == 200 and hashlib.sha256(raw).hexdigest() == digest
    for bad_digest in ("0" * 64, "../../etc", "A" * 64, ""):
        assert hw.http(s.url, "GET", f"/layout?digest={bad_digest}")[0] == 404
    status, reply, _ = hw.http(s.url, "GET", "/topology?instance=default")
    assert json.loads(reply)["ranks"][0]["layout"] == layout, "operators' /topology keeps the layout in its records"
