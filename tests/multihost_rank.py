"""One kvxfer rank (or the bootstrap registry) as a real process, for the multi-host tests.

Who calls what
--------------
``tests/test_multihost.py`` and ``scripts/bench_hosts.py`` start it inside a test host
(``Host.popen``, see ``tests/hosts.py``) and drive it with ``RankProc(host, role, **flags)``
(below; ``rank.call(op, **args)``), which runs this file as::

    python tests/multihost_rank.py --role bootstrap --host 10.213.7.1 [--expect 2]
    python tests/multihost_rank.py --role prefill --host 10.213.7.2 --bootstrap http://10.213.7.1:P \
        --tp-rank 0 --tp-size 2 --layout page_major --transport zmq --seed 5
    python tests/multihost_rank.py --role decode  --host 10.213.7.3 --bootstrap ... --tp-rank 1 --tp-size 4

Every address is the host's own (``--host``): the bootstrap server, the prefill control
ROUTER and the zmq data ROUTER bind it and advertise it (today's defaults are 127.0.0.1).

Protocol: one JSON command per line on stdin, one reply per line on stdout prefixed ``@@ ``
(anything else on stdout, e.g. a library's chatter, is not a reply). The first reply is the
hello (``{"ok": true, "pid", "heads"}``; the bootstrap's also has ``"url"``). A command that
raises answers ``{"error": "..."}``. Commands (``room`` an int, ``rooms`` a list of them):

    sender   {room, tokens}           prefill: allocate slots, make the sender -> {slots}
    send     {room, chunks=1}         prefill: send all its slots in ``chunks`` pieces, last=True
    receiver {room, tokens}           decode: allocate, ``receiver(room).init(slots)`` -> {slots}
    wait     {rooms, within}          until every room ended (or within s) -> {room: status}
    poll     {rooms}                  -> {room: {state, outcome, reason, releases, ended_after}}
    digest   {room}                   sha256 per "layer/kind/global head" of the room's tokens
    canary   {keep}                   bytes != 0xCD outside the slots of rooms ``keep`` (decode)
    stats                             allocator and release counts
    fencing                           the transport's ``fencing()`` (memory a failed peer still pins)
    exit

Prefill pools hold seeded random bytes (seed x TP rank x region), decode pools the canary
0xCD. A decode request that fails has its slots refilled with the canary when it is released,
then freed, as if the next owner had written them: a later write to them is then visible.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import torch

# --- every kvxfer name this harness uses: update here after a module move ----------------
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.endpoint.base import Outcome, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.grant import ByteRanges
from kvxfer.pools import MHAPool, PageAllocator
from kvxfer.ranks import RankSpec
from kvxfer.topology import heads_held

# ---------------------------------------------------------------------------------------------

CANARY = 0xCD


def reply(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_pool(a) -> tuple[MHAPool, list[int]]:
    """This rank's pool and the global heads it holds."""
    heads = list(heads_held(a.heads, a.tp_size, a.tp_rank))
    pool = MHAPool(layers=a.layers, heads=len(heads), head_dim=a.head_dim, dtype=a.dtype,
                   num_pages=a.num_pages, page_size=a.page_size, layout=a.layout)
    for i, b in enumerate(pool.buffers):
        if a.role == "prefill":
            g = torch.Generator().manual_seed((a.seed * 100 + a.tp_rank) * 1000 + i)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
        else:
            b.fill_(CANARY)
    return pool, heads


def transport_options(a) -> dict:
    if a.transport == "zmq":
        return {"endpoint": f"tcp://{a.host}:0", "heartbeat_ivl": a.hb[0], "heartbeat_timeout": a.hb[1]}
    if a.transport == "ucx":   # UCX_TLS comes from the environment (hosts.UCX_ENV)
        return ({"heartbeat": a.hb[0], "peer_timeout": a.hb[1]}
                | ({"stage_host": a.ucx_stage_host} if a.ucx_stage_host else {})
                | ({} if a.ucx_eager < 0 else {"eager_writes": bool(a.ucx_eager)}))
    return {}


def fill_canary(pool: MHAPool, slots: np.ndarray) -> None:
    br = ByteRanges.of_slots(pool.layout, slots)
    for r, b in enumerate(pool.buffers):
        starts, ends = br.intervals(r)
        view = b.numpy()
        for s, e in zip(starts.tolist(), ends.tolist()):
            view[s:e] = CANARY


def not_canary(pool: MHAPool, keep: list[np.ndarray], rooms: dict | None = None) -> dict:
    """Bytes != CANARY outside the slots ``keep``, per region, and the first few offsets;
    ``by_room``: how many of them lie in each room's slots (``rooms``: room -> slots ever held)."""
    br = ByteRanges.of_slots(pool.layout, np.concatenate(keep)) if keep else None
    out = {"bad": 0, "first": [], "by_room": {}}
    masks = []
    for r, b in enumerate(pool.buffers):
        mask = b.numpy() != CANARY
        if br is not None:
            for s, e in zip(*(x.tolist() for x in br.intervals(r))):
                mask[s:e] = False
        masks.append(mask)
        n = int(mask.sum())
        if n:
            out["bad"] += n
            out["first"].append([r, np.flatnonzero(mask)[:4].tolist()])
    if out["bad"] and rooms:
        for room, sl in rooms.items():
            rb = ByteRanges.of_slots(pool.layout, sl)
            n = sum(int(masks[r][s:e].sum()) for r in range(len(masks))
                    for s, e in zip(*(x.tolist() for x in rb.intervals(r))))
            if n:
                out["by_room"][str(room)] = n
    return out


def digest(pool: MHAPool, heads: list[int], layers: int, slots: np.ndarray) -> dict:
    out = {}
    for layer in range(layers):
        for kind in ("k", "v"):
            part = pool.get_part(layer, kind, slots)                # [tokens, heads, head_dim]
            raw = part.contiguous().view(torch.uint8).reshape(len(slots), len(heads), -1)
            for j, h in enumerate(heads):
                out[f"{layer}/{kind}/{h}"] = hashlib.sha256(raw[:, j].contiguous().numpy().tobytes()).hexdigest()
    return out


def serve(a) -> None:
    pool, heads = make_pool(a)
    alloc = PageAllocator(a.num_pages, a.page_size)
    t = a.timeouts
    timeouts = Timeouts(bootstrap=t[0], waiting=t[1], transfer=t[2], lease=t[3], handshake=10.0,
                        heartbeat=Heartbeat(interval=a.hb[0], timeout=a.hb[1]))
    spec = RankSpec(role=a.role, num_kv_heads=a.heads, num_layers=a.layers, tp_rank=a.tp_rank, tp_size=a.tp_size)
    common = dict(transport=a.transport, transport_options=transport_options(a), timeouts=timeouts)
    reqs, slots, releases, lock = {}, {}, {}, threading.Lock()
    ever = {}   # room -> its slots, kept after a free (prefill bytes never change: digest works)

    def released(room):
        def cb(outcome: Outcome):
            with lock:
                releases[room] = releases.get(room, 0) + 1
                if releases[room] > 1:
                    return
                if a.role == "prefill" or outcome is not Outcome.Success:
                    if a.role == "decode":
                        fill_canary(pool, slots[room])   # the next owner's bytes
                    alloc.free(slots.pop(room))
        return cb

    if a.role == "prefill":
        ep = PrefillEndpoint(spec, pool, host=a.host, **common)
        ep.register(a.bootstrap, ttl=5.0)
    else:
        ep = DecodeEndpoint(spec, pool, **common)
        ep.connect(bootstrap=a.bootstrap, timeout=60)
    reply({"ok": True, "pid": os.getpid(), "heads": heads, "info": ep.info.data})

    def take(room, tokens):
        s = alloc.alloc(tokens)
        if s is None:
            raise RuntimeError(f"allocator full ({alloc.free_pages} pages free)")
        with lock:
            slots[room] = ever[room] = s
        return s

    def status(rooms):
        return {str(r): {"state": reqs[r].poll().name, "reason": reqs[r].reason,
                         "outcome": reqs[r].outcome.value if reqs[r].outcome else None,
                         "releases": releases.get(r, 0),
                         "ended_after": round(reqs[r].ended_at - reqs[r].created, 3) if reqs[r].ended_at else None}
                for r in rooms}

    for line in sys.stdin:
        cmd = json.loads(line)
        op, res = cmd.pop("op"), {}
        try:
            if op == "sender":
                s = take(cmd["room"], cmd["tokens"])
                reqs[cmd["room"]] = ep.sender(cmd["room"], on_release=released(cmd["room"]))
                res = {"slots": s.tolist()}
            elif op == "send":
                s, n = slots[cmd["room"]], cmd.get("chunks", 1)
                cut = [len(s) * i // n // a.page_size * a.page_size for i in range(n)] + [len(s)]
                res = {"accepted": [reqs[cmd["room"]].send(s[x:y], start=x, last=y == len(s))
                                    for x, y in zip(cut, cut[1:]) if y > x]}
            elif op == "receiver":
                s = take(cmd["room"], cmd["tokens"])
                r = reqs[cmd["room"]] = ep.receiver(cmd["room"], on_release=released(cmd["room"]))
                r.init(s)
                res = {"slots": s.tolist()}
            elif op == "wait":
                end = time.monotonic() + cmd.get("within", 30)
                for room in cmd["rooms"]:
                    reqs[room].wait(max(0.0, end - time.monotonic()))
                res = status(cmd["rooms"])
            elif op == "poll":
                res = status(cmd["rooms"])
            elif op == "digest":
                res = digest(pool, heads, a.layers, ever[cmd["room"]])
            elif op == "canary":
                with lock:
                    res = not_canary(pool, [slots[r] for r in cmd.get("keep", []) if r in slots], dict(ever))
            elif op == "stats":
                with lock:
                    res = {"free_pages": alloc.free_pages, "capacity": alloc.capacity,
                           "releases": {str(k): v for k, v in releases.items()}}
            elif op == "fencing":
                res = ep.transport.fencing()
            elif op == "exit":
                reply({})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:   # the test sees it instead of a dead pipe
            res = {"error": f"{type(e).__name__}: {e}"}
        reply(res)
    ep.close()


def bootstrap(a) -> None:
    server = BootstrapServer(BootstrapConfig(host=a.host, port=a.port, ttl=10.0, expect=a.expect)).start()
    reply({"ok": True, "pid": os.getpid(), "url": server.url, "heads": []})
    for line in sys.stdin:
        if json.loads(line).get("op") == "exit":
            break
        reply({})
    reply({})
    server.stop()


class RankProc:
    """The test side: this script started in ``host`` (a ``hosts.Host``), driven over its pipes.
    ``flags``: command-line flags as keywords (``tp_rank=1`` -> ``--tp-rank 1``)."""

    def __init__(self, host, role: str, env: dict | None = None, start_timeout: float = 120.0, **flags):
        import queue
        argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--host", host.addr]
        for k, v in flags.items():
            argv += [f"--{k.replace('_', '-')}", *(map(str, v) if isinstance(v, (list, tuple)) else [str(v)])]
        self.role, self.host = role, host
        self.proc = host.popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.reply(start_timeout)
        self.pid, self.heads, self.url = self.hello["pid"], self.hello["heads"], self.hello.get("url")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._lines.put(json.loads(line[3:]))
        self._lines.put(None)

    def reply(self, timeout: float = 60.0) -> dict:
        import queue
        try:
            res = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.role} rank in {self.host} did not answer within {timeout}s") from None
        if res is None:
            raise RuntimeError(f"{self.role} rank in {self.host} exited (code {self.proc.wait()})")
        if "error" in res:
            raise RuntimeError(f"{self.role} rank: {res['error']}")
        return res

    def ask(self, op: str, **args) -> None:
        """Send a command without waiting for its reply (``reply`` reads it): several ranks then
        work on theirs at once, as each rank's own engine would."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = 60.0, **args) -> dict:
        self.ask(op, **args)
        return self.reply(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
                self.proc.wait(10)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


# What the multi-host tests do with a cluster ``c`` ({"prefill": [RankProc], "decode": [RankProc], ...})

def submit(c: dict, room: int, tokens: int, chunks: int = 1, send: bool = True) -> None:
    """Grant ``room`` on every decode rank, bind it on every prefill rank and (``send``) send it
    in ``chunks``."""
    for d in c["decode"]:
        d.call("receiver", room=room, tokens=tokens)
    for p in c["prefill"]:
        p.call("sender", room=room, tokens=tokens)
    if send:
        for p in c["prefill"]:
            p.call("send", room=room, chunks=chunks)


def ended(ranks, rooms, within: float) -> list[dict]:
    """Every rank's status of ``rooms``, waiting until all ended or ``within`` s (shared)."""
    end = time.monotonic() + within
    return [r.call("wait", timeout=within + 30, rooms=rooms, within=max(0.0, end - time.monotonic())) for r in ranks]


def attempt(c: dict, room: int, tokens: int, within: float, chunks: int = 1) -> list[dict]:
    """``submit`` then ``ended(decode + prefill, [room], within)``, for a loop that retries until
    a request lands: but decode's receivers come first, and when a decode rank fails the request
    at once (it still counts a peer lost) the attempt ends there, before any prefill sender exists.
    A prefill sender made for it would wait for decode's request, never sent, until its bootstrap
    deadline, holding its slots: the loop would wait ``within`` for nothing, or, retrying sooner,
    fill prefill's pool with such senders. Returns decode's statuses only when it ended there."""
    for d in c["decode"]:
        d.call("receiver", room=room, tokens=tokens)
    first = ended(c["decode"], [room], 0.5)
    if any(st[str(room)]["state"] == "Failed" for st in first):
        time.sleep(0.2)
        return first
    for p in c["prefill"]:
        p.call("sender", room=room, tokens=tokens)
    for p in c["prefill"]:
        p.call("send", room=room, chunks=chunks)
    return ended(c["decode"] + c["prefill"], [room], within)


def byte_exact(c: dict, room: int) -> None:
    """The digests of ``room``'s KV on the prefill ranks equal those on the decode ranks."""
    sent, got = {}, {}
    for p in c["prefill"]:
        sent.update(p.call("digest", room=room, timeout=120))
    for d in c["decode"]:
        got.update(d.call("digest", room=room, timeout=120))
    assert set(got) == set(sent) and all(sent[k] == got[k] for k in sent), f"room {room}: bytes differ"


def parse(argv=None):
    ap = argparse.ArgumentParser(description="one kvxfer rank for the multi-host tests")
    ap.add_argument("--role", choices=["bootstrap", "prefill", "decode"], required=True)
    ap.add_argument("--host", required=True, help="this host's address: bind and advertise it")
    ap.add_argument("--port", type=int, default=0, help="bootstrap: port (0: any)")
    ap.add_argument("--expect", type=int, default=None, help="bootstrap: ranks to wait for")
    ap.add_argument("--bootstrap", help="registry URL (prefill, decode)")
    ap.add_argument("--transport", default="zmq")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="global KV heads")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--layout", default="token_major")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeouts", type=float, nargs=4, default=[30, 60, 30, 60],
                    metavar=("BOOTSTRAP", "WAITING", "TRANSFER", "LEASE"))
    ap.add_argument("--hb", type=float, nargs=2, default=[0.5, 5.0], metavar=("INTERVAL", "TIMEOUT"))
    ap.add_argument("--ucx-eager", type=int, default=-1, choices=(-1, 0, 1),
                    help="UCX: eager_writes (pregranted puts): 1, 0 (announced), -1 the transport's default")
    ap.add_argument("--ucx-stage-host", default="", help="UCX: stage_host (never, network, always; \"\": default)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=os.environ.get("KVXFER_TEST_LOG", "WARNING"), stream=sys.stderr,
                        format=f"%(asctime)s {sys.argv[2:4]} %(name)s %(levelname)s %(message)s")
    args = parse()
    (bootstrap if args.role == "bootstrap" else serve)(args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed (``serve`` closed its endpoint, ``bootstrap`` its server). What is left
    # is the interpreter's final collection of torch's objects: ~0.5-1 s a process, and the tests
    # end their ranks one after the other
    os._exit(0)
