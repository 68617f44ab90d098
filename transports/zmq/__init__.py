"""Two-sided transport over ZeroMQ: run headers plus payload frames, checked before they land.

Each transport binds one ROUTER (it receives there) and connects one DEALER per peer it
sends to. One I/O thread owns every socket (zmq sockets are not thread-safe); callers only
enqueue commands and wake it through a pipe, so ``submit`` never blocks on the network.

Wire protocol (msgpack headers, run arrays as little-endian int64, never pickle):

    data  [hdr, part...]  {"t": "d", "r": request id, "x": transfer id, "dl": seconds left,
                           "runs": int64 LE bytes [dst_region * k, dst_offset * k, nbytes * k]}
                          parts: one part holding the k runs back to back (packed), or k parts,
                          part i holding run i (zero-copy), or none when k == 0.
                          The last message of a transfer adds its totals:
                          "nruns", "nbytes" (all messages together) and "notify".
    ping  [hdr]           {"t": "p"}, every heartbeat_ivl while a peer has transfers open.
    reply [hdr]           receiver -> sender: {"t": "a", "x": [transfer ids]} acks,
                          {"t": "n", "x": transfer id, "why": reason} nack, {"t": "p"} pong.
                          A pong comes after the replies to everything sent before its ping,
                          and echoes the ping's optional integer "n".

Sender: runs of at least ``zero_copy_min`` bytes in CPU regions go out as zero-copy views of
the region (split into ``frame_bytes`` parts, ``frames_per_message`` parts per message);
shorter runs, and every run of a CUDA region, are gathered (``torch.index_select``) into
staging frames of ~``frame_bytes * frames_per_message``, sorted by region so that the receiver scatters each
region's share with one indexed copy. zmq's send high-water mark (``window`` messages per
peer) is the back-pressure; staging buffers are reused once zmq has sent them.

Receiver: a message is checked whole before a byte lands: header well formed, part lengths
matching the runs, every run inside the request's grant (``GrantTable.check``) and its
region. A violation fails the transfer (nack, ``Arrival(ok=False)``) and writes nothing.
Otherwise each byte is copied once, from the received zmq frame into the region.

Every transfer ends: the sender's handle times out at its deadline, and the I/O thread fails
the open transfers of a peer that has neither answered nor taken data for
``heartbeat_timeout`` seconds; the receiver fails an incoming transfer at the deadline its
header carried, or when its sender went silent for ``heartbeat_timeout``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import ctypes.util
import functools
import itertools
import logging
import math
import os
import queue
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import msgpack
import numpy as np
import torch
import zmq

from kvxfer.copy import byte_view, scatter_runs
from kvxfer.errors import ConnectError, PlanError, RejectedWrite
from kvxfer.grant import GrantTable
from kvxfer.plan import FEW_RUNS, TransferPlan, merge_runs
from kvxfer.transport.base import (
    DEFAULT_TIMEOUT,
    Arrival,
    TransferHandle,
    TransferStatus,
    Transport,
    peer_failed,
)

log = logging.getLogger("kvxfer.transport.zmq")

_RUN_BYTES = 24                  # one run on the wire: region, offset, nbytes as int64
_MAX_PARTS = 1024                # payload parts per message
_REPLY_HWM = 1 << 20             # queued replies (tiny) before a ROUTER would drop one
_COPY_BELOW = 256 << 10          # messages up to this size are copied into zmq (see _pump)
_CMDS_PER_TURN = 64              # commands handled per loop turn, so a burst of submits never
                                 # keeps the loop from pumping, receiving and its silence checks
_OMP_PER_THREAD = "parallel backend: OpenMP" in torch.__config__.parallel_info()
# Exact types per header field (bool is an int subclass, so isinstance would let it in).
_FIELDS = {"d": {"r": (str,), "x": (int,), "dl": (int, float), "runs": (bytes,)}, "p": {}}
_END = {"nruns": (int,), "nbytes": (int,), "notify": (bytes,)}
_REPLIES = {"a": {"x": (list,)}, "n": {"x": (int,), "why": (str,)}, "p": {}}


def _keep_malloc_arenas() -> None:
    """Raise glibc's mmap and trim thresholds (what its own dynamic tuning reaches at most).

    zmq allocates every received message itself; at the default thresholds a 1 MiB message
    is mapped fresh and page-faulted in each time (measured: ~90 faults per MiB, receive-side
    zmq CPU up ~60%). Process-wide; ``ZMQTransport(tune_malloc=False)`` leaves malloc alone.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)    # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _unpack(buf, fields: dict, limit: int, max_array: int = 0) -> dict:
    """Decode and type-check one header; raise ValueError saying what is wrong."""
    if len(buf) > limit:
        raise ValueError(f"header of {len(buf)} bytes exceeds {limit}")
    try:
        h = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_str_len=4096, max_bin_len=limit,
                            max_array_len=max_array, max_map_len=16, max_ext_len=0)
    except Exception as e:  # msgpack raises many types on hostile input
        raise ValueError(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict) or h.get("t") not in fields:
        raise ValueError("not a header map with a known type")
    want = dict(fields[h["t"]], **(_END if h["t"] == "d" and _END.keys() & h.keys() else {}))
    for name, types in want.items():
        if type(h.get(name)) not in types:
            raise ValueError(f"field {name!r} missing or of the wrong type")
    if "x" in want and type(h["x"]) is int and not 0 <= h["x"] < 1 << 63:
        raise ValueError("transfer id out of range")
    if "dl" in want and not math.isfinite(h["dl"]):
        raise ValueError("deadline not finite")
    return h


def _runs_of(runs: bytes, k: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The ``k`` runs of a header as Python ints: (regions, offsets, lengths)."""
    v = struct.unpack_from(f"<{3 * k}q", runs)
    return v[:k], v[k: 2 * k], v[2 * k:]


def _lengths_match(nbytes, sizes, size: int) -> bool:
    """Every run is positive, the runs add up to the payload's ``size``, and with one part per
    run each part is as long as its run. Lists of Python ints, or int64 arrays."""
    if isinstance(nbytes, list):
        return min(nbytes) > 0 and sum(nbytes) == size and (len(sizes) <= 1 or sizes == nbytes)
    # each run is bounded by the payload first, so the sum cannot overflow
    return bool((nbytes > 0).all() and (nbytes <= size).all() and int(nbytes.sum()) == size
                and (len(sizes) <= 1 or (sizes == nbytes).all()))


def _pack_runs(runs: list[tuple[int, int, int, int, int]]) -> bytes:
    """The header's runs field for (src region, src offset, dst region, dst offset, nbytes) runs."""
    return struct.pack(f"<{3 * len(runs)}q", *(r[2] for r in runs), *(r[3] for r in runs), *(r[4] for r in runs))


def _fill(runs: list[tuple], budget: int, overhead: int) -> list[list[tuple]]:
    """Runs in order, cut into messages of at most ``budget`` bytes (each run costing its
    length plus ``overhead``) and ``_MAX_PARTS`` runs; a longer run gets a message of its own."""
    out, cur, used = [], [], 0
    for run in runs:
        cost = run[4] + overhead
        if cur and (used + cost > budget or len(cur) == _MAX_PARTS):
            out.append(cur)
            cur, used = [], 0
        cur.append(run)
        used += cost
    return out + [cur] if cur else out


def _bounds(*keys: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of the stretches where every key stays the same."""
    change = np.zeros(max(len(keys[0]) - 1, 0), bool)
    for k in keys:
        change |= k[1:] != k[:-1]
    cuts = [0, *(np.flatnonzero(change) + 1).tolist(), len(keys[0])]
    return list(zip(cuts[:-1], cuts[1:]))


def _rows(off: np.ndarray, n: np.ndarray) -> tuple[int, np.ndarray, bool]:
    """How to move runs that lie back to back on one side as one indexed copy of rows.

    Returns (row length, row index, window): rows of the gcd of offsets and lengths
    (contiguous rows; the fast path when runs are aligned), or, for same-length runs that
    are not aligned, one row per run of a sliding-window view (``window`` True).
    """
    u = int(np.gcd.reduce(np.concatenate((off, n))))
    if n[0] > u and (n == n[0]).all():
        return int(n[0]), off, True
    counts = n // u
    first = np.repeat(off // u - (np.cumsum(counts) - counts), counts)
    return u, first + np.arange(len(first), dtype=np.int64), False


def _gather(region: torch.Tensor, off: np.ndarray, n: np.ndarray, out: torch.Tensor) -> None:
    """out = the region's runs back to back, with one index_select (any device)."""
    off, _, n = merge_runs(off, np.cumsum(n) - n, n)   # runs that touch in the region: longer rows
    length, idx, window = _rows(off, n)
    rows = (region.as_strided((region.numel() - length + 1, length), (1, 1)) if window
            else region[: region.numel() // length * length].view(-1, length))
    torch.index_select(rows, 0, torch.from_numpy(idx).to(region.device), out=out.view(-1, length))


def _scatter(region: np.ndarray, off: np.ndarray, n: np.ndarray, data: np.ndarray) -> None:
    """Write ``data`` (the runs back to back) into a CPU region's runs with one indexed copy.

    Rows are numpy void elements, so each moves as one memcpy (~2.5x a uint8 row at 4 KiB);
    indexes are bounds-checked by numpy, window view included.
    """
    off, _, n = merge_runs(off, np.cumsum(n) - n, n)   # runs that touch in the region: longer rows
    length, idx, window = _rows(off, n)
    row = np.dtype((np.void, length))
    rows = (np.ndarray((region.size - length + 1,), row, buffer=region, strides=(1,)) if window
            else region[: region.size // length * length].view(row))
    rows[idx] = data.view(row)


class _Out:
    """An outgoing transfer (I/O thread). ``ahead``: its next message, made one step early
    so the message before it knows it is the last. ``trackers``: of its zero-copy messages,
    which may read the source until zmq lets go of them."""
    __slots__ = ("xid", "handle", "peer", "frames", "ahead", "end", "nruns", "trackers")

    def __init__(self, xid, handle, peer, frames, end):
        self.xid, self.handle, self.peer, self.frames, self.end = xid, handle, peer, frames, end
        self.nruns = 0   # runs in the headers sent so far: the last header's total
        self.trackers: list[zmq.MessageTracker] = []
        self.ahead = next(frames)


class _Peer:
    """One DEALER and its transfers. ``pending``: a message zmq refused for now (EAGAIN):
    (parts, staging buffer, the _Out it belongs to)."""
    __slots__ = ("endpoint", "sock", "sending", "open", "pending", "heard", "progress", "pinged")

    def __init__(self, endpoint, sock):
        self.endpoint, self.sock, self.sending, self.open, self.pending = endpoint, sock, collections.deque(), {}, None
        self.heard = self.progress = self.pinged = time.monotonic()


class _In:
    """An incoming transfer, keyed by (routing id, request id, transfer id)."""
    __slots__ = ("deadline", "start", "nbytes", "nruns")

    def __init__(self, deadline):
        self.deadline, self.start, self.nbytes, self.nruns = deadline, time.monotonic(), 0, 0


class ZMQTransport(Transport):
    """ZeroMQ data plane. Options (keyword arguments, all optional):

    endpoint            where the ROUTER binds: "tcp://HOST:PORT" (port 0: a free one) or "ipc:///path"
    frame_bytes         largest zero-copy frame (~1 MiB: zmq slows down on multi-MiB frames)
    frames_per_message  zero-copy frames per message, and the size of a packed frame in frame_bytes
                        (fewer per-message costs; packed frames measured faster at 4 MiB than 1 MiB)
    zero_copy_min       runs at least this long go out from the region without a copy (each such
                        part costs pyzmq ~40 us for its frame and tracker; a copy of 64 KiB costs
                        ~13 us: 1000 scattered 64 KiB pages went 1.3-1.5x faster copied, so 256 KiB)
    window              messages queued per peer before zmq pushes back (send high-water mark)
    heartbeat_ivl       seconds between pings while transfers are open
    heartbeat_timeout   seconds of silence after which a peer's open transfers fail
    max_message_bytes   largest message part the receiver accepts (zmq drops the connection)
    max_incoming        most incoming transfers open at once; more are rejected
    tune_malloc         raise glibc's malloc thresholds so zmq reuses its buffers (see _keep_malloc_arenas)
    """
    name = "zmq"

    def __init__(self, *, endpoint: str = "tcp://127.0.0.1:0", frame_bytes: int = 1 << 20,
                 frames_per_message: int = 4, zero_copy_min: int = 256 << 10, window: int = 16,
                 heartbeat_ivl: float = 1.0, heartbeat_timeout: float = 5.0, max_message_bytes: int = 64 << 20,
                 max_incoming: int = 4096, tune_malloc: bool = True):
        if not 4096 <= frame_bytes <= max_message_bytes // 2:
            raise ValueError(f"frame_bytes {frame_bytes} must be in 4096..max_message_bytes/2")
        self.frame_bytes, self.frames_per_message = int(frame_bytes), max(1, int(frames_per_message))
        self.zero_copy_min, self.window = int(zero_copy_min), int(window)
        self.hb_ivl, self.hb_timeout = float(heartbeat_ivl), float(heartbeat_timeout)
        self.max_message_bytes, self.max_incoming = int(max_message_bytes), int(max_incoming)
        if tune_malloc:
            _keep_malloc_arenas()
        self.id = uuid.uuid4().hex
        self.grants = GrantTable()
        self._regions: list[torch.Tensor] = []
        self._host: list[np.ndarray | None] = []       # numpy views of CPU regions (None: CUDA)
        self._is_host, self._sizes = np.zeros(1, bool), np.zeros(0, np.int64)
        self._stages: collections.deque = collections.deque()   # (staging buffer, zmq tracker)
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._cmds: queue.Queue = queue.Queue()
        self._write_lock = threading.Lock()             # check + write vs forget: none lands after forget
        self._close_lock = threading.Lock()
        self._closed = False
        self._xids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context(io_threads=1)
        self._ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(endpoint,), name="kvxfer-zmq-io", daemon=True)
        self._thread.start()
        try:
            self.endpoint = self._ready.result(timeout=30)  # raises ConnectError if the bind failed
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    # -- caller side (any thread) ----------------------------------------------------------
    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Called once at start-up, before peers send: the pool's byte regions, ids = positions."""
        views = [byte_view(t) for t in regions]
        with self._write_lock:
            self._regions = views
            self._host = [v.numpy() if v.device.type == "cpu" else None for v in views]
            self._is_host = np.array([h is not None for h in self._host] + [False], bool)
            self.grants.region_sizes = [v.numel() for v in views]
            self._sizes = np.asarray(self.grants.region_sizes, np.int64)

    def descriptor(self) -> dict:
        return {"transport": self.name, "id": self.id, "endpoint": self.endpoint,
                "region_sizes": list(self.grants.region_sizes)}

    def connect(self, descriptor: dict) -> str:
        """Called by the sender at handshake (blocks briefly); returns the peer id for ``submit``."""
        endpoint = descriptor.get("endpoint") if isinstance(descriptor, dict) else None
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ConnectError(f"not a zmq descriptor (no tcp:// or ipc:// endpoint): {descriptor!r}")
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._command(("connect", endpoint, fut))
        try:
            return fut.result(timeout=30)
        except zmq.ZMQError as e:
            raise ConnectError(f"cannot connect to {endpoint}: {e}") from e

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"") -> TransferHandle:
        """Hand the plan to the I/O thread and return at once. The source bytes must stay
        unchanged until ``handle.source_released``."""
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        if self._closed:
            handle.finish(peer_failed(request_id, "transport is closed"), release=True)
        else:
            self._command(("submit", peer, request_id, plan, bytes(notify), handle))
        return handle

    def close(self) -> None:
        """Fail whatever is open, close the sockets and join the I/O thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._command(("close",))
        self._thread.join(timeout=30)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _command(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread is awake already
            pass

    # -- I/O thread: loop and commands --------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 0
        # Data flows DEALER -> ROUTER, bounded by the window. Replies flow back and must never
        # meet a high-water mark: there a ROUTER drops them silently (a lost ack).
        s.sndhwm, s.rcvhwm = (self.window, _REPLY_HWM) if kind == zmq.DEALER else (_REPLY_HWM, self.window)
        s.setsockopt(zmq.HEARTBEAT_IVL, int(self.hb_ivl * 1000))
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.hb_timeout * 1000))
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return s

    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a connection that is down
        sock.connect(endpoint)
        return sock

    def _run(self, endpoint: str) -> None:
        if _OMP_PER_THREAD:
            # Copies here go one frame at a time; an OpenMP team would stall on its barrier
            # whenever a busy core descheduled a member. With OpenMP this is per thread.
            torch.set_num_threads(1)
        self._router = self._socket(zmq.ROUTER)
        try:
            self._router.bind(endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint)
        except zmq.ZMQError as e:
            self._router.close(linger=0)
            self._ctx.term()
            self._ready.set_exception(ConnectError(f"cannot bind {endpoint}: {e}"))
            return
        self._peers: dict[str, _Peer] = {}
        self._out: dict[int, _Out] = {}
        self._in: dict[tuple, _In] = {}
        self._dead: collections.OrderedDict = collections.OrderedDict()   # failed incoming keys
        self._seen: dict[bytes, float] = {}                               # routing id -> last message
        self._acks: dict[bytes, list[int]] = {}
        self._completed: list[Arrival] = []   # delivered after this turn's acks (see _on_router)
        self._releasing: list[_Out] = []   # ended, zero-copy messages of theirs still in zmq
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._ready.set_result(self._router.last_endpoint.decode())
        next_tick, running = 0.0, True
        try:
            while running:
                events = dict(self._poller.poll(50))
                if self._wake_r in events:
                    running = self._on_commands()
                drained = self._router not in events or self._on_router()
                for peer in self._peers.values():
                    if events.get(peer.sock, 0) & zmq.POLLIN:
                        self._on_replies(peer)
                    if peer.pending is not None or peer.sending:
                        self._pump(peer)
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now, drained)
                    next_tick = now + min(0.1, self.hb_ivl / 2)
        except Exception:  # a bug here must not leave callers waiting: fail everything below
            log.exception("zmq transport I/O thread crashed")
        finally:
            for out in list(self._out.values()):
                out.handle.finish(peer_failed(out.handle.request_id, "transport closed"))
            self._deliver_completed()
            for key in list(self._in):
                self._fail_in(key, "transport closed")
            while not self._cmds.empty():   # commands that raced with close()
                cmd = self._cmds.get_nowait()
                if cmd[0] == "submit":
                    cmd[-1].finish(peer_failed(cmd[2], "transport closed"), release=True)
                elif cmd[0] == "connect":
                    cmd[2].set_exception(ConnectError("transport closed"))
            for s in [self._router, *(p.sock for p in self._peers.values())]:
                s.close(linger=0)
            self._ctx.term()   # queued messages are dropped: nothing reads a source any more
            for out in [*self._out.values(), *self._releasing]:
                out.handle.release_source()

    def _on_commands(self) -> bool:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        for _ in range(_CMDS_PER_TURN):
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "close":
                return False
            if cmd[0] == "connect":
                _, endpoint, fut = cmd
                try:
                    sock = self._dealer(endpoint)
                except zmq.ZMQError as e:
                    fut.set_exception(e)
                    continue
                pid = f"{endpoint}#{len(self._peers)}"
                self._peers[pid] = _Peer(endpoint, sock)
                self._poller.register(sock, zmq.POLLIN)
                fut.set_result(pid)
            else:
                self._start(*cmd[1:])
        try:   # more may be queued: come back after a turn of sending and receiving
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass
        return True

    # -- I/O thread: sending --------------------------------------------------------------
    def _start(self, pid: str, request_id: str, plan: TransferPlan, notify: bytes, handle: TransferHandle):
        peer = self._peers.get(pid)
        if peer is None:
            handle.finish(peer_failed(request_id, f"unknown peer {pid!r}; call connect() first"), release=True)
            return
        # Empty runs carry nothing (and the receiver refuses them).
        runs = [run for run in plan.run_tuples() if run[4] > 0] if plan.num_runs <= FEW_RUNS else None
        if runs is not None and all(self._host[run[0]] is not None for run in runs):
            sizes = self.grants.region_sizes   # a few runs in CPU regions: Python ints, no array setup
            outside = any(not (0 <= r < len(sizes) and 0 <= o <= sizes[r] - c) for r, o, _, _, c in runs)
            nbytes, frames = sum(run[4] for run in runs), functools.partial(self._frames_few, runs)
        else:
            sr, so, dr, do, n, _ = plan.runs()
            if len(n) and n.min() <= 0:
                keep = n > 0
                sr, so, dr, do, n = sr[keep], so[keep], dr[keep], do[keep], n[keep]
            ok = (sr >= 0) & (sr < len(self._sizes))
            outside = not ok.all() or bool(((so < 0) | (so > self._sizes[np.where(ok, sr, 0)] - n)).any())
            nbytes, frames = int(n.sum()), functools.partial(self._frames, sr, so, dr, do, n)
        if outside:
            handle.finish(PlanError(f"request {request_id}: the plan reads outside the registered source regions"),
                          release=True)
            return
        end = {"nbytes": nbytes, "notify": notify}
        xid = next(self._xids)
        try:
            out = _Out(xid, handle, peer, frames(), end)
        except Exception as e:  # e.g. a CUDA copy failed: this transfer fails, not the thread
            handle.finish(peer_failed(request_id, f"cannot read the source: {e}"), release=True)
            return
        if not peer.open:
            peer.heard = peer.progress = time.monotonic()   # silence counts from now on
        self._out[xid] = peer.open[xid] = out
        peer.sending.append(out)
        self._pump(peer)

    def _frames(self, sr, so, dr, do, n) -> Iterator[tuple]:
        """(runs bytes, parts, staging buffer) per message, made lazily as zmq takes them."""
        fb = self.frame_bytes
        if len(n) and n.max() > fb:   # split runs longer than a frame into frame-sized chunks
            k = -(-n // fb)
            idx = np.repeat(np.arange(len(n)), k)
            step = (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)) * fb
            sr, so, dr, do, n = sr[idx], so[idx] + step, dr[idx], do[idx] + step, np.minimum(n[idx] - step, fb)
        zc = (n >= self.zero_copy_min) & self._is_host[sr]

        def runs(sel) -> bytes:
            return np.concatenate((dr[sel], do[sel], n[sel])).astype("<i8").tobytes()

        def views(sel) -> list[memoryview]:
            return [memoryview(self._host[r][o: o + c]) for r, o, c in zip(sr[sel].tolist(), so[sel].tolist(),
                                                                           n[sel].tolist())]

        def messages(sel: np.ndarray, overhead: int, budget: int) -> list[np.ndarray]:
            cost = n[sel] + overhead                 # header bytes count toward a packed frame
            if len(sel) <= 1 or (len(sel) <= _MAX_PARTS and cost.sum() <= budget):
                return [sel] if len(sel) else []
            frame_of = (np.cumsum(cost) - cost) // budget
            if not overhead:                         # zero-copy: at most _MAX_PARTS parts
                frame_of = frame_of * len(sel) + np.arange(len(sel)) // _MAX_PARTS
            return np.split(sel, np.flatnonzero(np.diff(frame_of)) + 1) if len(sel) else []

        sent = False
        for sel in messages(np.flatnonzero(zc), 0, fb * self.frames_per_message):
            sent = True
            yield runs(sel), views(sel), None
        small = np.flatnonzero(~zc)
        if len(small) > 1 and ((sr[small] != sr[small[0]]).any() or (dr[small] != dr[small[0]]).any()):
            small = small[np.lexsort((sr[small], dr[small]))]   # stable: plan order within a region pair
        packed = fb * self.frames_per_message   # measured: packed frames gain from size, zero-copy parts do not
        for sel in messages(small, _RUN_BYTES, packed):
            sent = True
            if len(sel) == 1 and self._is_host[sr[sel[0]]]:     # a lone run needs no staging
                yield runs(sel), views(sel), None
                continue
            pos = np.concatenate(([0], np.cumsum(n[sel])))
            base, header = self._stage(), []
            for a, b in _bounds(sr[sel], dr[sel]):              # loop per region pair in the frame
                region = self._regions[sr[sel[a]]]
                out = base[pos[a]: pos[b]] if region.is_cpu else torch.empty(
                    int(pos[b] - pos[a]), dtype=torch.uint8, device=region.device)
                _gather(region, so[sel[a:b]], n[sel[a:b]], out)
                if not region.is_cpu:   # CUDA: gather on the device, one copy to pinned host memory
                    base[pos[a]: pos[b]].copy_(out)
                # Runs back to back in the frame and at the receiver are one run there: a head
                # slice of token-major pages gathers 512 B rows into 8 KiB destination runs.
                start, _, length = merge_runs(do[sel[a:b]], pos[a:b], n[sel[a:b]])
                header.append((np.full(len(start), dr[sel[a]]), start, length))
            msg = np.concatenate([np.concatenate(c) for c in zip(*header)]).astype("<i8").tobytes()
            yield msg, [memoryview(base[: pos[-1]].numpy())], base
        if not sent:
            yield b"", [], None   # an empty transfer still sends its totals

    def _frames_few(self, runs: list[tuple[int, int, int, int, int]]) -> Iterator[tuple]:
        """``_frames`` for a few runs in CPU regions, as ``TransferPlan.run_tuples`` gives them."""
        fb, budget = self.frame_bytes, self.frame_bytes * self.frames_per_message
        views, small = [], []
        for r, o, d, e, c in runs:
            for x in range(0, c, fb):   # runs longer than a frame go in frame-sized chunks
                (views if c >= self.zero_copy_min else small).append((r, o + x, d, e + x, min(fb, c - x)))
        sent = False
        for msg in _fill(views, budget, 0):
            sent = True
            yield _pack_runs(msg), [memoryview(self._host[r][o: o + c]) for r, o, _, _, c in msg], None
        for msg in _fill(small, budget, _RUN_BYTES):
            sent = True
            if len(msg) == 1:   # a lone run needs no staging
                r, o, _, _, c = msg[0]
                yield _pack_runs(msg), [memoryview(self._host[r][o: o + c])], None
                continue
            base = self._stage()
            stage, p = base.numpy(), 0
            for r, o, _, _, c in msg:
                stage[p: p + c] = self._host[r][o: o + c]
                p += c
            yield _pack_runs(msg), [memoryview(stage[:p])], base
        if not sent:
            yield b"", [], None

    def _stage(self) -> torch.Tensor:
        """A staging buffer for a packed frame: one zmq has finished sending, or a new one."""
        if self._stages and (self._stages[0][1] is None or self._stages[0][1].done):
            return self._stages.popleft()[0]
        return torch.empty(self.frame_bytes * (self.frames_per_message + 1), dtype=torch.uint8,
                           pin_memory=not self._is_host[:-1].all())

    def _pump(self, peer: _Peer) -> None:
        """Hand messages to zmq, round-robin over the peer's transfers, until it pushes back."""
        for _ in range(4 * self.window):
            if peer.pending is None:
                if not peer.sending:
                    break
                out = peer.sending.popleft()
                if out.handle.poll() != TransferStatus.PENDING:
                    continue
                runs, parts, stage = out.ahead
                try:
                    out.ahead = next(out.frames, None)
                except Exception as e:  # a bad source fails this transfer, not the thread
                    out.handle.finish(peer_failed(out.handle.request_id, f"cannot read the source: {e}"))
                    continue
                hdr = {"t": "d", "r": out.handle.request_id, "x": out.xid,
                       "dl": out.handle.deadline - time.monotonic(), "runs": runs}
                out.nruns += len(runs) // _RUN_BYTES
                if out.ahead is None:
                    hdr.update(out.end, nruns=out.nruns)
                else:
                    peer.sending.append(out)
                peer.pending = [msgpack.packb(hdr), *parts], stage, out
            parts, stage, out = peer.pending
            # Small messages are copied into zmq: zero-copy costs pyzmq a tracked buffer and a
            # wake-up of its garbage-collector thread (~100 us), more than copying 256 KiB.
            copy = sum(len(p) for p in parts) <= _COPY_BELOW
            try:
                if copy:
                    peer.sock.send_multipart(parts, flags=zmq.NOBLOCK)
                else:   # a tracker per part: zmq reads each (the source, or staging) until it lets go
                    last = len(parts) - 1   # only the first part can meet the high-water mark
                    trackers = [peer.sock.send(p, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=False,
                                               track=True) for i, p in enumerate(parts)]
                    out.trackers += trackers
            except zmq.Again:
                break
            if stage is not None:   # reuse the buffer once zmq is done with it (no fresh pages)
                self._stages.append((stage, None if copy else trackers[-1]))
                if len(self._stages) > self.window:
                    self._stages.popleft()
            peer.pending, peer.progress = None, time.monotonic()
        want = zmq.POLLIN | (zmq.POLLOUT if peer.pending is not None or peer.sending else 0)
        self._poller.modify(peer.sock, want)

    def _retire(self, out: _Out) -> None:
        """``out`` ended: forget it, and release its source once zmq holds nothing of it."""
        self._out.pop(out.xid, None)
        out.peer.open.pop(out.xid, None)
        if out.peer.pending is not None and out.peer.pending[2] is out:
            out.peer.pending = None   # never handed to zmq: dropped (the receiver fails the transfer)
        out.frames = out.ahead = None
        if not self._release_if_free(out):
            self._releasing.append(out)

    @staticmethod
    def _release_if_free(out: _Out) -> bool:
        if out.handle.source_released or all(t.done for t in out.trackers):
            out.handle.release_source()
            return True
        return False

    def _reconnect(self, peer: _Peer) -> None:
        """A fresh DEALER for a silent peer: closing the old one (linger 0) drops every message
        queued for it, so zero-copy frames stop referencing their sources."""
        self._poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        peer.pending = None
        try:
            peer.sock = self._dealer(peer.endpoint)
        except zmq.ZMQError as e:   # cannot happen for an endpoint that connected before; keep going
            log.error("cannot reconnect to %s: %s", peer.endpoint, e)
            peer.sock = self._ctx.socket(zmq.DEALER)
        self._poller.register(peer.sock, zmq.POLLIN)

    def _on_replies(self, peer: _Peer) -> None:
        while True:
            try:
                parts = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            peer.heard = time.monotonic()
            try:
                h = _unpack(parts[0], _REPLIES, 1 << 24, max_array=1 << 20)
            except ValueError as e:
                log.warning("ignoring a malformed reply: %s", e)
                continue
            for xid in h["x"] if h["t"] == "a" else [h.get("x")]:
                out = peer.open.get(xid) if type(xid) is int else None
                if out is None:
                    continue
                if h["t"] == "a":   # the receiver has every byte: zmq sent them all
                    out.handle.finish(release=True)
                else:
                    out.handle.finish(RejectedWrite(
                        f"request {out.handle.request_id}: the receiver failed the transfer: {h['why']}"))
                self._retire(out)

    def _tick(self, now: float, drained: bool) -> None:
        """Deadlines, pings and silence, a few times per second."""
        for out in list(self._out.values()):
            if out.handle.poll() != TransferStatus.PENDING:   # poll() times out a passed deadline
                self._retire(out)
        self._releasing = [out for out in self._releasing if not self._release_if_free(out)]
        for pid, peer in self._peers.items():
            if not peer.open:
                continue
            silent = now - max(peer.heard, peer.progress)
            if silent > self.hb_timeout:
                for out in list(peer.open.values()):
                    out.handle.finish(peer_failed(out.handle.request_id,
                                                  f"peer {pid} stopped answering for {silent:.1f}s"))
                    self._retire(out)
                peer.sending.clear()
                self._reconnect(peer)
            elif now - peer.pinged >= self.hb_ivl:
                peer.pinged = now
                try:
                    peer.sock.send(msgpack.packb({"t": "p"}), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        for key, st in list(self._in.items()):
            if now > st.deadline:
                self._fail_in(key, f"deadline passed: {st.nbytes} bytes arrived before it")
            elif drained and now - max(self._seen.get(key[0], 0.0), st.start) > self.hb_timeout:
                self._fail_in(key, f"sender went silent for more than {self.hb_timeout}s")
        if len(self._seen) > 1024:   # forget routing ids gone quiet with nothing open
            busy = {k[0] for k in self._in}
            self._seen = {r: t for r, t in self._seen.items() if r in busy or now - t < 60}

    # -- I/O thread: receiving ------------------------------------------------------------
    def _on_router(self) -> bool:
        """Handle queued messages; True when the socket is drained (silence checks are fair then)."""
        drained = False
        for _ in range(4 * self.window):
            try:
                parts = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                drained = True
                break
            rid = parts[0].bytes
            self._seen[rid] = time.monotonic()
            try:
                self._on_message(rid, parts[1:])
            except Exception as e:  # a bug: count it, and never let one message take the receiver down
                log.exception("error handling a message")
                self.grants.reject("?", f"internal error: {type(e).__name__}")
        self._flush_acks()
        self._deliver_completed()
        return drained

    def _deliver_completed(self) -> None:
        """Completed transfers reach the caller after the turn's acks: its handler (a decode
        endpoint's, say) wakes a waiting thread, which runs once this one blocks in poll."""
        done, self._completed = self._completed, []
        for arrival in done:
            self._deliver(arrival)

    def _flush_acks(self) -> None:
        for rid, xids in self._acks.items():   # one ack message per sender per batch
            self._reply(rid, {"t": "a", "x": xids})
        self._acks.clear()

    def _on_message(self, rid: bytes, parts: list) -> None:
        try:
            if not parts:
                raise ValueError("empty message")
            h = _unpack(parts[0].buffer, _FIELDS, self.max_message_bytes)
        except ValueError as e:
            self.grants.reject("?", f"malformed header: {e}")
            return
        if h["t"] == "p":   # answered after the acks so far: a pong means "all before it handled"
            self._flush_acks()
            self._reply(rid, {"t": "p", "n": h["n"]} if type(h.get("n")) is int else {"t": "p"})
            return
        key, request_id = (rid, h["r"], h["x"]), h["r"]
        if key in self._dead:   # the transfer failed already: its later messages are dropped quietly
            return
        st = self._in.get(key)
        if st is None:
            if len(self._in) >= self.max_incoming:
                self._fail_in(key, self.grants.reject(request_id, f"too many transfers: {len(self._in)} open"))
                return
            st = self._in[key] = _In(time.monotonic() + h["dl"])
        if time.monotonic() > st.deadline:   # too late: the sender has given up on it
            self._fail_in(key, f"deadline passed: {st.nbytes} bytes arrived before it")
            return
        runs, payload = h["runs"], parts[1:]
        k = len(runs) // _RUN_BYTES
        few = k <= FEW_RUNS   # Python ints: a few runs check and land without array setup
        if few:
            region, offset, nbytes = (list(c) for c in _runs_of(runs, k))
            sizes = [len(p) for p in payload]
            size = sum(sizes)
        else:
            region, offset, nbytes = np.frombuffer(runs, "<i8", 3 * k).reshape(3, -1).astype(np.int64)
            sizes = np.fromiter((len(p) for p in payload), np.int64, len(payload))
            size = int(sizes.sum())
        if len(runs) % _RUN_BYTES or (k == 0) != (len(payload) == 0) or \
                len(payload) not in (0, 1, k) or len(payload) > _MAX_PARTS:
            reason = (f"malformed message: {len(payload)} payload frames for a runs field of {len(runs)} bytes "
                      f"(expected none, 1, or one per run)")
        elif k and not _lengths_match(nbytes, sizes, size):
            claimed = sum(n for n in (nbytes if few else nbytes.tolist()) if n > 0)
            reason = f"length mismatch: runs claim {claimed} bytes, payload has {size}"
        else:
            reason = None
        if reason is not None:
            self._fail_in(key, self.grants.reject(request_id, reason))
            return
        with self._write_lock:
            reason = self.grants.check(request_id, region, offset, nbytes)   # also: request ended?
            if reason is None and (any(o + n > self.grants.region_sizes[r] for r, o, n in zip(region, offset, nbytes))
                                   if few else (offset + nbytes > self._sizes[region]).any()):
                reason = self.grants.reject(request_id, "outside region: a granted run passes its region's end")
            if reason is None and size:
                self._write(region, offset, nbytes, payload)
        if reason is not None:
            self._fail_in(key, reason)
            return
        st.nbytes += size
        st.nruns += len(nbytes)
        if "nruns" in h:   # the transfer's last message
            if (st.nbytes, st.nruns) != (h["nbytes"], h["nruns"]):
                self._fail_in(key, f"incomplete transfer: {st.nbytes} of {h['nbytes']} bytes, "
                                   f"{st.nruns} of {h['nruns']} runs arrived")
                return
            del self._in[key]
            self._completed.append(Arrival(request_id, st.nbytes, True, "", h["notify"]))
            self._acks.setdefault(rid, []).append(key[2])

    def _write(self, region, offset, nbytes, payload: list) -> None:
        """Copy checked runs from the received frames into the regions (one copy per byte).
        Runs come as lists of Python ints (a message of a few runs) or as int64 arrays."""
        few = isinstance(region, list)
        if few or len(payload) == len(nbytes):   # a copy per run: a few runs, or one part per (large) run
            if not few:
                region, offset, nbytes = region.tolist(), offset.tolist(), nbytes.tolist()
            packed, p = len(payload) == 1, 0
            for i, (r, o, c) in enumerate(zip(region, offset, nbytes)):
                src = payload[0].buffer[p: p + c] if packed else payload[i].buffer
                p += c
                if self._host[r] is not None:
                    self._host[r][o: o + c] = np.frombuffer(src, np.uint8)
                else:
                    self._regions[r][o: o + c].copy_(torch.frombuffer(src, dtype=torch.uint8))
            return
        buf = payload[0].buffer
        spans = _bounds(region)
        if len(spans) > 64 or any(self._host[region[a]] is None for a, _ in spans):
            # Runs not sorted by region (not our sender), or a CUDA region: the generic executor.
            scatter_runs(self._regions, region, offset, nbytes, torch.frombuffer(buf, dtype=torch.uint8))
            return
        data, pos = np.frombuffer(buf, np.uint8), np.concatenate(([0], np.cumsum(nbytes)))
        for a, b in spans:   # loop per destination region in the frame
            _scatter(self._host[region[a]], offset[a:b], nbytes[a:b], data[pos[a]: pos[b]])

    def _fail_in(self, key: tuple, reason: str) -> None:
        rid, request_id, xid = key
        st = self._in.pop(key, None)
        self._dead[key] = None
        if len(self._dead) > 65536:
            self._dead.popitem(last=False)
        log.warning("incoming transfer %d of request %s failed: %s", xid, request_id, reason)
        self._deliver_completed()   # in the order they happened
        self._deliver(Arrival(request_id, st.nbytes if st else 0, False, reason))
        self._reply(rid, {"t": "n", "x": xid, "why": reason})

    def _reply(self, rid: bytes, msg: dict) -> None:
        try:
            self._router.send_multipart([rid, msgpack.packb(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the sender is gone: it times out on its own
            pass
