"""Killed senders give back what they pinned in the receiver, with ``UCX_TLS=tcp`` (issue 35).

A receiver (``xfer_peer``, its own process) takes a 64 MiB transfer of 1 KiB runs from a sender
in another process: staged frames of 4 MiB through its receive ring (8 slots), over TCP. The
sender is killed (``kill -9``) mid-transfer, ``ROUNDS`` times, a new sender each time. After each
kill, ``fencing()`` on the receiver (bytes held because a peer could still write them: the ring
slots its frames were being received into, and grant memory) is back to 0 within ``FREED_S``
and the ring has no slot in use; after the last, a new sender's 64 MiB transfer lands byte-exact.

Two places: two test hosts (network namespaces: another kernel's view of the peer, no pid to
check) and plain loopback (the same kernel: the peer's pid proves it dead). Before: across
namespaces the receiver could prove nothing (an explicit UCX_TLS kept UCX error handling off),
so the slots stayed held for good; 8 slots x 4 MiB (the whole ring) after a few kills, and every
later transfer waited for a slot until its deadline.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import time

import numpy as np
import pytest
from hosts import hosts_fixture
from xfer_peer import PeerProcess, enc, plan_to_json, raw_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx does not import")]

two = hosts_fixture(2)
ROUNDS = 4
FREED_S = 5.0            # fence_grace 1 s + the proof (a reset: ~0.1 s; a pid: a tick), with slack for a busy box
RUNS, RUN = 65536, 1024   # 64 MiB of 1 KiB runs: staged frames (pieces under STAGE_BELOW)
SRC, DST = 2 * RUNS * RUN, RUNS * RUN
OPTS = {"tls": "tcp", "heartbeat": 0.5, "peer_timeout": 3.0, "fence_grace": 1.0, "frame_bytes": 4 << 20,
        "staging_frames": 8}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}


def _plan():
    z = np.zeros(RUNS, np.int64)
    k = np.arange(RUNS, dtype=np.int64)
    return plan_to_json(raw_plan(z, k * 2 * RUN, z, k * RUN, np.full(RUNS, RUN, np.int64)))   # sources apart


def _sender(tmp, name: str, prefix: list[str] | None, rx_desc: dict, rx: PeerProcess,
            options: dict = OPTS) -> tuple[PeerProcess, str]:
    tx = PeerProcess(tmp / f"{name}.err", env=_env(), prefix=prefix)
    desc = tx.call("init", transport="ucx", sizes=[SRC], fill="seed", seed=9, options=options)["descriptor"]
    token = rx.call("admit", descriptor=desc)["token"]
    return tx, tx.call("connect", descriptor=rx_desc, token=token)["peer"]


def _held(rx: PeerProcess) -> tuple[int, int]:
    f = rx.call("fencing")
    return f["fencing"]["bytes"], f["staging"]["recv"]["in_use"]


def run_kills(tmp, rx_prefix, tx_prefix, shape=None) -> dict:
    """``shape(on)``: slow the sender's link while it sends (across hosts); without it (loopback)
    the sender is killed as soon as a frame is being received."""
    rx = PeerProcess(tmp / "rx.err", env=_env(), prefix=rx_prefix)
    report: dict = {"freed_s": [], "held_at_kill": []}
    try:
        rx_desc = rx.call("init", transport="ucx", sizes=[DST], fill="canary", options=OPTS)["descriptor"]
        z = np.zeros(1, np.int64)
        for r in range(ROUNDS):
            rid = f"k.{r}"
            rx.call("expect", request_id=rid, ranges={"region": enc(z), "start": enc(z), "nbytes": enc(z + DST)})
            tx, peer = _sender(tmp, f"tx{r}", tx_prefix, rx_desc, rx)
            if shape:
                shape(True)
            tx.call("submit", peer=peer, request_id=rid, plan=_plan(), timeout=60.0)
            end = time.monotonic() + 20.0
            while (held := _held(rx))[1] == 0:   # frames are being received into the ring
                assert time.monotonic() < end, "no frame reached the receive ring"
                time.sleep(0.002)
            if shape:
                time.sleep(0.3)
                held = _held(rx)
            tx.signal(signal.SIGKILL)
            tx.proc.wait(10)
            t0 = time.monotonic()
            rx.call("forget", request_id=rid)
            report["held_at_kill"].append(held)
            while _held(rx) != (0, 0):
                assert time.monotonic() - t0 < FREED_S, f"round {r}: held after {FREED_S}s: {rx.call('fencing')}"
                time.sleep(0.05)
            report["freed_s"].append(round(time.monotonic() - t0, 2))
            tx.close()
            if shape:
                shape(False)
        assert any(h[1] for h in report["held_at_kill"]), f"no kill came while frames were being received: {report}"
        rid = "k.last"
        rx.call("expect", request_id=rid, ranges={"region": enc(z), "start": enc(z), "nbytes": enc(z + DST)})
        tx, peer = _sender(tmp, "tx-last", tx_prefix, rx_desc, rx)
        try:
            tx.call("submit", peer=peer, request_id=rid, plan=_plan(), timeout=60.0)
            res = tx.call("wait", request_ids=[rid], wait_s=60.0)["results"][rid]
            assert res["status"] == "DONE", res
            assert rx.call("strided_matches", region=0, seed=9, runs=RUNS, run=RUN)["same"], "bytes differ"
        finally:
            tx.close()
        return report
    finally:
        print("kills:", report)
        rx.close()


def test_killed_senders_over_tcp_give_the_ring_back_across_hosts(two, tmp_path):
    ns = lambda h: ["ip", "netns", "exec", h.ns]  # noqa: E731

    def shape(on: bool) -> None:   # 200 Mbit/s out of the sender's host: the transfer is in flight when killed
        if on:
            two[1].tc("qdisc", "replace", "dev", "veth0", "root", "tbf", "rate", "200mbit", "burst", "256kb",
                      "latency", "100ms")
        else:
            two[1].tc("qdisc", "del", "dev", "veth0", "root", check=False)
    run_kills(tmp_path, ns(two[0]), ns(two[1]), shape)


def test_killed_senders_over_tcp_give_the_ring_back_on_loopback(tmp_path):
    run_kills(tmp_path, None, None)   # the receiver's own kernel: the pid proves the sender dead

