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
