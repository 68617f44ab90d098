"""UCX across test hosts with no UCX setting at all (issue 17: far-worker endpoints, error
handling on): bootstrap in host A, prefill in host B, decode TP 1 in host C, every rank a real
process (``tests/multihost_rank.py``). Two shapes: prefill TP 2 page-major -> decode token-major
(1 KiB head-slice runs: packed frames into receives decode posted) and prefill TP 1 page-major
-> decode page-major (128 KiB page runs: one-sided puts, which decode cannot cancel).

``kill -9`` of prefill rank 0 while 256 MiB are in flight (host B's egress shaped so they are):
decode's endpoint to it reports the failure (TCP reset), its requests fail on decode with a
reason within peer_timeout + slack, and, its connection being gone (writes impossible), every
decode slot is free again: none leaks waiting for a quarantine. The freed slots keep the canary
for seconds (no late write), and prefill rank 0 restarted (a new process on a new port) serves
the next request byte-exact without restarting decode. Without error handling (or without
``UCXFencing._check_failed``) decode keeps the slots forever: a killed peer over TCP is silent,
and silence is not death.
"""
from __future__ import annotations

import importlib.util
import time

import pytest
from hosts import hosts_fixture, hosts_skip_reason
from multihost_rank import RankProc, attempt, byte_exact, ended, submit

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason())),
              pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx does not import"),
              pytest.mark.timeout(600)]

three = hosts_fixture(3)
D_TP = 1
SHAPES = {"frames": (2, "token_major"), "puts": (1, "page_major")}   # prefill TP, decode layout
# 4 requests of 8192 tokens: 2 layers x K,V x 8 heads x 128 dims x bf16 = 8 KiB a token, 256 MiB.
POOL = dict(heads=8, layers=2, head_dim=128, page_size=16, num_pages=4 * 8192 // 16 + 64)
ROOMS, TOKENS = [11, 12, 13, 14], 8192
TIMEOUTS, HB = (30, 60, 10, 30), (0.5, 3.0)   # transfer: 10 s without progress; peer silent: 3 s
SLACK = 4.0
CANARY_WATCH = 5.0


def start(hosts, p_tp: int, d_layout: str) -> dict:
    c = {"boot": RankProc(hosts[0], "bootstrap", expect=p_tp), "prefill": [], "decode": [], "p_tp": p_tp}
    try:
        c["common"] = dict(bootstrap=c["boot"].url, transport="ucx", timeouts=list(TIMEOUTS), hb=list(HB), **POOL)
        c["prefill"] = [prefill(hosts, r, c) for r in range(p_tp)]
        c["decode"] = [RankProc(hosts[2], "decode", env={}, tp_rank=r, tp_size=D_TP, layout=d_layout,
                                **c["common"]) for r in range(D_TP)]
    except BaseException:
        stop(c)
        raise
    return c


def prefill(hosts, r: int, c: dict) -> RankProc:
    return RankProc(hosts[1], "prefill", env={}, tp_rank=r, tp_size=c["p_tp"], layout="page_major", seed=7,
                    **c["common"])


def stop(c: dict) -> None:
    for r in c.get("decode", []) + c.get("prefill", []) + [c["boot"]]:
        r.close()


def canary_intact(c: dict, keep: list[int]) -> None:
    for d in c["decode"]:
        res = d.call("canary", keep=keep, timeout=120)
        assert res["bad"] == 0, f"{res['bad']} decode bytes outside live grants changed (a late write): {res}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_killed_mid_transfer_over_ucx_without_settings(three, shape):
    c = start(three, *SHAPES[shape])
    report: dict = {}
    try:
        submit(c, 1, 64)                                  # the path works (and warms up) first
        for st in ended(c["decode"] + c["prefill"], [1], 60):
            assert st["1"]["state"] == "Success", st
        byte_exact(c, 1)
        free = [d.call("stats")["free_pages"] for d in c["decode"]]   # room 1 stays (decoding)
        three[1].tc("qdisc", "replace", "dev", "veth0", "root", "tbf", "rate", "800mbit", "burst", "256kb",
                    "latency", "100ms")
        for room in ROOMS:
            submit(c, room, TOKENS, chunks=4)
        time.sleep(1.0)
        report["before"] = c["decode"][0].call("poll", rooms=ROOMS)
        c["prefill"][0].proc.kill()                        # kill -9, mid-transfer
        t0 = time.monotonic()
        sts = ended(c["decode"], ROOMS, HB[1] + SLACK)
        report["decode_end_s"] = round(time.monotonic() - t0, 2)
        report["decode"] = sts
        for st in sts:
            failed = [r for r in ROOMS if st[str(r)]["state"] == "Failed"]
            assert failed, f"the kill came after the transfers: {report}"
            for r in ROOMS:
                assert st[str(r)]["state"] in ("Success", "Failed"), report
                assert st[str(r)]["state"] == "Success" or st[str(r)]["reason"], report
        ok = [r for r in ROOMS if all(st[str(r)]["state"] == "Success" for st in sts)]
        # Every failed request's slots come back (its sender's connection is gone: writes impossible).
        end = time.monotonic() + HB[1] + SLACK
        while True:
            stats = [d.call("stats") for d in c["decode"]]
            if all(s["free_pages"] == f - len(ok) * TOKENS // POOL["page_size"] for s, f in zip(stats, free)):
                break
            assert time.monotonic() < end, f"decode slots leaked: {stats} (free before: {free}) {report}"
            time.sleep(0.2)
        report["freed_s"] = round(time.monotonic() - t0, 2)
        for s in stats:
            assert all(s["releases"].get(str(r)) == 1 for r in ROOMS), s
        watch = time.monotonic() + CANARY_WATCH             # freed slots: nothing late lands in them
        while time.monotonic() < watch:
            canary_intact(c, [1, *ok])
            time.sleep(1.0)
        three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
        old = c["prefill"][0]
        c["prefill"][0] = prefill(three, 0, c)             # a new process, a new port
        assert c["prefill"][0].hello["info"] != old.hello["info"]
        end, room = time.monotonic() + 40, 20
        while True:                                        # decode finds and greets it by itself
            sts = attempt(c, room, 256, 20, chunks=2)
            if all(st[str(room)]["state"] == "Success" for st in sts):
                break
            assert time.monotonic() < end, sts
            room += 1
        report["next_room"] = room
        byte_exact(c, room)
        canary_intact(c, [1, *ok, room])
    finally:
        print(f"prefill kill -9 over UCX (no settings, {shape}):", report)
        three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
        stop(c)
