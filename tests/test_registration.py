"""A rank notices when its registration expired (it registers again) or was taken by another owner
(issue 34): ``Registration.state``, the log, and ``kvxfer_registrations_lost{why}``; against the
embedded registry and against etcd (``etcd_server.registry``)."""
from __future__ import annotations

import logging

from etcd_server import etcd, registries, registry  # noqa: F401
from waiting import until

from kvxfer.control.client import BootstrapClient, Registration
from kvxfer.control.records import RankInfo
from kvxfer.metrics import REGISTRATIONS_LOST
from kvxfer.ranks import RankSpec

INFO = RankInfo(spec=RankSpec(role="prefill", num_kv_heads=2, num_layers=2, instance="reg"),
                control="tcp://127.0.0.1:5999")


def lost(why: str) -> float:
    return REGISTRATIONS_LOST.labels(why)._value.get()


def test_an_expired_registration_is_noticed_and_renewed(registry, caplog):  # noqa: F811
    reg_ = registry(ttl=5.0)
    reg = Registration(BootstrapClient(reg_.url), INFO, interval=0.1, ttl=5.0).start()
    try:
        assert reg.state == "registered"
        before = lost("expired")
        reg_.expire(INFO.spec.key, reg.owner)                           # the registry forgets it
        with caplog.at_level(logging.WARNING, "kvxfer.control.bootstrap"):
            assert until(lambda: lost("expired") == before + 1, 3)
            assert until(lambda: reg.state == "registered", 3)
        assert any("expired" in r.getMessage() for r in caplog.records)
        assert [r.spec.key for r in BootstrapClient(reg_.url).topology()[1]] == [INFO.spec.key]
    finally:
        reg.stop()


def test_a_taken_key_is_noticed(registry, caplog):  # noqa: F811
    reg_ = registry(ttl=5.0)
    reg = Registration(BootstrapClient(reg_.url), INFO, interval=0.1, ttl=5.0).start()
    thief = BootstrapClient(reg_.url)
    try:
        before = lost("taken")
        reg_.forget(INFO.spec.key, reg.owner)                         # the key lapses ...
        thief.register(INFO, "t" * 32)                                # ... and another owner takes it
        with caplog.at_level(logging.ERROR, "kvxfer.control.bootstrap"):
            assert until(lambda: reg.state == "taken", 3), reg.state
        assert lost("taken") == before + 1
        assert any("another owner" in r.getMessage() for r in caplog.records)
    finally:
        reg.stop(deregister=False)
        thief.deregister(INFO.spec.key, "t" * 32)
