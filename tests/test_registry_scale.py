"""The embedded registry at deployment scale (issue 38) and under connection exhaustion (issue 34).

Written from outside: raw HTTP (http.client, sockets), a counting relay and a connection flood from
addresses of our choosing (``registry_helpers``); kvxfer's own client classes only where the test is
about what they do (``Registration``, ``wait_ready``, ``PeerRecovery``). Each test states what it
would have seen on the registry before issue 38.

Slow tier: each takes seconds, and some start processes (a flood, a load).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
from registry_helpers import Conn, CountingRelay, FloodProcess, LoadProcess, record
from support.ports import free_port
from waiting import until

from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import RankInfo
from kvxfer.endpoint.recovery import PeerRecovery
from kvxfer.errors import ConnectError
from kvxfer.layout import page_major_layout, token_major_layout
from kvxfer.metrics import REGISTRATIONS_LOST

pytestmark = pytest.mark.slow
SMALL = token_major_layout(layers=2, heads=2, head_dim=8, dtype="float16", num_slots=64, page_size=4).to_dict()


def big_layout() -> dict:
    """The largest layout the issue names: 80 layers, FP8, page-major, with per-block scales (~67 KB)."""
    return page_major_layout(layers=80, heads=1, head_dim=128, dtype="fp8_e4m3", num_pages=4096, page_size=16,
                             scale_block=32).to_dict()


BIG = big_layout()



def lost() -> float:
    return sum(REGISTRATIONS_LOST.labels(w)._value.get() for w in ("expired", "taken"))


def listen_drops() -> int:
    """SYNs this host's kernel dropped because a listen queue was full (``ListenDrops``)."""
    with open("/proc/net/netstat") as f:
        head, values = [line.split() for line in f if line.startswith("TcpExt:")][:2]
    return int(values[head.index("ListenDrops")])


# ------------------------------------------------------------------------------------
# Sizes and connections
# ------------------------------------------------------------------------------------
def test_1024_ranks_of_an_80_layer_fp8_page_major_model_fit_the_defaults(server):
    """Before: every rank stored its own 67 KB layout and max_total_bytes (64 MiB) held ~900 of them
    (507 "registry full" after that). Now the layout is held once, by digest."""
    s = server()
    layout = BIG
    c = Conn(s.url)
    keys = []
    for i in range(1024):
        inst, tp = divmod(i, 8)
        rec = record(f"i{inst}", tp, 8, layout, f"tcp://127.0.0.1:{30000 + i}", num_layers=80, num_kv_heads=8)
        status, body, _ = c.call("PUT", "/register", {**rec, "owner": "r" * 32})
        assert status == 200, f"rank {i}: {status} {body[:200]!r}"
        keys.append(f"i{inst}/dp0/pp0/tp{tp}")
        if i % 64 == 63:      # registering them all takes longer than the ttl: they heartbeat meanwhile
            assert {c.call("POST", "/heartbeat", {"key": k, "owner": "r" * 32})[0] for k in keys} == {200}
    status, body, _ = c.call("GET", "/health")
    assert status == 200 and json.loads(body)["registered"] == 1024
    status, body, _ = c.call("POST", "/watch", {"since": {"i5": -1}})
    ranks = json.loads(body)["changed"]["i5"]["ranks"]
    assert len(ranks) == 8 and "layout" not in ranks[0]
    digest = ranks[0]["layout_digest"]
    status, raw, _ = c.call("GET", f"/layout?digest={digest}")
    assert status == 200 and hashlib.sha256(raw).hexdigest() == digest and json.loads(raw) == layout
    c.close()


def test_requests_share_one_kept_alive_connection(server):
    """Before: one request per connection (keepalive 0): a heartbeat every ttl / 3 was a new TCP
    connection, and 1,024 ranks starting at once overran the accept queue."""
    s = server()
    c = Conn(s.url)
    c.call("GET", "/health")
    first = c.c.sock.getsockname()
    for _ in range(3):
        status, _, r = c.call("GET", "/health")
        assert status == 503 and not r.will_close, "the server closed a kept-alive connection"
    assert c.c.sock.getsockname() == first, "a new connection was made"
    c.close()


def test_a_flood_from_one_address_leaves_honest_clients_and_live_keys_alone(server):
    """Issue 34: 300 connections from one attacker address, each reopened as soon as it is closed.
    Before: they held all 256 connections; honest /health calls were refused and a live rank's
    registration expired, after which the attacker registered its key. Now: the attacker holds its
    own address's share; honest hosts, the live rank's heartbeats and its key are untouched."""
    # ttl 3 s, heartbeats every 0.4 s: slack for a loaded machine, and the flood outlasts the ttl
    s = server(ttl=3.0)
    info = RankInfo.from_dict(record("victim", layout=SMALL))
    reg = Registration(BootstrapClient(s.url), info, ttl=3.0, interval=0.4).start()
    before = lost()
    flood = FloodProcess(s.port, ["127.0.0.66"], 300)
    try:
        answered, takes = 0, []
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            try:
                answered += Conn(s.url, source="127.0.0.9", timeout=2.0).call("GET", "/health")[0] == 200
            except OSError:
                pass
            try:
                takes.append(Conn(s.url, source="127.0.0.67", timeout=2.0).call(
                    "PUT", "/register", {**record("victim", layout=SMALL, control="tcp://10.66.6.6:6666"),
                                         "owner": "x" * 32})[0])
            except OSError:
                takes.append(0)
            time.sleep(0.2)
        assert answered >= len(takes) - 1, f"honest /health answered {answered} of {len(takes)} during the flood"
        assert 200 not in takes, "the attacker took the live rank's key"
        held = s.registry.holder("victim/dp0/pp0/tp0", time.monotonic())
        assert held and reg.state == "registered" and lost() == before, "the live registration expired in the flood"
        assert set(takes) == {409}, f"the attacker's PUTs of the live key answered {sorted(set(takes))}"
        assert s.admission.open["127.0.0.66"] <= s.admission.share("127.0.0.66")
    finally:
        opened = flood.stop()
        reg.stop()
    assert opened > 300, "the flood never had a connection closed"
    ranks = BootstrapClient(s.url).topology("victim")[1]
    assert ranks == [], "stop() deregisters"


def test_a_flood_from_many_addresses_leaves_room_for_registered_ranks(server):
    """A flood from 40 addresses (3 connections each, within any per-address share) against 64
    connections. Before: they held all of them and a registered rank that reconnects for each
    heartbeat expired. Now a quarter of the connections is kept for addresses with registered ranks.
    And the refused reconnects pass through the accept queue too: sized by max_connections (65) it
    stayed full, the kernel dropped SYNs (28 in a 4 s run), and one of the rank's heartbeats waited a
    1 s SYN retry (a full CI run saw the registration expire). Now no SYN is dropped."""
    s = server(ttl=1.5, max_connections=64, idle_timeout=0.2)   # the rank's connection closes between beats
    info = RankInfo.from_dict(record("many", layout=SMALL))
    reg = Registration(BootstrapClient(s.url), info, ttl=1.5, interval=0.4).start()
    before, drops = lost(), listen_drops()
    flood = FloodProcess(s.port, [f"127.0.1.{i}" for i in range(1, 41)], 3)
    try:
        time.sleep(4.0)
        held = s.registry.holder("many/dp0/pp0/tp0", time.monotonic()) is not None
        assert held and reg.state == "registered" and lost() == before, "the registered rank's heartbeats were refused"
        assert s.admission.unregistered <= 64 - s.admission.reserved
        assert listen_drops() == drops, f"the kernel dropped {listen_drops() - drops} SYNs: the accept queue was full"
    finally:
        flood.stop()
        reg.stop()


# ------------------------------------------------------------------------------------
# Reads that cannot starve heartbeats
# ------------------------------------------------------------------------------------
def test_bulk_reads_do_not_starve_heartbeats(server):
    """256 ranks of 67 KB layouts: the whole topology is 14.6 MiB. Before: each /topology was encoded
    on the event loop (json.dumps of every record), so 16 readers in a loop held it for seconds at a
    time and a rank heartbeating every 0.3 s with ttl 2 s expired. Now the answer is built once
    per version from kept bytes and written in pieces. (Readers and the 256 ranks' heartbeats come
    from another process.)"""
    s = server(ttl=2.0)
    c = Conn(s.url)
    keys = []
    for i in range(256):
        body = {**record(f"bulk{i // 8}", i % 8, 8, BIG, num_layers=80), "owner": "b" * 32}
        assert c.call("PUT", "/register", body)[0] == 200
        keys.append(f"bulk{i // 8}/dp0/pp0/tp{i % 8}")
        if i % 32 == 31:      # registering them all takes longer than the ttl: the first ones heartbeat
            assert {c.call("POST", "/heartbeat", {"key": k, "owner": "b" * 32})[0] for k in keys} == {200}
    c.close()
    keeper = LoadProcess(s.url, 0, "/health", keys, "b" * 32, beat=0.5)
    load = LoadProcess(s.url, 16, "/topology", [], "", beat=0.5)
    reg = Registration(BootstrapClient(s.url), RankInfo.from_dict(record("live", layout=SMALL)), ttl=2.0,
                       interval=0.3).start()
    before = lost()
    try:
        time.sleep(4.0)
        live = reg.state == "registered" and lost() == before
    finally:
        sizes = load.stop()
        keeper.stop()
        reg.stop()
    assert sizes and min(sizes) > 14 << 20, f"the readers did not read the whole topology: {min(sizes or [0])}"
    assert live, "the heartbeats starved behind bulk reads"


# ------------------------------------------------------------------------------------
# Waits that block on the server, reads of what changed
# ------------------------------------------------------------------------------------
def test_wait_ready_is_one_request_the_server_holds(server):
    """Before: wait_ready asked every 0.1 s (and every answer carried every record). Now one request
    is held by the server until the instance is complete."""
    s = server()
    relay = CountingRelay(s.port)
    c = Conn(s.url)
    assert c.call("PUT", "/register", record("half", 0, 2, SMALL))[0] == 200
    got = []
    t = threading.Thread(target=lambda: got.append(BootstrapClient(relay.url).wait_ready(20, "half")), daemon=True)
    t.start()
    time.sleep(1.5)
    assert not got
    assert c.call("PUT", "/register", record("half", 1, 2, SMALL))[0] == 200
    t.join(10)
    assert got and [r.spec.tp_rank for r in got[0]] == [0, 1]
    _, requests, _ = relay.counts()
    assert requests <= 3, f"wait_ready sent {requests} requests while it waited 1.5 s"
    relay.close()
    c.close()


class _Decode:
    """What ``PeerRecovery`` uses of a decode endpoint: one instance, its ranks as first read."""

    def __init__(self, client: BootstrapClient, instance: str):
        self.client, self.instance = client, instance
        self.known = {r.spec.key: r for r in client.topology(instance)[1]}
        self.rejoined: list[tuple[str, str, bool]] = []

    lost_peers: dict[str, str] = {}

    def registries(self):
        return {self.instance: self.client}

    def known_peers(self):
        return dict(self.known)

    def rejoin(self, key, info, *, replaced, read_at):
        self.rejoined.append((key, info.control, replaced))
        self.known[key] = info
        return True

    def break_endpoint(self, why):
        raise AssertionError(why)


def test_recovery_reads_nothing_while_nothing_changes(server):
    """Before: PeerRecovery re-read its instance every ``Timeouts.registry`` seconds (here 0.2 s),
    whether or not anything changed. Now it holds one watch: a restarted rank's new record still
    reaches it at once."""
    s = server()
    relay = CountingRelay(s.port)
    c = Conn(s.url)
    assert c.call("PUT", "/register", {**record("watched", layout=SMALL), "owner": "o" * 32})[0] == 200
    ep = _Decode(BootstrapClient(relay.url), "watched")
    rec = PeerRecovery(ep, interval=0.2, retry=1.0).start()
    try:
        time.sleep(1.0)                       # the watch's first read
        _, _, settled = relay.counts()
        time.sleep(3.0)
        _, _, later = relay.counts()
        assert later - settled < 1024, f"{later - settled} bytes read in 3 s with nothing changed"
        moved = {**record("watched", layout=SMALL, control="tcp://127.0.0.1:29999"), "owner": "o" * 32}
        assert c.call("PUT", "/register", moved)[0] == 200     # the rank restarted elsewhere
        assert until(lambda: ep.rejoined, 5), "the new record did not reach the recovery thread"
        assert ep.rejoined == [("watched/dp0/pp0/tp0", "tcp://127.0.0.1:29999", True)]
    finally:
        rec.stop()
        relay.close()
        c.close()


# ------------------------------------------------------------------------------------
# Clients that try again
# ------------------------------------------------------------------------------------
def test_registration_start_waits_for_a_registry_that_is_not_up_yet(server):
    """Before: Registration.start retried only "409 another owner": a registry starting a second
    after its ranks (or refusing a connection in a burst) failed the rank's launch."""
    port = free_port()
    info = RankInfo.from_dict(record("late", layout=SMALL))
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        Registration(BootstrapClient(f"http://127.0.0.1:{port}"), info, ttl=5.0).start()), daemon=True)
    t.start()
    time.sleep(1.0)
    s = server(port=port)
    t.join(12)
    assert out and out[0].state == "registered", "start() gave up on a registry that came up a second later"
    assert [r.spec.key for r in BootstrapClient(s.url).topology("late")[1]] == ["late/dp0/pp0/tp0"]
    out[0].stop()


def test_registration_start_fails_at_once_on_a_refusal_that_will_not_change(server):
    s = server(secret=b"s3cret")
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="HTTP 401"):
        Registration(BootstrapClient(s.url, "wrong"), RankInfo.from_dict(record("nope", layout=SMALL)),
                     ttl=5.0).start()
    assert time.monotonic() - t0 < 5
