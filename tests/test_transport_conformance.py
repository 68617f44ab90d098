"""Conformance suite: every registered transport against the Transport contract, and only it.

Network transports run sender and receiver as two processes (``tests/xfer_peer.py``) talking
over 127.0.0.1; in-process transports ("local") run both ends in this process. A transport
whose optional dependency is missing (ucxx) is skipped; one that is broken fails.

Every transfer test fills the receiver's regions with a canary byte, moves seeded source
bytes, and compares each destination region whole (sha256) with the image the reference
executor (``kvxfer.plan.execute_plan``) makes from the same seed onto the same canary, so a
byte written outside a run, or a run written wrong, fails the test.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import os
import signal
import threading
import time
from functools import lru_cache
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from support.deps import need, pregrants
from waiting import until
from xfer_peer import (
    CANARY,
    InProcessPeer,
    PeerProcess,
    make_pattern,
    plan_to_json,
    ranges_to_json,
    raw_plan,
    region_seed,
)

from kvxfer.copy import execute_plan
from kvxfer.grant import ByteRanges
from kvxfer.layout import page_major_layout, token_major_layout
from kvxfer.plan import EMPTY_PLAN, Planner, TransferPlan, plan_transfer
from kvxfer.transport.registry import ENTRY_POINT_GROUP, available_transports, get_transport

IN_PROCESS = {"local", "faulty"}   # faulty wraps "local" by default: both ends in one process
KiB, MiB = 1 << 10, 1 << 20
SMALL, BIG = 4 * MiB, 256 * MiB + 64 * KiB
SIZES = [SMALL] * 4 + [BIG]          # regions 0-3 small, region 4 holds the 256 MiB case
SEED = 7
NAMES = available_transports()
NETWORK = [n for n in NAMES if n not in IN_PROCESS]


def _importable(name: str) -> None:
    """Skip only when the transport's optional dependency is missing; a transport that is broken at
    import fails here, loudly."""
    need(name)
    {e.name: e for e in entry_points(group=ENTRY_POINT_GROUP)}[name].load()


@lru_cache(maxsize=8)
def source(region: int, nbytes: int) -> torch.Tensor:
    """The sender's region ``region`` as xfer_peer fills it (cached; never written)."""
    return torch.from_numpy(make_pattern(region_seed(SEED, region), nbytes))


@lru_cache(maxsize=4)
def canary_digest(nbytes: int) -> str:
    return hashlib.sha256(np.full(nbytes, CANARY, np.uint8)).hexdigest()


class Pair:
    """A sender and a receiver of one transport, connected with the receiver's token; the receiver all canary."""

    def __init__(self, name: str, sizes: list[int], tmp, sender_fill="seed", options=None):
        cls = InProcessPeer if name in IN_PROCESS else PeerProcess
        self.name, self.sizes, self.ids = name, sizes, itertools.count()
        self.tx, self.rx = cls(tmp / "sender.log"), cls(tmp / "receiver.log")
        try:
            init = [dict(transport=name, sizes=sizes, fill=sender_fill, seed=SEED, options=options),
                    dict(transport=name, sizes=sizes, fill="canary", options=options)]
            if cls is PeerProcess:   # start both before waiting: interpreter start-up dominates
                for p, kw in zip((self.tx, self.rx), init):
                    p.send("init", **kw)
                tx_desc = self.tx.reply(120, "init")["descriptor"]
                desc = self.rx.reply(120, "init")["descriptor"]
            else:
                tx_desc = self.tx.call("init", **init[0])["descriptor"]
                desc = self.rx.call("init", **init[1])["descriptor"]
            self.rx_descriptor = desc
            token = self.rx.call("admit", descriptor=tx_desc)["token"]
            self.peer = self.tx.call("connect", descriptor=desc, token=token)["peer"]
        except BaseException:
            self.close()
            raise

    def rid(self, tag: str) -> str:
        return f"{tag}-{next(self.ids)}"

    def reset(self, regions) -> None:
        self.rx.call("fill", regions=list(regions), fill="canary")

    def expect(self, rid: str, region, start, nbytes) -> None:
        self.rx.call("expect", request_id=rid, ranges=ranges_to_json(region, start, nbytes))

    def submit(self, rid: str, plan: TransferPlan, timeout: float = 60.0, notify: bytes = b"") -> None:
        self.tx.call("submit", peer=self.peer, request_id=rid, plan=plan_to_json(plan), timeout=timeout,
                     notify=base64.b64encode(notify).decode())

    def wait(self, rids: list[str], timeout: float = 120.0) -> dict:
        return self.tx.call("wait", wait_s=timeout, request_ids=rids)["results"]

    def arrivals(self, count: int, timeout: float = 60.0) -> list[dict]:
        return self.rx.call("arrivals", wait_s=timeout, count=count)["arrivals"]

    def rejected(self) -> int:
        return sum(self.rx.call("rejected")["rejected"].values())

    def transfer(self, plan: TransferPlan, grant=None, tag: str = "t") -> str:
        """Grant (default: exactly the plan's destination runs), send, and check both ends."""
        rid = self.rid(tag)
        r = plan.runs()
        self.expect(rid, *(grant if grant is not None else (r.dst_region, r.dst_offset, r.nbytes)))
        self.submit(rid, plan)
        res = self.wait([rid])[rid]
        assert res["status"] == "DONE", res
        (arr,) = self.arrivals(1)
        assert (arr["request_id"], arr["ok"], arr["nbytes"]) == (rid, True, plan.nbytes), arr
        assert self.rx.call("forget", request_id=rid)["live"]
        return rid

    def check_images(self, plan: TransferPlan, regions=range(4)) -> None:
        """Every listed receiver region equals canary + the plan applied (reference executor)."""
        touched = set(plan.runs().dst_region.tolist())
        dst = [torch.full((s,), CANARY, dtype=torch.uint8) if i in touched else torch.empty(0, dtype=torch.uint8)
               for i, s in enumerate(self.sizes)]
        execute_plan(plan, [source(i, s) for i, s in enumerate(self.sizes)], dst)
        want = {i: hashlib.sha256(dst[i].numpy()).hexdigest() if i in touched else canary_digest(self.sizes[i])
                for i in sorted(set(regions) | touched)}
        got = self.rx.call("digest", regions=sorted(want))["digests"]
        bad = [i for i in want if got[str(i)] != want[i]]
        assert not bad, f"{self.name}: receiver regions {bad} differ from the expected image"

    def close(self) -> None:
        for p in (getattr(self, "tx", None), getattr(self, "rx", None)):
            if p is not None:
                p.close()


@pytest.fixture(scope="module", params=[pytest.param(n, marks=() if n in IN_PROCESS else pytest.mark.slow)
                                        for n in NAMES])   # a network pair is two processes: the full tier
def pair(request, tmp_path_factory):
    _importable(request.param)
    p = Pair(request.param, SIZES, tmp_path_factory.mktemp(request.param))
    yield p
    p.close()


@pytest.fixture(scope="module", params=[(n, few) for n in NETWORK for few in (0, 1 << 20)],
                ids=lambda p: f"{p[0]}-few_runs={p[1]}")
def forced(request, tmp_path_factory):
    """A pair whose transports take one run path only: ``few_runs`` 0 (every plan and message
    as arrays) or 2**20 (every one as Python ints), whatever its size; zmq's requires admission."""
    name, few = request.param
    _importable(name)
    options = {"few_runs": few, **({"admission": "required"} if name == "zmq" else {})}
    p = Pair(name, [SMALL] * 4, tmp_path_factory.mktemp(f"{name}-{few}"), options=options)
    yield p
    p.close()


@pytest.mark.slow   # seconds
def test_both_run_paths(forced):
    """The transfers that reach the few-runs and the array paths, each forced down the other."""
    pair, rng = forced, np.random.default_rng(11)
    pair.reset(range(4))
    pair.transfer(raw_plan([0], [1001], [1], [77], [2]), tag="two-bytes")
    pair.check_images(raw_plan([0], [1001], [1], [77], [2]))
    for k, lo, hi, cell in ((5, 1, 64 * KiB, 64 * KiB), (300, 1, 4 * KiB, 4 * KiB),
                            (12, 200 * KiB, 600 * KiB, 1 * MiB)):   # (runs, shortest, longest, cell)
        cells = rng.choice(4 * SMALL // cell, k, replace=False)   # one run per disjoint destination cell
        n = rng.integers(lo, hi + 1, k)
        dr, do = cells // (SMALL // cell), (cells % (SMALL // cell)) * cell
        sr, so = rng.integers(0, 4, k), rng.integers(0, SMALL - n + 1)
        plan = raw_plan(sr, so, dr, do, n)
        pair.reset(range(4))
        pair.transfer(plan, tag=f"runs-{k}")
        pair.check_images(plan)
    rid = pair.rid("refused")
    pair.reset(range(4))
    pair.expect(rid, [1], [0], [100])
    pair.submit(rid, raw_plan([0], [0], [1], [50], [100]), timeout=20)
    assert pair.wait([rid])[rid]["status"] == "FAILED"
    (a,) = pair.arrivals(1, timeout=15.0)
    assert a["request_id"] == rid and not a["ok"], a
    pair.check_images(EMPTY_PLAN)
    pair.rx.call("forget", request_id=rid)
    rid = pair.rid("empty")
    pair.expect(rid, [0], [0], [16])
    pair.submit(rid, EMPTY_PLAN)
    assert pair.wait([rid])[rid]["status"] == "DONE"
    assert [(a["request_id"], a["ok"]) for a in pair.arrivals(1)] == [(rid, True)]
    pair.rx.call("forget", request_id=rid)


# -- transfers --------------------------------------------------------------------------
def test_single_two_byte_run(pair):
    pair.reset(range(4))
    plan = raw_plan([0], [1001], [1], [77], [2])
    pair.transfer(plan, tag="two-bytes")
    pair.check_images(plan)


@pytest.mark.parametrize("nbytes", [4097, 3 * MiB + 5, 256 * MiB])
def test_one_run_sizes(pair, nbytes):
    region = 4 if nbytes > SMALL - 64 else 2
    pair.reset([0, 1, 2, 3, 4] if region == 4 else range(4))
    plan = raw_plan([region], [3], [region], [BIG - nbytes - 1 if region == 4 else 11], [nbytes])
    pair.transfer(plan, tag=f"size{nbytes}")
    pair.check_images(plan, regions=[0, 1, 2, 3, region])


def _slot_grant(layout, slots):
    """The receiver's grant for ``slots`` as arrays, built as ByteRanges.of_slots builds it."""
    r = Planner(layout, layout, pack_below=0).plan(slots, slots).runs()
    assert ByteRanges.of_slots(layout, slots).covers(r.dst_region, r.dst_offset, r.nbytes).all()
    return r.dst_region, r.dst_offset, r.nbytes


def test_planned_token_major(pair):
    """Per-token runs of a token-major pool (packed groups), granted by slots."""
    layout = token_major_layout(layers=2, heads=4, head_dim=64, dtype="float16", num_slots=8192, page_size=16)
    assert [r.nbytes for r in layout.regions] == [SMALL] * 4
    rng = np.random.default_rng(1)
    free = np.setdiff1d(np.arange(16, 8192), np.arange(1000, 1100))   # destination slots stay distinct
    src, dst = rng.choice(np.arange(16, 8192), 700), rng.choice(free, 700, replace=False)
    dst[100:200] = np.arange(1000, 1100)   # a stretch of consecutive slots merges into longer runs
    src[100:200] = np.arange(3000, 3100)
    plan = plan_transfer(layout, src, layout, dst)
    assert plan.num_packed_runs > 0
    pair.reset(range(4))
    pair.transfer(plan, grant=_slot_grant(layout, dst), tag="token-major")
    pair.check_images(plan)


def test_planned_page_major(pair):
    """Whole 128 KiB pages of a page-major pool (big runs) plus a partial page."""
    layout = page_major_layout(layers=2, heads=4, head_dim=64, dtype="float16", num_pages=32, page_size=64)
    rng = np.random.default_rng(2)
    sp, dp = (rng.choice(np.arange(1, 32), 9, replace=False) for _ in range(2))
    src = np.concatenate([p * 64 + np.arange(64) for p in sp[:8]] + [sp[8] * 64 + np.arange(5)])
    dst = np.concatenate([p * 64 + np.arange(64) for p in dp[:8]] + [dp[8] * 64 + np.arange(5)])
    plan = plan_transfer(layout, src, layout, dst)
    assert plan.runs().nbytes.max() >= 128 * KiB
    pair.reset(range(4))
    pair.transfer(plan, grant=_slot_grant(layout, dst), tag="page-major")
    pair.check_images(plan)


def test_ten_thousand_scattered_runs(pair):
    """10,000 runs of 1..1024 bytes at random places, in one request; the grant is exactly them."""
    rng = np.random.default_rng(3)
    n = rng.integers(1, 1025, 10_000)
    cells = rng.choice(4 * SMALL // 1024, 10_000, replace=False)          # disjoint 1 KiB destination cells
    dr, do = cells // (SMALL // 1024), (cells % (SMALL // 1024)) * 1024 + rng.integers(0, 1025 - n)
    sr = rng.integers(0, 4, 10_000)
    so = rng.integers(0, SMALL - n + 1)
    order = rng.permutation(10_000)
    plan = raw_plan(sr[order], so[order], dr[order], do[order], n[order])
    assert plan.num_runs == 10_000
    pair.reset(range(4))
    pair.transfer(plan, tag="scattered")
    pair.check_images(plan)


def test_64_concurrent_requests(pair):
    """64 requests in flight on one connection, each with its own grant and notify bytes."""
    rng = np.random.default_rng(4)
    plans, rids = [], []
    pair.reset(range(4))
    for i in range(64):
        region, base = i % 4, (i // 4) * 256 * KiB           # disjoint 256 KiB areas
        k = 1 + i % 4
        n = rng.integers(1, 60 * KiB, k) if i % 8 else np.array([200 * KiB + i])
        do = base + np.concatenate(([0], np.cumsum(n)[:-1])) + rng.integers(0, 64)
        sr = rng.integers(0, 4, len(n))
        plans.append(raw_plan(sr, rng.integers(0, SMALL - n + 1), np.full(len(n), region), do, n))
        rids.append(pair.rid("concurrent"))
        pair.expect(rids[-1], np.full(len(n), region), do, n)
    for i, (rid, plan) in enumerate(zip(rids, plans)):
        pair.submit(rid, plan, notify=f"notify-{i}".encode())
    res = pair.wait(rids)
    assert all(res[r]["status"] == "DONE" for r in rids), [res[r] for r in rids if res[r]["status"] != "DONE"][:3]
    arrived = {a["request_id"]: a for a in pair.arrivals(64)}
    assert sorted(arrived) == sorted(rids)
    for i, rid in enumerate(rids):
        a = arrived[rid]
        assert a["ok"] and a["nbytes"] == plans[i].nbytes and base64.b64decode(a["notify"]) == f"notify-{i}".encode()
        assert pair.rx.call("forget", request_id=rid)["live"]
    pair.check_images(TransferPlan.concat(plans))


def test_empty_plan_completes(pair):
    rid = pair.rid("empty")
    pair.expect(rid, [0], [0], [16])
    pair.submit(rid, EMPTY_PLAN)
    assert pair.wait([rid])[rid]["status"] == "DONE"
    (a,) = pair.arrivals(1)
    assert (a["request_id"], a["ok"], a["nbytes"]) == (rid, True, 0)
    pair.rx.call("forget", request_id=rid)


# -- what the receiver refuses -------------------------------------------------------------
@pytest.mark.parametrize("case", ["outside grant", "never granted", "after forget", "unknown region"])
def test_rejected_write_lands_nowhere(pair, case):
    pair.reset(range(4))
    rid = pair.rid(case.replace(" ", "-"))
    plan = raw_plan([0], [0], [9 if case == "unknown region" else 1], [50], [100])
    if case != "never granted":
        pair.expect(rid, [1], [0], [100])       # grants bytes 0..99 of region 1 only
    if case == "after forget":
        assert pair.rx.call("forget", request_id=rid)["live"]
        # The contract: bytes may land in a forgotten grant while ``writes_pending`` (a sender it
        # was pregranted to, UCX's eager writes, has not answered its FENCE yet); none after.
        assert until(lambda: not pair.rx.call("pending", request_id=rid)["pending"], 10.0), "writes still pending"
        plan = raw_plan([0], [0], [1], [0], [100])
    before = pair.rejected()
    pair.submit(rid, plan, timeout=20)
    res = pair.wait([rid])[rid]
    assert res["status"] == "FAILED" and res["error"], res
    # Only the receiver knows its grants. A run into a region the receiver's descriptor does
    # not have may also be refused by the sender before anything is sent: then no arrival.
    arrived = pair.arrivals(1, timeout=2.0 if case == "unknown region" else 15.0)
    if arrived or case != "unknown region":
        (a,) = arrived
        assert a["request_id"] == rid and not a["ok"] and a["reason"], a
        assert pair.rejected() == before + 1
    pair.check_images(EMPTY_PLAN)              # every region still all canary
    pair.rx.call("forget", request_id=rid)


# -- peers that stop or die ---------------------------------------------------------------
# These come last in the module: they kill the shared pair's processes (sender first, then
# receiver, with a fresh sender process feeding it), which saves starting two more pairs.
KILL_BYTES, DEADLINE, SLACK = 256 * MiB, 4.0, 2.0


QUICK_SILENCE = {"zmq": {"heartbeat_timeout": 2.0}, "ucx": {"peer_timeout": 2.0}}


@pytest.mark.slow   # seconds
@pytest.mark.parametrize("pair", NETWORK, indirect=True)   # it stops or kills a peer process
def test_source_released_only_when_nothing_reads_it(pair, tmp_path):
    """The receiver stops mid-transfer (SIGSTOP) long before its deadline. The sender fails the
    transfer when the receiver goes silent (or, UCX's eager puts, completes it at their flush)
    and, while it is still stopped, releases the source (nothing queued or in flight reads it).
    Bytes written to the source after that must never reach the receiver once it runs again; its
    grant is still live then."""
    tx = PeerProcess(tmp_path / "sender3.log")
    try:
        tx_desc = tx.call("init", transport=pair.name, sizes=SIZES, fill="seed", seed=SEED,
                          options=QUICK_SILENCE.get(pair.name, {}))["descriptor"]
        token = pair.rx.call("admit", descriptor=tx_desc)["token"]
        peer = tx.call("connect", descriptor=pair.rx_descriptor, token=token)["peer"]
        rid, _ = _kill_mid_transfer(pair, tx, peer, pair.rx, timeout=60.0, sig=signal.SIGSTOP)
        try:
            res = tx.call("wait", request_ids=[rid], wait_s=10.0)["results"][rid]
            # UCX's eager puts into a stopped process can complete: the sender succeeds at its
            # flush (its bytes are in the receiver's memory, its source is free); otherwise it fails
            assert res["status"] == "FAILED" or (res["status"] == "DONE" and pregrants(pair.name)), res
            assert until(lambda: tx.call("status", request_ids=[rid])["released"][rid], 10.0), \
                "the source of a failed transfer was not released while its receiver was stopped"
            tx.call("fill", regions=[4], fill=0x3C)   # the sender reuses its memory
        finally:
            pair.rx.signal(signal.SIGCONT)
        # The receiver fails it (that sender went silent), or, when every byte had landed
        # before the release (UCX puts into a stopped process), completes it.
        arrived = pair.arrivals(1, timeout=15.0)
        assert arrived and arrived[0]["request_id"] == rid, arrived
        assert pair.rx.call("foreign", region=4, seed=SEED)["count"] == 0, \
            "bytes written to the source after its release reached the receiver"
        pair.rx.call("forget", request_id=rid)
    finally:
        tx.close()


def _stop_mid_transfer(tx, rx, victim, rid: str, watch: int) -> bool:
    """Stop ``victim`` with bytes landed but the transfer still open at both ends.

    The victim runs only in short bursts until the byte at ``watch`` of the receiver's
    region 4 lands, so 256 MiB cannot finish between "landed" and SIGSTOP. Returns False
    (victim running again) if the transfer finished anyway.
    """
    victim.signal(signal.SIGSTOP)
    limit = time.monotonic() + DEADLINE
    while True:
        victim.signal(signal.SIGCONT)
        if victim is tx:
            time.sleep(0.005)
        landed = rx.call("watch", region=4, offset=watch, wait_s=0)["changed"]   # the receiver runs meanwhile
        victim.signal(signal.SIGSTOP)
        if landed:
            break
        assert time.monotonic() < limit, "no byte landed before the deadline"
    open_ = (tx.call("status", request_ids=[rid])["status"][rid] == "PENDING" if victim is rx
             else not rx.call("arrivals", count=1, wait_s=0)["arrivals"])
    if not open_:
        victim.signal(signal.SIGCONT)
    return open_


def _kill_mid_transfer(p: Pair, tx, peer: str, victim, timeout: float = DEADLINE,
                       sig: int = signal.SIGKILL) -> tuple[str, float]:
    """Send 256 MiB into the receiver's region 4 and SIGKILL ``victim`` (or leave it stopped:
    ``sig`` SIGSTOP) while it is in flight. Returns the request id and when it was submitted."""
    watch = int(np.argmax(source(4, BIG).numpy()[:KILL_BYTES] != CANARY))   # the first byte that shows a landing
    for _ in range(3):   # another try only when the transfer won the race against SIGSTOP
        p.reset([4])
        rid = p.rid("kill")
        p.expect(rid, [4], [0], [KILL_BYTES])
        t0 = time.monotonic()
        tx.call("submit", peer=peer, request_id=rid, plan=plan_to_json(raw_plan([4], [0], [4], [0], [KILL_BYTES])),
                timeout=timeout)
        if _stop_mid_transfer(tx, p.rx, victim, rid, watch):
            victim.signal(sig)
            return rid, t0
        p.arrivals(1)
        p.rx.call("forget", request_id=rid)
    pytest.fail("the transfer finished before its peer could be stopped, three times")


@pytest.mark.slow   # seconds
@pytest.mark.parametrize("pair", NETWORK, indirect=True)   # it stops or kills a peer process
def test_sender_killed_mid_transfer(pair):
    """SIGKILL the sender mid-transfer: the receiver reports a failed arrival within the
    deadline and releases the grant exactly once."""
    rid, t0 = _kill_mid_transfer(pair, pair.tx, pair.peer, pair.tx)
    arrived = pair.arrivals(1, timeout=DEADLINE + SLACK)
    took = time.monotonic() - t0
    assert arrived and arrived[0]["request_id"] == rid and not arrived[0]["ok"], arrived
    assert took <= DEADLINE + SLACK, f"failure reported {took:.1f}s after submit"
    f = pair.rx.call("forget", request_id=rid)
    assert f["live"] and f["grants_live"] in (0, None), f
    assert not pair.rx.call("forget", request_id=rid)["live"]


@pytest.mark.slow   # seconds
@pytest.mark.parametrize("pair", NETWORK, indirect=True)   # it stops or kills a peer process
def test_receiver_killed_mid_transfer(pair, tmp_path):
    """SIGKILL the receiver mid-transfer: the sender's handle fails within its deadline (or, eager
    puts, which need nothing of the receiver, succeeds once they are flushed into its memory)."""
    tx = PeerProcess(tmp_path / "sender2.log")
    try:
        token = pair.rx.call("admit", descriptor=tx.call("init", transport=pair.name, sizes=SIZES, fill="seed",
                                                        seed=SEED)["descriptor"])["token"]
        peer = tx.call("connect", descriptor=pair.rx_descriptor, token=token)["peer"]
        rid, _ = _kill_mid_transfer(pair, tx, peer, pair.rx)
        res = tx.call("wait", request_ids=[rid], wait_s=DEADLINE + SLACK)["results"][rid]
        # eager puts (RDMA or shared memory) can all be flushed into the stopped receiver's memory
        # before the kill: then the sender's Success is right
        ended = ("FAILED", "DONE") if pregrants(pair.name) else ("FAILED",)
        assert res["status"] in ended and (res["error"] or res["status"] == "DONE"), res
        assert res["elapsed"] <= DEADLINE + SLACK, res
        assert tx.call("status", request_ids=[rid])["status"][rid] == res["status"]   # the sender is still alive
    finally:
        tx.close()


# -- disconnect ---------------------------------------------------------------------------
def _ranges(plan: TransferPlan) -> ByteRanges:
    return ByteRanges(plan.runs().dst_region, plan.runs().dst_offset, plan.runs().nbytes)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow   # seconds
def test_disconnect_frees_the_peer(name):
    """Connect/disconnect one peer 200 times (a decode rank re-handshaking): fds and threads stay
    flat, a transfer after is byte-exact, one in flight at disconnect fails with a reason."""
    _importable(name)
    tx, rx = get_transport(name), get_transport(name)
    try:
        big, src = 64 * MiB, [source(0, SMALL), torch.from_numpy(make_pattern(region_seed(SEED, 9), 64 * MiB))]
        dst = [torch.full((SMALL,), CANARY, dtype=torch.uint8), torch.full((big,), CANARY, dtype=torch.uint8)]
        tx.register(src), rx.register(dst)
        desc = rx.descriptor()
        tx.disconnect(tx.connect(desc))   # the transport's own threads and fds exist from here on
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        for _ in range(200):
            peer = tx.connect(desc)
            tx.disconnect(peer), tx.disconnect(peer)   # idempotent
        tx.disconnect("no such peer")      # unknown: a no-op
        assert until(lambda: len(os.listdir("/proc/self/fd")) <= fds and threading.active_count() <= threads, 10), \
            f"{name}: fds {fds} -> {len(os.listdir('/proc/self/fd'))}, threads {threads} -> {threading.active_count()}"
        peer = tx.connect(desc)
        plan = raw_plan([0, 0], [5, 70_000], [0, 0], [1000, 3 * MiB], [60_000, 300 * KiB])
        rx.expect("after", _ranges(plan)), tx.submit(peer, "after", plan, timeout=30).result(30)
        want = torch.full((SMALL,), CANARY, dtype=torch.uint8)
        execute_plan(plan, src, [want, torch.empty(0, dtype=torch.uint8)])
        assert torch.equal(dst[0], want), f"{name}: bytes after 200 disconnects differ from those sent"
        whole = raw_plan([1], [0], [1], [0], [big])
        for k in range(3):   # in flight: disconnected right after submit (a local copy ends inside submit)
            rid = f"inflight-{k}"
            rx.expect(rid, _ranges(whole))
            h = tx.submit(peer, rid, whole, timeout=30)
            tx.disconnect(peer), h.wait(30), rx.forget(rid)
            if h.error is not None or name in ("local", "faulty"):
                break
            peer = tx.connect(desc)
        assert name in ("local", "faulty") or (h.error is not None and "disconnect" in str(h.error)), h.error
        assert until(lambda: h.source_released, 10), f"{name}: the source was never released"
        late = tx.submit(peer, "late", plan, timeout=5)
        assert not late.wait(5) and "peer" in str(late.error), late.error
    finally:
        tx.close(), rx.close()
