"""A partition long enough for the kernel to give up on the TCP connections, over UCX across test
hosts: bootstrap in host A, prefill TP 1 page-major in host B, decode TP 1 token-major in host C,
UCX with no setting (eager writes). ``net.ipv4.tcp_rto_max_ms`` is lowered inside the three
hosts (Linux >= 6.15; per network namespace) so that retransmissions to the cut host run out
within seconds instead of ~15 minutes; the kernel then ends the connections, and UCX reports
that to both sides as a connection *reset*, exactly as when the peer's process is killed.
Measured before the fixes this test holds:
- the prefill rank died of SIGSEGV: it had disconnected the silent decode rank, and the
  disconnect's flush ran on the endpoint handle that ucxx had closed on the failure (NULL);
- decode took the reset for proof that prefill's writes had stopped and gave back the memory
  prefill had been pregranted, while the cut link would bring prefill's own connection back.
Now: prefill lives; decode keeps that memory fenced until prefill handshakes again after the
heal; the first request after the heal lands byte-exact, the fenced memory comes back, and no
byte outside live grants changed.
"""
from __future__ import annotations

import importlib.util
import time

import pytest
from hosts import hosts_fixture, hosts_skip_reason
from multihost_rank import byte_exact, ended, submit
from test_multihost import stop_cluster
from test_multihost_heal import BIG, BIG_ROOMS, FIRST, SMALL, cluster, pinned

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason())),
              pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx does not import"),
              pytest.mark.timeout(600)]

three = hosts_fixture(3)
RTO_MAX_MS = 1000
GIVE_UP = 90.0   # s of cut within which the kernels end the connections (measured ~20 s at 1000 ms)


def test_a_reset_after_a_long_partition_neither_crashes_nor_frees_what_the_peer_may_write(three):
    for h in three:
        r = h.run(["sysctl", "-w", f"net.ipv4.tcp_rto_max_ms={RTO_MAX_MS}"])
        if r.returncode:
            pytest.skip(f"this kernel has no net.ipv4.tcp_rto_max_ms (Linux >= 6.15): {r.stderr.strip()}")
    c = cluster(three, "ucx")
    report: dict = {}
    try:
        submit(c, 1, SMALL)
        assert all(st["1"]["state"] == "Success" for st in ended(c["decode"] + c["prefill"], [1], 60))
        byte_exact(c, 1)
        three[1].tc("qdisc", "replace", "dev", "veth0", "root", "tbf", "rate", "400mbit", "burst", "256kb",
                    "latency", "100ms")
        for room in BIG_ROOMS:   # in flight when the link goes: the connections have data to retransmit
            submit(c, room, BIG, chunks=4)
        time.sleep(1.0)
        decode, prefill = c["decode"][0], c["prefill"][0]
        three[2].link_down()
        cut = time.monotonic()
        try:
            while time.monotonic() - cut < GIVE_UP and prefill.proc.poll() is None:
                if decode.call("fencing").get("released"):   # decode handled its endpoint's failure
                    break
                time.sleep(0.5)
            report["given_up_s"] = round(time.monotonic() - cut, 1)
            assert prefill.proc.poll() is None, f"prefill died (code {prefill.proc.poll()}) when its kernel " \
                                                f"gave up on the connection: {report}"
            assert decode.call("fencing").get("released"), f"no connection failed within {GIVE_UP}s: {report}"
            time.sleep(2.0)   # past fence_grace: a reset taken for proof would have freed it by now
            report["held_in_cut"] = pinned(decode)
            assert report["held_in_cut"], f"decode gave back what the partitioned prefill may still write: {report}"
        finally:
            three[2].link_up()
        healed = time.monotonic()
        three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
        submit(c, FIRST, SMALL)
        sts = ended(c["decode"] + c["prefill"], [FIRST], 30)
        assert all(st[str(FIRST)]["state"] == "Success" for st in sts), (sts, report)
        byte_exact(c, FIRST)
        while any(pinned(r) for r in c["decode"] + c["prefill"]) and time.monotonic() - healed < 30:
            time.sleep(0.2)
        report["freed_after_heal_s"] = round(time.monotonic() - healed, 1)
        assert not any(pinned(r) for r in c["decode"] + c["prefill"]), report
        states = ended(c["decode"], BIG_ROOMS, 5)[0]
        keep = [1, FIRST] + [room for room in BIG_ROOMS if states[str(room)]["state"] == "Success"]
        res = decode.call("canary", keep=keep, timeout=120)
        assert res["bad"] == 0, f"{res['bad']} decode bytes outside live grants changed: {res}"
    finally:
        print("kernel gave up on the cut connections:", report)
        three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
        stop_cluster(c)
