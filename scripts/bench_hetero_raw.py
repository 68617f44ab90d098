"""The raw zmq processes of ``bench_hetero.py``: a pairing's bytes with pyzmq alone (no kvxfer
code), one process per rank (``raw_main``, started as the rank processes are), a case per
pairing, and the bytes kvxfer's plans move between each prefill and decode rank
(``plan_bytes``): what the shape itself costs on this box.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import zmq
from bench_hetero_ranks import CHUNK, HEADS, Config, make_layout, pack, unpack


def raw_pattern(case: int, sender: int, n: int) -> np.ndarray:
    """Sender ``sender``'s source bytes in raw case ``case``; the receivers make them again to check."""
    return np.random.default_rng([case, sender]).integers(0, 256, n, dtype=np.uint8)


class RawSender:
    """One prefill rank of a raw case: a contiguous source buffer (its bytes for every decode
    rank it feeds, one after the other) and a DEALER per decode rank."""

    def __init__(self, zctx: zmq.Context, case: int, rank: int, to: list[list]):
        self.src = raw_pattern(case, rank, sum(n for _, n in to))
        mv = self.src.data
        self.socks: list[zmq.Socket] = []
        self.parts: list[list[memoryview]] = []   # CHUNK slices of the source, per decode rank
        off = 0
        for endpoint, n in to:
            s = zctx.socket(zmq.DEALER)
            s.linger, s.rcvtimeo = 0, 120_000
            s.setsockopt(zmq.ROUTING_ID, b"p%d" % rank)
            s.connect(endpoint)
            self.socks.append(s)
            self.parts.append([mv[o: min(o + CHUNK, off + n)] for o in range(off, off + n, CHUNK)])
            off += n

    def send(self) -> tuple[float, float, str]:
        """Every part, the decode ranks taken in turn, then every ack: (first send, last ack,
        why not), CLOCK_MONOTONIC as ``PrefillRank.send``."""
        t0 = time.monotonic()
        for batch in itertools.zip_longest(*self.parts):
            for s, part in zip(self.socks, batch):
                if part is not None:
                    s.send(part, copy=False)
        try:
            acks = [s.recv() for s in self.socks]
        except zmq.Again:
            return t0, time.monotonic(), "raw sender: no ack in 120 s"
        return t0, time.monotonic(), "" if all(a == b"k" for a in acks) else f"raw sender: acks {acks}"

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


class RawReceiver:
    """One decode rank of a raw case: a ROUTER and a destination buffer, each feeding prefill
    rank's bytes at its own offset (in prefill rank order)."""

    def __init__(self, zctx: zmq.Context, case: int, frm: list[list]):
        self.case, self.frm = case, frm   # [prefill rank, bytes, offset in its source, its source's size]
        self.router = zctx.socket(zmq.ROUTER)
        self.router.linger, self.router.rcvtimeo = 0, 120_000
        self.router.bind("tcp://127.0.0.1:*")   # kvxfer's zmq default: loopback TCP, one I/O thread
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.base: dict[bytes, int] = {}
        self.need: dict[bytes, int] = {}
        o = 0
        for p, n, _, _ in frm:
            self.base[b"p%d" % p], self.need[b"p%d" % p] = o, n
            o += n
        self.dst = np.zeros(o, np.uint8)

    def recv(self, clear: bool, ready) -> str:
        """Copy every message to its place in the destination, ack each prefill rank once all of
        its bytes are in; ``ready()`` once listening. '' when every byte came, else why not."""
        if clear:
            self.dst.fill(0)
        dst, got, left = self.dst.data, dict.fromkeys(self.need, 0), len(self.dst)
        ready()
        while left:
            try:
                ident, frame = self.router.recv_multipart(copy=False)
            except zmq.Again:
                return f"raw receiver: {left:,} bytes missing after 120 s"
            who, buf = ident.bytes, frame.buffer
            o, n = got.get(who), len(buf)
            if o is None or o + n > self.need[who]:
                return f"raw receiver: {n:,} bytes from {who!r} unexpected"
            dst[self.base[who] + o: self.base[who] + o + n] = buf   # libzmq's message -> our memory
            got[who] = o + n
            left -= n
            if o + n == self.need[who]:
                self.router.send_multipart([who, b"k"])
        return ""

    def verify(self) -> str:
        for p, n, src_off, src_len in self.frm:
            b = self.base[b"p%d" % p]
            if not np.array_equal(self.dst[b: b + n], raw_pattern(self.case, p, src_len)[src_off: src_off + n]):
                return f"raw receiver: bytes from prefill rank {p} differ from its source"
        return ""

    def close(self) -> None:
        self.router.close(0)


def raw_main(conn) -> None:
    """One raw zmq process (sender or receiver per case): serve the driver's commands until "quit"."""
    zctx = zmq.Context(io_threads=1)
    senders: dict[int, RawSender] = {}
    receivers: dict[int, RawReceiver] = {}
    conn.send_bytes(pack({"tcp_port": None}))   # started (as rank_main, without a TCP sink)
    while True:
        cmd = unpack(conn.recv_bytes())
        op, out = cmd["op"], {}
        try:
            if op == "router":
                receivers[cmd["id"]] = RawReceiver(zctx, cmd["id"], cmd["from"])
                out = {"endpoint": receivers[cmd["id"]].endpoint}
            elif op == "dealer":
                senders[cmd["id"]] = RawSender(zctx, cmd["id"], cmd["rank"], cmd["to"])
            elif op == "recv":   # two answers: listening, then done
                out = {"why": receivers[cmd["id"]].recv(cmd["clear"], lambda: conn.send_bytes(pack({})))}
            elif op == "send":
                out = dict(zip(("t0", "t1", "why"), senders[cmd["id"]].send()))
            elif op == "verify":
                out = {"why": receivers[cmd["id"]].verify()}
            elif op in ("teardown", "quit"):
                for s in senders.values():
                    s.close()
                for r in receivers.values():
                    r.close()
                senders.clear()
                receivers.clear()
                if op == "quit":
                    zctx.term()
                    conn.send_bytes(pack({}))
                    return
        except Exception as e:  # report, keep serving
            out = {"error": f"{type(e).__name__}: {e}"[:300]}
        conn.send_bytes(pack(out))


def plan_bytes(cfg: Config, p_slots: np.ndarray, d_slots: np.ndarray) -> dict[tuple[int, int], int]:
    """Bytes kvxfer's plans move from each prefill rank to each decode rank it feeds: the
    ``Planner``'s plans of the rank processes, made the same way here."""
    from kvxfer.plan import Planner
    from kvxfer.topology import targets_for_prefill_rank
    out: dict[tuple[int, int], int] = {}
    for p in range(cfg.p_tp):
        for s in targets_for_prefill_rank(num_kv_heads=HEADS, p_tp=cfg.p_tp, d_tp=cfg.d_tp, p_rank=p,
                                          num_layers=cfg.layers):
            plan = Planner(make_layout(cfg, "p", p), make_layout(cfg, "d", s.d_rank), src_heads=s.src_heads,
                           dst_heads=s.dst_heads, layers=s.layers, pack_below=cfg.pack_below).plan(p_slots, d_slots)
            out[p, s.d_rank] = out.get((p, s.d_rank), 0) + plan.nbytes
    return out


__all__ = ["raw_main", "plan_bytes"]
