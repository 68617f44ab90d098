"""Recovery across test hosts (issue 17): bootstrap in host A, prefill TP 2 page-major in host B,
decode TP 1 token-major in host C (pulling from both), every rank a real process (``tests/multihost_rank.py``).

- ``kill -9`` of prefill rank 0 with requests in flight: they fail on every decode rank within
  the heartbeat timeout plus slack, no decode slot leaks, a new request fails within one new
  handshake naming the lost rank; prefill rank 0 restarted (a new process on a new port) serves the
  first request after it, byte-exact, without restarting any decode rank.
- the bootstrap killed and restarted on its port: the prefill ranks register again, requests
  keep working throughout.
"""
from __future__ import annotations

import time

import pytest
from hosts import hosts_fixture, hosts_skip_reason
from multihost_rank import RankProc, attempt, byte_exact, ended, submit

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason())),
              pytest.mark.timeout(600)]

three = hosts_fixture(3)
P_TP, D_TP = 2, 1               # the decode rank pulls from both prefill ranks
POOL = dict(heads=8, layers=2, head_dim=64, page_size=16, num_pages=64)
HB = (0.5, 2.0)
SLACK = 3.0
BOOT_PORT = 8997


def start(hosts, boot_port: int = 0) -> dict:
    c = {"boot": RankProc(hosts[0], "bootstrap", expect=P_TP, port=boot_port), "prefill": [], "decode": []}
    try:
        common = dict(bootstrap=c["boot"].url, transport="zmq", timeouts=[30, 60, 10, 30], hb=list(HB), **POOL)
        c["common"] = common
        c["prefill"] = [prefill(hosts, r, common) for r in range(P_TP)]
        c["decode"] = [RankProc(hosts[2], "decode", tp_rank=r, tp_size=D_TP, layout="token_major", **common)
                       for r in range(D_TP)]
    except BaseException:
        stop(c)
        raise
    return c


def prefill(hosts, r: int, common: dict) -> RankProc:
    return RankProc(hosts[1], "prefill", tp_rank=r, tp_size=P_TP, layout="page_major", seed=7, **common)


def stop(c: dict) -> None:
    for r in c["decode"] + c["prefill"] + [c["boot"]]:
        r.close()


def ok(c: dict, room: int) -> None:
    submit(c, room, 40)
    for st in ended(c["decode"] + c["prefill"], [room], 60):
        assert st[str(room)]["state"] == "Success", st
    byte_exact(c, room)


def test_prefill_killed_then_restarted_on_a_new_port(three):
    c = start(three)
    try:
        ok(c, 1)
        free = [d.call("stats")["free_pages"] for d in c["decode"]]   # room 1's slots stay (decoding)
        submit(c, 2, 40, send=False)                          # every side bound, waiting for input
        for st in ended(c["decode"], [2], 0.5):
            assert st["2"]["state"] == "WaitingForInput", st
        c["prefill"][0].proc.kill()                        # kill -9
        t0 = time.monotonic()
        for st in ended(c["decode"], [2], HB[1] + SLACK):
            assert st["2"]["state"] == "Failed" and "silent" in st["2"]["reason"], st
        assert time.monotonic() - t0 <= HB[1] + SLACK + 1
        for d, f in zip(c["decode"], free):                # no decode slot leaked
            s = d.call("stats")
            assert s["free_pages"] == f and s["releases"].get("2") == 1, s
        t1 = time.monotonic()
        for d in c["decode"]:       # a new request waits for one new handshake, which fails: the reason
            d.call("receiver", room=3, tokens=40)
        for st in ended(c["decode"], [3], 4.0):
            assert st["3"]["state"] == "Failed" and "tp0 is lost" in st["3"]["reason"], st
        assert time.monotonic() - t1 < 5.0
        old = c["prefill"][0]
        c["prefill"][0] = prefill(three, 0, c["common"])   # a new process, a new port
        assert c["prefill"][0].hello["info"] != old.hello["info"]
        # the first request after the restart succeeds: decode handshakes with the new rank first
        sts = attempt(c, 10, 40, 20)
        assert all(st["10"]["state"] == "Success" for st in sts), sts
        byte_exact(c, 10)
        ok(c, 11)
    finally:
        stop(c)


def test_bootstrap_restarted_ranks_register_again(three):
    c = start(three, BOOT_PORT)
    try:
        ok(c, 1)
        c["boot"].proc.kill()
        ok(c, 2)                                           # no registry: requests go on
        c["boot"] = RankProc(three[0], "bootstrap", expect=P_TP, port=BOOT_PORT)
        time.sleep(3.0)                                    # prefill heartbeats register them again
        ok(c, 3)
        # a fresh decode rank finds both prefill ranks in the new registry (it connects at start; a rank not live yet)
        RankProc(three[2], "decode", tp_rank=1, tp_size=2, layout="token_major", **c["common"]).close()
    finally:
        stop(c)
