"""etcd as the registry (issue 38), against a real etcd (``etcd_server``): leases kept alive on one
connection, a restarted rank's takeover when its predecessor's lease expires, watches instead of
reads, layouts written once, and records read back with the same checks as from the embedded
registry. What etcd holds is looked at, and written by an attacker, through its gateway by hand.

Slow tier: etcd is a process of its own.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
from etcd_server import etcd  # noqa: F401
from registry_helpers import CountingRelay, record
from waiting import until

from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import RankInfo
from kvxfer.endpoint.recovery import PeerRecovery
from kvxfer.errors import ConnectError
from kvxfer.layout import page_major_layout
from kvxfer.metrics import REGISTRATIONS_LOST

pytestmark = pytest.mark.slow
LAYOUT = page_major_layout(layers=4, heads=2, head_dim=16, dtype="fp8_e4m3", num_pages=8, page_size=4).to_dict()
_n = iter(range(1, 1 << 30))


def prefix() -> str:
    return f"e{time.monotonic_ns()}x{next(_n)}"


def info(instance: str, tp: int = 0, tp_size: int = 1, port: int = 20000) -> RankInfo:
    return RankInfo.from_dict(record(instance, tp, tp_size, LAYOUT, f"tcp://127.0.0.1:{port + tp}"))


def test_a_rank_keeps_its_lease_alive_on_one_connection(etcd):  # noqa: F811
    p = prefix()
    relay = CountingRelay(etcd.client_port)
    reg = Registration(BootstrapClient(relay.url.replace("http", "etcd") + f"/{p}"), info("one"), ttl=2.0,
                       interval=0.3).start()
    try:
        time.sleep(3.0)                               # longer than the lease: only keep-alives hold it
        kv = etcd.keys(f"{p}/ranks/")[f"{p}/ranks/one/dp0/pp0/tp0"]
        assert int(kv["lease"]) > 0 and kv["json"]["control"] == "tcp://127.0.0.1:20000"
        assert "layout" not in kv["json"] and kv["json"]["layout_digest"]
        connections, requests, _ = relay.counts()
        assert connections == 1 and requests >= 10, (connections, requests)
        lease = kv["lease"]
    finally:
        reg.stop()
        relay.close()
    assert etcd.keys(f"{p}/ranks/") == {}, "stop() deleted the key"
    assert "TTL" not in etcd.rpc("lease/timetolive", {"ID": lease}) or \
        int(etcd.rpc("lease/timetolive", {"ID": lease}).get("TTL", -1)) <= 0, "stop() revoked the lease"


def test_a_restarted_rank_takes_its_key_when_the_predecessors_lease_expires(etcd):  # noqa: F811
    url = etcd.url(prefix())
    old = Registration(BootstrapClient(url), info("take"), ttl=2.0, interval=0.3).start()
    # while the predecessor keeps its lease alive, the key is never another owner's
    with pytest.raises(ConnectError, match="another owner"):
        Registration(BootstrapClient(url), info("take", port=21000), ttl=2.0).start(timeout=3.0)
    assert [r.control for r in BootstrapClient(url).topology("take")[1]] == ["tcp://127.0.0.1:20000"]
    old.stop(deregister=False)                      # killed: its keep-alives stop, its lease runs out
    new = Registration(BootstrapClient(url), info("take", port=21000), ttl=2.0).start()
    try:
        assert [r.control for r in BootstrapClient(url).topology("take")[1]] == ["tcp://127.0.0.1:21000"]
        assert not old.client.heartbeat(old.key, old.owner), "the predecessor's lease outlived its TTL"
    finally:
        new.stop()


def test_a_takeover_keeps_the_key_it_took(etcd):  # noqa: F811
    """The successor's lease is granted at its first try and its registration waits a whole TTL for the
    predecessor's lease: the lease is kept alive at each try, so the key it finally writes does not
    vanish with a lease about to run out (before: lost at once, registered again)."""
    p = prefix()
    url = etcd.url(p)
    old = Registration(BootstrapClient(url), info("keep"), ttl=3.0, interval=1.0).start()
    time.sleep(1.5)
    old.stop(deregister=False)
    before = REGISTRATIONS_LOST.labels("expired")._value.get()
    new = Registration(BootstrapClient(url), info("keep", port=23000), ttl=3.0, interval=1.0).start()
    try:
        time.sleep(2.5)
        assert new.state == "registered" and REGISTRATIONS_LOST.labels("expired")._value.get() == before
        assert etcd.keys(f"{p}/ranks/")[f"{p}/ranks/keep/dp0/pp0/tp0"]["json"]["control"] == "tcp://127.0.0.1:23000"
    finally:
        new.stop()


def test_layouts_are_written_once_and_checked_against_their_digest(etcd):  # noqa: F811
    p = prefix()
    url = etcd.url(p)
    regs = [Registration(BootstrapClient(url), info("lay", t, 4), ttl=5.0).start() for t in range(4)]
    try:
        layouts = etcd.keys(f"{p}/layouts/")
        digest = hashlib.sha256(json.dumps(LAYOUT, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        assert list(layouts) == [f"{p}/layouts/{digest}"] and layouts[f"{p}/layouts/{digest}"]["json"] == LAYOUT
        ranks = BootstrapClient(url).wait_ready(5, "lay")
        assert [r.layout for r in ranks] == [LAYOUT] * 4 and [r.spec.tp_rank for r in ranks] == [0, 1, 2, 3]
        # an attacker with write access rewrites the layout: readers refuse it, naming the digest
        etcd.put(f"{p}/layouts/{digest}", json.dumps({**LAYOUT, "kind": "token_major"}).encode())
        with pytest.raises(ConnectError, match="does not match its digest"):
            BootstrapClient(url).topology("lay")
    finally:
        for r in regs:
            r.stop()


def test_a_rank_that_names_no_ttl_takes_etcd_s_default_lease_and_beats_a_third_of_it(etcd):  # noqa: F811
    """Keep-alives are most of what etcd spends: a rank that names no ttl gets a 30 s lease (the
    embedded registry's default stays 10 s), renewed every 10 s."""
    from kvxfer.control.etcd_registry import ETCD_TTL
    p = prefix()
    client = BootstrapClient(etcd.url(p))
    reg = Registration(client, info("dflt"))
    assert client.default_ttl == ETCD_TTL == 30.0 and reg.ttl == 30.0 and reg.interval == 10.0
    assert BootstrapClient("http://127.0.0.1:1").default_ttl == 10.0
    reg.start()
    try:
        lease = etcd.keys(f"{p}/ranks/")[f"{p}/ranks/dflt/dp0/pp0/tp0"]["lease"]
        granted = etcd.rpc("lease/timetolive", {"ID": lease})
        assert int(granted["grantedTTL"]) == 30 and 25 <= int(granted["TTL"]) <= 30, granted
    finally:
        reg.stop()


def test_a_record_under_another_ranks_key_is_dropped(etcd):  # noqa: F811
    p = prefix()
    url = etcd.url(p)
    reg = Registration(BootstrapClient(url), info("mine"), ttl=5.0).start()
    try:
        good = etcd.keys(f"{p}/ranks/")[f"{p}/ranks/mine/dp0/pp0/tp0"]["json"]
        etcd.put(f"{p}/ranks/mine/dp0/pp0/tp1", json.dumps({**good, "control": "tcp://10.6.6.6:1"}).encode())
        etcd.put(f"{p}/ranks/mine/dp0/pp0/tp2", b"not json")
        ready, ranks = BootstrapClient(url).topology("mine")
        assert ready and [r.control for r in ranks] == ["tcp://127.0.0.1:20000"]
        etcd.put(f"{p}/ranks/other/dp0/pp0/tp0", json.dumps({**good, "instance": "other", "tp_size": 0}).encode())
        with pytest.raises(ConnectError, match="invalid rank record"):
            BootstrapClient(url).topology("other")
    finally:
        reg.stop()


def test_wait_ready_and_recovery_watch_instead_of_reading(etcd):  # noqa: F811
    """One watch while waiting for an instance, one while following it; a replaced rank's new record
    reaches the recovery thread."""
    p = prefix()
    relay = CountingRelay(etcd.client_port)
    url = relay.url.replace("http", "etcd") + f"/{p}"
    first = Registration(BootstrapClient(etcd.url(p)), info("w", 0, 2), ttl=5.0).start()
    got: list = []
    t = threading.Thread(target=lambda: got.append(BootstrapClient(url).wait_ready(20, "w")), daemon=True)
    t.start()
    time.sleep(1.5)
    second = Registration(BootstrapClient(etcd.url(p)), info("w", 1, 2), ttl=5.0).start()
    t.join(10)
    assert got and [r.spec.tp_rank for r in got[0]] == [0, 1]
    assert relay.counts()[1] <= 6, f"wait_ready sent {relay.counts()[1]} requests"

    class Decode:
        lost_peers: dict = {}

        def __init__(self):
            self.client = BootstrapClient(url)
            self.known = {r.spec.key: r for r in got[0]}
            self.rejoined: list = []

        def registries(self):
            return {"w": self.client}

        def known_peers(self):
            return dict(self.known)

        def rejoin(self, key, new, *, replaced, read_at):
            self.rejoined.append((key, new.control, replaced))
            self.known[key] = new
            return True

        def break_endpoint(self, why):
            raise AssertionError(why)
    ep = Decode()
    rec = PeerRecovery(ep, interval=0.2, retry=1.0).start()
    try:
        time.sleep(1.0)
        _, _, settled = relay.counts()
        time.sleep(3.0)
        assert relay.counts()[2] - settled < 1024, "the recovery thread read while nothing changed"
        second.stop()                                  # the rank restarts elsewhere
        second = Registration(BootstrapClient(etcd.url(p)), info("w", 1, 2, port=22000), ttl=5.0).start()
        assert until(lambda: ep.rejoined, 5), "the new record did not reach the recovery thread"
        assert ep.rejoined[-1] == ("w/dp0/pp0/tp1", "tcp://127.0.0.1:22001", True)
    finally:
        rec.stop()
        first.stop()
        second.stop()
        relay.close()


def test_a_bad_etcd_url_is_refused_naming_it():
    for bad in ("etcd://", "etcd://h:notaport", "etcd://user:pw@h:2379"):
        with pytest.raises(ValueError, match="registry URL"):
            BootstrapClient(bad)


def test_kvxfer_rank_takes_an_etcd_url(etcd):  # noqa: F811
    """``kvxfer rank --bootstrap etcd://...`` (in process): prefill TP 2 page-major registers in etcd,
    a decode rank finds it there and its self-test verifies every byte."""
    from kvxfer.cli import rank as cli
    from kvxfer.cli import rank_serve as serve
    url = etcd.url(prefix())
    flags = ["--bootstrap", url, "--kv-heads", "4", "--head-dim", "16", "--layers", "2", "--pages", "32",
             "--page-size", "4", "--tp-size", "2", "--seed", "6"]
    ranks = []
    try:
        for r in (0, 1):
            p = serve.Rank(cli.resolve(cli.parser().parse_args([*flags, "--role", "prefill", "--tp-rank", str(r),
                                                                "--layout", "page_major"]), {}))
            ranks.append(p)
            p.start()
        d = serve.Rank(cli.resolve(cli.parser().parse_args([*flags, "--role", "decode", "--tp-rank", "0"]), {}))
        ranks.append(d)
        d.start()
        res = d.selftest(2, 10, 5, 20)
        assert res["ok"] and all(v["verified"] for v in res["requests"].values()), res
    finally:
        for rk in reversed(ranks):
            rk.close()
    assert etcd.keys(url.rsplit("/", 1)[1] + "/ranks/") == {}, "closed ranks left their keys"
