"""One transport endpoint, driven by commands, for tests that need a peer in another process.

As a program (``python tests/xfer_peer.py``) it reads one JSON command per line on stdin and
writes one JSON reply per line on stdout; logs go to stderr. Tests start it with
``PeerProcess`` and talk through ``PeerProcess.call``. Transports that only work inside one
process (``local``) use ``InProcessPeer``, which runs the same ``Peer`` without a process.

Commands (``{"op": ..., **arguments}``; a failing command replies ``{"error": "..."}``):

    init     transport, options, sizes, fill ("seed" | "canary" | byte value), seed -> descriptor, pid
    fill     regions, fill, seed              reset region contents
    connect  descriptor, token (b64, optional) -> peer
    disconnect  peer
    admit    descriptor -> token (b64)                 ``Transport.admit``
    peers    -> peers                                  UCX: the peer ids the transport keeps
    expect   request_id, ranges               ranges: encoded (region, start, nbytes) arrays
    forget   request_id -> live, grants_live  grants_live: GrantTable.live() when the transport has one
    pending  request_id -> pending                     ``writes_pending`` (after forget: may bytes still land?)
    submit   peer, request_id, plan, timeout, notify     returns at once; the handle is kept
    wait     request_ids, wait_s -> results {id: {status, error, elapsed}}
    status   request_ids -> status {id: name}, released {id: source_released}   never blocks
    arrivals count, wait_s -> arrivals [...]                   until ``count`` arrived or wait_s passed
    digest   regions -> digests {region: sha256 hex}
    watch    region, offset, value, wait_s -> changed       until that byte is no longer ``value``
    foreign  region, seed -> count                           bytes that are neither canary nor the seed's
    matches  region, start, nbytes, seed -> same             those bytes hold the seed's pattern there
    strided_matches  region, seed, runs, run -> same       runs 0, 2, 4, ... of a sender's seeded region 0
    health   -> kvxfer_threads, fds, threads, rss, peak_rss, broken   this process, for the hostile tests
    rejected -> rejected {reason: count}
    close

Region contents are reproducible from a seed (``pattern``), so the test process can compute
the image a destination must hold without moving the bytes back.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

CANARY = 0xA5


_PERIOD = 1_048_573   # a prime just under 1 MiB: frames or chunks moved to the wrong place show


def fill_pattern(out: np.ndarray, seed: int) -> None:
    """Deterministic bytes that depend on the seed and on the position modulo ``_PERIOD``."""
    x = np.arange((_PERIOD + 7) // 8, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    block = x.view(np.uint8)[:_PERIOD]
    for off in range(0, out.size, _PERIOD):   # test set-up, one step per ~1 MiB
        out[off: off + _PERIOD] = block[: out.size - off]


def make_pattern(seed: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    fill_pattern(out, seed)
    return out


@lru_cache(maxsize=8)
def pattern(seed: int, nbytes: int) -> np.ndarray:
    """``make_pattern``, cached and read-only (the test process asks for the same images often)."""
    out = make_pattern(seed, nbytes)
    out.flags.writeable = False
    return out


def region_seed(seed: int, region: int) -> int:
    return seed * 1000 + region


def enc(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<i8").tobytes()).decode()


def dec(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), "<i8").astype(np.int64)


def plan_to_json(plan) -> list[dict]:
    return [{"src_region": enc(g.src_region), "src_base": enc(g.src_base), "dst_region": enc(g.dst_region),
             "dst_base": enc(g.dst_base), "row_src": enc(g.row_src), "row_dst": enc(g.row_dst),
             "row_len": enc(g.row_len), "packed": bool(g.packed), "heads": g.heads,
             "src_head_stride": g.src_head_stride, "dst_head_stride": g.dst_head_stride} for g in plan.groups]


def plan_from_json(groups: list[dict]):
    from kvxfer.plan import RunGroup, TransferPlan
    arrays = ("src_region", "src_base", "dst_region", "dst_base", "row_src", "row_dst", "row_len")
    return TransferPlan(tuple(RunGroup(**{k: dec(g[k]) for k in arrays}, packed=g["packed"], heads=g["heads"],
                                       src_head_stride=g["src_head_stride"], dst_head_stride=g["dst_head_stride"])
                              for g in groups))


def raw_plan(sr, so, dr, do, n):
    """A TransferPlan of the given flat runs, in order within each (src, dst) region pair."""
    from kvxfer.plan import PACK_BELOW, RunGroup, TransferPlan
    sr, so, dr, do, n = (np.asarray(a, np.int64) for a in (sr, so, dr, do, n))
    groups = []
    pair = sr * (1 << 20) + dr
    for key in np.unique(pair):
        for packed in (False, True):
            m = (pair == key) & ((n < PACK_BELOW) == packed)
            if m.any():
                z = np.zeros(1, np.int64)
                groups.append(RunGroup(z + key // (1 << 20), z, z + key % (1 << 20), z, so[m], do[m], n[m], packed))
    return TransferPlan(tuple(groups))


def ranges_to_json(region, start, nbytes) -> dict:
    return {"region": enc(region), "start": enc(start), "nbytes": enc(nbytes)}


class Peer:
    """The command interpreter: one transport, its regions and its handles."""

    def __init__(self):
        self.t = None
        self.regions: list[torch.Tensor] = []
        self.handles: dict = {}
        self.lost: list = []   # arrivals read by ``arrivals`` beyond the count asked for

    def call(self, cmd: dict) -> dict:
        try:
            return getattr(self, "op_" + cmd.pop("op"))(**cmd) or {}
        except Exception as e:
            logging.exception("command failed")
            return {"error": f"{type(e).__name__}: {e}"}

    def _fill(self, i: int, fill, seed: int) -> None:
        r = self.regions[i].numpy()
        if fill == "seed":
            fill_pattern(r, region_seed(seed, i))
        else:
            r.fill(CANARY if fill == "canary" else int(fill))

    def op_init(self, transport: str, sizes: list[int], fill="canary", seed: int = 0, options=None):
        from kvxfer.transport.registry import get_transport
        self.t = get_transport(transport, **(options or {}))
        self.regions = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        for i in range(len(sizes)):
            self._fill(i, fill, seed)
        self.t.register(self.regions)
        return {"descriptor": self.t.descriptor(), "pid": os.getpid()}

    def op_fill(self, regions: list[int], fill="canary", seed: int = 0):
        for i in regions:
            self._fill(i, fill, seed)

    def op_connect(self, descriptor: dict, token: str = ""):
        return {"peer": self.t.connect(descriptor, base64.b64decode(token))}

    def op_disconnect(self, peer: str):
        self.t.disconnect(peer)

    def op_admit(self, descriptor: dict):
        return {"token": base64.b64encode(self.t.admit(descriptor)).decode()}

    def op_peers(self):
        """UCX: the peer ids this transport keeps."""
        return {"peers": self.t.call_io(lambda: sorted(self.t.peers))}

    def op_expect(self, request_id: str, ranges: dict, capability: str = ""):
        from kvxfer.grant import ByteRanges
        self.t.expect(request_id, ByteRanges(dec(ranges["region"]), dec(ranges["start"]), dec(ranges["nbytes"])),
                      **({"capability": base64.b64decode(capability)} if capability else {}))

    def op_forget(self, request_id: str):
        grants = getattr(self.t, "grants", None)
        live = self.t.forget(request_id)
        return {"live": live, "grants_live": grants.live() if grants is not None else None}

    def op_pending(self, request_id: str):
        return {"pending": self.t.writes_pending(request_id)}

    def op_submit(self, peer: str, request_id: str, plan: list, timeout: float = 30.0, notify: str = "",
                  capability: str = "", stall_s: float = 0.0):
        """``stall_s`` (UCX): once the ANNOUNCE is out, the I/O thread stalls that long (a stalled
        or partitioned sender: it answers nothing, then goes on with the GO it finds)."""
        kw = {"capability": base64.b64decode(capability)} if capability else {}
        if not stall_s:
            self.handles[request_id] = self.t.submit(peer, request_id, plan_from_json(plan), timeout=timeout,
                                                     notify=base64.b64decode(notify), **kw)
            return
        # UCX internals: the announce and the stall in one command, so no GO is handled between
        from kvxfer.transport.base import TransferHandle
        from kvxfer.transport.kit import Call
        t, pl = self.t, plan_from_json(plan)
        h = self.handles[request_id] = TransferHandle(request_id, pl.nbytes, timeout, holds_source=True)
        out = t.planner.prepare_transfer(t.peers[peer], h, pl, base64.b64decode(notify), kw.get("capability", b""))

        def stall():
            t.sender.start_out(out)
            t.outbox.flush()
            end = time.monotonic() + 0.05
            while time.monotonic() < end:   # the ANNOUNCE leaves
                t.workers.worker.progress()
            time.sleep(stall_s)
        t.commands.put(Call(stall, ()))

    def op_wait(self, request_ids: list[str], wait_s: float = 60.0):
        limit, out = time.monotonic() + wait_s, {}
        for rid in request_ids:
            h = self.handles[rid]
            h.wait(max(limit - time.monotonic(), 0))
            out[rid] = {"status": h.poll().name, "error": "" if h.error is None else f"{type(h.error).__name__}: "
                        f"{h.error}", "elapsed": time.monotonic() - h.started}
        return {"results": out}

    def op_status(self, request_ids: list[str]):
        return {"status": {rid: self.handles[rid].poll().name for rid in request_ids},
                "released": {rid: self.handles[rid].source_released for rid in request_ids}}

    def op_arrivals(self, count: int, wait_s: float = 30.0):
        limit, got = time.monotonic() + wait_s, self.lost
        got += self.t.arrivals()
        while len(got) < count and time.monotonic() < limit:
            got += self.t.arrivals(timeout=min(0.2, max(limit - time.monotonic(), 0.001)))
        got, self.lost = got[:count], got[count:]
        return {"arrivals": [{"request_id": a.request_id, "nbytes": a.nbytes, "ok": a.ok, "reason": a.reason,
                              "notify": base64.b64encode(a.notify).decode()} for a in got]}

    def op_digest(self, regions: list[int]):
        return {"digests": {str(i): hashlib.sha256(self.regions[i].numpy()).hexdigest() for i in regions}}

    def op_watch(self, region: int, offset: int, value: int = CANARY, wait_s: float = 10.0):
        r, limit = self.regions[region].numpy(), time.monotonic() + wait_s
        while int(r[offset]) == value:
            if time.monotonic() > limit:
                return {"changed": False}
            time.sleep(0.0005)
        return {"changed": True}

    def op_foreign(self, region: int, seed: int):
        r = self.regions[region].numpy()
        return {"count": int(((r != CANARY) & (r != pattern(region_seed(seed, region), r.size))).sum())}

    def op_matches(self, region: int, start: int, nbytes: int, seed: int):
        """Do bytes ``start .. start + nbytes`` of ``region`` hold the seed's pattern there?"""
        r = self.regions[region].numpy()[start:start + nbytes]
        return {"same": bool((r == pattern(region_seed(seed, region), start + nbytes)[start:]).all())}

    def op_strided_matches(self, region: int, seed: int, runs: int, run: int, apart: bool = False):
        """Does ``region`` start with every other ``run`` bytes of a sender's region 0 filled from
        ``seed`` (runs 0, 2, 4, ... of it, back to back; ``apart``: each at its source offset)?"""
        want = pattern(region_seed(seed, 0), 2 * runs * run).reshape(runs, 2, run)[:, 0, :]
        got = self.regions[region].numpy()[:2 * runs * run].reshape(runs, 2, run)[:, 0, :] if apart else \
            self.regions[region].numpy()[:runs * run].reshape(runs, run)
        return {"same": bool((got == want).all())}

    def op_health(self):
        """This process: the kvxfer threads alive, open fds, threads, RSS bytes, ``broken``."""
        import threading
        with open("/proc/self/status") as f:
            mem = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                   if k in ("VmRSS", "VmHWM")}
        return {"kvxfer_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvxfer")),
                "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(), "rss": mem["VmRSS"],
                "peak_rss": mem["VmHWM"], "broken": getattr(self.t, "broken", None)}

    def op_stall(self, seconds: float):
        """UCX: the I/O thread stops for ``seconds`` (no progress, no answers), as a stopped host."""
        from kvxfer.transport.kit import Call
        self.t.commands.put(Call(time.sleep, (seconds,)))

    def op_stall_after_announce(self, seconds: float):
        """UCX: after the next ANNOUNCE is answered (GO sent), the I/O thread stops for ``seconds``
        (a receiver that stops taking the puts it just allowed)."""
        t = self.t
        orig = t.receiver.on_announce

        def hooked(p, m):
            del t.receiver.on_announce   # once
            orig(p, m)
            t.outbox.flush()
            end = time.monotonic() + 0.05
            while p.last_send is not None and not p.last_send.completed and time.monotonic() < end:
                t.workers.worker.progress()   # the GO leaves
            time.sleep(seconds)
        t.receiver.on_announce = hooked

    def op_pregranted(self, peer: str):
        """UCX: the request ids ``peer`` pregranted us (eager writes)."""
        return {"rids": self.t.call_io(lambda: list(self.t.peers[peer].pregranted))}

    def op_pregrant(self, peer: str, request_id: str):
        """UCX: behave as if ``peer`` pregranted ``request_id``, all of its memory (a buggy sender)."""
        from kvxfer.grant import ByteRanges
        p = self.t.peers[peer]
        sizes = np.asarray(p.sizes, np.int64)
        everything = ByteRanges(np.arange(len(sizes)), np.zeros(len(sizes), np.int64), sizes)
        self.t.call_io(lambda: p.pregranted.__setitem__(request_id, everything))

    def op_fencing(self):
        return {"fencing": self.t.fencing(), "staging": self.t.staging() if hasattr(self.t, "staging") else {}}

    def op_rejected(self):
        return {"rejected": dict(self.t.rejected)}

    def op_close(self):
        if self.t is not None:
            self.t.close()


class InProcessPeer:
    """``Peer`` behind the same ``call`` as ``PeerProcess``, for in-process transports."""
    pid = None

    def __init__(self, *_args):
        self.peer = Peer()

    def call(self, op: str, **kw) -> dict:
        reply = self.peer.call(json.loads(json.dumps({"op": op, **kw})))
        if "error" in reply:
            raise RuntimeError(f"peer {op} failed: {reply['error']}")
        return reply

    def signal(self, sig: int) -> None:
        raise RuntimeError("an in-process peer cannot be signalled")

    def close(self) -> None:
        self.peer.call({"op": "close"})


class PeerProcess:
    """A ``Peer`` in a child process (this file run as a program)."""

    def __init__(self, stderr_path: Path, script: str = __file__, env: dict | None = None,
                 prefix: list[str] | None = None):
        """``script``: the program (this file; a test's own command loop speaks the same lines);
        ``env``: its environment (default: ours); ``prefix``: argv before the interpreter (e.g.
        ``["ip", "netns", "exec", ns]``: it execs, so the pid is the program's)."""
        self.stderr_path = stderr_path
        self._err = open(stderr_path, "wb")
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=env)
        self.pid = self.proc.pid
        self._buf = b""

    def send(self, op: str, **kw) -> None:
        """Send a command without waiting for its reply (see ``reply``)."""
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0, op: str = "?") -> dict:
        limit = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = limit - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(left, 0))[0]
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20) if ready else None
            if not chunk:
                try:
                    why = "timed out" if chunk is None else f"exited with {self.proc.wait(5)}"
                except subprocess.TimeoutExpired:
                    why = "closed its output"
                raise RuntimeError(f"peer {self.pid} {why} during {op}; stderr:\n{self.stderr_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"peer {op} failed: {reply['error']}; stderr:\n{self.stderr_tail()}")
        return reply

    def call(self, op: str, **kw) -> dict:
        """Send a command and wait for its reply (a minute longer than the command may wait)."""
        self.send(op, **kw)
        return self.reply(60.0 + kw.get("wait_s", 0), op)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stderr_tail(self, lines: int = 30) -> str:
        self._err.flush()
        return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("close")
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._err.close()


@contextlib.contextmanager
def stalled_receiver(tmp_path: Path, stall_s: float = 3.0, size: int = 64 << 20):
    """A UCX sender in this process (over TCP, peer_timeout 0.8 s) and a receiver process that
    grants all of its ``size``-byte canary region, answers the first ANNOUNCE with GO and then
    stalls for ``stall_s`` s, so the sender's puts sit in the sockets. Yields ``(tx, rx, peer,
    region, plan)``: ``plan`` moves the whole random ``region`` to offset 0; nothing is sent yet.
    Closes both at the end. ``digest_of(region)`` is what the receiver's region must hash to."""
    from kvxfer.transport.registry import get_transport
    opts = {"tls": "tcp", "heartbeat": 0.1, "peer_timeout": 0.8}
    tx = get_transport("ucx", **opts)
    region = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    tx.register([region])
    rx = PeerProcess(tmp_path / "rx.err")
    try:
        desc = rx.call("init", transport="ucx", sizes=[size], fill="canary", options=opts)["descriptor"]
        rx.call("expect", request_id="t.1", ranges={"region": enc(np.array([0])), "start": enc(np.array([0])),
                                                     "nbytes": enc(np.array([size]))})
        peer = tx.connect(desc)
        rx.call("stall_after_announce", seconds=stall_s)   # GO, then it stops
        z = np.zeros(1, np.int64)
        yield tx, rx, peer, region, raw_plan(z, z, z, z, np.array([size], np.int64))
    finally:
        rx.close()
        tx.close()


def digest_of(region: torch.Tensor) -> str:
    return hashlib.sha256(region.numpy()).hexdigest()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    # stdout carries only replies: what a library prints there (UCX logs its errors to stdout) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    peer = Peer()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        reply = peer.call(cmd)
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if op == "close":
            break


if __name__ == "__main__":
    main()
