"""The zmq sender releases a transfer's source only once zmq no longer reads it, whatever the
receiver says (issue 34, "Use after release over zmq").

The receiver is a raw pyzmq ROUTER speaking the data protocol with its own msgpack frames: it
answers the connect probe, acks the transfer after its first data message (a lying or early
receiver), and then stops reading, so the sender's later messages sit in zmq, still referencing
the source. Before the fix the ack released the source at once (``finish(release=True)``): a
caller that reused its memory then had the new bytes sent (measured: 51 MB read after the
release). Now the handle is done (the receiver said so) but the source stays held until zmq's
trackers say it let go of every frame; the receiver then sees only the bytes that were there
before the release.
"""
from __future__ import annotations

import struct
import threading
import time

import msgpack
import numpy as np
import torch
import zmq

from kvxfer.plan import RunGroup, TransferPlan
from kvxfer.transport.base import TransferStatus
from kvxfer.transport.registry import get_transport

SIZE = 32 << 20   # the sender queues 8 messages of 4 MiB; the kernel holds a few MiB of them
REUSED = 0xEE    # what the caller writes into its memory once the transport released it


class EarlyAcker(threading.Thread):
    """Acks a transfer after its first data message, then reads nothing until ``drain`` is set;
    keeps every run it received as (destination offset, bytes)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.rcvhwm = 1
        self.sock.setsockopt(zmq.RCVBUF, 64 << 10)   # the kernel holds little: zmq holds the rest
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.last_endpoint.decode()
        self.acked, self.drain, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.runs: list[tuple[int, bytes]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            if self.acked.is_set() and not self.drain.is_set():
                time.sleep(0.01)   # stopped reading: the sender's messages wait in zmq
                continue
            if not self.sock.poll(20):
                continue
            rid, hdr, *parts = self.sock.recv_multipart()
            h = msgpack.unpackb(hdr, raw=False)
            if h["t"] == "p":
                self.sock.send_multipart([rid, msgpack.packb({"t": "p", **({"n": h["n"]} if "n" in h else {})})])
                continue
            k = len(h["runs"]) // 24   # int64 LE: k regions, k offsets, k lengths
            v = struct.unpack(f"<{3 * k}q", h["runs"])
            offsets, lengths = v[k: 2 * k], v[2 * k:]
            data = parts if len(parts) == k else [parts[0][sum(lengths[:i]): sum(lengths[: i + 1])] for i in range(k)]
            self.runs += list(zip(offsets, data))
            if not self.acked.is_set():
                self.sock.send_multipart([rid, msgpack.packb({"t": "a", "x": [h["x"]]})])
                self.acked.set()

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.sock.close(0)
        self.ctx.term()


def honest_after(tx, src: torch.Tensor) -> None:
    """The victim (the sender) afterwards: its I/O thread alive, and an honest receiver gets a
    transfer from it byte-exact, with every byte around the grant still the canary."""
    from kvxfer.grant import ByteRanges
    assert tx.broken is None and tx.io.alive, f"the sender's I/O thread died: {tx.broken}"
    n, canary = 1 << 20, 0xA5
    with get_transport("zmq") as honest:
        dst = torch.full((3 * n,), canary, dtype=torch.uint8)
        honest.register([dst])
        honest.expect("honest.1", ByteRanges(np.zeros(1), np.array([n]), np.array([n])))
        z = np.zeros(1, np.int64)
        plan = TransferPlan((RunGroup(z, z, z, np.array([n]), z, z, np.array([n]), False),))
        assert tx.submit(tx.connect(honest.descriptor()), "honest.1", plan, timeout=10).wait(10)
        assert torch.equal(dst[n: 2 * n], src[:n]), "the honest transfer is not byte-exact"
        assert bool((dst[:n] == canary).all() and (dst[2 * n:] == canary).all()), "a byte outside the grant changed"


def test_an_early_ack_does_not_release_a_source_zmq_still_reads():
    import os
    import threading
    rx = EarlyAcker()
    rx.start()
    tx = get_transport("zmq")
    try:
        src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
        original = src.clone()
        tx.register([src])
        peer = tx.connect({"endpoint": rx.endpoint})
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        z = np.zeros(1, np.int64)
        plan = TransferPlan((RunGroup(z, z, z, z, z, z, np.array([SIZE]), False),))
        h = tx.submit(peer, "early.1", plan, timeout=30)
        assert rx.acked.wait(10) and h.wait(10), "the receiver's ack did not complete the handle"
        time.sleep(0.5)   # the sender's I/O thread handles the ack; zmq still holds later messages
        held = tx.fencing()["sources"]
        released_early = h.source_released
        if released_early:
            src.fill_(REUSED)   # the caller reuses memory the transport said it no longer reads
        rx.drain.set()
        assert released_early is False, "the source was released while zmq still held frames that read it"
        assert held == 1, f"fencing() shows {held} held sources"
        end = time.monotonic() + 10
        while not h.source_released and time.monotonic() < end:
            time.sleep(0.02)
        assert h.source_released, "the source was never released after zmq let go of it"
        assert h.poll() == TransferStatus.DONE and tx.fencing()["sources"] == 0
        src.fill_(REUSED)   # reused now: nothing of it may reach the receiver any more
        time.sleep(0.3)
        assert rx.runs, "the receiver got nothing"
        after = sum(int((torch.frombuffer(bytearray(b), dtype=torch.uint8) !=
                         original[off: off + len(b)]).sum()) for off, b in rx.runs)
        assert after == 0, f"{after} bytes the receiver got were read from the source after its release"
        honest_after(tx, src)
        grew = len(os.listdir("/proc/self/fd")) - fds, threading.active_count() - threads
        assert grew[0] <= 8 and grew[1] <= 1, f"fds and threads grew by {grew} (bounds: 8 fds, 1 thread)"
    finally:
        rx.close()
        tx.close()
