"""Eight ``kill -9``s of a prefill rank across test hosts, each restarted, in each UCX mode
(issue 35): no setting (eager writes, the default), ``UCX_TLS=tcp``, announced
(``eager_writes=False``). Bootstrap in host A, prefill TP 1 page-major in host B, decode TP 1
token-major in host C (head-slice runs: packed frames, staged through decode's receive ring
across hosts), every rank a real process (``multihost_rank.py``).

Each round: a 16 MiB request in flight (host B's egress shaped so it is), prefill killed, then
- decode's request ends with a reason, and everything the dead peer pinned comes back within
  ``BOUND`` s: ``fencing()`` all zero (receive-ring frames, posted receives, held requests) and
  every decode page free again. Before the fix, with ``UCX_TLS=tcp`` each kill pinned ring
  frames for good until the whole ring was gone and every request failed at its deadline;
- prefill restarted (a new process, a new port): the *first* request after it succeeds,
  byte-exact (decode re-handshakes with the newer registration instead of failing the request).
After the last round, a 64 MiB request moves byte-exact and no byte outside live grants changed.
"""
from __future__ import annotations

import importlib.util
import time

import pytest
from hosts import UCX_ENV, hosts_fixture, hosts_skip_reason
from multihost_rank import RankProc, byte_exact, ended, submit

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.skipif(bool(hosts_skip_reason()), reason=str(hosts_skip_reason())),
              pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx does not import"),
              pytest.mark.timeout(900)]

three = hosts_fixture(3)
MODES = {"default": ({}, -1), "tcp": (UCX_ENV, -1), "announced": ({}, 0)}   # env, eager_writes (-1: default)
KILLS = 8
# 2 layers x K,V x 8 heads x 128 dims x bf16 = 8 KiB a token: 2048 tokens 16 MiB, 8192 tokens 64 MiB.
IN_FLIGHT, SMALL, BIG = 2048, 256, 8192
POOL = dict(heads=8, layers=2, head_dim=128, page_size=16)
PAGES = {"prefill": (BIG + IN_FLIGHT) // 16 + 8,                       # prefill frees each request's slots
         "decode": (BIG + (KILLS + 1) * (IN_FLIGHT + SMALL)) // 16 + 8}  # decode keeps what landed
TIMEOUTS, HB = (30, 60, 10, 30), (0.5, 3.0)   # transfer: 10 s without progress; peer silent: 3 s
BOUND = HB[1] + 4.0     # s from the kill until decode holds nothing for the dead peer
# what ``fencing()`` says is pinned (the rest are counters: ``released``, ``expired``)
PINNED = ("requests", "bytes", "transfers", "sources", "source_bytes", "fenced_peers", "eager_fences")


def pinned(d: RankProc) -> dict:
    f = d.call("fencing")
    return {k: f[k] for k in PINNED if f.get(k)}


def rank(hosts, role: str, mode: str, boot_url: str, **flags) -> RankProc:
    env, eager = MODES[mode]
    return RankProc(hosts[1 if role == "prefill" else 2], role, env=dict(env), bootstrap=boot_url, transport="ucx",
                    timeouts=list(TIMEOUTS), hb=list(HB), ucx_eager=eager, tp_rank=0, tp_size=1, **POOL,
                    num_pages=PAGES[role], **flags)


def fencing_clear(d: RankProc, free: int, since: float) -> float:
    """Seconds from ``since`` until decode pins nothing and has ``free`` pages free again."""
    while True:
        f, s = pinned(d), d.call("stats")
        if not f and s["free_pages"] == free:
            return time.monotonic() - since
        assert time.monotonic() - since < BOUND, f"decode still pins {f} ({s['free_pages']} of {free} pages free)"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", list(MODES))
def test_eight_prefill_kills_give_everything_back_and_the_first_request_after_each_restart_lands(three, mode):
    boot = RankProc(three[0], "bootstrap", expect=1)
    c: dict = {"prefill": [], "decode": []}
    report: dict = {"freed_s": [], "ended": []}
    try:
        c["prefill"] = [rank(three, "prefill", mode, boot.url, layout="page_major", seed=7)]
        c["decode"] = [rank(three, "decode", mode, boot.url, layout="token_major")]
        d = c["decode"][0]
        submit(c, 1, SMALL)                                    # the path works (and warms up) first
        for st in ended(c["decode"] + c["prefill"], [1], 60):
            assert st["1"]["state"] == "Success", st
        byte_exact(c, 1)
        free = d.call("stats")["free_pages"]                   # room 1 stays (decoding)
        live, room = [1], 100                                  # rooms whose KV decode keeps
        for kill in range(KILLS):
            three[1].tc("qdisc", "replace", "dev", "veth0", "root", "tbf", "rate", "200mbit", "burst", "256kb",
                        "latency", "100ms")
            submit(c, room, IN_FLIGHT, chunks=4)
            time.sleep(0.3)
            c["prefill"][0].proc.kill()                        # kill -9, mid-transfer
            t0 = time.monotonic()
            st = ended(c["decode"], [room], BOUND)[0][str(room)]
            assert st["state"] in ("Success", "Failed") and (st["state"] == "Success" or st["reason"]), st
            report["ended"].append(st["state"])
            expect_free = free - (IN_FLIGHT // POOL["page_size"] if st["state"] == "Success" else 0)
            report["freed_s"].append(round(fencing_clear(d, expect_free, t0), 2))
            if st["state"] == "Success":                       # it landed before the kill: decode keeps it
                free = expect_free
                live.append(room)
            three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
            c["prefill"][0].close()
            c["prefill"][0] = rank(three, "prefill", mode, boot.url, layout="page_major", seed=7)
            room += 1
            submit(c, room, SMALL)                             # the first request after the restart
            sts = ended(c["decode"] + c["prefill"], [room], 30)
            assert all(s[str(room)]["state"] == "Success" for s in sts), (kill, sts, report)
            byte_exact(c, room)
            free -= SMALL // POOL["page_size"]
            live.append(room)
            room += 1
        submit(c, room, BIG, chunks=4)                          # 64 MiB after the last restart
        for st in ended(c["decode"] + c["prefill"], [room], 120):
            assert st[str(room)]["state"] == "Success", st
        byte_exact(c, room)
        res = d.call("canary", keep=live + [room], timeout=120)
        assert res["bad"] == 0, f"{res['bad']} decode bytes outside live grants changed (a late write): {res}"
        assert not pinned(d)
    finally:
        print(f"UCX ({mode}): {KILLS} prefill kills:", report)
        three[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
        for r in c["decode"] + c["prefill"] + [boot]:
            r.close()
