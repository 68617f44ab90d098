"""UCX staged frames on real endpoints (issue #18): packed rows gathered frame by frame into a
fixed send ring and received into a fixed receive ring, on the CPU through the ways a host
transfer stages (``stage_host="always"``, a peer in another network namespace, a TCP-only
UCX_TLS). Transfers far larger than the rings arrive byte-exact, nothing between the rows is
touched, the rings never grow and waiting for a slot is counted; several transfers share the
rings; a sender killed mid-stream leaves no slot free that a receive still writes, and the next
transfer is byte-exact."""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from waiting import arrivals_of  # noqa: E402
from xfer_peer import CANARY, PeerProcess, pattern, plan_to_json, raw_plan, region_seed  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.metrics import REGISTRY  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

FRAME, ROW, GAP = 16 << 10, 512, 256
# Rendezvous for every frame: a send completes only once the receiver took it, so a small send
# ring runs out (what a slow network does), deterministically.
RING = {"frame_bytes": FRAME, "staging_frames": 2, "ucx_config": {"RNDV_THRESH": "4096"}}
WAYS = {"always": {"stage_host": "always"}, "far": {}, "tcp": {"tls": "tcp"}, "in_place": {"tls": "tcp"}}
RX_ONLY = {"in_place": {"stage_host": "never"}}   # the receiver takes staged frames in place (its iovs)


def _far(desc: dict) -> dict:
    """The descriptor as a peer in another network namespace of this kernel writes it."""
    ids = desc["host"].split("/")
    return {**desc, "host": "/".join([ids[0], ids[1], str(int(ids[2]) + 1)])}


def _pair(way: str, **opts):
    o = {**RING, **WAYS[way], **opts}
    return get_transport("ucx", **{**o, **RX_ONLY.get(way, {})}), get_transport("ucx", **o)


def _rows(rows: int, seed: int, src_size: int, base: int = 0):
    """``rows`` 512 B rows from scattered source places to ``base`` + k * 768 (a 256 B gap after each)."""
    so = np.random.default_rng(seed).permutation(src_size // 1024)[:rows].astype(np.int64) * 1024
    do = base + np.arange(rows, dtype=np.int64) * (ROW + GAP)
    return so, do


def _check(dst: np.ndarray, src: np.ndarray, so, do) -> None:
    got = dst.reshape(-1)
    rows = got[do[:, None] + np.arange(ROW)]
    assert np.array_equal(rows, src[so[:, None] + np.arange(ROW)]), "a row differs"
    gaps = got[do[:, None] + ROW + np.arange(GAP)]
    assert (gaps == CANARY).all(), "a byte between the rows changed"


def until(cond, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _frames(name: str) -> float:
    return REGISTRY.get_sample_value("kvxfer_staging_frames", {"transport": name}) or 0.0


@pytest.mark.parametrize("way", sorted(WAYS))
def test_staged_transfers_far_larger_than_the_ring_are_byte_exact(way):
    """8192 rows (4 MiB, 256 frames of 16 KiB through rings of 2), then four such transfers at
    once: byte-exact, the same two slots throughout, waits counted. The receiver takes them
    through its ring too, except with stage_host "never" ("in_place": cut as the sender cut them)."""
    rx, tx = _pair(way)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = torch.full((5 * 6 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        desc = rx.descriptor()
        peer = tx.connect(_far(desc) if way == "far" else desc)
        rows = 8192
        jobs = [(f"s.{k}", *_rows(rows, k, 16 << 20, base=k * (6 << 20))) for k in range(5)]
        zz, z = np.zeros(1, np.int64), np.zeros(rows, np.int64)
        for rid, _, _ in jobs:
            rx.expect(rid, ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        rid, so, do = jobs[0]
        h = tx.submit(peer, rid, raw_plan(z, so, z, do, np.full(rows, ROW)), timeout=60)
        assert h.wait(60), h.error
        ring = {side: [b.data_ptr() for b in r._ring] for side, r in (("send", tx.send_ring), ("recv", rx.recv_ring))}
        frames = _frames("ucx-send"), _frames("ucx-recv")
        hs = [tx.submit(peer, rid, raw_plan(z, so, z, do, np.full(rows, ROW)), timeout=60) for rid, so, do in jobs[1:]]
        for h in hs:
            assert h.wait(60), h.error
        for _, so, do in jobs:
            _check(dst.numpy(), src.numpy(), so, do)
        assert (dst.numpy()[5 * (6 << 20) - (6 << 20) + rows * (ROW + GAP):] == CANARY).all()
        s, r = tx.staging(), rx.staging()
        assert s["send"]["frames"] == 2 and s["send"]["peak"] <= 2 and s["send"]["waits"] > 0, s
        # a host receiver takes staged frames through its ring unless told "never" (then in place)
        assert r["recv"]["frames"] == (0 if way == "in_place" else 2) and r["recv"]["peak"] <= 2, r
        assert r["recv"]["in_use"] == 0, r
        assert s["recv"]["frames"] == r["send"]["frames"] == 0, "a ring that moved nothing was allocated"
        # the very same slots: the rings never grew or were replaced
        assert [b.data_ptr() for b in tx.send_ring._ring] == ring["send"]
        assert [b.data_ptr() for b in rx.recv_ring._ring] == ring["recv"]
        assert (_frames("ucx-send"), _frames("ucx-recv")) == frames
    finally:
        tx.close()
        rx.close()


def test_the_receive_ring_waits_for_its_slots():
    """A receive ring of one slot and a send ring of eight: frames arrive faster than one slot
    takes them, the receiver waits (counted) and leaves them in UCX, and nothing is lost."""
    rx = get_transport("ucx", frame_bytes=FRAME, staging_frames=1, stage_host="always")
    tx = get_transport("ucx", frame_bytes=FRAME, staging_frames=8, stage_host="always")
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    dst = torch.full((8 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        so, do = _rows(8192, 9, 8 << 20)
        z = np.zeros(len(so), np.int64)
        rx.expect("w.1", ByteRanges(z[:1], z[:1], np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "w.1", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=60)
        assert h.wait(60), h.error
        _check(dst.numpy(), src.numpy(), so, do)
        r = rx.staging()["recv"]
        assert r["frames"] == 1 and r["peak"] == 1 and r["waits"] > 0, r
    finally:
        tx.close()
        rx.close()


def test_frames_larger_than_the_receive_ring_are_refused():
    """A sender with larger frames than the receiver's ring slots: refused whole, in words, and
    nothing lands (never a bigger slot)."""
    rx = get_transport("ucx", frame_bytes=FRAME, staging_frames=2, stage_host="always")
    tx = get_transport("ucx", frame_bytes=4 * FRAME, staging_frames=2, stage_host="always")
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.full((4 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        so, do = _rows(1024, 1, 4 << 20)
        z = np.zeros(len(so), np.int64)
        rx.expect("big.1", ByteRanges(z[:1], z[:1], np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "big.1", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=20)
        assert not h.wait(20) and "staging frames" in str(h.error), h.error
        assert (dst.numpy() == CANARY).all()
        assert rx.staging()["recv"]["frames"] == 0
    finally:
        tx.close()
        rx.close()


def test_a_frame_sent_twice_does_not_stand_in_for_another():
    """A sender that sends its first frames again before the rest: the receiver refuses the
    transfer at the first repeat instead of counting it complete with the last frames missing."""
    rx, tx = _pair("always")
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    dst = torch.full((4 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        so, do = _rows(1024, 2, 4 << 20)   # 512 KiB: 32 frames of 16 KiB
        z = np.zeros(len(so), np.int64)
        rx.expect("dup.1", ByteRanges(z[:1], z[:1], np.full(1, dst.numel(), np.int64)))
        pump, again = tx.sender.pump_frames, [True]

        def repeat(o):   # once the first frames left: back to frame 0
            done = pump(o)
            if again and o.staging.next > 0:
                again.clear()
                o.staging.next = 0
                return False
            return done
        tx.sender.pump_frames = repeat
        h = tx.submit(peer, "dup.1", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=20)
        assert not h.wait(20) and "malformed frame" in str(h.error), h.error
        arr = arrivals_of(rx, "dup.1")
        assert arr and not arr[0].ok and "malformed frame" in arr[0].reason, arr
    finally:
        tx.close()
        rx.close()


def test_a_transfer_that_times_out_mid_stream_gives_every_slot_back():
    """A transfer whose deadline passes while its frames stream (a slow receiver): it fails on
    both sides, its frames in flight end (received, or dropped as frames of an ended transfer),
    every slot of both rings comes back without a new one, and the next transfer is byte-exact."""
    rx, tx = _pair("always")
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))
    dst = torch.full((16 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        land = rx.receiver.land

        def slow(packed, data):
            time.sleep(0.004)
            land(packed, data)
        rx.receiver.land = slow
        so, do = _rows(16384, 13, 16 << 20)   # 512 frames: ~2 s at 4 ms a frame
        z, zz = np.zeros(len(so), np.int64), np.zeros(1, np.int64)
        rx.expect("t.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "t.1", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=0.5)
        assert not h.wait(10) and "deadline" in str(h.error), h.error
        assert until(lambda: tx.staging()["send"]["in_use"] == 0 and rx.staging()["recv"]["in_use"] == 0, 10), \
            (tx.staging(), rx.staging())
        del rx.receiver.land
        rx.forget("t.1")
        dst.fill_(CANARY)
        so, do = _rows(4096, 14, 16 << 20)
        z = np.zeros(len(so), np.int64)
        rx.expect("t.2", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "t.2", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=30)
        assert h.wait(30), h.error
        _check(dst.numpy(), src.numpy(), so, do)
        s, r = tx.staging()["send"], rx.staging()["recv"]
        assert s["frames"] == r["frames"] == 2 and s["peak"] <= 2 and r["peak"] <= 2, (s, r)
    finally:
        tx.close()
        rx.close()


def test_a_sender_killed_mid_stream_leaves_no_written_slot_free(tmp_path):
    """A sender process (UCX over TCP, both rings: ``stage_host="always"``) is killed while its
    frames stream into a receive ring of two. The transfer fails; every slot a receive of it may still write stays
    taken until that receive completed; a new sender's transfer then lands byte-exact."""
    opts = {"tls": "tcp", "frame_bytes": FRAME, "staging_frames": 2, "heartbeat": 0.1, "peer_timeout": 1.0,
            "ucx_config": {"RNDV_THRESH": "4096"}, "stage_host": "always"}
    size = 32 << 20
    rx = get_transport("ucx", **opts)
    dst = torch.full((size,), CANARY, dtype=torch.uint8)
    rx.register([dst])
    seed = 4
    src = pattern(region_seed(seed, 0), size)
    procs = []
    try:
        def sender():
            p = PeerProcess(tmp_path / f"tx{len(procs)}.err")
            procs.append(p)
            p.call("init", transport="ucx", sizes=[size], fill="seed", seed=seed, options=opts)
            return p, p.call("connect", descriptor=rx.descriptor())["peer"]

        land = rx.receiver.land

        def slow(packed, data):   # a slow receiver (4 ms a frame): the kill finds frames streaming
            time.sleep(0.004)
            land(packed, data)
        rx.receiver.land = slow
        rows = 32768                               # 16 MiB of rows: 1024 frames
        so, do = _rows(rows, 3, size)
        z, zz = np.zeros(rows, np.int64), np.zeros(1, np.int64)
        held = 0
        for attempt in range(3):   # under load the kill may find no receive in flight: kill another
            rid = f"k.{attempt}"
            tx, peer = sender()
            rx.expect(rid, ByteRanges(zz, zz, np.full(1, size, np.int64)))
            tx.call("submit", peer=peer, request_id=rid,
                    plan=plan_to_json(raw_plan(z, so, z, do, np.full(rows, ROW))), timeout=60)
            end = time.monotonic() + 30
            while rx.staging()["recv"]["peak"] < 1 and time.monotonic() < end:   # frames are streaming
                time.sleep(0.001)
            # stopped first: what it sent is matched here, and the receives of its rendezvous frames
            # wait for data that never comes; stopped again until one does (under load a stop may
            # find none sent), then killed
            for _ in range(100):
                tx.signal(signal.SIGSTOP)
                if until(lambda: receiving(rx), 0.3):
                    break
                tx.signal(signal.SIGCONT)
                time.sleep(0.02)
            tx.signal(signal.SIGKILL)
            tx.proc.wait(10)   # reaped: a zombie still has its pid and start time (not proven dead)
            end = time.monotonic() + 15
            arrived = []
            while not arrived and time.monotonic() < end:
                arrived = [a for a in rx.arrivals(0.1) if a.request_id == rid]
            assert arrived and not arrived[0].ok, arrived
            held = rx.fencing()["transfers"]
            if held:
                break
            rx.forget(rid)
        ring = rx.recv_ring
        assert held, "in 3 kills no receive of the killed sender was left in flight: nothing was tested"
        for _ in range(50):   # while the I/O thread runs: never a free slot under a live receive
            rx.staging()   # frees every slot whose receive completed (or whose hold ended)
            with ring._lock:
                free = {ring._ring[k].data_ptr() for k in ring._free}
            live = {slot.data_ptr() for req, slot in list(rx.leftovers.zombies) if isinstance(slot, torch.Tensor)
                    and slot.numel() > 1 and not req.completed}
            assert not free & live, "a slot a receive may still write is free for reuse"
            time.sleep(0.01)
        assert rx.staging()["recv"]["frames"] == 2
        # the dead sender's receives held their slots: freed once it is proven dead, not before
        assert until(lambda: rx.fencing()["released"] >= 1 and rx.staging()["recv"]["in_use"] == 0, 10), \
            (rx.fencing(), rx.staging())
        rx.forget(rid)
        del rx.receiver.land
        dst.fill_(CANARY)
        # a new sender: byte-exact through the same ring
        tx2, peer2 = sender()
        so, do = _rows(8192, 5, size)
        z = np.zeros(len(so), np.int64)
        rx.expect("k.new", ByteRanges(zz, zz, np.full(1, size, np.int64)))
        tx2.call("submit", peer=peer2, request_id="k.new",
                 plan=plan_to_json(raw_plan(z, so, z, do, np.full(len(so), ROW))), timeout=60)
        res = tx2.call("wait", request_ids=["k.new"], wait_s=60)["results"]["k.new"]
        assert res["status"] == "DONE", res
        _check(dst.numpy(), src, so, do)
        assert rx.staging()["recv"]["frames"] == 2
    finally:
        for p in procs:
            p.close()
        rx.close()


def receiving(rx) -> bool:
    """A receive of a staged frame is posted and not complete (read from the test's thread)."""
    return any(i.staging is not None and any(not r[0].completed for r in list(i.staging.reqs))
               for i in list(rx.receiver.incoming.values()))


def test_ucx_tls_from_the_environment_counts_as_network_only(monkeypatch):
    """UCX_TLS=tcp set in the environment (no ``tls`` option, a peer on this host): the sender
    stages (stage_host "network") and the receiver takes the frames through its ring."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    rx, tx = _pair("far")
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.full((1 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        so, do = _rows(1024, 3, 4 << 20)
        z, zz = np.zeros(len(so), np.int64), np.zeros(1, np.int64)
        rx.expect("env.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "env.1", raw_plan(z, so, z, do, np.full(len(so), ROW)), timeout=30)
        assert h.wait(30), h.error
        _check(dst.numpy(), src.numpy(), so, do)
        assert tx.staging()["send"]["frames"] == 2 and rx.staging()["recv"]["frames"] == 2, \
            (tx.staging(), rx.staging())
    finally:
        tx.close()
        rx.close()


def test_runs_to_a_far_peer_over_tcp_travel_packed():
    """A peer in another network namespace reached over TCP has UCX error handling on, where UCX
    emulates puts in software (3x slower): runs a put would move (256 KiB each) travel packed
    instead (frames, in place: pieces this big are not staged), byte-exact."""
    rx, tx = _pair("far")
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    dst = torch.full((6 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(_far(rx.descriptor()))
        n = 256 << 10
        so = np.arange(4, dtype=np.int64)[::-1].copy() * n
        do = np.arange(4, dtype=np.int64) * (n + 4096)
        z, zz = np.zeros(4, np.int64), np.zeros(1, np.int64)
        rx.expect("far.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        plan = raw_plan(z, so, z, do, np.full(4, n))
        puts, _, nput, packed = tx.planner.prepare(tx.peers[peer], plan)
        assert (puts, nput) == (b"", 0) and packed is not None and len(packed[2]) == 4, (puts, nput)
        h = tx.submit(peer, "far.1", plan, timeout=30)
        assert h.wait(30), h.error
        got, want = dst.numpy(), src.numpy()
        for s_, d_ in zip(so, do):
            assert np.array_equal(got[d_:d_ + n], want[s_:s_ + n])
            assert (got[d_ + n:d_ + n + 4096] == CANARY).all()
        assert tx.staging()["send"]["frames"] == 0, tx.staging()   # big pieces: read in place
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("way", ["far", "tcp"])
def test_staged_frames_into_long_destination_runs_land_in_place(way):
    """A head slice into token-major slots: 512 B rows scattered on the sender (staged through its
    ring) land in one long destination run. The receiver posts each frame in place (its pieces
    are long: ``Receiver.rings_host``), one copy less than its ring; byte-exact, nothing past the
    run touched, no receive slot taken. Rows with gaps between them still take the ring (above)."""
    rx, tx = _pair(way)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(15))
    dst = torch.full((5 << 20,), CANARY, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        desc = rx.descriptor()
        peer = tx.connect(_far(desc) if way == "far" else desc)
        rows = 8192   # 4 MiB: 256 frames of 16 KiB through a send ring of 2
        so = np.random.default_rng(16).permutation((16 << 20) // 1024)[:rows].astype(np.int64) * 1024
        do = 4096 + np.arange(rows, dtype=np.int64) * ROW
        z, zz = np.zeros(rows, np.int64), np.zeros(1, np.int64)
        rx.expect("long.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "long.1", raw_plan(z, so, z, do, np.full(rows, ROW)), timeout=60)
        assert h.wait(60), h.error
        got, want = dst.numpy(), src.numpy()
        assert np.array_equal(got[4096:4096 + rows * ROW].reshape(rows, ROW), want[so[:, None] + np.arange(ROW)])
        assert (got[:4096] == CANARY).all() and (got[4096 + rows * ROW:] == CANARY).all()
        s, r = tx.staging(), rx.staging()
        assert s["send"]["frames"] == 2 and r["recv"]["frames"] == 0, (s, r)   # staged, then in place
    finally:
        tx.close()
        rx.close()
