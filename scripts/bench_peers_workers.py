"""The two sides of every peer of ``bench_peers.py``: the cases and their byte pattern, the
control connection between a peer's two workers, one class per peer, and ``worker`` (one
side of one peer, run by ``bench_peers.py --worker``). numpy only at import: workers run in
the peers' own virtual environments, without torch.
"""
from __future__ import annotations

import json
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
CHUNK = MiB


# ---------------------------------------------------------------------------------------
# The cases and the byte pattern (numpy only: workers run in peer venvs without torch)
# ---------------------------------------------------------------------------------------
def make_cases(pool_bytes: int, pages: int, page_sizes: list[int], run_sizes: list[int], seed: int) -> list[dict]:
    """One scattered case per page size (``pages`` pages at random places of the source pool ->
    random places of the destination pool) and one single-run case per run size."""
    rng = np.random.default_rng(seed)
    cases = []
    for page in page_sizes:
        slots = pool_bytes // page
        cases.append({"name": f"scattered {page // KiB} KiB x{pages}", "nbytes": page,
                      "so": (rng.choice(slots, pages, replace=False) * page).tolist(),
                      "do": (rng.choice(slots, pages, replace=False) * page).tolist()})
    for run in run_sizes:
        cases.append({"name": f"one run {run // MiB} MiB", "nbytes": run,
                      "so": [int(rng.integers(pool_bytes // run)) * run],
                      "do": [int(rng.integers(pool_bytes // run)) * run]})
    return cases


def pattern(word_index: np.ndarray) -> np.ndarray:
    """The source pool's 8-byte words: every word differs, so a misplaced page shows."""
    return (word_index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)


def source_pool(pool_bytes: int, cases: list[dict]) -> np.ndarray:
    """The source pool: the pattern at every source run, zero pages (never touched) elsewhere."""
    pool = np.zeros(pool_bytes, np.uint8)
    for c in cases:
        for so in c["so"]:
            pool[so: so + c["nbytes"]] = pattern(np.arange(so // 8, (so + c["nbytes"]) // 8)).view(np.uint8)
    return pool


def check(pool: np.ndarray, case: dict) -> str:
    """'' when the destination runs hold the source runs' pattern, else what differs."""
    n = case["nbytes"]
    for i, (so, do) in enumerate(zip(case["so"], case["do"])):
        want = pattern(np.arange(so // 8, (so + n) // 8))
        if not np.array_equal(pool[do: do + n].view(np.uint64), want):
            return f"{case['name']}: run {i} differs at the receiver"
    return ""


class Ctl:
    """JSON lines over a loopback socket between the two workers of a peer."""

    def __init__(self, sock: socket.socket):
        self.sock, self.f = sock, sock.makefile("rwb")

    def send(self, obj) -> None:
        self.f.write(json.dumps(obj).encode() + b"\n")
        self.f.flush()

    def readable(self) -> bool:
        """Whether a message is waiting (never blocks)."""
        return bool(self.f.peek(1)) if select.select([self.sock], [], [], 0)[0] else False

    def recv(self):
        line = self.f.readline()
        if not line:
            raise ConnectionError("the other worker went away")
        return json.loads(line)


# ---------------------------------------------------------------------------------------
# Peers: the target (receiver) and the initiator (sender) side of each
# ---------------------------------------------------------------------------------------
class Peer:
    """Defaults for a one-sided peer, whose target does nothing per transfer."""
    verify = True   # check the target's bytes after the warm-up

    def info(self) -> dict:
        """Target, once: what the initiator needs to reach it."""
        return {}

    def accept(self) -> None:
        """Target, once, while the initiator runs ``connect`` (rendezvous-style peers)."""

    def connect(self, info: dict) -> None:
        """Initiator, once."""

    def prepare(self, case: dict, tag: str) -> None:
        """Target, before the initiator starts a transfer (kvxfer: the grant)."""

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        """Target, during the transfer (two-sided peers receive here); ``ended()`` turns True
        once the initiator reports its transfer complete."""

    def transfer(self, case: dict, tag: str) -> None:
        """Initiator: returns once the bytes are at the target."""
        raise NotImplementedError

    def finish(self, tag: str) -> None:
        """Target, after the transfer was checked."""

    def close(self) -> None:
        pass


class NixlPeer(Peer):
    """NIXL's Python API spins its progress thread (no delay): on a 2-core box that takes a
    core from everyone. So neither side runs it: the initiator progresses by polling its
    transfer's state, the target by polling for notifications while a transfer may be under
    way, as an engine's loop would."""

    notify = False   # the WRITE carries no notification: the target never learns it arrived

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        from nixl._api import nixl_agent, nixl_agent_config
        self.pool, self.base = pool, pool.ctypes.data
        self.agent = nixl_agent(f"{role}-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory([(self.base, pool.nbytes, 0, "")], "DRAM")

    def info(self) -> dict:
        return {"meta": self.agent.get_agent_metadata().hex(), "base": self.base}

    def connect(self, info: dict) -> None:
        self.remote = self.agent.add_remote_agent(bytes.fromhex(info["meta"]))
        self.remote_base = info["base"]

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        while not ended():   # keeps the worker progressing (the first transfer's wire-up needs it)
            self.agent.get_new_notifs()
            time.sleep(1e-4)

    def transfer(self, case: dict, tag: str) -> None:
        n = case["nbytes"]

        def descs(base: int, offs: list[int]) -> np.ndarray:   # [runs, (address, length, device)]
            return np.stack([np.uint64(base) + np.asarray(offs, np.uint64), np.full(len(offs), n, np.uint64),
                             np.zeros(len(offs), np.uint64)], axis=1)
        local = self.agent.get_xfer_descs(descs(self.base, case["so"]), "DRAM")
        remote = self.agent.get_xfer_descs(descs(self.remote_base, case["do"]), "DRAM")
        h = self.agent.initialize_xfer("WRITE", local, remote, self.remote,
                                       notif_msg=tag.encode() if self.notify else b"")
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")


class NixlNotifiedPeer(NixlPeer):
    """NIXL as a serving engine drives it: the WRITE carries a notification (``notif_msg``), sent
    once the bytes are in place, which is how the target learns that they arrived (vLLM's and
    Dynamo's NIXL connectors tell the other side so). kvxfer's receiver learns it the same way,
    from the DONE its sender sends after the flush; this row is NIXL doing that work too."""
    notify = True

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        want, seen = tag.encode(), False
        while not ended():   # as NixlPeer, and look for this transfer's notification
            seen = seen or any(want in msgs for msgs in self.agent.get_new_notifs().values())
            time.sleep(1e-4)
        limit = time.monotonic() + 30
        while not seen and time.monotonic() < limit:   # the initiator's DONE may come first
            seen = any(want in msgs for msgs in self.agent.get_new_notifs().values())
            time.sleep(1e-4)
        if not seen:
            raise RuntimeError(f"no NIXL notification for {tag}")


class MooncakePeer(Peer):
    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        from mooncake.engine import TransferEngine
        self.pool, self.base = pool, pool.ctypes.data
        self.te = TransferEngine()
        port = spec["port"] if role == "target" else spec["port2"]
        if self.te.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        if self.te.register_memory(self.base, pool.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")

    def info(self) -> dict:
        return {"host": f"127.0.0.1:{self.te.get_rpc_port()}", "base": self.base}

    def connect(self, info: dict) -> None:
        self.host, self.remote_base = info["host"], info["base"]

    def transfer(self, case: dict, tag: str) -> None:
        n = len(case["so"])
        rc = self.te.batch_transfer_sync_write(self.host, [self.base + o for o in case["so"]],
                                               [self.remote_base + o for o in case["do"]], [case["nbytes"]] * n)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")


class TcpRaw(Peer):
    """The ceiling for TCP peers: the case's bytes, contiguous, through one socket."""
    verify = False

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        self.buf = memoryview(pool)
        if role == "target":
            self.ls = socket.create_server(("127.0.0.1", 0))
        else:   # real memory: most of the source pool is untouched zero pages, which read too fast
            most = max(c["nbytes"] * len(c["so"]) for c in spec["cases"])
            self.buf = memoryview(np.random.default_rng(0).integers(0, 256, most, dtype=np.uint8))

    def info(self) -> dict:
        return {"port": self.ls.getsockname()[1]}

    def connect(self, info: dict) -> None:
        self.s = socket.create_connection(("127.0.0.1", info["port"]))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def accept(self) -> None:
        self.s, _ = self.ls.accept()

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        left = case["nbytes"] * len(case["so"])
        while left:
            want, got = min(CHUNK, left), 0
            while got < want:
                got += self.s.recv_into(self.buf[got:want], want - got)
            left -= want
        self.s.sendall(b"k")

    def transfer(self, case: dict, tag: str) -> None:
        total = case["nbytes"] * len(case["so"])
        for o in range(0, total, CHUNK):
            self.s.sendall(self.buf[o: o + min(CHUNK, total - o)])
        self.s.recv(1)


class ZmqRaw(Peer):
    """The floor under any transport on libzmq: pyzmq alone, no kvxfer code, moving the case as
    gloo does (the initiator gathers scattered runs, sends 1 MiB messages without copying them
    into zmq; the target writes each message's rows in place and acks with one byte). libzmq
    cannot receive into the caller's memory: each message lands in a buffer of its own, and one
    copy more than gloo's (whose receives fill the destination) puts it in place."""

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        import zmq
        self.zmq, self.pool, self.ctx = zmq, pool, zmq.Context()
        self.s = self.ctx.socket(zmq.ROUTER if role == "target" else zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        if role == "target":
            self.port = self.s.bind_to_random_port("tcp://127.0.0.1")
        self.stage = np.empty(0, np.uint8)

    def info(self) -> dict:
        return {"port": self.port}

    def connect(self, info: dict) -> None:
        self.s.connect(f"tcp://127.0.0.1:{info['port']}")

    def _rows(self, n: int) -> np.ndarray:
        return self.pool[: self.pool.size // n * n].view(np.dtype((np.void, n)))

    def transfer(self, case: dict, tag: str) -> None:
        n, so = case["nbytes"], case["so"]
        if len(so) == 1:
            buf = self.pool[so[0]: so[0] + n]   # one run: no gather
        else:
            if self.stage.size < n * len(so):
                self.stage = np.empty(n * len(so), np.uint8)
            buf = self.stage[: n * len(so)]
            for i, o in enumerate(so):   # a memmove a row (numpy's take of void rows is ~3x slower)
                buf[i * n: (i + 1) * n] = self.pool[o: o + n]
        for o in range(0, buf.size, CHUNK):   # zero-copy: copied into zmq, or 4 MiB messages, measured slower
            self.s.send(buf[o: o + CHUNK], copy=False)
        self.s.recv()

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        n, do = case["nbytes"], case["do"]
        total, got, rid = n * len(do), 0, b""
        rows, idx = (None, None) if len(do) == 1 else (self._rows(n), np.asarray(do) // n)
        while got < total:
            who, msg = self.s.recv_multipart(copy=False)
            rid, data = who.bytes, np.frombuffer(msg.buffer, np.uint8)
            if rows is None:
                self.pool[do[0] + got: do[0] + got + data.size] = data
            else:   # whole rows per message (1 MiB holds whole 64 KiB and 4 KiB rows)
                rows[idx[got // n: (got + data.size) // n]] = data.view(np.dtype((np.void, n)))
            got += data.size
        self.s.send_multipart([rid, b"k"])

    def close(self) -> None:
        self.s.close()
        self.ctx.term()


class ZmqThreads(ZmqRaw):
    """``zmq raw`` with the threads every transport on libzmq has when one I/O thread per side owns
    its sockets (zmq sockets are not thread-safe; kvxfer zmq is one): the caller hands the transfer
    to its I/O thread (a queue and a pipe wake), which gathers and sends it, takes the ack and wakes
    the caller; the target's I/O thread receives, writes the rows, acks, and wakes the target's main
    thread (its arrival). No protocol work, no checks: the floor under such a design here."""

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        super().__init__(role, pool, spec)
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.io: threading.Thread | None = None

    def _start(self, body: Callable[[dict], None]) -> None:
        """The I/O thread: from here on it alone uses the socket."""
        def loop() -> None:
            poller = self.zmq.Poller()
            poller.register(self.wake_r, self.zmq.POLLIN)
            while True:
                if not poller.poll(50):
                    continue
                os.read(self.wake_r, 4096)
                while not self.todo.empty():
                    item = self.todo.get_nowait()
                    if item is None:
                        return
                    case, done, failed = item
                    try:   # with one transfer at a time, a blocking receive is what a poll would do
                        body(case)
                    except Exception as e:   # the caller raises it: a failed peer is a row with its reason
                        failed.append(e)
                    finally:
                        done.release()
        self.io = threading.Thread(target=loop, daemon=True)
        self.io.start()

    def _hand_over(self, case: dict) -> None:
        """The caller's side: queue ``case`` for the I/O thread, wake it, wait for its word."""
        done, failed = threading.Lock(), []
        done.acquire()
        self.todo.put((case, done, failed))
        os.write(self.wake_w, b"\0")
        done.acquire()
        if failed:
            raise failed[0]

    def accept(self) -> None:
        self._start(lambda case: ZmqRaw.receive(self, case, "", lambda: False))

    def connect(self, info: dict) -> None:
        super().connect(info)
        self._start(lambda case: ZmqRaw.transfer(self, case, ""))

    def transfer(self, case: dict, tag: str) -> None:
        self._hand_over(case)

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        self._hand_over(case)

    def close(self) -> None:
        if self.io is not None:
            self.todo.put(None)
            os.write(self.wake_w, b"\0")
            self.io.join(10)
        os.close(self.wake_r)
        os.close(self.wake_w)
        super().close()


class GlooPeer(Peer):
    """torch.distributed gloo send/recv: gather, 1 MiB messages in flight, scatter, ack."""

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        self.torch, self.dist, self.pool = torch, dist, pool
        self.t = torch.from_numpy(pool)
        self.rank, self.init = (0 if role == "initiator" else 1), f"tcp://127.0.0.1:{spec['port']}"
        self.ack = torch.zeros(1, dtype=torch.uint8)

    def accept(self) -> None:   # both sides join the group at once
        self.dist.init_process_group("gloo", init_method=self.init, rank=self.rank, world_size=2)

    def connect(self, info: dict) -> None:
        self.accept()

    def _staging(self, case: dict):
        n, k = case["nbytes"], len(case["so"])
        if not hasattr(self, "stage") or self.stage.numel() < n * k:
            self.stage = self.torch.empty(n * k, dtype=self.torch.uint8)
        return self.stage[: n * k]

    def _chunks(self, buf):
        return [buf[o: o + CHUNK] for o in range(0, buf.numel(), CHUNK)]

    def transfer(self, case: dict, tag: str) -> None:
        n = case["nbytes"]
        if len(case["so"]) == 1:
            buf = self.t[case["so"][0]: case["so"][0] + n]   # one run: no gather
        else:
            rows = self.t[: self.t.numel() // n * n].view(-1, n)
            buf = self._staging(case)
            self.torch.index_select(rows, 0, self.torch.tensor(case["so"]) // n, out=buf.view(-1, n))
        for w in [self.dist.isend(c, dst=1) for c in self._chunks(buf)]:
            w.wait()
        self.dist.recv(self.ack, src=1)

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        n = case["nbytes"]
        single = len(case["do"]) == 1
        buf = self.t[case["do"][0]: case["do"][0] + n] if single else self._staging(case)
        for w in [self.dist.irecv(c, src=0) for c in self._chunks(buf)]:
            w.wait()
        if not single:   # numpy moves a row of raw bytes as one memcpy (~2x index_copy_: kvxfer.plan.copy_runs)
            rows = self.pool[: self.pool.size // n * n].view(np.dtype((np.void, n)))
            rows[np.asarray(case["do"]) // n] = buf.numpy().view(np.dtype((np.void, n)))
        self.dist.send(self.ack, dst=0)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class KvxferPeer(Peer):
    """kvxfer's own transports: one plan of the runs, one submit."""

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        import torch

        from kvxfer.transport.registry import get_transport
        torch.set_num_threads(1)
        self.t = get_transport(spec["transport"], **spec.get("options", {}))
        self.t.register([torch.from_numpy(pool)])

    def info(self) -> dict:
        return {"descriptor": self.t.descriptor()}

    def connect(self, info: dict) -> None:
        self.peer = self.t.connect(info["descriptor"])

    @staticmethod
    def _runs(case: dict):
        k = len(case["so"])
        return (np.zeros(k, np.int64), np.asarray(case["so"], np.int64), np.asarray(case["do"], np.int64),
                np.full(k, case["nbytes"], np.int64))

    def transfer(self, case: dict, tag: str) -> None:
        from kvxfer.plan import PACK_BELOW, RunGroup, TransferPlan
        z, so, do, n = self._runs(case)
        plan = TransferPlan((RunGroup(z[:1], z[:1], z[:1], z[:1], so, do, n, bool(n[0] < PACK_BELOW)),))
        self.t.submit(self.peer, tag, plan, timeout=120).result()

    def prepare(self, case: dict, tag: str) -> None:
        from kvxfer.grant import ByteRanges
        z, _, do, n = self._runs(case)
        self.t.expect(tag, ByteRanges(z, do, n))

    def receive(self, case: dict, tag: str, ended: Callable[[], bool]) -> None:
        got = []
        limit = time.monotonic() + 120
        while not got and time.monotonic() < limit:
            got = self.t.arrivals(timeout=0.5)
        if not got or not got[0].ok:
            raise RuntimeError(f"no arrival for {tag}" if not got else got[0].reason)

    def finish(self, tag: str) -> None:
        self.t.forget(tag)

    def close(self) -> None:
        self.t.close()


PEERS = {"tcp raw": TcpRaw, "zmq raw": ZmqRaw, "zmq threads": ZmqThreads, "kvxfer zmq": KvxferPeer,
         "kvxfer ucx": KvxferPeer, "kvxfer ucx announced": KvxferPeer, "gloo": GlooPeer,
         "nixl ucx": NixlPeer, "nixl ucx notified": NixlNotifiedPeer, "mooncake tcp": MooncakePeer}


def python_tids() -> list[int]:
    """The kernel's ids of this process's Python threads (``bench_critical_path.py`` tells them
    from the threads of the libraries they drive)."""
    return [t.native_id for t in threading.enumerate() if t.native_id is not None]


def _busy() -> None:
    while True:
        sum(range(1000))


def worker(peer: str, role: str, spec: dict, say: Callable[[str, dict], None]) -> None:
    """One side of one peer. The target serves the initiator over a control connection; the
    initiator does one transfer per command line on stdin (the orchestrator interleaves the
    peers this way) and answers each with its seconds."""
    pool = source_pool(spec["pool_bytes"], spec["cases"]) if role == "initiator" else \
        np.zeros(spec["pool_bytes"], np.uint8)
    p = PEERS[peer](role, pool, spec)
    if role == "initiator" and spec.get("busy_caller"):   # an engine's scheduler, busy in Python
        threading.Thread(target=_busy, daemon=True).start()
    try:
        if role == "target":
            ls = socket.create_server(("127.0.0.1", 0))
            say("READY", {**p.info(), "ctl": ls.getsockname()[1]})
            ctl = Ctl(ls.accept()[0])
            p.accept()
            while (cmd := ctl.recv())["op"] != "quit":
                case = spec["cases"][cmd["case"]]
                p.prepare(case, cmd["tag"])
                ctl.send({"ready": True})
                p.receive(case, cmd["tag"], ctl.readable)
                ctl.recv()   # "end": the initiator saw its transfer complete
                why = check(pool, case) if cmd["verify"] and p.verify else ""
                p.finish(cmd["tag"])
                ctl.send({"why": why, "tids": python_tids()})
            return
        ctl = Ctl(socket.create_connection(("127.0.0.1", spec["target"]["ctl"])))
        p.connect(spec["target"])
        say("READY", {})
        for n, line in enumerate(sys.stdin):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            case, tag = spec["cases"][cmd["case"]], f"t{n}"
            ctl.send({"op": "begin", "case": cmd["case"], "tag": tag, "verify": cmd["verify"]})
            ctl.recv()
            start = time.monotonic_ns()   # CLOCK_MONOTONIC, as perf's -k (bench_critical_path.py)
            t0 = time.perf_counter()
            p.transfer(case, tag)
            dt = time.perf_counter() - t0
            ctl.send({"op": "end"})
            reply = ctl.recv()
            say("DONE", {"seconds": dt, "why": reply["why"], "t0_ns": start,
                         "tids": {"initiator": python_tids(), "target": reply["tids"]}})
        ctl.send({"op": "quit"})
    finally:
        p.close()
