"""The rank processes of ``bench_hetero.py``: the benchmark's settings (``Config``), pools and
KV values, and one process per rank (``rank_main``) that serves the driver's commands over a
pipe as a prefill or a decode rank.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

HEADS, HEAD_DIM, PAGE, DTYPE = 8, 128, 16, "bfloat16"
CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One measured case: a transport, a layout on each side, a TP pairing."""
    transport: str
    p_layout: str
    d_layout: str
    p_tp: int
    d_tp: int
    layers: int
    tokens: int
    pack_below: int

    @property
    def name(self) -> str:
        return f"{self.transport} {self.p_layout}->{self.d_layout} TP {self.p_tp}->{self.d_tp}"

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def pack(obj) -> bytes:
    return msgpack.packb(obj)


def unpack(b: bytes):
    return msgpack.unpackb(b, strict_map_key=False)


def num_pages(tokens: int) -> int:
    """Pool pages: twice the request's pages (room to scatter), plus the padding page."""
    return 2 * (tokens // PAGE) + 1


def request_slots(tokens: int, seed: int) -> np.ndarray:
    """Slots of a request on random distinct pages (page 0 is padding)."""
    pages = np.random.default_rng(seed).permutation(np.arange(1, num_pages(tokens)))[: tokens // PAGE]
    return (pages[:, None] * PAGE + np.arange(PAGE)).ravel()


def make_layout(cfg: Config, side: str, rank: int):
    """The layout of one rank's pool (``side`` "p" or "d"): its share of the heads, every layer."""
    from kvxfer.layout import hnd_layout, page_major_layout, token_major_layout
    from kvxfer.topology import heads_held
    kind = cfg.p_layout if side == "p" else cfg.d_layout
    common = dict(layers=cfg.layers, heads=len(heads_held(HEADS, cfg.p_tp if side == "p" else cfg.d_tp, rank)),
                  head_dim=HEAD_DIM, dtype=DTYPE, page_size=PAGE)
    n = num_pages(cfg.tokens)
    if kind == "token_major":
        return token_major_layout(num_slots=n * PAGE, **common)
    return hnd_layout(num_pages=n, **common) if kind == "hnd" else page_major_layout(num_pages=n, **common)


def make_pool(cfg: Config, side: str, rank: int):
    from kvxfer.pools import KVPool
    return KVPool(make_layout(cfg, side, rank))


def kv_values(layer: int, kind: str, tokens: int, heads: range) -> torch.Tensor:
    """The full model's K or V of (layer, token, global head, dim) as bf16 bit patterns
    ``[tokens, heads, dim]``; every coordinate changes the value, so a misplaced byte shows."""
    k = 0 if kind == "k" else 1
    t = torch.arange(tokens, dtype=torch.int64)[:, None, None]
    h = torch.tensor(list(heads), dtype=torch.int64)[None, :, None]
    d = torch.arange(HEAD_DIM, dtype=torch.int64)[None, None, :]
    x = ((layer * 2 + k) * 40503 + t * 8191 + h * 131 + d * 7) % 65536 - 32768
    return x.to(torch.int16).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Rank processes: one per rank, as in a deployment (a process holding several ranks' transports
# measures their threads fighting over its GIL, not heterogeneity). The driver runs none.
# ---------------------------------------------------------------------------------------
class DecodeRank:
    """One decode rank of one case: its pool, its transport, its grant."""

    def __init__(self, cfg: Config, slots: np.ndarray, rank: int):
        from kvxfer.grant import ByteRanges
        from kvxfer.topology import sources_for_decode_rank
        from kvxfer.transport.registry import get_transport
        self.cfg, self.slots, self.rank = cfg, slots, rank
        self.pool = make_pool(cfg, "d", rank)
        self.t = get_transport(cfg.transport)
        self.t.register(self.pool.regions())
        self.ranges = ByteRanges.of_slots(self.pool.layout, slots)
        self.nsrc = len(sources_for_decode_rank(num_kv_heads=HEADS, p_tp=cfg.p_tp, d_tp=cfg.d_tp, d_rank=rank,
                                                num_layers=cfg.layers))

    def drain(self, rid: str, timeout: float = 120) -> str:
        """Collect one arrival per source; '' when all landed, else why not."""
        got, limit = [], time.monotonic() + timeout
        while len(got) < self.nsrc and time.monotonic() < limit:
            got += self.t.arrivals(timeout=0.5)
        self.t.forget(rid)
        bad = [a.reason for a in got if not a.ok]
        return f"decode rank {self.rank}: {len(got)}/{self.nsrc} arrivals {bad[:1]}" if len(got) < self.nsrc or bad \
            else ""

    def verify(self) -> str:
        from kvxfer.topology import heads_held
        heads = heads_held(HEADS, self.cfg.d_tp, self.rank)
        for layer in range(self.cfg.layers):
            for kind in ("k", "v"):
                got = self.pool.get_part(layer, kind, self.slots).view(torch.int16)
                if not torch.equal(got, kv_values(layer, kind, self.cfg.tokens, heads).view(torch.int16)):
                    return f"decode rank {self.rank} layer {layer} {kind}: bytes differ from the prefill KV"
        return ""


class PrefillRank:
    """One prefill rank of one case: its pool (the full model's KV, its heads), its transport,
    and a plan per decode rank it feeds (head slices and layers from the topology)."""

    def __init__(self, cfg: Config, p_slots: np.ndarray, d_slots: np.ndarray, descriptors: dict, rank: int):
        from kvxfer.plan import Planner
        from kvxfer.topology import heads_held, targets_for_prefill_rank
        from kvxfer.transport.registry import get_transport
        self.pool = make_pool(cfg, "p", rank)
        for layer in range(cfg.layers):
            self.pool.set_parts(layer, p_slots, [(kind, kv_values(layer, kind, cfg.tokens,
                                                                  heads_held(HEADS, cfg.p_tp, rank)))
                                                 for kind in ("k", "v")])
        self.t = get_transport(cfg.transport)
        self.t.register(self.pool.regions())
        self.jobs: list[tuple[str, object]] = []   # (peer id, plan) per decode rank fed
        self.per_decode: dict[int, dict] = {}
        self.plan_ms = 0.0
        peers: dict[int, str] = {}
        for s in targets_for_prefill_rank(num_kv_heads=HEADS, p_tp=cfg.p_tp, d_tp=cfg.d_tp, p_rank=rank,
                                          num_layers=cfg.layers):
            if s.d_rank not in peers:
                peers[s.d_rank] = self.t.connect(descriptors[s.d_rank])
            planner = Planner(self.pool.layout, make_layout(cfg, "d", s.d_rank), src_heads=s.src_heads,
                              dst_heads=s.dst_heads, layers=s.layers, pack_below=cfg.pack_below)
            planner.plan(p_slots, d_slots)   # warm-up: the first call pays allocator faults
            t0 = time.perf_counter()
            plan = planner.plan(p_slots, d_slots)
            self.plan_ms += (time.perf_counter() - t0) * 1e3
            self.jobs.append((peers[s.d_rank], plan))
            sliced = s.src_heads.count > 1 or s.dst_heads.count > 1
            c = self.per_decode.setdefault(s.d_rank, {"runs": 0, "packed_runs": 0, "sglang_descriptors": 0})
            c["runs"] += plan.num_runs
            c["packed_runs"] += plan.num_packed_runs
            c["sglang_descriptors"] += (cfg.tokens if sliced else cfg.tokens // PAGE) * len(s.layers) * 2
        self.nbytes = sum(plan.nbytes for _, plan in self.jobs)

    def send(self, rid: str) -> tuple[float, float]:
        """Submit every plan, wait for all: (first submit, last done), CLOCK_MONOTONIC (shared by
        the processes of one host, so the driver can take the span over every rank)."""
        t0 = time.monotonic()
        handles = [self.t.submit(peer, rid, plan, timeout=120) for peer, plan in self.jobs]
        for h in handles:
            h.result()
        return t0, time.monotonic()


def rank_main(conn) -> None:
    """One rank process: serve the driver's commands (msgpack over a pipe) until "quit". Holds
    one rank of each case set up (cases are interleaved per repetition)."""
    torch.set_num_threads(1)
    ranks: dict[int, DecodeRank | PrefillRank] = {}
    sink = socket.create_server(("127.0.0.1", 0))
    conn.send_bytes(pack({"tcp_port": sink.getsockname()[1]}))
    tcp = None
    buf = memoryview(bytearray(CHUNK))
    while True:
        cmd = unpack(conn.recv_bytes())
        op, out = cmd["op"], {}
        try:
            if op == "decode":
                r = ranks[cmd["id"]] = DecodeRank(Config(**cmd["cfg"]), np.frombuffer(cmd["slots"], np.int64).copy(),
                                                  cmd["rank"])
                out = {"descriptor": r.t.descriptor()}
            elif op == "prefill":
                r = ranks[cmd["id"]] = PrefillRank(Config(**cmd["cfg"]), np.frombuffer(cmd["p_slots"], np.int64).copy(),
                                                   np.frombuffer(cmd["d_slots"], np.int64).copy(),
                                                   {int(k): v for k, v in cmd["descriptors"].items()}, cmd["rank"])
                out = {"nbytes": r.nbytes, "plan_ms": r.plan_ms, "per_decode": r.per_decode}
            elif op == "expect":
                ranks[cmd["id"]].t.expect(cmd["rid"], ranks[cmd["id"]].ranges)
            elif op == "send":
                out = dict(zip(("t0", "t1"), ranks[cmd["id"]].send(cmd["rid"])))
            elif op == "drain":
                out = {"why": ranks[cmd["id"]].drain(cmd["rid"])}
            elif op == "verify":
                out = {"why": ranks[cmd["id"]].verify()}
            elif op == "teardown":
                for r in ranks.values():
                    r.t.close()
                ranks.clear()
            elif op == "tcp":   # receive nbytes in CHUNK messages, then ack one byte
                if tcp is None:
                    tcp, _ = sink.accept()
                left = cmd["nbytes"]
                conn.send_bytes(pack({}))   # ready: the driver starts its clock and sends
                while left:
                    want, got = min(CHUNK, left), 0
                    while got < want:
                        got += tcp.recv_into(buf[got:want], want - got)
                    left -= want
                tcp.sendall(b"k")
            elif op == "quit":
                for r in ranks.values():
                    r.t.close()
                conn.send_bytes(pack({}))
                return
        except Exception as e:  # report, keep serving: the driver turns it into a row
            out = {"error": f"{type(e).__name__}: {e}"[:300]}
        conn.send_bytes(pack(out))
