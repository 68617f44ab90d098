"""Helper program for kvxfer's multi-process request tests.

One prefill or decode endpoint in its own process, driven by JSON commands over a pipe
(``Peer.call(op, ...)``). Processes come from a forkserver that imported kvxfer once, so a
fresh peer costs ~0.1 s instead of torch's import time; each is a real process on
127.0.0.1 that a test can SIGKILL or SIGSTOP.

Also here: the pool recipe (prefill pools hold seeded random bytes, so the test rebuilds
them to know what was sent), and ``ControlProxy``, a man in the middle on the control
channel that drops or delays chosen message types (fault injection).
"""
from __future__ import annotations

import heapq
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import replace

import msgpack
import numpy as np
import torch
import zmq
from manual_clock import ManualClock

from kvxfer.control.channel import Heartbeat
from kvxfer.control.client import BootstrapClient
from kvxfer.endpoint.aux import AuxBuffer, AuxRecord
from kvxfer.endpoint.base import KVPoll, Outcome, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.pools import MHAPool, PageAllocator, StatePool
from kvxfer.ranks import RankSpec

CANARY = 0xCD


# ------------------------------------------------------------------------------------
# Pools
# ------------------------------------------------------------------------------------
def make_pools(cfg: dict, seed: int | None):
    """(kv pool, state pool or None). ``seed``: fill with seeded random bytes (prefill); None: canary."""
    p = cfg["pool"]
    kv = MHAPool(layers=p["layers"], heads=p["heads"], head_dim=p["head_dim"], dtype=p["dtype"],
                 num_pages=p["num_pages"], page_size=p["page_size"], layout=p.get("layout", "token_major"))
    st = None
    if cfg.get("state_slots"):
        st = StatePool(layers=p["layers"], conv_blocks=[4, 4], conv_width=3, temporal_heads=p["heads"],
                       temporal_head_shape=[4], num_slots=cfg["state_slots"])
    for pool in (kv, st):
        if pool is None:
            continue
        for i, b in enumerate(pool.buffers):
            if seed is None:
                b.fill_(CANARY)
            else:
                g = torch.Generator().manual_seed(seed * 1000 + i)
                b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return kv, st


DEFAULT_HEARTBEAT = [0.5, 5.0]   # lenient: a loaded 2-core CI box must not look like a dead peer


def timeouts(cfg: dict) -> Timeouts:
    """Deadlines from ``cfg["timeouts"]``; the fault tests pass short ones, the rest lenient ones."""
    t = cfg.get("timeouts", {})
    hb = t.get("heartbeat", DEFAULT_HEARTBEAT)
    return Timeouts(bootstrap=t.get("bootstrap", 20.0), waiting=t.get("waiting", 20.0),
                    transfer=t.get("transfer", 20.0), lease=t.get("lease", 20.0), handshake=t.get("handshake", 10.0),
                    registry=t.get("registry", 5.0), heartbeat=Heartbeat(interval=hb[0], timeout=hb[1]))


def transport_options(name: str, cfg: dict) -> dict:
    """The transport's own liveness limits follow the control plane's (short in fault tests)."""
    hb = cfg.get("timeouts", {}).get("heartbeat", DEFAULT_HEARTBEAT)
    if name == "zmq":
        return {"heartbeat_ivl": hb[0], "heartbeat_timeout": hb[1]}
    if name == "ucx":
        return {"heartbeat": hb[0], "peer_timeout": hb[1],   # ``eager``: set, or the transport's default
                **({"eager_writes": bool(cfg["eager"])} if cfg.get("eager") is not None else {})}
    return {}


# ------------------------------------------------------------------------------------
# The peer process
# ------------------------------------------------------------------------------------
class _Book:
    """Per-room bookkeeping in the peer: slots, releases (must end at exactly 1)."""

    def __init__(self):
        self.reqs, self.slots, self.state, self.releases, self.ended = {}, {}, {}, {}, {}


def run(conn, cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    role, p = cfg["role"], cfg["pool"]
    kv, st = make_pools(cfg, cfg.get("seed") if role == "prefill" else None)
    alloc = PageAllocator(p["num_pages"], p["page_size"])
    st_alloc = PageAllocator(cfg["state_slots"], 1) if cfg.get("state_slots") else None
    spec = RankSpec(role=role, num_kv_heads=cfg.get("num_kv_heads", p["heads"]), num_layers=p["layers"],
                    **cfg.get("spec", {}))
    common = dict(state=st, transport=cfg["transport"], transport_options=transport_options(cfg["transport"], cfg),
                  timeouts=timeouts(cfg), secret=cfg.get("secret"))
    clock = ManualClock() if cfg.get("manual_clock") else None   # deadlines move only on "advance"
    if clock is not None:
        common["clock"] = clock
    book, lock = _Book(), threading.Lock()

    def released(room):
        def cb(outcome):
            with lock:
                book.releases[room] = book.releases.get(room, 0) + 1
                if book.releases[room] == 1:    # free exactly once; a second call is counted, not freed
                    alloc.free(book.slots[room])
                    if room in book.state and st_alloc is not None:
                        st_alloc.free(book.state[room])
        return cb

    if role == "prefill":
        ep = PrefillEndpoint(spec, kv, **common)
        if cfg.get("hello_delay"):   # a slow rank (starting, a loaded host): each HELLO answered late
            answer, delay = ep.links.on_hello, cfg["hello_delay"]

            def slow_hello(peer, msg):
                time.sleep(delay)
                answer(peer, msg)
            ep.links.on_hello = slow_hello
        ep.register(cfg["bootstrap"], ttl=cfg.get("ttl", 3.0))
    else:
        ep = DecodeEndpoint(spec, kv, aux=AuxBuffer(64), **common)
        ep.connect(bootstrap=cfg["bootstrap"], timeout=20)
    conn.send_bytes(json.dumps({"ok": True, "pid": os.getpid()}).encode())

    def take(room, tokens, want_state):
        slots = alloc.alloc(tokens)
        if slots is None:
            raise RuntimeError(f"allocator full ({alloc.free_pages} pages free)")
        book.slots[room] = slots
        if want_state:
            book.state[room] = st_alloc.alloc(1)
        return slots

    def status(rooms):
        out = {}
        for room in rooms:
            r = book.reqs[room]
            out[str(room)] = {"state": int(r.poll()), "outcome": r.outcome.value if r.outcome else "",
                              "reason": r.reason, "releases": book.releases.get(room, 0)}
        return out

    while True:
        try:
            cmd = json.loads(conn.recv_bytes())
        except EOFError:
            break
        op, res = cmd.pop("op"), {}
        try:
            if op == "sender":
                room = cmd["room"]
                slots = take(room, cmd["tokens"], cmd.get("state", False))
                book.reqs[room] = ep.sender(room, on_release=released(room))
                res = {"slots": slots.tolist(), "state": book.state.get(room, np.zeros(0, np.int64)).tolist()}
            elif op == "receiver":
                room = cmd["room"]
                slots = take(room, cmd["tokens"], cmd.get("state", False))
                r = book.reqs[room] = ep.receiver(room, on_release=released(room))
                if cmd.get("init", True):
                    r.init(slots, prefix_len=cmd.get("prefix", 0), state_slots=book.state.get(room),
                           aux_slot=cmd.get("aux_slot"))
                res = {"slots": slots.tolist()}
            elif op == "send":
                room, s = cmd["room"], book.reqs[cmd["room"]]
                a, b = cmd.get("range", [0, len(book.slots[room])])
                aux = AuxRecord(*cmd["aux"]) if cmd.get("aux") else None
                ok = s.send(book.slots[room][a:b], start=a, last=cmd.get("last", False), aux=aux,
                            state_slots=book.state.get(room) if cmd.get("last") else None)
                res = {"accepted": ok}
            elif op == "serve":   # autonomous prefill: every room in one chunk as soon as it is bound
                rooms, t0 = cmd["rooms"], time.monotonic()
                res = {"slots": {}}
                for room in rooms:
                    res["slots"][str(room)] = take(room, cmd["tokens"], False).tolist()
                    book.reqs[room] = ep.sender(room, on_release=released(room))
                todo = set(rooms)
                while todo and time.monotonic() - t0 < cmd.get("timeout", 60):
                    ready = [room for room in todo if book.reqs[room].poll() >= KVPoll.WaitingForInput
                             or book.reqs[room].poll() == KVPoll.Failed]
                    for room in ready:
                        book.reqs[room].send(book.slots[room], last=True)
                        todo.discard(room)
                    if not ready:
                        time.sleep(0.001)
                for room in rooms:
                    book.reqs[room].wait(max(0.0, t0 + cmd.get("timeout", 60) - time.monotonic()))
                res["status"] = status(rooms)
            elif op == "wait":
                deadline = time.monotonic() + cmd.get("timeout", 5)
                for room in cmd["rooms"]:
                    book.reqs[room].wait(max(0.0, deadline - time.monotonic()))
                res = status(cmd["rooms"])
            elif op == "poll":
                res = status(cmd["rooms"])
            elif op == "abort":
                book.reqs[cmd["room"]].abort(cmd.get("reason", "test"))
            elif op == "advance":   # the manual clock: past a deadline without waiting for it
                res = {"now": clock.advance(cmd["seconds"])}
            elif op == "stats":
                with lock:
                    res = {"free_pages": alloc.free_pages, "capacity": alloc.capacity,
                           "state_free": st_alloc.free_pages if st_alloc else 0,
                           "releases": {str(k): v for k, v in book.releases.items()}}
            elif op == "exit":
                conn.send_bytes(b"{}")
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:   # report to the test instead of dying silently
            import traceback
            res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}
        conn.send_bytes(json.dumps(res).encode())
    ep.close()


# ------------------------------------------------------------------------------------
# The test side
# ------------------------------------------------------------------------------------
_CTX = None


def context():
    """A forkserver that has imported kvxfer once (peers then start in ~0.1 s)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["kvxfer.endpoint", "request_peer"])
    return _CTX


def _state(status_path: str) -> str:
    """The one-letter state of a thread ("T": stopped), or "" when it is gone."""
    try:
        with open(status_path) as f:
            return next((line.split()[1] for line in f if line.startswith("State:")), "")
    except FileNotFoundError:
        return ""


class Peer:
    """A peer process. ``call(op, **args)`` sends a command and returns its JSON reply."""

    def __init__(self, role: str, cfg: dict, start_timeout: float = 60.0):
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run, args=(child, json.dumps({**cfg, "role": role})), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout):
            self.kill()
            raise TimeoutError(f"{role} peer did not start within {start_timeout}s")
        hello = json.loads(self.conn.recv_bytes())
        if "error" in hello:
            raise RuntimeError(hello["error"])
        self.pid = self.proc.pid

    def post(self, op: str, **args) -> None:
        self.conn.send_bytes(json.dumps({"op": op, **args}).encode())

    def reply(self, timeout: float = 60.0) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        res = json.loads(self.conn.recv_bytes())
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(res["error"])
        return res

    def call(self, op: str, timeout: float = 60.0, **args) -> dict:
        self.post(op, **args)
        return self.reply(timeout)

    def stop(self):
        """SIGSTOP, and return once the process is stopped: the signal is delivered
        asynchronously, and a peer still running for a moment could finish what the test
        sends next."""
        os.kill(self.pid, signal.SIGSTOP)
        limit = time.monotonic() + 5
        while time.monotonic() < limit:   # every thread: they stop one by one
            if all(_state(f"/proc/{self.pid}/task/{t}/status") in ("t", "T")
                   for t in os.listdir(f"/proc/{self.pid}/task")):
                return
            time.sleep(0.001)
        raise TimeoutError(f"process {self.pid} did not stop within 5 s of SIGSTOP")

    def cont(self):
        os.kill(self.pid, signal.SIGCONT)

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def close(self):
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.call("exit", timeout=10)
            except Exception:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class ControlProxy:
    """Man in the middle on one prefill rank's control channel (decode side connects here).

    ``rule(direction, msg) -> None | "drop" | seconds``: direction "d2p" or "p2d", msg the decoded
    message (a dict with "t", "room", ...). Frames pass through untouched (HMAC stays valid).
    """

    def __init__(self, upstream: str, rule=None):
        self.rule = rule or (lambda direction, msg: None)
        self.upstream = upstream
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        self.front.bind("tcp://127.0.0.1:*")
        self.address = self.front.last_endpoint.decode()
        self.backs: dict[bytes, zmq.Socket] = {}
        self.seen: list[tuple[str, str, str]] = []
        self._delayed: list = []
        self._n = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _route(self, direction: str, sock, frames: list, ident: bytes) -> None:
        try:
            msg = msgpack.unpackb(frames[-1], raw=False)
        except Exception:
            msg = {"t": "?"}
        action = self.rule(direction, msg)
        self.seen.append((direction, msg.get("t"), msg.get("room"), "drop" if action == "drop" else action))
        if action == "drop":
            return
        out = frames if direction == "d2p" else [ident] + frames
        if action:
            self._n += 1
            heapq.heappush(self._delayed, (time.monotonic() + float(action), self._n, sock, out))
        else:
            sock.send_multipart(out)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(5):
                frames = sock.recv_multipart()
                if sock is self.front:
                    ident, rest = frames[0], frames[1:]
                    if ident not in self.backs:
                        b = self.ctx.socket(zmq.DEALER)
                        b.linger = 0
                        b.setsockopt(zmq.IDENTITY, ident)
                        b.connect(self.upstream)
                        self.backs[ident] = b
                        poller.register(b, zmq.POLLIN)
                    self._route("d2p", self.backs[ident], rest, ident)
                else:
                    ident = next(k for k, v in self.backs.items() if v is sock)
                    self._route("p2d", self.front, frames, ident)
            now = time.monotonic()
            while self._delayed and self._delayed[0][0] <= now:
                _, _, sock, out = heapq.heappop(self._delayed)
                sock.send_multipart(out)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        for s in [self.front, *self.backs.values()]:
            s.close(0)
        self.ctx.term()


def proxied_peers(bootstrap: str, proxies: dict[str, "ControlProxy"] | None = None, make=None):
    """Prefill RankInfos from the registry with their control address swapped for a proxy's."""
    _, ranks = BootstrapClient(bootstrap).topology()
    out = []
    for info in ranks:
        proxy = make(info.control) if make else None
        if proxies is not None and proxy is not None:
            proxies[info.spec.key] = proxy
        out.append(replace(info, control=proxy.address) if proxy else info)
    return out


# ------------------------------------------------------------------------------------
# One side in the test process, the other in a peer process
# ------------------------------------------------------------------------------------
POOL = dict(layers=2, heads=2, head_dim=8, dtype="float16", num_pages=1100, page_size=4)


def config(transport: str, **over) -> dict:
    cfg = {"transport": transport, "pool": dict(POOL), "seed": 11, "ttl": 3.0}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg


class Side:
    """The endpoint that lives in the test process, with an allocator and release counts."""

    def __init__(self, role: str, cfg: dict, bootstrap: str, peers=None):
        p = cfg["pool"]
        self.cfg, self.role = cfg, role
        self.kv, self.st = make_pools(cfg, cfg.get("seed") if role == "prefill" else None)
        self.alloc = PageAllocator(p["num_pages"], p["page_size"])
        self.st_alloc = PageAllocator(cfg["state_slots"], 1) if cfg.get("state_slots") else None
        self.releases: dict[int, int] = {}
        self.slots: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        self.lock = threading.RLock()
        spec = RankSpec(role=role, num_kv_heads=cfg.get("num_kv_heads", p["heads"]), num_layers=p["layers"],
                        **cfg.get("spec", {}))
        common = dict(state=self.st, transport=cfg["transport"], secret=cfg.get("secret"), timeouts=timeouts(cfg),
                      transport_options=transport_options(cfg["transport"], cfg))
        self.clock = ManualClock() if cfg.get("manual_clock") else None   # cfg "manual_clock": deadlines by hand
        if self.clock is not None:
            common["clock"] = self.clock
        if role == "prefill":
            self.ep = PrefillEndpoint(spec, self.kv, **common)
            self.ep.register(bootstrap, ttl=cfg.get("ttl", 3.0))
        else:
            self.aux = AuxBuffer(64)
            self.ep = DecodeEndpoint(spec, self.kv, aux=self.aux, **common)
            if peers is None:
                self.ep.connect(bootstrap=bootstrap, timeout=30)
            else:
                self.ep.connect(peers=peers)

    def _take(self, room: int, tokens: int, state: bool) -> np.ndarray:
        with self.lock:
            slots = self.alloc.alloc(tokens)
            assert slots is not None, "test allocator full"
            self.slots[room] = slots
            if state:
                self.state[room] = self.st_alloc.alloc(1)
            return slots

    def _on_release(self, room: int):
        def cb(outcome: Outcome):
            with self.lock:
                self.releases[room] = self.releases.get(room, 0) + 1
                if self.releases[room] == 1 and (self.role == "prefill" or outcome != Outcome.Success):
                    self.free(room)   # prefill reuses its KV; decode frees only a failed request's slots
        return cb

    def free(self, room: int) -> None:
        with self.lock:   # re-entrant: the release callback calls it under the lock
            self.alloc.free(self.slots.pop(room))
            if room in self.state:
                self.st_alloc.free(self.state.pop(room))

    def receiver(self, room: int, tokens: int, *, prefix: int = 0, state: bool = False, aux_slot=None,
                 init: bool = True):
        slots = self._take(room, tokens, state)
        r = self.ep.receiver(room, on_release=self._on_release(room))
        if init:
            r.init(slots, prefix_len=prefix, state_slots=self.state.get(room), aux_slot=aux_slot)
        return r, slots

    def sender(self, room: int, tokens: int, *, state: bool = False):
        slots = self._take(room, tokens, state)
        return self.ep.sender(room, on_release=self._on_release(room)), slots

    def full(self) -> bool:
        with self.lock:
            return self.alloc.free_pages == self.alloc.capacity and (
            self.st_alloc is None or self.st_alloc.free_pages == self.st_alloc.capacity)

    def close(self) -> None:
        self.ep.close()


def reference(cfg: dict, d_buffers, moves) -> list:
    """What the decode pool must hold: ``d_buffers`` (before) plus every (p_slots, d_slots) move
    planned and executed locally from a rebuilt prefill pool (the reference executor)."""
    from kvxfer.copy import execute_plan
    from kvxfer.plan import plan_transfer
    p_kv, p_st = make_pools(cfg, cfg["seed"])
    d_kv, d_st = make_pools(cfg, None)
    ref = [b.clone() for b in d_buffers]
    n = len(p_kv.buffers)
    for p_slots, d_slots, *state in moves:
        if len(p_slots):
            execute_plan(plan_transfer(p_kv.layout, np.asarray(p_slots), d_kv.layout, np.asarray(d_slots)),
                         p_kv.buffers, ref[:n])
        if state and state[0] is not None and len(state[0]):
            execute_plan(plan_transfer(p_st.layout, np.asarray(state[0]), d_st.layout, np.asarray(state[1])),
                         p_st.buffers, ref[n:])
    return ref


def same_bytes(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
