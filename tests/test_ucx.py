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

from kvxfer.errors import PeerError, RejectedWrite, TransferTimeout, TransportError  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import (  # noqa: E402
    FEW_RUNS,  # noqa: E402
    RunGroup,
    TransferPlan,
)
from kvxfer.transport.base import TransferStatus  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
POOL = 24 * MiB
CANARY = 0xA5
OPTS = {"frame_bytes": 1 * MiB, "heartbeat": 0.2, "peer_timeout": 1.5}
TLS = {"default": None, "tcp": "tcp"}


def _plan(groups) -> TransferPlan:
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
            conn.send(sorted(k[1] for k in list(t._in)))
            continue
        elif cmd == "dtag":      # the data tag GO gave an incoming transfer (0: none yet)
            conn.send(next((i.dtag for i in list(t._in.values()) if i.xid == a[0]), 0))
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
                t._start_puts = lambda out, dtag: setattr(out, "state", "stalled")
            handles[a[1]] = t.submit(a[0], a[1], _plan(a[2]), timeout=a[3])
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


@pytest.fixture(scope="module", params=sorted(TLS))
def pair(request, peers):
    """(local sender transport, its source pool, remote receiver Peer, peer id) for one TLS."""
    tls, peer = TLS[request.param], peers[request.param]
    t = get_transport("ucx", tls=tls, **OPTS)
    src = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    t.register([src])
    pid = t.connect(peer.descriptor)
    yield t, src.numpy(), peer, pid
    t.close()


def _whole(n: int):
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
    plan = _plan([big, scattered, packed, tiny])
    peer("expect", "r-exact", _whole(POOL))
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
    peer("expect", "r-many", _whole(POOL))
    hs = [t.submit(pid, "r-many", _plan([([i * 64 * KiB], [i * 64 * KiB], [64 * KiB], False)]), timeout=30)
          for i in range(32)]
    packed = [4 * MiB + i * 64 * KiB + np.arange(1 + 7 * i) * 4 * KiB for i in range(16)]
    hs += [t.submit(pid, "r-many", _plan([(o, o, 1000 + i, True)]), timeout=30) for i, o in enumerate(packed)]
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
    partly_out = _plan([([0], [MiB], [MiB], False), ([0], [3 * MiB], [4 * KiB], False)])
    packed_out = _plan([([0, 8 * KiB], [MiB, 5 * MiB], [4 * KiB], True)])
    h1 = t.submit(pid, "r-grant", partly_out, timeout=10)
    h2 = t.submit(pid, "r-grant", packed_out, timeout=10)
    h3 = t.submit(pid, "r-nobody", _plan([([0], [0], [4 * KiB], False)]), timeout=10)
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
    h4 = t.submit(pid, "r-grant", _plan([([0], [MiB], [4 * KiB], False)]), timeout=10)
    assert not h4.wait(10) and "refused" in str(h4.error)
    assert [a[:3] for a in peer("arrivals", 5, 1)] == [("r-grant", 4 * KiB, False)]
    assert (peer.pool() == CANARY).all()


def _send_tagged(t, pid: str, tag: int, wire: bytes) -> None:
    """Send raw bytes with ``tag`` from ``t`` to its connected peer, on ``t``'s I/O thread."""
    from kvxfer_transports.ucx import Array, ucx_api
    p = t._peers[pid]

    def send():
        buf = np.frombuffer(wire, np.uint8)
        t._ctrl_sends.append((p.ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))
    t._call(send)


def _raw(t, pid: str, msg, sender: str | None = None) -> None:
    """Send a hand-made control message from ``t`` to its connected peer (a hostile peer).

    ``msg`` is one message (sent as a batch of one from ``sender``, default ``t``) or raw bytes.
    """
    from kvxfer_transports.ucx import CTRL_TAG
    secret = t._peers[pid].secret
    wire = msg if isinstance(msg, bytes) else msgpack.packb([sender or t.id, secret, [msg]], use_bin_type=True)
    _send_tagged(t, pid, CTRL_TAG, wire)


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
    arrs = peer("arrivals", 5, 11)
    assert len(arrs) == 11 and not any(a[2] for a in arrs)  # every announce from a known peer: one failed arrival
    after = peer("rejected")
    for reason, msgs in hostile.items():
        assert after.get(reason, 0) - before.get(reason, 0) == len(msgs), (reason, after)
    assert (peer.pool() == CANARY).all()
    # The receiver still works for honest transfers afterwards.
    h = t.submit(pid, "r-host", _plan([([0], [0], [64 * KiB], False)]), timeout=10)
    assert h.wait(10), h.error
    assert np.array_equal(peer.pool()[: 64 * KiB], src[: 64 * KiB])
    peer("arrivals", 5, 1)
    peer("forget", "r-host")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_receiver_fails_transfer_past_its_deadline(pair):
    """An announce that never finishes (sender stalls) fails on the receiver at its deadline."""
    from kvxfer_transports.ucx import ANNOUNCE
    t, src, peer, pid = pair
    peer("expect", "r-late", _whole(POOL))
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
        peer("expect", rid, _whole(POOL))
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
    peer("expect", "r-land-aborted", _whole(POOL))
    _raw(t, pid, [ANNOUNCE, 30_004, "r-land-aborted", 10.0, b"", runs, 1, MiB, b""])
    assert until(lambda: 30_004 in peer("open_in"), 5.0)
    _raw(t, pid, [ABORT, 30_004, "sender gave up"])
    (arr,) = peer("arrivals", 5, 1)
    assert arr[0] == "r-land-aborted" and not arr[2] and "aborted by the sender" in arr[3]
    peer("forget", "r-land-aborted")
    time.sleep(0.2)
    assert not peer("pending", "r-land-aborted")
    # an announce without puts (everything packed) leaves nothing pending
    peer("expect", "r-land-packed", _whole(POOL))
    _raw(t, pid, [ANNOUNCE, 30_003, "r-land-packed", 10.0, b"", np.asarray([[0], [0], [8 * MiB]], "<i8").tobytes(),
                  0, MiB, b""])
    assert until(lambda: 30_003 in peer("open_in"), 5.0)
    peer("forget", "r-land-packed")
    assert until(lambda: 30_003 not in peer("open_in"), 5.0)
    assert until(lambda: not peer("pending", "r-land-packed"), 5.0), "cancelled receives kept the request pending"
    peer("arrivals", 2, 1)
    assert (peer.pool() == CANARY).all()


def test_frame_iovs_carry_the_bytes_of_staging_frames():
    """Frame k of an iov transfer holds the bytes frame k of a staging block would: the runs
    back to back, cut every frame_bytes (runs cut where a boundary falls inside them)."""
    from kvxfer_transports.ucx import frame_iovs as _frame_iovs
    rng = np.random.default_rng(7)
    for trial in range(300):
        k = int(rng.integers(1, 30))
        n = rng.integers(0, 3000, k).astype(np.int64)
        n[rng.integers(0, k)] += 1   # at least one byte
        addr = rng.integers(0, 1 << 40, k).astype(np.int64)
        frame = int(rng.integers(1, 2500))
        if trial % 3 == 0:           # equal runs that divide the frame: no run is cut
            n[:], frame = 64, 64 * int(rng.integers(1, 8))
        frames = _frame_iovs(addr, n, frame)
        stream = np.concatenate([a + np.arange(c) for a, c in zip(addr, n)])
        assert len(frames) == -(-int(n.sum()) // frame)
        got = [np.concatenate([int(a) + np.arange(int(c)) for a, c in f]) for f in frames]
        assert [len(g) for g in got] == [min(frame, len(stream) - i * frame) for i in range(len(frames))]
        assert np.array_equal(np.concatenate(got), stream) and all((f[:, 1] > 0).all() for f in frames)


def test_hostile_frames_fail_their_transfer_and_land_only_in_its_grant(pair):
    """Packed frames are received straight into the granted runs. A frame of the wrong size
    fails its transfer (counted as malformed); a frame with an unknown tag is dropped; no byte
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
        _send_tagged(t, pid, DATA_BIT | dtag << FRAME_BITS | 7, b"x" * MiB)   # no frame 7: dropped
        _send_tagged(t, pid, DATA_BIT | dtag << FRAME_BITS | 1, bad)
        (arr,) = peer("arrivals", 10, 1)
        assert arr[0] == rid and not arr[2] and "malformed frame" in arr[3], arr
        assert until(lambda rid=rid: not peer("pending", rid), 5.0), "cancelled receives still pending"
        peer("forget", rid)
    assert peer("rejected").get("malformed frame", 0) - before.get("malformed frame", 0) == 2
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
    plan = _plan([(so, do, 64 * KiB, False)])
    puts, runs, nput, _ = t._prepare(t._peers[pid], plan)
    # two merged runs of 1.25 MiB, each cut at frame_bytes (1 MiB here)
    assert [n for _, _, n, _, _ in puts] == [MiB, 256 * KiB] * 2 and nput == k == len(runs) // 24
    peer("expect", "r-merge", _whole(POOL))
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
    n = rng.integers(1, t.put_below, k)             # ~2.3 MiB: three frames of 1 MiB
    plan = _plan([(so, do, n, False)])
    puts, _, nput, packed = t._prepare(t._peers[pid], plan)
    assert not puts and nput == 0 and len(packed[2]) == k
    peer("expect", "r-iov", _whole(POOL))
    h = t.submit(pid, "r-iov", plan, timeout=30)
    assert h.wait(30), h.error
    assert peer("arrivals", 10, 1)[0][2]
    got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
    for a, b, c in zip(so.tolist(), do.tolist(), n.tolist()):
        want[b: b + c] = src[a: a + c]
    assert np.array_equal(got, want)
    peer("forget", "r-iov")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_mid_size_runs_are_put_in_small_plans_and_packed_in_large_ones(pair):
    """16 KiB runs: a plan of a few is put (no frame's rendezvous); a plan of many travels
    packed (no system call per run). Both land exactly, nothing else changes."""
    t, src, peer, pid = pair
    assert t.put_below <= 16 * KiB < t.put_below_many
    rng = np.random.default_rng(8)
    for k, rid in ((4, "r-mid-few"), (48, "r-mid-many")):
        so = rng.choice(POOL // (16 * KiB), k, replace=False) * 16 * KiB
        do = rng.choice(POOL // (16 * KiB), k, replace=False) * 16 * KiB
        plan = _plan([(so, do, 16 * KiB, False)])
        prepare = t._prepare_few if k <= FEW_RUNS else t._prepare
        _, _, nput, packed = prepare(t._peers[pid], plan)
        assert (nput, packed is None) == ((k, True) if k <= FEW_RUNS else (0, False))
        peer("expect", rid, _whole(POOL))
        h = t.submit(pid, rid, plan, timeout=30)
        assert h.wait(30), h.error
        assert peer("arrivals", 10, 1)[0][2]
        got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
        for a, b in zip(so.tolist(), do.tolist()):
            want[b: b + 16 * KiB] = src[a: a + 16 * KiB]
        assert np.array_equal(got, want)
        peer("forget", rid)
        peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


@pytest.mark.parametrize("strided", ["source", "destination"])
def test_head_slice_rows_announce_whole_pages(pair, strided):
    """Token-major head slices: 512 B rows, strided on one side and back to back within a page
    on the other (TP 2 -> 4 and 4 -> 2). Each side posts and checks the page, not 16 rows; a few
    put runs ride along. Bytes land exactly and nothing else changes."""
    t, src, peer, pid = pair
    pages = np.random.default_rng(5).choice(POOL // (32 * KiB) - 2, 40, replace=False) * 32 * KiB
    strided_off = (pages[:, None] + np.arange(16) * 1024).ravel()    # 512 B of every 1 KiB row
    whole_off = (pages[::-1, None] + 16 * KiB + np.arange(16) * 512).ravel()   # pages of 8 KiB
    so, do = (strided_off, whole_off) if strided == "source" else (whole_off, strided_off)
    n = np.full(len(so), 512)
    big = ([POOL - 64 * KiB], [POOL - 64 * KiB], [64 * KiB], False)   # one put
    plan = _plan([(so, do, n, False), big])
    puts, announced, nput, packed = t._prepare(t._peers[pid], plan)
    runs = np.frombuffer(announced, "<i8").reshape(3, -1)
    assert nput == 1 and len(puts) == 1
    assert runs.shape[1] == 1 + (40 if strided == "source" else 640)   # the put, then the packed runs
    assert len(packed[2]) == (640 if strided == "source" else 40)
    peer("expect", "r-rows", _whole(POOL))
    h = t.submit(pid, "r-rows", plan, timeout=30)
    assert h.wait(30), h.error
    assert peer("arrivals", 10, 1)[0][2]
    got, want = peer.pool(), np.full(POOL, CANARY, np.uint8)
    for a, b, c in zip([*so.tolist(), *big[0]], [*do.tolist(), *big[1]], [*n.tolist(), *big[2]]):
        want[b: b + c] = src[a: a + c]
    assert np.array_equal(got, want)
    peer("forget", "r-rows")
    peer("fill", np.full(POOL, CANARY, np.uint8).tobytes())


def test_ucx_settings_defaults_give_way_to_environment_and_caller():
    from kvxfer_transports.ucx import UCX_DEFAULTS, ucx_settings
    assert ucx_settings(None, None, {}) == UCX_DEFAULTS
    assert "SYSV_FIFO_SIZE" not in ucx_settings(None, None, {"UCX_SYSV_FIFO_SIZE": "256"})
    assert ucx_settings("tcp", {"SYSV_FIFO_SIZE": "64", "RNDV_THRESH": "8192"}, {}) == {
        "SYSV_FIFO_SIZE": "64", "RNDV_THRESH": "8192", "TLS": "tcp"}


def test_peers_with_different_shared_memory_settings_refuse_to_connect(monkeypatch):
    """A sender indexes the receiver's shared-memory FIFO with its own size: a pair that
    disagrees would hang, so connect() refuses it and names the setting."""
    monkeypatch.delenv("UCX_SYSV_FIFO_SIZE", raising=False)
    a = get_transport("ucx")
    b = get_transport("ucx", ucx_config={"SYSV_FIFO_SIZE": "256"})
    try:
        for t in (a, b):
            t.register([torch.zeros(4096, dtype=torch.uint8)])
        with pytest.raises(TransportError, match="UCX_SYSV_FIFO_SIZE 4096 here, 256 at the peer"):
            a.connect(b.descriptor())
        old = {k: v for k, v in b.descriptor().items() if k != "shm_settings"}   # a peer that does not say
        with pytest.raises(TransportError, match="UCX_SYSV_FIFO_SIZE 256 here, unset at the peer"):
            b.connect(old)
        assert a.connect(a.descriptor()) == a.id   # the same settings connect
    finally:
        a.close()
        b.close()


def test_contract_edges():
    t = get_transport("ucx", tls="tcp")
    t.register([torch.zeros(4096, dtype=torch.uint8)])
    h = t.submit("nobody", "r", _plan([([0], [0], [16], False)]), timeout=1)
    assert h.poll() == TransferStatus.FAILED and isinstance(h.error, PeerError)
    with pytest.raises(TransportError):
        t.connect({"id": "x"})
    t.close()
    t.close()  # idempotent
    h = t.submit("nobody", "r", _plan([([0], [0], [16], False)]), timeout=1)
    assert h.poll() == TransferStatus.FAILED


def test_killed_peer_mid_transfer_fails_both_ways(pair):
    """Runs last per TLS: kills the pair's peer while a transfer to it and one from it are in flight.

    White box, to hit the worst moments deterministically: the peer dies after it sent GO
    and before our puts (over shared memory UCX would abort() on the dead pid without the
    transport's log hook), and the peer's own transfer to us is stuck after its GO.
    """
    t, src, peer, pid = pair
    t.expect("r-from-dead", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, MiB)))
    my_id = peer("connect", t.descriptor())
    peer("submit", my_id, "r-from-dead", [([0], [0], [MiB], False)], 30.0, True)
    end = time.monotonic() + 10
    while not t._in and time.monotonic() < end:  # its ANNOUNCE arrived and we answered GO
        time.sleep(0.005)
    assert t._in, "the peer's transfer never started"
    peer("expect", "r-to-dead", _whole(POOL))
    real_start_puts = t._start_puts

    def kill_then_put(out, dtag):
        peer.kill()
        real_start_puts(out, dtag)
    t._start_puts = kill_then_put
    start = time.monotonic()
    h = t.submit(pid, "r-to-dead", _plan([([0], [0], [8 * MiB], False), ([0], [9 * MiB], [4 * KiB], True)]),
                 timeout=30)
    assert not h.wait(30)
    assert isinstance(h.error, PeerError | TransferTimeout), h.error
    got = []
    while not got and time.monotonic() - start < 30:
        got = t.arrivals(0.1)
    assert [(a.request_id, a.ok) for a in got] == [("r-from-dead", False)], got
    assert time.monotonic() - start < 10, "a dead peer must be noticed by heartbeats, well before the deadline"
    t._start_puts = real_start_puts
    h2 = t.submit(pid, "r-to-dead", _plan([([0], [0], [4096], False)]), timeout=2)
    assert not h2.wait(10) and h2.poll() == TransferStatus.FAILED


def test_no_ucx_warning_noise_at_start_up():
    """ucxx sets UCX_MEMTYPE_CACHE for old UCX releases; the bundled UCX warns about it at every
    context unless the transport drops it: a rank's log starts clean."""
    import subprocess
    import sys
    code = "import kvxfer; t = kvxfer.get_transport('ucx'); t.close(); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "UCX  WARN" not in r.stderr, r.stderr[-2000:]
