"""UCX transport between real processes on 127.0.0.1: bytes, grants, hostile peers, dead peers.

Each peer process runs ``_serve``: a small command loop over a multiprocessing pipe that
drives one ``UCXTransport``. The test process holds the other transport. Children are
spawned (never forked: UCX state must not be copied) and reused across tests per TLS.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import until

from kvxfer.errors import RejectedWrite  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import (  # noqa: E402
    RunGroup,
    TransferPlan,
)
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
POOL = 24 * MiB
CANARY = 0xA5
OPTS = {"frame_bytes": 1 * MiB, "heartbeat": 0.2, "peer_timeout": 1.5,
        "eager_writes": False}   # the announced protocol (ANNOUNCE, GO); eager writes: test_ucx_eager.py
TLS = {"default": None, "tcp": "tcp"}


def plan_of(groups) -> TransferPlan:
    """``groups``: (src offsets, dst offsets, lengths, packed) in region 0 on both sides."""
    z = np.zeros(1, np.int64)
    return TransferPlan(tuple(RunGroup(z, z, z, z, np.asarray(s, np.int64), np.asarray(d, np.int64),
                                       np.broadcast_to(np.asarray(n, np.int64), np.shape(s)).copy(), p)
                              for s, d, n, p in groups))


def _serve(conn, tls, pool_bytes: int, opts: dict) -> None:
    """Child process: one transport and one pool (filled with CANARY), driven by commands."""
    t = get_transport("ucx", tls=tls, **opts)
    pool = torch.full((pool_bytes,), CANARY, dtype=torch.uint8)
    t.register([pool])
    conn.send(t.descriptor())
    handles = {}  # keeps submitted handles alive
    while True:
        cmd, *a = conn.recv()
        if cmd == "expect":
            t.expect(a[0], ByteRanges(*(np.asarray(x, np.int64) for x in a[1])))
        elif cmd == "forget":
            t.forget(a[0])
        elif cmd == "pending":
            conn.send(t.writes_pending(a[0]))
            continue
        elif cmd == "open_in":   # xids of the incoming transfers open now (read off the I/O thread)
            conn.send(sorted(k[1] for k in list(t.receiver.incoming)))
            continue
        elif cmd == "dtag":      # the data tag GO gave an incoming transfer (0: none yet)
            conn.send(next((i.dtag for i in list(t.receiver.incoming.values()) if i.xid == a[0]), 0))
            continue
        elif cmd == "arrivals":
            got, end = [], time.monotonic() + a[0]
            while len(got) < a[1] and time.monotonic() < end:
                got += t.arrivals(0.05)
            conn.send([tuple(x) for x in got])
            continue
        elif cmd == "pool":
            conn.send(pool.numpy().tobytes())
            continue
        elif cmd == "fill":
            pool.copy_(torch.from_numpy(np.frombuffer(a[0], np.uint8)))
        elif cmd == "rejected":
            conn.send(dict(t.rejected))
            continue
        elif cmd == "connect":
            conn.send(t.connect(a[0]))
            continue
        elif cmd == "submit":
            if a[4]:  # a sender frozen after GO (as if it stopped mid-transfer): never puts, never DONE
                t.sender.start_puts = lambda out, dtag: setattr(out, "state", "stalled")
            handles[a[1]] = t.submit(a[0], a[1], plan_of(a[2]), timeout=a[3])
        elif cmd == "close":
            t.close()
            conn.send("closed")
            return
        conn.send("ok")


class Peer:
    """The test-side handle on a child process running ``_serve``."""

    def __init__(self, tls, pool_bytes=POOL, **opts):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, tls, pool_bytes, {**OPTS, **opts}), daemon=True)
        self.proc.start()
        self._descriptor = None

    @property
    def descriptor(self) -> dict:
        """The peer's transport descriptor (waits for the process to come up the first time)."""
        if self._descriptor is None:
            if not self.conn.poll(90):
                raise RuntimeError("UCX peer process did not start")
            self._descriptor = self.conn.recv()
        return self._descriptor

    def __call__(self, *cmd, timeout: float = 30):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]}")
        return self.conn.recv()

    def pool(self) -> np.ndarray:
        return np.frombuffer(self("pool"), np.uint8)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self("close", timeout=15)
            except (TimeoutError, EOFError, BrokenPipeError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


@pytest.fixture(scope="module")
def peers():
    """One peer process per TLS, all started at once: their start-up (torch, UCX) overlaps."""
    started = {name: Peer(tls) for name, tls in TLS.items()}
    yield started
    for p in started.values():
        p.stop()


@pytest.fixture(scope="module", params=[pytest.param(n, marks=() if n == "default" else pytest.mark.slow)
                                        for n in sorted(TLS)])   # the fast tier keeps UCX's default path
def pair(request, peers):
    """(local sender transport, its source pool, remote receiver Peer, peer id) for one TLS."""
    tls, peer = TLS[request.param], peers[request.param]
    t = get_transport("ucx", tls=tls, **OPTS)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    t.register([src])
    pid = t.connect(peer.descriptor)
    yield t, src.numpy(), peer, pid
    t.close()


def whole(n: int):
    return ([0], [0], [n])


def test_bytes_land_exactly_with_canaries(pair):
    t, src, peer, pid = pair
    rng = np.random.default_rng(7)
    # One big run (split into 1 MiB puts), 100 scattered 64 KiB pages, 1500 packed 4 KiB-16 pages.
    big = ([0], [MiB], [5 * MiB + 123], False)
    pages = rng.choice(np.arange(8 * MiB, 16 * MiB, 64 * KiB) // (64 * KiB), 100, replace=False) * 64 * KiB
    scattered = (rng.permutation(pages), pages, 64 * KiB, False)
    small = rng.choice(np.arange(16 * MiB, 24 * MiB, 4 * KiB) // (4 * KiB), 1500, replace=False) * 4 * KiB
    packed = (rng.permutation(small) - 8 * MiB, small, 4 * KiB - 16, True)  # leaves a 16-byte canary per page
    # 300 tiny runs the plan left unpacked: the transport packs them (put_below) rather than 300 puts.
    tiny_dst = 7 * MiB + np.arange(300) * 256
    tiny = (rng.integers(0, POOL - 200, 300), tiny_dst, 200, False)
    plan = plan_of([big, scattered, packed, tiny])
    peer("expect", "r-exact", whole(POOL))
    h = t.submit(pid, "r-exact", plan, timeout=30, notify=b"chunk-0")
    assert h.wait(30), h.error
    (arr,) = peer("arrivals", 10, 1)
    assert arr == ("r-exact", plan.nbytes, True, "", b"chunk-0")
    want = np.full(POOL, CANARY, np.uint8)
    r = plan.runs()
    for s, d, n in zip(r.src_offset, r.dst_offset, r.nbytes):
        want[d: d + n] = src[s: s + n]
    got = peer.pool()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5]}"
    peer("forget", "r-exact")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_many_in_flight_and_empty_plan(pair):
    """32 put transfers, 16 packed ones of varied sizes (staging blocks get reused) and an empty one."""
    t, src, peer, pid = pair
    peer("expect", "r-many", whole(POOL))
    hs = [t.submit(pid, "r-many", plan_of([([i * 64 * KiB], [i * 64 * KiB], [64 * KiB], False)]), timeout=30)
          for i in range(32)]
    packed = [4 * MiB + i * 64 * KiB + np.arange(1 + 7 * i) * 4 * KiB for i in range(16)]
    hs += [t.submit(pid, "r-many", plan_of([(o, o, 1000 + i, True)]), timeout=30) for i, o in enumerate(packed)]
    hs.append(t.submit(pid, "r-many", TransferPlan(()), timeout=30))
    assert all(h.wait(30) for h in hs), [h.error for h in hs if h.error]
    arrs = peer("arrivals", 10, len(hs))
    assert len(arrs) == len(hs) and all(a[2] for a in arrs)
    got = peer.pool()
    assert np.array_equal(got[: 2 * MiB], src[: 2 * MiB])
    for i, offs in enumerate(packed):
        for o in offs[:: max(1, len(offs) // 5)]:
            assert np.array_equal(got[o: o + 1000 + i], src[o: o + 1000 + i]), (i, o)
    peer("forget", "r-many")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_writes_outside_grant_are_rejected_whole(pair):
    t, src, peer, pid = pair
    before = peer("rejected")
    peer("expect", "r-grant", ([0], [MiB], [MiB]))   # bytes [1 MiB, 2 MiB) only
    partly_out = plan_of([([0], [MiB], [MiB], False), ([0], [3 * MiB], [4 * KiB], False)])
    packed_out = plan_of([([0, 8 * KiB], [MiB, 5 * MiB], [4 * KiB], True)])
    h1 = t.submit(pid, "r-grant", partly_out, timeout=10)
    h2 = t.submit(pid, "r-grant", packed_out, timeout=10)
    h3 = t.submit(pid, "r-nobody", plan_of([([0], [0], [4 * KiB], False)]), timeout=10)
    for h in (h1, h2, h3):
        assert not h.wait(10)
        assert isinstance(h.error, RejectedWrite), h.error
    # No oracle: the sender learns "refused" alike; the receiver's counters below say which it was.
    assert all("refused" in str(h.error) for h in (h1, h2, h3))
    arrs = peer("arrivals", 5, 3)
    assert sorted((a[0], a[2]) for a in arrs) == [("r-grant", False), ("r-grant", False), ("r-nobody", False)]
    after = peer("rejected")
    assert after.get("outside grant", 0) - before.get("outside grant", 0) == 2
    assert after.get("unknown request", 0) - before.get("unknown request", 0) == 1
    assert (peer.pool() == CANARY).all(), "a rejected transfer wrote bytes"
    peer("forget", "r-grant")
    h4 = t.submit(pid, "r-grant", plan_of([([0], [MiB], [4 * KiB], False)]), timeout=10)
    assert not h4.wait(10) and "refused" in str(h4.error)
    assert [a[:3] for a in peer("arrivals", 5, 1)] == [("r-grant", 4 * KiB, False)]
    assert (peer.pool() == CANARY).all()


def _send_tagged(t, pid: str, tag: int, wire: bytes) -> None:
    """Send raw bytes with ``tag`` from ``t`` to its connected peer, on ``t``'s I/O thread."""
    from kvxfer_transports.ucx import Array, ucx_api
    p = t.peers[pid]

    def send():
        buf = np.frombuffer(wire, np.uint8)
        t.outbox.sends.append((p.ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))
    t.call_io(send)


def _raw(t, pid: str, msg, sender: str | None = None) -> None:
    """Send a hand-made control message from ``t`` to its connected peer (a hostile peer).

    ``msg`` is one message (sent as a batch of one from ``sender``, default ``t``) or raw bytes.
    """
    from kvxfer_transports.ucx import CTRL_TAG
    secret = t.peers[pid].secret
    wire = msg if isinstance(msg, bytes) else msgpack.packb([sender or t.id, secret, [msg]], use_bin_type=True)
    _send_tagged(t, pid, CTRL_TAG | t.peers[pid].tag_out, wire)


def test_hostile_announces_are_rejected_and_counted(pair):
    from kvxfer_transports.ucx import ANNOUNCE
    t, src, peer, pid = pair
    peer("expect", "r-host", ([0], [0], [POOL + MiB]))  # a grant reaching past the region (receiver's bug)

    def ann(xid, reg, off, n, nput=None, frame=MiB, inline=b"", runs=None):
        """An announce of runs (region, offset, length lists), the first ``nput`` put, the rest packed."""
        runs = np.asarray([reg, off, n], "<i8").tobytes() if runs is None else runs
        return [ANNOUNCE, 10_000 + xid, "r-host", 5.0, b"", runs, len(reg) if nput is None else nput, frame, inline]
    before = peer("rejected")
    hostile = {  # in this order: messages on one endpoint are handled in order, and only announces yield arrivals
        "malformed message": [b"\xc1\xff not msgpack", msgpack.packb(["x", "not a list"]), [ANNOUNCE], 7],
        "unknown peer": [([ANNOUNCE, 1, "r-host"], "nobody")],
        "malformed header": [ann(1, [], [], [], runs=np.zeros(4, "<i8").tobytes()),  # not three rows
                             ann(2, [], [], [], runs=b"\x01\x02\x03"),       # not int64 bytes
                             ann(3, [0], [0], [4096], frame=7),                 # absurd frame size
                             ann(9, [0], [0], [4096], nput=2),                  # more put runs than runs
                             ann(10, [0], [0], [16], nput=0, inline=b"x" * 15)],  # inline bytes do not fit
        "unknown region": [ann(4, [3], [0], [4096])],
        "outside grant": [ann(5, [0], [-4096], [8192]),                # negative offset
                          ann(6, [0], [2**62], [2**62]),               # overflow bait
                          ann(7, [0], [0], [0])],                      # empty run
        "outside region": [ann(8, [0], [POOL - 4096], [8192]),         # granted, but past the pool
                           ann(11, [0], [POOL - 8], [16], nput=0, inline=b"y" * 16)],  # inline, same
    }
    for msgs in hostile.values():
        for m in msgs:
            _raw(t, pid, *(m if isinstance(m, tuple) else (m,)))
    # every announce from a known peer that parses: one failed arrival; the four that do not parse
    # (not three rows, not int64 bytes, frame size 7, more put runs than runs) touch no request
    arrs = peer("arrivals", 5, 7)
    assert len(arrs) == 7 and not any(a[2] for a in arrs)
    assert peer("arrivals", 0.5, 1) == []
    after = peer("rejected")
    for reason, msgs in hostile.items():
        assert after.get(reason, 0) - before.get(reason, 0) == len(msgs), (reason, after)
    assert (peer.pool() == CANARY).all()
    # The receiver still works for honest transfers afterwards.
    h = t.submit(pid, "r-host", plan_of([([0], [0], [64 * KiB], False)]), timeout=10)
    assert h.wait(10), h.error
    assert np.array_equal(peer.pool()[: 64 * KiB], src[: 64 * KiB])
    peer("arrivals", 5, 1)
    peer("forget", "r-host")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_receiver_fails_transfer_past_its_deadline(pair):
    """An announce that never finishes (sender stalls) fails on the receiver at its deadline."""
    from kvxfer_transports.ucx import ANNOUNCE
    t, src, peer, pid = pair
    peer("expect", "r-late", whole(POOL))
    _raw(t, pid, [ANNOUNCE, 20_000, "r-late", 0.5, b"n", np.asarray([0, 0, 4096], "<i8").tobytes(), 1, MiB, b""])
    start = time.monotonic()
    (arr,) = peer("arrivals", 10, 1)
    assert arr[:3] == ("r-late", 4096, False) and "deadline passed" in arr[3]
    assert time.monotonic() - start < 5
    peer("forget", "r-late")


def test_forgotten_request_keeps_its_memory_until_no_put_is_left(pair):
    """Puts cannot be recalled: once GO went out, a request the receiver forgets keeps
    ``writes_pending`` True (its memory must not be reused) until the sender says that no put of
    it is left: ABORT (sent after its flush) or DONE."""
    from kvxfer_transports.ucx import ABORT, ANNOUNCE, DONE
    t, src, peer, pid = pair
    runs = np.asarray([[0], [0], [4096]], "<i8").tobytes()
    for xid, end in ((30_001, [ABORT, 30_001, "sender gave up"]), (30_002, [DONE, 30_002])):
        rid = f"r-land-{xid}"
        peer("expect", rid, whole(POOL))
        _raw(t, pid, [ANNOUNCE, xid, rid, 10.0, b"", runs, 1, MiB, b""])   # one put run: GO comes back
        assert until(lambda xid=xid: xid in peer("open_in"), 5.0), "the announce was not taken"
        assert not peer("pending", rid)
        peer("forget", rid)
        assert until(lambda rid=rid: peer("pending", rid), 5.0), \
            "a forgotten transfer with puts after GO is not pending"
        time.sleep(0.3)
        assert peer("pending", rid)                        # no word from the sender: still pending
        _raw(t, pid, end)
        assert until(lambda rid=rid: not peer("pending", rid), 5.0), f"{end[0]} did not end the pending writes"
        peer("arrivals", 2, 1)                             # the failed arrival of the forgotten transfer
    # the sender aborts first (its puts are flushed by then): nothing is pending after the forget
    peer("expect", "r-land-aborted", whole(POOL))
    _raw(t, pid, [ANNOUNCE, 30_004, "r-land-aborted", 10.0, b"", runs, 1, MiB, b""])
    assert until(lambda: 30_004 in peer("open_in"), 5.0)
    _raw(t, pid, [ABORT, 30_004, "sender gave up"])
    (arr,) = peer("arrivals", 5, 1)
    assert arr[0] == "r-land-aborted" and not arr[2] and "aborted by the sender" in arr[3]
    peer("forget", "r-land-aborted")
    time.sleep(0.2)
    assert not peer("pending", "r-land-aborted")
    # an announce without puts (everything packed) leaves nothing pending
    peer("expect", "r-land-packed", whole(POOL))
    _raw(t, pid, [ANNOUNCE, 30_003, "r-land-packed", 10.0, b"", np.asarray([[0], [0], [8 * MiB]], "<i8").tobytes(),
                  0, MiB, b""])
    assert until(lambda: 30_003 in peer("open_in"), 5.0)
    peer("forget", "r-land-packed")
    assert until(lambda: 30_003 not in peer("open_in"), 5.0)
    assert until(lambda: not peer("pending", "r-land-packed"), 5.0), "cancelled receives kept the request pending"
    peer("arrivals", 2, 1)
    assert (peer.pool() == CANARY).all()


def test_hostile_frames_fail_their_transfer_and_land_only_in_its_grant(pair):
    """Packed frames are received straight into the granted runs. A frame under the transfer's
    tag that does not fit (the wrong size, no such frame) fails it (counted as malformed); a frame
    with an unknown tag is dropped and counted; no byte
    lands outside the grant, and an honest transfer works afterwards."""
    from kvxfer_transports.ucx import ANNOUNCE, DATA_BIT, DONE, FRAME_BITS
    t, src, peer, pid = pair
    grant = ([0, 0], [MiB, 5 * MiB], [2 * MiB, 2 * MiB])
    runs = np.asarray(grant, "<i8").tobytes()   # 4 MiB packed: four 1 MiB frames
    before = peer("rejected")
    for xid, bad in ((40_001, b"s" * (MiB // 2)), (40_002, b"l" * (2 * MiB))):   # short, then long frame 1
        rid = f"r-frames-{xid}"
        peer("expect", rid, grant)
        _raw(t, pid, [ANNOUNCE, xid, rid, 10.0, b"", runs, 0, MiB, b""])
        assert until(lambda xid=xid: peer("dtag", xid), 5.0), "no GO for the packed frames"
        dtag = peer("dtag", xid)
        _send_tagged(t, pid, DATA_BIT | 999_999 << FRAME_BITS, b"x" * MiB)    # nobody's tag: dropped
        _send_tagged(t, pid, DATA_BIT | dtag << FRAME_BITS | 7, b"x" * MiB)   # no frame 7: fails it
        _send_tagged(t, pid, DATA_BIT | dtag << FRAME_BITS | 1, bad)
        (arr,) = peer("arrivals", 10, 1)
        assert arr[0] == rid and not arr[2] and "malformed frame" in arr[3], arr
        assert until(lambda rid=rid: not peer("pending", rid), 5.0), "cancelled receives still pending"
        peer("forget", rid)
    # each transfer failed by its first bad frame (frame 7, under its tag); nobody's tag, and what
    # came after the failure, dropped: counted too
    assert peer("rejected").get("malformed frame", 0) - before.get("malformed frame", 0) >= 2
    pool = peer.pool()
    outside = np.ones(POOL, bool)
    outside[MiB: 3 * MiB] = outside[5 * MiB: 7 * MiB] = False
    assert (pool[outside] == CANARY).all(), "a frame landed outside its grant"
    # an honest sender of the same frames succeeds, byte for byte
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())
    peer("expect", "r-frames-ok", grant)
    _raw(t, pid, [ANNOUNCE, 40_003, "r-frames-ok", 10.0, b"", runs, 0, MiB, b""])
    assert until(lambda: peer("dtag", 40_003), 5.0)
    dtag = peer("dtag", 40_003)
    payload = src[: 4 * MiB].tobytes()
    for k in range(4):
        _send_tagged(t, pid, DATA_BIT | dtag << FRAME_BITS | k, payload[k * MiB: (k + 1) * MiB])
    _raw(t, pid, [DONE, 40_003])
    (arr,) = peer("arrivals", 10, 1)
    assert arr[0] == "r-frames-ok" and arr[2], arr
    pool = peer.pool()
    assert np.array_equal(pool[MiB: 3 * MiB], src[: 2 * MiB]) and np.array_equal(pool[5 * MiB: 7 * MiB],
                                                                                 src[2 * MiB: 4 * MiB])
    assert (pool[outside] == CANARY).all()
    peer("forget", "r-frames-ok")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_adjacent_runs_go_as_one_put(pair):
    """Runs adjacent on both sides are merged into one put; the announce keeps every run."""
    t, src, peer, pid = pair
    k = 40  # more than FEW_RUNS: the vectorized path
    so, do = np.r_[np.arange(k // 2), 100 + np.arange(k // 2)] * 64 * KiB, np.arange(k) * 64 * KiB
    plan = plan_of([(so, do, 64 * KiB, False)])
    puts, runs, nput, _ = t.planner.prepare(t.peers[pid], plan)
    # two merged runs of 1.25 MiB, each cut at frame_bytes (1 MiB here)
    sizes = np.frombuffer(puts, "<i8").reshape(-1, 5)[:, 2].tolist()   # rows of (src, dst, nbytes, sreg, dreg)
    assert sizes == [MiB, 256 * KiB] * 2 and nput == k == len(runs) // 24
    peer("expect", "r-merge", whole(POOL))
    assert t.submit(pid, "r-merge", plan, timeout=30).wait(30)
    assert peer("arrivals", 10, 1)[0][2]
    got = peer.pool()
    assert np.array_equal(got[: k * 64 * KiB], np.concatenate([src[o: o + 64 * KiB] for o in so]))
    peer("forget", "r-merge")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_small_scattered_runs_travel_as_iov_frames(pair):
    """Runs below put_below are packed into frames sent from and received into the runs
    themselves (iov), runs cut where a frame ends; the bytes land exactly, and nothing outside
    the runs changes."""
    t, src, peer, pid = pair
    k = 600
    rng = np.random.default_rng(3)
    so = rng.choice(POOL // (8 * KiB), k, replace=False) * 8 * KiB
    do = rng.choice(POOL // (8 * KiB), k, replace=False) * 8 * KiB
    n = rng.integers(1, t.options.put_below, k)             # ~2.3 MiB: three frames of 1 MiB
    plan = plan_of([(so, do, n, False)])
    puts, _, nput, packed = t.planner.prepare(t.peers[pid], plan)
    assert not puts and nput == 0 and len(packed[2]) == k
    peer("expect", "r-iov", whole(POOL))
    h = t.submit(pid, "r-iov", plan, timeout=30)
    assert h.wait(30), h.error
    assert peer("arrivals", 10, 1)[0][2]
    got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
    for a, b, c in zip(so.tolist(), do.tolist(), n.tolist()):
        want[b: b + c] = src[a: a + c]
    assert np.array_equal(got, want)
    peer("forget", "r-iov")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())
