"""Metrics and per-request log lines: one tiny in-process request over the local transport
moves the Prometheus counters, and each side writes exactly one log line per request end."""
from __future__ import annotations

import logging
import re
import threading

import numpy as np
import pytest
from waiting import until

from kvxfer import metrics
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.endpoint.base import KVPoll, Outcome, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.plan import plan_transfer
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec

TIMEOUTS = Timeouts(bootstrap=20, waiting=20, transfer=20, lease=20, heartbeat=Heartbeat(interval=0.5, timeout=5.0))
LINE = re.compile(r"room=(?P<room>\d+) role=(?P<role>\w+) peers=(?P<peers>\S*) bytes=(?P<bytes>\d+) "
                  r"duration_ms=(?P<ms>[\d.]+) state=(?P<state>\w+)(?: reason=(?P<reason>.*))?$")


def _pool() -> MHAPool:
    return MHAPool(layers=2, heads=2, head_dim=8, dtype="float16", num_pages=8, page_size=4)


def _value(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def pair():
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    p_pool, d_pool = _pool(), _pool()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=2, num_layers=2), p_pool, transport="local",
                         timeouts=TIMEOUTS)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2), d_pool, transport="local",
                        timeouts=TIMEOUTS)
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        yield pe, de, p_pool, d_pool
    finally:
        de.close()
        pe.close()
        server.stop()


def _lines(caplog, room: int) -> dict[str, list[re.Match]]:
    out: dict[str, list[re.Match]] = {}
    for rec in caplog.records:
        m = LINE.match(rec.getMessage())
        if rec.name == "kvxfer.request" and m and int(m["room"]) == room:
            out.setdefault(m["role"], []).append(m)
    return out


def test_a_request_moves_the_counters_and_logs_one_line_per_side(pair, caplog):
    pe, de, p_pool, d_pool = pair
    caplog.set_level(logging.DEBUG, logger="kvxfer.request")
    before = {"bytes": _value("kvxfer_bytes_moved_total", transport="local", role="send"),
              "transfers": _value("kvxfer_transfer_seconds_count", transport="local"),
              "runs": _value("kvxfer_runs_per_transfer_sum", transport="local"),
              "d_ok": _value("kvxfer_requests_total", role="decode", state="success", reason=""),
              "p_ok": _value("kvxfer_requests_total", role="prefill", state="success", reason="")}
    ps, ds = np.arange(4, 14), np.arange(8, 18)
    plan = plan_transfer(p_pool.layout, ps, d_pool.layout, ds)
    released = threading.Event()
    r, s = de.receiver(7, on_release=lambda _: released.set()), pe.sender(7)
    r.init(ds)
    s.send(ps[:4])
    s.send(ps[4:], last=True)
    assert r.wait(10) == KVPoll.Success, r.reason
    assert s.wait(10) == KVPoll.Success, s.reason
    assert until(lambda: released.is_set() and s.kv_releasable, 10.0)   # both sides' end bookkeeping has run

    assert _value("kvxfer_bytes_moved_total", transport="local", role="send") - before["bytes"] == plan.nbytes
    assert _value("kvxfer_transfer_seconds_count", transport="local") - before["transfers"] == 2   # two chunks
    assert _value("kvxfer_runs_per_transfer_sum", transport="local") - before["runs"] >= 2
    assert _value("kvxfer_requests_total", role="decode", state="success", reason="") - before["d_ok"] == 1
    assert _value("kvxfer_requests_total", role="prefill", state="success", reason="") - before["p_ok"] == 1

    lines = _lines(caplog, 7)
    assert sorted(lines) == ["decode", "prefill"] and all(len(v) == 1 for v in lines.values()), lines
    d, p = lines["decode"][0], lines["prefill"][0]
    assert d["state"] == p["state"] == "success" and d["reason"] is None
    assert int(d["bytes"]) == int(p["bytes"]) == plan.nbytes
    assert d["peers"] == pe.spec.key and p["peers"].startswith(de.spec.key + "/")   # decode's channel identity
    assert float(d["ms"]) > 0 and float(p["ms"]) > 0
    # decode's "done" may overtake the transport's ack: never a warning
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text


def test_an_aborted_request_is_counted_once_per_side_with_its_reason(pair, caplog):
    pe, de, _, _ = pair
    caplog.set_level(logging.INFO, logger="kvxfer.request")
    before = _value("kvxfer_requests_total", role="decode", state="aborted", reason="aborted by decode")
    r, s = de.receiver(8), pe.sender(8)
    r.init(np.arange(8, 12))
    assert until(lambda: r.poll() == KVPoll.WaitingForInput, 10.0)
    r.abort("test")
    assert s.wait(10) == KVPoll.Failed and s.outcome == Outcome.Aborted
    assert until(lambda: s.kv_releasable and len(_lines(caplog, 8)) == 2, 10.0)
    assert _value("kvxfer_requests_total", role="decode", state="aborted", reason="aborted by decode") - before == 1
    lines = _lines(caplog, 8)
    assert all(len(v) == 1 for v in lines.values()), lines
    assert lines["decode"][0]["reason"] == "'aborted by decode: test'"
    assert lines["prefill"][0]["state"] == "aborted" and "aborted by decode" in lines["prefill"][0]["reason"]
    r.abort("again")   # ended already: nothing more is counted
    assert _value("kvxfer_requests_total", role="decode", state="aborted", reason="aborted by decode") - before == 1


def test_reason_labels_stay_bounded():
    assert metrics.reason_label("") == ""
    assert metrics.reason_label("decode rank default/dp0/pp0/tp1/ed27b3ee7690 heartbeat lost") == \
        "decode rank * heartbeat lost"
    assert metrics.reason_label("timed out in Bootstrapping: no acknowledgement from x") == \
        "timed out in Bootstrapping"
    assert metrics.reason_label("chunk 3 from a/b is a duplicate or beyond its total 2") == \
        "chunk * from * is a duplicate or beyond its total *"
