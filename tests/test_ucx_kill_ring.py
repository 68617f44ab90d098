"""Killed senders give back what they pinned in the receiver, with ``UCX_TLS=tcp`` (issue 35).

A receiver (``xfer_peer``, its own process) takes a 64 MiB transfer of 1 KiB runs, apart on both
sides, from a sender in another process: staged frames of 4 MiB through its receive ring (8 slots:
its pieces are small, ``Receiver.rings_host``), over TCP. The sender is killed (``kill -9``)
mid-transfer, ``ROUNDS`` times, a new sender each time. After each kill, ``fencing()`` on the
receiver (bytes held because a peer could still write them: the ring slots its frames were being
received into, and grant memory) is back to 0 within ``FREED_S`` and the ring has no slot in
use; after the last, a new sender's 64 MiB transfer lands byte-exact.

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
SRC = DST = 2 * RUNS * RUN   # every other run on both sides: the receiver's pieces are small too
OPTS = {"tls": "tcp", "heartbeat": 0.5, "peer_timeout": 3.0, "fence_grace": 1.0, "frame_bytes": 4 << 20,
        "staging_frames": 8}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}


def _plan():
    z = np.zeros(RUNS, np.int64)
    k = np.arange(RUNS, dtype=np.int64)
    return plan_to_json(raw_plan(z, k * 2 * RUN, z, k * 2 * RUN, np.full(RUNS, RUN, np.int64)))   # apart


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
            assert rx.call("strided_matches", region=0, seed=9, runs=RUNS, run=RUN, apart=True)["same"], \
                "bytes differ"
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


def test_a_silent_sender_keeps_only_its_own_share_of_the_ring(tmp_path):
    """An admitted peer (``hostile_ucx_wire``, alive but silent: it stops progressing with its 4
    frames' rendezvous started) holds every slot of a 4-slot receive ring when its request is
    forgotten: it cannot be proven dead, so those slots stay held. Another sender's transfer
    through the ring still lands byte-exact (spill frames stand in for the held slots); before,
    it waited for a slot until its deadline. Once the silent peer is killed, its pid proves it
    dead and nothing stays held."""
    import base64

    import hostile_ucx_wire as hw
    opts = {**OPTS, "frame_bytes": 1 << 20, "staging_frames": 4}
    rx = PeerProcess(tmp_path / "rx.err", env=_env())
    att = PeerProcess(tmp_path / "stuck.err", script=hw.__file__, env=_env())
    tx = None
    try:
        rx_desc = rx.call("init", transport="ucx", sizes=[DST], fill="canary", options=opts)["descriptor"]
        # its frames go by rendezvous, whose data needs its progress: posted, then it goes silent
        att.call("init", config={"TLS": "tcp", "RNDV_THRESH": "1024"})
        token = rx.call("admit", descriptor={"id": "stuck"})["token"]
        ch = att.call("join", front=rx_desc["address"], sender="stuck", token=token, identity=True)
        assert ch["joined"]
        n = np.full(1024, 4 << 10, np.int64)   # 4 MiB of 4 KiB runs: 4 frames of 1 MiB, through the ring
        off = (DST - (4 << 20)) + np.arange(1024, dtype=np.int64) * (4 << 10)
        rx.call("expect", request_id="pin.1", ranges={"region": enc(np.zeros(1, np.int64)), "start": enc(off[:1]),
                                                      "nbytes": enc(np.full(1, 4 << 20, np.int64))})
        runs = hw.runs_field(*[(0, int(o), int(c)) for o, c in zip(off, n)])
        msg = hw.announce(7, "pin.1", runs, 0, frame=1 << 20) + [1]   # staged frames (11th field)
        secret = base64.b64decode(ch["secret"])
        att.call("send", ep=ch["ep"], tag=hw.CTRL_TAG | ch["tag"],
                 data=base64.b64encode(hw.batch("stuck", secret, [msg])).decode())
        go, end = None, time.monotonic() + 20.0   # other control batches may come first on a loaded machine
        while go is None and time.monotonic() < end:
            go = next((m for b in att.call("recv", wait_s=1.0)["batches"] if b for m in b[-1] if m and m[0] == hw.GO),
                      None)
        assert go is not None, "no GO for the staged ANNOUNCE"
        att.call("post", ep=ch["ep"], tag=hw.DATA_BIT | go[2] << hw.FRAME_BITS, count=4, size=1 << 20, turns=0)
        end = time.monotonic() + 5.0
        while _held(rx)[1] < 4:
            assert time.monotonic() < end, f"the silent peer's frames did not take the ring: {rx.call('fencing')}"
            time.sleep(0.05)
        rx.call("forget", request_id="pin.1")
        time.sleep(1.5)   # its pid is alive: nothing proves its writes impossible
        f = rx.call("fencing")
        assert f["fencing"]["bytes"] == 4 << 20 and f["staging"]["recv"]["in_use"] == 4, f   # the whole ring
        z = np.zeros(1, np.int64)
        rx.call("expect", request_id="after.1", ranges={"region": enc(z), "start": enc(z), "nbytes": enc(z + DST // 2)})
        tx, peer = _sender(tmp_path, "tx", None, rx_desc, rx, opts)
        small = RUNS // 4   # 16 MiB of 1 KiB runs
        k = np.arange(small, dtype=np.int64)
        zs = np.zeros(small, np.int64)
        tx.call("submit", peer=peer, request_id="after.1",
                plan=plan_to_json(raw_plan(zs, k * 2 * RUN, zs, k * 2 * RUN, np.full(small, RUN, np.int64))),
                timeout=20.0)
        res = tx.call("wait", request_ids=["after.1"], wait_s=30.0)["results"]["after.1"]
        assert res["status"] == "DONE", f"a transfer behind a silent peer's held slots failed: {res}"
        assert rx.call("strided_matches", region=0, seed=9, runs=small, run=RUN, apart=True)["same"]
        att.signal(signal.SIGKILL)
        att.proc.wait(10)
        end = time.monotonic() + FREED_S
        while (g := rx.call("fencing"))["fencing"]["bytes"] or g["staging"]["recv"]["held"] or \
                g["staging"]["recv"]["spill"] or g["staging"]["recv"]["in_use"]:
            assert time.monotonic() < end, g
            time.sleep(0.1)
        print("spill:", f["staging"]["recv"], "->", g["staging"]["recv"])
    finally:
        for p in (tx, att, rx):
            if p is not None:
                p.close()
