"""Hostile clients of the bootstrap registry (issue 16): bounded work per request, replay,
ownership of keys, record size and names. The attacker speaks raw HTTP (``hostile_wire.http``,
signing with hmac itself when it holds the secret or replaying a captured signature).

After each attack: the registry still serves an honest registration, and fds stay bounded.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time

import hostile_wire as hw
import pytest
from hostile_victims import bounded, snapshot

# kvxfer names used here (update here after a module move)
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.client import BootstrapClient
from kvxfer.control.records import RankInfo

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

SECRET = b"registry-secret"
_names = itertools.count(1)


@pytest.fixture(scope="module")
def registry():
    srv = BootstrapServer(BootstrapConfig(ttl=30.0, secret=SECRET)).start()
    yield srv
    srv.stop()


def record(instance: str, control: str = "tcp://127.0.0.1:5555", **over) -> dict:
    return {"role": "prefill", "num_kv_heads": 2, "num_layers": 2, "instance": instance, "tp_rank": 0,
            "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1, "replicated": False,
            "control": control, "data": {}, "layout": {}, "aux_bytes": 0, "protocol": 1, **over}


def key(instance: str) -> str:
    return f"{instance}/dp0/pp0/tp0"


def controls(url: str, instance: str) -> list[str]:
    return [i.control for i in BootstrapClient(url).topology(instance)[1]]


def after_attack(url: str, before) -> None:
    """An honest rank still registers, shows in the topology and deregisters."""
    name = f"honest{next(_names)}"
    client = BootstrapClient(url, SECRET)
    client.register(RankInfo.from_dict(record(name)))
    assert controls(url, name) == ["tcp://127.0.0.1:5555"]
    assert "status" in client.health()
    client.deregister(key(name))
    assert not bounded(before, fd_slack=8), bounded(before, fd_slack=8)


def test_unsigned_and_badly_signed_writes_are_refused(registry):
    before = snapshot()
    name = f"unsigned{next(_names)}"
    assert hw.http(registry.url, "PUT", "/register", record(name))[0] == 401
    assert hw.http(registry.url, "PUT", "/register", record(name), secret=b"wrong")[0] == 401
    assert hw.http(registry.url, "PUT", "/register", record(name), header="0:00")[0] == 401
    # the old two-field header (no nonce), correctly signed under the old scheme: refused
    raw = json.dumps(record(name)).encode()
    t = str(int(time.time()))
    old = hmac.new(SECRET, f"{t}\nPUT\n/register\n".encode() + raw, hashlib.sha256).hexdigest()
    assert hw.http(registry.url, "PUT", "/register", raw=raw, header=f"{t}:{old}")[0] == 401
    # a valid signature for another path, and one from outside the time window
    assert hw.http(registry.url, "PUT", "/register", raw=raw,
                   header=hw.sign(SECRET, "PUT", "/heartbeat", raw))[0] == 401
    assert hw.http(registry.url, "PUT", "/register", raw=raw,
                   header=hw.sign(SECRET, "PUT", "/register", raw, now=time.time() - 3600))[0] == 401
    assert controls(registry.url, name) == []
    after_attack(registry.url, before)


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


def owner() -> str:
    """A rank's owner token, as ``Registration`` makes one (16-64 of [A-Za-z0-9_-])."""
    return os.urandom(16).hex()


def test_a_captured_signed_delete_cannot_be_replayed(registry):
    """The rank's own signed DELETE (owner token included) is captured and replayed, byte for byte
    with its X-KVXfer-Auth header, after the rank registered again: 401, the rank stays."""
    before = snapshot()
    name, mine = f"replay{next(_names)}", owner()
    client = BootstrapClient(registry.url, SECRET)
    client.register(RankInfo.from_dict(record(name)), mine)
    body = json.dumps({"key": key(name), "owner": mine}).encode()
    status, _, captured = hw.http(registry.url, "DELETE", "/register", raw=body, secret=SECRET)
    assert status == 200 and controls(registry.url, name) == []
    client.register(RankInfo.from_dict(record(name)), mine)       # the rank comes back
    try:
        status = hw.http(registry.url, "DELETE", "/register", raw=body, header=captured)[0]  # the attacker replays
        assert controls(registry.url, name) == ["tcp://127.0.0.1:5555"], "the replayed DELETE removed the rank"
        assert status == 401, f"the replayed DELETE answered {status}"
        # the same capture replayed as a heartbeat or a PUT does not verify either (path and method are signed)
        assert hw.http(registry.url, "POST", "/heartbeat", raw=body, header=captured)[0] == 401
        after_attack(registry.url, before)
    finally:
        client.deregister(key(name), mine)


def test_a_second_put_does_not_replace_a_live_rank(registry):
    """A second party holding the secret (another process of the deployment, or a stale rank) PUTs
    a live key under another owner, or none: 409, and its DELETE is 403; the record is unchanged."""
    before = snapshot()
    name, mine = f"hijack{next(_names)}", owner()
    client = BootstrapClient(registry.url, SECRET)
    client.register(RankInfo.from_dict(record(name)), mine)
    try:
        for theirs in (owner(), None):
            rec = record(name, control="tcp://10.66.6.6:6666", **({"owner": theirs} if theirs else {}))
            status = hw.http(registry.url, "PUT", "/register", rec, secret=SECRET)[0]
            assert controls(registry.url, name) == ["tcp://127.0.0.1:5555"], "the rank's record was hijacked"
            assert status == 409, f"the hijacking PUT (owner {theirs!r}) answered {status}"
            body = {"key": key(name), **({"owner": theirs} if theirs else {})}
            status = hw.http(registry.url, "DELETE", "/register", body, secret=SECRET)[0]
            assert status == 403, f"another owner's DELETE answered {status}"
            assert hw.http(registry.url, "POST", "/heartbeat", body, secret=SECRET)[0] == 404
        assert controls(registry.url, name) == ["tcp://127.0.0.1:5555"], "the rank was removed by another owner"
        assert client.heartbeat(key(name), mine), "the owner's heartbeat no longer keeps its record"
        after_attack(registry.url, before)
    finally:
        client.deregister(key(name), mine)


def test_an_oversized_record_is_refused(registry):
    before = snapshot()
    name = f"big{next(_names)}"
    try:
        status = hw.http(registry.url, "PUT", "/register", record(name, data={"zmq": {"pad": "x" * (4 << 20)}}),
                         secret=SECRET)[0]
        # (a transport descriptor is free-form, so only a size cap refuses this record, not a schema)
        assert status == 413, f"a 4 MiB record answered {status}"
        after_attack(registry.url, before)
    finally:
        hw.http(registry.url, "DELETE", "/register", {"key": key(name)}, secret=SECRET)


def test_a_name_with_a_trailing_newline_is_refused(registry):
    before = snapshot()
    name = f"newline{next(_names)}\n"
    try:
        status, body, _ = hw.http(registry.url, "PUT", "/register", record(name), secret=SECRET)
        assert status == 400, f"instance {name!r} answered {status}: {body[:100]!r}"
        after_attack(registry.url, before)
    finally:
        hw.http(registry.url, "DELETE", "/register", {"key": key(name)}, secret=SECRET)
