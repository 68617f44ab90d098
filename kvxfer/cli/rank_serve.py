"""What a rank started by ``kvxfer rank`` does (the flags and addresses live in ``kvxfer.cli.rank``).

A launched rank has no model, so it serves a pattern: every KV byte of a request is a function
of (seed, room, layer, K/V, global head, token position, byte), the same on every host,
layout and TP size (``pattern``). ``Rank`` holds the pool, the allocator and the endpoint:

    prefill: answers every request decode sends: the endpoint's ``on_request`` hook queues the
             room, a worker thread makes the sender, fills the request's slots with the pattern
             and sends them (a silent replica's dummy request gets an empty last chunk).
    decode:  ``recv`` allocates and requests; the release callback verifies the bytes
             (``verify``) before the slots are freed; ``selftest`` = recv x N + wait.

Commands of ``--serve`` (``Rank.command``), one JSON object per line, answered by one line:
``info``, ``stats``, ``selftest {requests, tokens, room, within}``, ``recv {room, tokens}``,
``wait {rooms, within}``, ``exit``. ``serve_stdin`` / ``serve_unix`` read them; ``run_check`` is
``--check``.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("kvxfer.rank")

MAX_COMMAND = 1 << 16       # bytes of one control line
MAX_LIVE = 4096             # prefill: requests being answered at once; decode: ends remembered


@dataclass(frozen=True, slots=True, kw_only=True)
class RankConfig:
    role: str
    bootstrap: str
    secret: bytes | None
    instance: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    local_rank: int
    layout: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    pages: int
    page_size: int
    device: str
    transport: str
    ucx_tls: str | None
    bind: str
    advertise: str
    port: int
    data_port: int
    metrics_port: int | None
    timeouts: tuple[float, float, float, float]
    heartbeat: tuple[float, float]
    seed: int
    check: bool
    selftest: int
    tokens: int
    room: int
    serve: str | None
    connect_timeout: float
    head_map: tuple[tuple[int, ...], ...] | None = None   # RankSpec.head_map (--head-map); None: contiguous
    ucx_eager_writes: bool = False   # decode over UCX: pregrant (--ucx-eager-writes)

    @property
    def mla(self) -> bool:
        return self.layout.startswith("mla")



def transport_options_of(cfg: RankConfig, hb) -> dict:
    """The transport's options for rank ``cfg``; ``hb``: its ``Heartbeat``."""
    if cfg.transport == "zmq":
        # The data socket binds --bind and tells peers --advertise (checked in rank.addresses).
        return {"endpoint": f"tcp://{cfg.bind}:{cfg.data_port}", "advertise": cfg.advertise or None,
                "heartbeat_ivl": hb.interval, "heartbeat_timeout": hb.timeout}
    return {"tls": cfg.ucx_tls, "heartbeat": hb.interval, "peer_timeout": hb.timeout,
            **({"eager_writes": True} if cfg.ucx_eager_writes else {})}


def timeouts_of(phases: Sequence[float], heartbeat: Sequence[float]):
    from ..control.channel import Heartbeat
    from ..endpoint.base import Timeouts
    bootstrap, waiting, transfer, lease = phases
    return Timeouts(bootstrap=bootstrap, waiting=waiting, transfer=transfer, lease=lease,
                    heartbeat=Heartbeat(interval=heartbeat[0], timeout=heartbeat[1]))

# ------------------------------------------------------------------------------------
# The pattern: KV bytes as a function of logical coordinates
# ------------------------------------------------------------------------------------
def pattern(seed: int, room: int, layer: int, kind: str, heads: Sequence[int], positions: np.ndarray,
            head_bytes: int) -> np.ndarray:
    """``[tokens, heads, head_bytes]`` uint8: the same bytes on every host, layout and TP split."""
    key = (seed * 0x9E3779B97F4A7C15 + room * 0xBF58476D1CE4E5B9 + layer * 0x94D049BB133111EB
           + sum(map(ord, kind)) * 0x2545F4914F6CDD1D) & (2**64 - 1)
    with np.errstate(over="ignore"):
        x = (np.uint64(key) + np.asarray(positions, np.uint64)[:, None, None] * np.uint64(0xD6E8FEB86659FD93)
             + np.asarray(heads, np.uint64)[None, :, None] * np.uint64(0xA0761D6478BD642F)
             + np.arange(head_bytes, dtype=np.uint64)[None, None, :] * np.uint64(0xE7037ED1A0B428DB))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x7FB5D329728EA185)
        x ^= x >> np.uint64(27)
    return (x >> np.uint64(32)).astype(np.uint8)


def _parts(pool) -> list:
    return [p for p in pool.layout.parts if p.kind in pool.kv_kinds]


def fill(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> None:
    """Write the pattern of ``room`` into ``slots`` (token positions 0..len - 1)."""
    import torch

    from ..pools import torch_dtype
    pos = np.arange(len(slots))
    for p in _parts(pool):
        raw = torch.from_numpy(pattern(seed, room, p.layer, p.kind, heads, pos, p.head_bytes))
        pool.set_parts(p.layer, slots, [(p.kind, raw.view(torch_dtype(p.dtype)))])


def verify(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> tuple[int, str]:
    """(bytes that differ from the pattern, the first one in words)."""
    import torch
    bad, first = 0, ""
    pos = np.arange(len(slots))
    for p in _parts(pool):
        got = pool.get_part(p.layer, p.kind, slots).contiguous().view(torch.uint8).cpu().numpy()
        diff = got.reshape(len(slots), len(heads), p.head_bytes) != pattern(seed, room, p.layer, p.kind, heads, pos,
                                                                             p.head_bytes)
        n = int(diff.sum())
        if n and not first:
            t, h, b = (int(i[0]) for i in np.nonzero(diff))
            first = f"layer {p.layer} {p.kind} head {heads[h]} token {t} byte {b}"
        bad += n
    return bad, first


# ------------------------------------------------------------------------------------
# Endpoints as this launcher runs them
# ------------------------------------------------------------------------------------
class Rank:
    """One running rank: pool, allocator, endpoint, and the commands of ``--serve``."""

    def __init__(self, cfg: RankConfig):
        from ..pools import KVPool, MHAPool, MLAPool, PageAllocator
        from ..ranks import RankSpec
        from ..topology import stage_layers
        self.cfg = cfg
        self.spec = RankSpec(role=cfg.role, num_kv_heads=cfg.kv_heads, num_layers=cfg.layers, instance=cfg.instance,
                             tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
                             dp_rank=cfg.dp_rank, dp_size=cfg.dp_size, replicated=cfg.mla, head_map=cfg.head_map)
        layers = list(stage_layers(cfg.layers, cfg.pp_size, cfg.pp_rank))
        self.heads = [0] if cfg.mla else list(self.spec.heads)   # global heads, in the pool's order
        self.pool: KVPool
        if cfg.mla:
            self.pool = MLAPool(layers=layers, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.rope_dim, dtype=cfg.dtype,
                                num_pages=cfg.pages, page_size=cfg.page_size, device=cfg.device,
                                layout="page_major" if cfg.layout == "mla_page_major" else "token_major")
        else:
            self.pool = MHAPool(layers=layers, heads=len(self.heads), head_dim=cfg.head_dim, dtype=cfg.dtype,
                                num_pages=cfg.pages, page_size=cfg.page_size, layout=cfg.layout, device=cfg.device)
        self.alloc = PageAllocator(cfg.pages, cfg.page_size)
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.bytes = 0
        self.done: dict[int, dict] = {}             # decode: room -> its end, verified (last 4096)
        self.events: dict[int, threading.Event] = {}
        self.reqs: dict[int, Any] = {}              # decode: room -> live receiver
        self.live: dict[int, Any] = {}              # prefill: room -> sender being answered
        timeouts = timeouts_of(cfg.timeouts, cfg.heartbeat)
        from ..endpoint.decode import DecodeEndpoint
        from ..endpoint.prefill import PrefillEndpoint
        common = dict(transport=cfg.transport, transport_options=transport_options_of(cfg, timeouts.heartbeat),
                      timeouts=timeouts, secret=cfg.secret)
        self.ep: PrefillEndpoint | DecodeEndpoint
        if cfg.role == "prefill":
            self._todo: queue.Queue = queue.Queue(MAX_LIVE)
            self.ep = PrefillEndpoint(self.spec, self.pool, bind=f"tcp://{cfg.bind}:{cfg.port}",
                                      advertise=cfg.advertise or None, on_request=self._queue, **common)
            threading.Thread(target=self._answer_loop, name="kvxfer-rank-answer", daemon=True).start()
        else:
            self.ep = DecodeEndpoint(self.spec, self.pool, **common)

    # -- start-up ------------------------------------------------------------------------
    def start(self) -> None:
        """Prefill: register (heartbeats follow). Decode: handshake with every prefill rank it needs."""
        if self.cfg.metrics_port is not None:
            from ..metrics import start_exporter
            start_exporter(self.cfg.metrics_port, self.cfg.bind)
        from ..endpoint.prefill import PrefillEndpoint
        if isinstance(self.ep, PrefillEndpoint):
            self.ep.register(self.cfg.bootstrap, ttl=10.0)
        else:
            self.ep.connect(bootstrap=self.cfg.bootstrap, instance=self.cfg.instance,
                            timeout=self.cfg.connect_timeout)

    def info(self) -> dict:
        i = self.ep.info
        return {"role": self.cfg.role, "key": self.spec.key, "heads": self.heads, "control": i.control,
                "data": {k: {f: v for f, v in d.items() if f in ("endpoint", "transport")} for k, d in i.data.items()},
                "bind": self.cfg.bind, "advertise": self.cfg.advertise, "layout": self.cfg.layout,
                "page_size": self.cfg.page_size}

    def _count(self, outcome: str, nbytes: int = 0) -> None:
        with self.lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            self.bytes += nbytes

    # -- prefill: answer every request with the pattern ------------------------------------
    def _queue(self, room: int | str, tokens: int) -> None:   # the endpoint's on_request: must not block
        try:
            self._todo.put_nowait((room, tokens))
        except queue.Full:
            log.warning("room %s: %d requests are being answered already; this one will time out", room, MAX_LIVE)

    def _answer_loop(self) -> None:
        from ..endpoint.base import KVPoll
        from ..endpoint.prefill import PrefillEndpoint
        from ..errors import KVXferError
        while True:
            room, tokens = self._todo.get()
            if room is None:
                return
            with self.lock:
                old = self.live.get(room)
                if old is not None and old.poll() not in (KVPoll.Success, KVPoll.Failed):
                    continue   # another decode rank's part of a request already answered
                slots = self.alloc.alloc(tokens) if tokens else np.zeros(0, np.int64)
            ep = self.ep
            assert isinstance(ep, PrefillEndpoint), "the answer loop runs on prefill ranks"
            try:
                s = ep.sender(room, on_release=self._prefill_released(room, slots))
            except KVXferError as e:
                log.warning("room %s: cannot answer: %s", room, e)
                if slots is not None and len(slots):
                    with self.lock:
                        self.alloc.free(slots)
                continue
            with self.lock:
                self.live[room] = s
            if slots is None:
                s.abort(f"prefill pool full: {self.alloc.free_pages} pages free, {tokens} tokens asked")
                continue
            if len(slots):
                fill(self.pool, self.cfg.seed, room, self.heads, slots)
            s.send(slots, last=True)

    def _prefill_released(self, room: int, slots):
        from ..endpoint.base import KVPoll

        def released(outcome) -> None:
            self._count(outcome.value)
            with self.lock:
                s = self.live.get(room)
                if s is not None and s.poll() in (KVPoll.Success, KVPoll.Failed):
                    del self.live[room]
                if slots is not None and len(slots):
                    self.alloc.free(slots)
        return released

    # -- decode: request, then verify ------------------------------------------------------
    def recv(self, room: int, tokens: int) -> None:
        from ..errors import RequestError
        with self.lock:
            if room in self.reqs:
                raise RequestError(f"room {room} is still running here")
            slots = self.alloc.alloc(tokens)
            if slots is None:
                raise RequestError(f"decode pool full: {self.alloc.free_pages} pages free, {tokens} tokens asked")
            self.events[room] = threading.Event()
            self.done.pop(room, None)
        from ..endpoint.decode import DecodeEndpoint
        assert isinstance(self.ep, DecodeEndpoint), "recv is a decode rank's command"
        try:
            r = self.ep.receiver(room, on_release=self._decode_released(room, slots))
        except Exception:
            with self.lock:
                self.alloc.free(slots)
                self.events.pop(room, None)
            raise
        with self.lock:
            self.reqs[room] = r
        try:
            r.init(slots)
        except Exception:
            r.abort("init failed")
            raise

    def _decode_released(self, room: int, slots: np.ndarray):
        from ..endpoint.base import Outcome

        def released(outcome) -> None:
            with self.lock:
                r = self.reqs.get(room)   # stored right after it was made; None only if it ended at once
            res = {"state": outcome.state.name, "outcome": outcome.value, "reason": r.reason if r else "",
                   "seconds": round(r.ended_at - r.created, 4) if r else 0.0, "tokens": len(slots)}
            if outcome is Outcome.Success:
                bad, first = verify(self.pool, self.cfg.seed, room, self.heads, slots)
                res["verified"] = bad == 0
                res["nbytes"] = sum(len(slots) * p.heads * p.head_bytes for p in _parts(self.pool))
                if bad:
                    res["mismatch"] = (f"{bad} byte(s) differ from the pattern, first at {first} (the same --seed "
                                       f"on both sides?)")
            self._count(outcome.value if outcome.value != "success" or res.get("verified") else "corrupt",
                        res.get("nbytes", 0))
            with self.lock:
                self.alloc.free(slots)
                self.reqs.pop(room, None)
                self.done[room] = res
                while len(self.done) > MAX_LIVE:
                    self.done.pop(next(iter(self.done)))
                ev = self.events.pop(room, None)
            if ev is not None:
                ev.set()
        return released

    def wait(self, rooms: Sequence[int], within: float) -> dict:
        end = time.monotonic() + within
        for room in rooms:
            with self.lock:
                ev = self.events.get(room)
            if ev is not None:
                ev.wait(max(0.0, end - time.monotonic()))
        with self.lock:
            return {str(r): self.done.get(r, {"state": "running" if r in self.reqs else "unknown"}) for r in rooms}

    def selftest(self, requests: int, tokens: int, room: int, within: float) -> dict:
        rooms = list(range(room, room + requests))
        t0 = time.monotonic()
        for r in rooms:
            self.recv(r, tokens)
        res = self.wait(rooms, within)
        seconds = time.monotonic() - t0
        ok = all(v.get("verified") for v in res.values())
        nbytes = sum(v.get("nbytes", 0) for v in res.values())
        return {"ok": ok, "requests": res, "nbytes": nbytes, "seconds": round(seconds, 3),
                "MBps": round(nbytes / seconds / 1e6, 1) if seconds > 0 else None}

    # -- commands --------------------------------------------------------------------------
    def command(self, cmd: Mapping) -> dict:
        op = cmd.get("op")
        decode_only = ("selftest", "recv", "wait")
        if op in decode_only and self.cfg.role != "decode":
            raise ValueError(f"{op!r} is a decode command; prefill ranks answer requests by themselves")
        if op == "info":
            return self.info()
        if op == "stats":
            with self.lock:
                return {"requests": dict(self.counts), "bytes": self.bytes, "free_pages": self.alloc.free_pages,
                        "capacity": self.alloc.capacity}
        if op == "selftest":
            return self.selftest(int(cmd.get("requests", 1)), int(cmd.get("tokens", 256)), int(cmd.get("room", 1)),
                                 float(cmd.get("within", 60)))
        if op == "recv":
            self.recv(int(cmd["room"]), int(cmd["tokens"]))
            return {"room": int(cmd["room"])}
        if op == "wait":
            return self.wait([int(r) for r in cmd["rooms"]], float(cmd.get("within", 60)))
        raise ValueError(f"unknown op {op!r}: info, stats, selftest, recv, wait, exit")

    def close(self) -> None:
        self.ep.close()
        if self.cfg.role == "prefill":
            self._todo.put((None, None))


# ------------------------------------------------------------------------------------
# The control: one JSON command per line, on stdin or a unix socket
# ------------------------------------------------------------------------------------
def _reply(rank: Rank, line: str, stop: threading.Event) -> dict | None:
    try:
        cmd = json.loads(line)
        if not isinstance(cmd, dict):
            raise ValueError("a command is a JSON object, e.g. {\"op\": \"info\"}")
        if cmd.get("op") == "exit":
            stop.set()
            return {"ok": True}
        return rank.command(cmd)
    except Exception as e:   # a bad command never stops the rank
        return {"error": f"{type(e).__name__}: {e}"}


def serve_stdin(rank: Rank, stop: threading.Event) -> None:
    out = threading.Lock()
    for line in sys.stdin:
        if not line.strip():
            continue
        res = _reply(rank, line[:MAX_COMMAND], stop)
        with out:
            print(json.dumps(res), flush=True)
        if stop.is_set():
            return
    stop.set()   # stdin closed: whoever drove us is gone


def serve_unix(rank: Rank, path: str, stop: threading.Event) -> socket.socket:
    if os.path.exists(path):
        import stat
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--serve unix:{path}: exists and is not a socket; pick another path")
        os.unlink(path)   # a stale socket of an earlier run
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)   # owner only
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(8)

    def client(conn: socket.socket) -> None:
        with conn, conn.makefile("rw", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    f.write(json.dumps(_reply(rank, line[:MAX_COMMAND], stop)) + "\n")
                    f.flush()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=client, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name="kvxfer-rank-control", daemon=True).start()
    return srv


# ------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------
def check_prefill(cfg: RankConfig, info) -> list[str]:
    """What stops this prefill rank from registering, in words ([] when nothing does)."""
    from ..control.client import BootstrapClient
    from ..errors import ConnectError
    try:
        _, ranks = BootstrapClient(cfg.bootstrap, cfg.secret).topology(cfg.instance)
    except ConnectError as e:
        return [str(e)]
    out = []
    s = info.spec
    for r in ranks:
        o = r.spec
        if o.key != s.key and (o.tp_size, o.pp_size, o.dp_size) != (s.tp_size, s.pp_size, s.dp_size):
            out.append(f"{o.key} is registered with tp/pp/dp sizes {o.tp_size}/{o.pp_size}/{o.dp_size} but this "
                       f"rank has {s.tp_size}/{s.pp_size}/{s.dp_size}: the registry would refuse it")
        if o.key == s.key:
            out.append(f"{s.key} is registered already (control {r.control}): starting this rank would replace it")
    return out


def run_check(rank: Rank) -> int:
    from ..errors import CompatibilityError, KVXferError
    cfg = rank.cfg
    if cfg.role == "prefill":
        why = check_prefill(cfg, rank.ep.info)
        for w in why:
            print(f"  - {w}")
        print(f"kvxfer rank --check: prefill {rank.spec.key} " + ("can register with " if not why else
              "cannot register cleanly with ") + cfg.bootstrap)
        return 1 if why else 0
    try:
        rank.start()
    except CompatibilityError as e:
        print(f"kvxfer rank --check: decode {rank.spec.key} and the prefill ranks of {cfg.instance!r} cannot talk:")
        for m in e.mismatches:
            print(f"  - {m}")
        return 1
    except KVXferError as e:
        print(f"kvxfer rank --check: decode {rank.spec.key} could not handshake: {e}")
        return 1
    print(f"kvxfer rank --check: decode {rank.spec.key} handshook with every prefill rank it needs in "
          f"{cfg.instance!r} over {cfg.transport}: compatible (run --selftest to move bytes)")
    return 0


