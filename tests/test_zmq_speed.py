"""Guards of the zmq transport's fast paths (no timings: each checks the state a fix relies on,
and every transfer checks its bytes)."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import torch
import zmq
from xfer_peer import raw_plan

from kvxfer.copy import execute_plan
from kvxfer.grant import ByteRanges
from kvxfer.transport.kit import Call
from kvxfer.transport.registry import get_transport


def _on_io(t, fn):
    """Run ``fn()`` on the transport's I/O thread, after every command queued before it."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    t.commands.put(Call(fn, (), fut))
    return fut.result(timeout=30)


def _flags(t, sock) -> int:
    return dict(t.sockets.poller.sockets).get(sock, 0)


def test_waiting_for_a_staging_frame_never_polls_for_writable():
    """While every transfer of a peer waits for a staging frame, its socket is not polled for
    POLLOUT: it is writable, so poll would return at once and the I/O thread would spin a core
    until zmq frees a frame. Once frames are free again, the transfer completes byte-exact."""
    tx, rx = get_transport("zmq", staging_frames=1), get_transport("zmq")
    try:
        rng = np.random.default_rng(0)
        size, k, run = 8 << 20, 64, 4000                     # 64 scattered runs: packed, staged
        src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
        dst = torch.zeros(size, dtype=torch.uint8)
        tx.register([src]), rx.register([dst])
        peer = tx.connect(rx.descriptor())
        do = np.arange(k) * 8192
        plan = raw_plan(np.zeros(k), rng.integers(0, size - run, k), np.zeros(k), do, np.full(k, run))
        rx.expect("r", ByteRanges(np.zeros(k), do, np.full(k, run)))
        tx.staging_pool.available = lambda: False              # the ring is exhausted (zmq holds every frame)
        handle = tx.submit(peer, "r", plan, timeout=30)
        sock = tx.sender.peers[peer].sock
        flags = _on_io(tx, lambda: _flags(tx, sock))        # after the submit's first pump
        assert tx.sender.peers[peer].sending, "the transfer should be waiting for a frame"
        assert not flags & zmq.POLLOUT, "polling a writable socket while starved spins the loop"
        del tx.staging_pool.available                          # frames free again: the loop's tick resumes
        handle.result(30)
        want = torch.zeros(size, dtype=torch.uint8)
        execute_plan(plan, [src], [want])
        assert torch.equal(dst, want)
    finally:
        tx.close(), rx.close()


def test_scattered_4k_pages_are_byte_exact_with_a_small_ring():
    """1000 scattered 4 KiB runs (4 MiB packed, in more than one message with 1 MiB frames)
    through a ring of two frames land byte-exact; one arrival says so."""
    tx = get_transport("zmq", staging_frames=2, frame_bytes=1 << 20, frames_per_message=1)
    rx = get_transport("zmq")
    try:
        rng = np.random.default_rng(1)
        size, k, run = 64 << 20, 1000, 4096
        src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
        dst = torch.zeros(size, dtype=torch.uint8)
        tx.register([src]), rx.register([dst])
        peer = tx.connect(rx.descriptor())
        so = rng.choice(size // run, k, replace=False) * run
        do = rng.choice(size // run, k, replace=False) * run
        plan = raw_plan(np.zeros(k), so, np.zeros(k), do, np.full(k, run))
        rx.expect("r", ByteRanges(np.zeros(k), do, np.full(k, run)))
        tx.submit(peer, "r", plan, timeout=30).result(30)
        want = torch.zeros(size, dtype=torch.uint8)
        execute_plan(plan, [src], [want])
        assert torch.equal(dst, want)
        arrivals = rx.arrivals(timeout=5)
        assert [(a.request_id, a.ok, a.nbytes) for a in arrivals] == [("r", True, k * run)]
    finally:
        tx.close(), rx.close()


def _framer(regions: list[torch.Tensor], **opts):
    from kvxfer.transport.kit import StagingPool
    from transports.zmq.frames import Framer
    from transports.zmq.options import ZMQOptions
    from transports.zmq.regions import Regions
    options = ZMQOptions(**opts)
    r = Regions()
    r.set(regions)
    staging = StagingPool(frames=2, frame_bytes=options.frame_bytes * (options.frames_per_message + 1), name="test")
    return Framer(options, r, staging), staging, options


def test_framed_messages_carry_every_run_within_the_message_budget():
    """``Framer.frames`` on thousands of small runs over several region pairs (in plan order,
    and shuffled) plus a few long ones: each packed message is at most the budget (its runs and
    their header entries) plus at most its last run, the messages together land every byte where
    its run says, and the totals match. Zero-copy runs go as parts of their own."""
    rng = np.random.default_rng(11)
    src = [torch.from_numpy(rng.integers(0, 256, 4 << 20, dtype=np.uint8)) for _ in range(3)]
    framer, staging, o = _framer(src, frame_bytes=64 << 10, frames_per_message=2, zero_copy_min=96 << 10)
    budget = o.frame_bytes * o.frames_per_message
    k = 6000
    n = rng.integers(1, 1500, k)
    n[rng.choice(k, 5, replace=False)] = 200 << 10                 # a few zero-copy runs, split in frames
    sr, dr = rng.integers(0, 3, k), rng.integers(0, 2, k)
    for shuffled in (True, False):   # region pairs in random order first (the framer sorts them), then sorted
        if not shuffled:
            order = np.lexsort((sr, dr))
            sr, dr, n = sr[order], dr[order], n[order]
        so = rng.integers(0, (4 << 20) - (200 << 10), k)
        do = np.cumsum(n) - n                                   # every run its own destination bytes
        dst = [torch.zeros(int(n.sum()), dtype=torch.uint8) for _ in range(2)]
        nbytes = 0
        for msg in framer.frames(sr, so, dr, do, n):
            assert msg is not None   # two staging frames, each given back below
            hdr, parts, stage, _ = msg
            runs = np.frombuffer(hdr, "<i8").reshape(3, -1)
            payload = b"".join(bytes(p) for p in parts)
            if stage is not None:   # packed: its runs start within one budget, the last may run over
                assert len(payload) <= budget + o.frame_bytes <= stage.numel()   # runs are cut at frame_bytes
            p = 0
            for r, off, c in runs.T.tolist():
                dst[r][off: off + c] = torch.frombuffer(bytearray(payload[p: p + c]), dtype=torch.uint8)
                p += c
            assert p == len(payload)
            nbytes += p
            staging.put(stage)
        assert nbytes == int(n.sum())
        want = [torch.zeros_like(d) for d in dst]
        for s_, o_, r, d_, c in zip(sr.tolist(), so.tolist(), dr.tolist(), do.tolist(), n.tolist()):
            want[r][d_: d_ + c] = src[s_][o_: o_ + c]
        assert all(torch.equal(a, b) for a, b in zip(dst, want)), shuffled


def test_pairs_in_order_is_exactly_when_sorting_by_region_pair_changes_nothing():
    from transports.zmq.frames import pairs_in_order
    rng = np.random.default_rng(12)
    for _ in range(300):
        k = int(rng.integers(2, 40))
        sr, dr = rng.integers(0, 3, k), rng.integers(0, 3, k)
        if rng.random() < 0.5:
            order = np.lexsort((sr, dr))
            sr, dr = sr[order], dr[order]
        assert pairs_in_order(sr, dr) == bool((np.lexsort((sr, dr)) == np.arange(k)).all()), (sr, dr)


def test_a_frame_with_device_regions_gathers_the_same_bytes_region_pair_by_region_pair():
    """A packed frame with any region off the host gathers each region pair's runs with an
    indexed copy (``rows.gather_rows``) instead of one compiled call. Here the regions are on the
    CPU but marked off the host, so that path runs anywhere: every message (header and bytes)
    must be the one the host path makes."""
    rng = np.random.default_rng(13)
    src = [torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8)) for _ in range(2)]
    k = 3000
    n = np.full(k, 512, np.int64)
    sr, dr = np.repeat([0, 1, 0], k // 3), np.repeat([0, 0, 1], k // 3)
    so = rng.integers(0, (1 << 20) // 512, k) * 512
    do = np.arange(k, dtype=np.int64) * 1024
    out = []
    for mark_device in (False, True):
        framer, staging, _ = _framer(src, frame_bytes=128 << 10, frames_per_message=2)
        if mark_device:
            framer.regions.is_host = np.zeros(len(src) + 1, bool)
        msgs = []
        for msg in framer.frames(sr, so, dr, do, n):
            hdr, parts, stage, last = msg
            msgs.append((hdr, b"".join(bytes(p) for p in parts), last))
            staging.put(stage)
        out.append(msgs)
    assert len(out[0]) > 3 and out[0] == out[1]
