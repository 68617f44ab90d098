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
``wait {rooms, within}``, ``exit``. ``kvxfer.cli.rank_io`` reads them (``serve_stdin`` /
``serve_unix``) and runs ``--check``; the pattern is ``kvxfer.cli.pattern``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from .pattern import fill, parts_of, verify

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
    ucx_eager_writes: bool | None = None   # decode over UCX: pregrant or not (--[no-]ucx-eager-writes); None: default

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
            **({} if cfg.ucx_eager_writes is None else {"eager_writes": cfg.ucx_eager_writes})}


def timeouts_of(phases: Sequence[float], heartbeat: Sequence[float]):
    from ..control.channel import Heartbeat
    from ..endpoint.base import Timeouts
    bootstrap, waiting, transfer, lease = phases
    return Timeouts(bootstrap=bootstrap, waiting=waiting, transfer=transfer, lease=lease,
                    heartbeat=Heartbeat(interval=heartbeat[0], timeout=heartbeat[1]))

# ------------------------------------------------------------------------------------
# Endpoints as this launcher runs them
# ------------------------------------------------------------------------------------
def pool_bytes(cfg: "RankConfig", layers: int, heads: int) -> int:
    """Bytes the rank's KV pool takes (what ``--pages`` x the model shape allocates)."""
    from ..layout import dtype_size
    row = (cfg.kv_lora_rank + cfg.rope_dim) if cfg.mla else 2 * heads * cfg.head_dim
    return layers * cfg.pages * cfg.page_size * row * dtype_size(cfg.dtype)


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
        need = pool_bytes(cfg, len(layers), len(self.heads))
        log.log(logging.WARNING if need >= 1 << 30 else logging.INFO,   # the operator sees what --pages costs
                "%s %s: allocating %.1f MiB of KV pool on %s (%d layers x %d pages x %d tokens x %d head(s)): "
                "--pages sets it", cfg.role, self.spec.key, need / (1 << 20), cfg.device, len(layers), cfg.pages,
                cfg.page_size, len(self.heads))
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
            self.ep.register(self.cfg.bootstrap)
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
                   "seconds": round(r.ended_at - r.created, 4) if r else 0.0, "tokens": len(slots),
                   "moving_from": r.transferring_at if r and r.transferring_at else None,
                   "moving_to": r.ended_at if r else None}
            if outcome is Outcome.Success:
                bad, first = verify(self.pool, self.cfg.seed, room, self.heads, slots)
                res["verified"] = bad == 0
                res["nbytes"] = sum(len(slots) * p.heads * p.head_bytes for p in parts_of(self.pool))
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
        """``requests`` pattern requests, verified. ``MBps``: bytes over the whole run (prefill writes
        the pattern, decode checks it: both are in it); ``wire_MBps``: bytes over the time transfers
        were in flight (from the first chunk of any request to the end of the last), the transport's."""
        rooms = list(range(room, room + requests))
        t0 = time.monotonic()
        for r in rooms:
            self.recv(r, tokens)
        res = self.wait(rooms, within)
        seconds = time.monotonic() - t0
        ok = all(v.get("verified") for v in res.values())
        nbytes = sum(v.get("nbytes", 0) for v in res.values())
        spans = [(v["moving_from"], v["moving_to"]) for v in res.values() if v.get("moving_from") is not None]
        wire = max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0
        for v in res.values():
            v.pop("moving_from", None), v.pop("moving_to", None)
        return {"ok": ok, "requests": res, "nbytes": nbytes, "seconds": round(seconds, 3),
                "MBps": round(nbytes / seconds / 1e6, 1) if seconds > 0 else None,
                "wire_seconds": round(wire, 4), "wire_MBps": round(nbytes / wire / 1e6, 1) if wire > 0 else None}

    # -- commands --------------------------------------------------------------------------
    def command(self, cmd: Mapping) -> dict:
        op = cmd.get("op")
        decode_only = ("selftest", "recv", "wait")
        if op in decode_only and self.cfg.role != "decode":
            raise ConfigError(f"{op!r} is a decode command; prefill ranks answer requests by themselves")
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
        raise ConfigError(f"unknown op {op!r}: info, stats, selftest, recv, wait, exit")

    def close(self) -> None:
        self.ep.close()
        if self.cfg.role == "prefill":
            self._todo.put((None, None))
