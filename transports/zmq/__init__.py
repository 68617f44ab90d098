"""Two-sided transport over ZeroMQ: run headers plus payload frames, checked before they land.

Each transport binds one ROUTER (it receives there) and connects one DEALER per peer it
sends to. One I/O thread (``kit.IOThread``) owns every socket (zmq sockets are not
thread-safe); callers only enqueue typed commands (``kit.CommandQueue``) and wake it through a
pipe, so ``submit`` never blocks on the network.

Files: ``protocol`` (wire messages, parsed and validated once), ``sender`` (runs cut into
messages, zero-copy or staged in the staging ring), ``receiver`` (every message checked whole
before a byte lands), ``devsync`` (arrivals wait for device copies), ``addresses`` (bind, ports),
this module (options, the contract's methods, the loop).

Addresses: the ROUTER binds ``endpoint`` (a wildcard is fine); peers are told ``advertise`` (or
the bind host, or a routable interface address), never a wildcard, never loopback with
``remote``. ``connect`` proves the data path with a ping round trip (``connect_timeout``): an
unreachable address fails there, by name. ``disconnect`` fails a peer's transfers and closes its
DEALER; sources zmq still holds stay unreleased until it lets go.

Every transfer ends: the sender's handle times out at its deadline, and the I/O thread fails
the open transfers of a peer that has neither answered nor taken data for
``heartbeat_timeout`` seconds; the receiver fails an incoming transfer at the deadline its
header carried, or when its sender went silent for ``heartbeat_timeout``. An I/O thread that
dies of a bug fails every transfer it owned, and the transport says so (``broken``).

Where one transfer's time goes (issue 20; 2 vCPUs, loopback, next to gloo send/recv + ack):
six thread wake-ups (caller -> I/O thread by the pipe, I/O thread -> zmq's I/O thread, and
back, on each side, then I/O thread -> caller), each ~30-50 us here, and one copy more than a
socket recv at the receiver (zmq owns the received buffer; every run is checked before it is
copied). A bare pyzmq DEALER/ROUTER round trip of 1 MiB already takes about gloo's time, so
one-run 1 MiB stays near 0.5x gloo. Measured without a gain, so not done: fixed SNDBUF/RCVBUF
(128 KiB-4 MiB: 1 MiB up to 1.5x slower than the kernel's autotuning), a 1 MiB message copied
into zmq instead of zero-copy, 1-2 MiB messages for one transfer alone (4 KiB x1000, 16 MiB),
and ``submit`` handing a few-run plan's first message to zmq itself under a lock (one wake-up
less: within the noise of a shared 2-core machine, 16 MiB possibly slower).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from kvxfer.control.addresses import advertise_address
from kvxfer.copy import byte_view
from kvxfer.errors import ConnectError
from kvxfer.grant import GrantTable
from kvxfer.plan import FEW_RUNS, TransferPlan
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport, peer_failed
from kvxfer.transport.kit import (
    Call,
    Close,
    CommandQueue,
    Connect,
    Crash,
    IOThread,
    PipeWaker,
    StagingPool,
    Submit,
    fail_command,
)

from .addresses import bind, check_ports
from .devsync import WriteSync
from .protocol import MAX_PARTS, RUN_BYTES
from .receiver import ZMQReceiver
from .sender import Peer, Probe, ZMQSender

log = logging.getLogger("kvxfer.transport.zmq")

_REPLY_HWM = 1 << 20             # queued replies (tiny) before a ROUTER would drop one
_CMDS_PER_TURN = 64              # commands handled per loop turn, so a burst of submits never
                                 # keeps the loop from pumping, receiving and its silence checks
_HEADER_ROOM = MAX_PARTS * RUN_BYTES + 4096   # the largest header our sender makes
_OMP_PER_THREAD = "parallel backend: OpenMP" in torch.__config__.parallel_info()


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


class ZMQTransport(ZMQSender, ZMQReceiver, Transport):
    """ZeroMQ data plane. Options (keyword arguments, all optional):

    endpoint            where the ROUTER binds: "tcp://HOST:PORT" (port 0: a free one; HOST may be a
                        wildcard, 0.0.0.0) or "ipc:///path"
    advertise           the address, host name or interface name (``eth0``) peers are told to reach
                        (``descriptor()["endpoint"]``); None: the bind host, or for a wildcard bind a
                        routable interface address. A wildcard is never advertised (ValueError)
    event               a factory of events (``record(stream=None)``, ``query()``) marking writes complete;
                        default ``torch.cuda.Event`` after writes to a device region (``devsync``).
                        Given, every write records one (tests: a stand-in that completes late)
    staging_frames      frames in the staging ring (each frame_bytes * (frames_per_message + 1) bytes),
                        allocated at ``register`` (pinned when a region is on a device), never more:
                        when every one is in zmq, sending waits (counted: ``staging()``, kvxfer.metrics)
    connect_timeout     seconds ``connect`` waits for a ping's answer on the data socket (an unreachable
                        or black-holed data address fails there, naming the address)
    remote              peers are on other hosts: advertising loopback (or ipc://) is refused too
    ports               (first, last): bind the first free port of this range (the endpoint's port must
                        be 0); None: the endpoint's port
    frame_bytes         largest zero-copy frame (~1 MiB: zmq slows down on multi-MiB frames)
    frames_per_message  zero-copy frames per message, and the size of a packed frame in frame_bytes
                        (fewer per-message costs; packed frames measured faster at 4 MiB than 1 MiB)
    zero_copy_min       runs at least this long go out from the region without a copy (each such
                        part costs pyzmq ~40 us for its frame and tracker; a copy of 64 KiB costs
                        ~13 us: 1000 scattered 64 KiB pages went 1.3-1.5x faster copied, so 256 KiB)
    window              messages queued per peer before zmq pushes back (send high-water mark)
    heartbeat_ivl       seconds between pings while transfers are open
    heartbeat_timeout   seconds of silence after which a peer's open transfers fail
    max_message_bytes   largest message the receiver accepts, all parts together (a larger part
                        makes zmq drop the connection; a larger message fails its transfer)
    max_incoming        most incoming transfers open at once; more are rejected
    max_incoming_per_peer  most incoming transfers open at once from one sender (routing id)
    few_runs            messages and plans of at most this many runs are handled with Python ints
                        (``FEW_RUNS``: a 1-run message's frames cost 2.3 us that way, 44 us as arrays;
                        the conformance suite forces 0 and 2**20 so both paths carry every case)
    tune_malloc         raise glibc's malloc thresholds so zmq reuses its buffers (see _keep_malloc_arenas)
    """
    name = "zmq"

    def __init__(self, *, endpoint: str = "tcp://127.0.0.1:0", frame_bytes: int = 1 << 20,
                 frames_per_message: int = 4, zero_copy_min: int = 256 << 10, window: int = 16,
                 heartbeat_ivl: float = 1.0, heartbeat_timeout: float = 5.0, max_message_bytes: int = 64 << 20,
                 max_incoming: int = 4096, max_incoming_per_peer: int = 1024, few_runs: int = FEW_RUNS,
                 tune_malloc: bool = True, advertise: str | None = None, remote: bool = False,
                 ports: tuple[int, int] | None = None, connect_timeout: float = 5.0,
                 event: Callable[[], Any] | None = None, staging_frames: int = 8):
        self._sync = WriteSync(event)
        self.connect_timeout = float(connect_timeout)
        if not 0 < self.connect_timeout <= 600:
            raise ValueError(f"connect_timeout {connect_timeout} must be in (0, 600] seconds")
        self._advertise, self._remote, self._ports = advertise, bool(remote), check_ports(endpoint, ports)
        if not 4096 <= frame_bytes <= max_message_bytes // 2:
            raise ValueError(f"frame_bytes {frame_bytes} must be in 4096..max_message_bytes/2")
        self.frame_bytes, self.frames_per_message = int(frame_bytes), max(1, int(frames_per_message))
        if self.frame_bytes * self.frames_per_message + _HEADER_ROOM > max_message_bytes:
            raise ValueError(f"frame_bytes * frames_per_message ({self.frame_bytes * self.frames_per_message}) "
                             f"plus {_HEADER_ROOM} header bytes must fit max_message_bytes ({max_message_bytes}): "
                             f"send fewer frames per message")
        self.zero_copy_min, self.window = int(zero_copy_min), int(window)
        self.hb_ivl, self.hb_timeout = float(heartbeat_ivl), float(heartbeat_timeout)
        self.max_message_bytes, self.max_incoming = int(max_message_bytes), int(max_incoming)
        self.few_runs, self.max_incoming_per_peer = int(few_runs), int(max_incoming_per_peer)
        if tune_malloc:
            _keep_malloc_arenas()
        self.id = uuid.uuid4().hex
        self.grants = GrantTable()
        self._regions: list[torch.Tensor] = []
        self._host: list[np.ndarray | None] = []       # numpy views of CPU regions (None: CUDA)
        self._is_host, self._sizes = np.zeros(1, bool), np.zeros(0, np.int64)
        if not 1 <= int(staging_frames) <= 4096:
            raise ValueError(f"staging_frames {staging_frames} must be in 1..4096")
        self._staging = StagingPool(frames=int(staging_frames), name=self.name,
                                    frame_bytes=self.frame_bytes * (self.frames_per_message + 1))
        self.staging_wait = False   # the ring was exhausted: look again soon (its frames free as zmq sends)
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._waker = PipeWaker()
        self.commands = CommandQueue(self._waker.wake)
        self._write_lock = threading.Lock()             # check + write vs forget: none lands after forget
        self._close_lock = threading.Lock()
        self._closed = False
        self._xids = itertools.count(1)
        self._pids = itertools.count()
        self._ctx = zmq.Context(io_threads=1)
        self._router: zmq.Socket | None = None
        self.bound = ""                                  # what the ROUTER bound (endpoint: what peers are told)
        self._sender_init()
        self._receiver_init()
        self._ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.io = IOThread("kvxfer-zmq-io", lambda: self._run(endpoint), on_crash=self._fail_all,
                           on_exit=self._free)
        self.io.start()
        try:
            self.endpoint = self._ready.result(timeout=30)  # raises ConnectError if the bind failed
        except BaseException:
            self.io.join(5)
            self._waker.close()
            raise

    @property
    def broken(self) -> str | None:
        """Why the I/O thread died (a bug), or None: a broken transport fails every transfer."""
        return self.io.broken

    # -- caller side (any thread) ----------------------------------------------------------
    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Called once at start-up, before peers send: the pool's byte regions, ids = positions."""
        views = [byte_view(t) for t in regions]
        with self._write_lock:
            self._regions = views
            self._host = [v.numpy() if v.device.type == "cpu" else None for v in views]
            self._is_host = np.array([h is not None for h in self._host] + [False], bool)
            self._staging.allocate(pin=not self._is_host[:-1].all())
            self._sync.configure(views)
            self.grants.region_sizes = [v.numel() for v in views]
            self._sizes = np.asarray(self.grants.region_sizes, np.int64)

    def descriptor(self) -> dict:
        return {"transport": self.name, "id": self.id, "endpoint": self.endpoint,
                "region_sizes": list(self.grants.region_sizes)}

    def connect(self, descriptor: dict, token: bytes = b"") -> str:   # binds nothing: the token is not used
        """Called by the sender at handshake (blocks briefly); returns the peer id for ``submit``."""
        endpoint = descriptor.get("endpoint") if isinstance(descriptor, dict) else None
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ConnectError(f"not a zmq descriptor (no tcp:// or ipc:// endpoint): {descriptor!r}")
        if self._closed or self.broken:
            raise ConnectError(f"cannot connect to {endpoint}: {self.broken or 'transport closed'}")
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.commands.put(Connect(endpoint, fut))
        try:
            return fut.result(timeout=self.connect_timeout + 30)
        except Exception as e:   # zmq refused the endpoint, no pong in time, or the thread ended
            raise ConnectError(f"cannot connect to {endpoint}: {e}") from e

    def disconnect(self, peer: str) -> None:
        """Fail the peer's open transfers ("disconnected") and close its DEALER (linger 0: zmq drops
        what is queued for it). Sources of frames zmq still held stay unreleased until zmq lets go
        of them (``fencing``). Idempotent; an unknown peer or a closed transport: no-op."""
        if self._closed or self.broken:
            return
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.commands.put(Call(self._disconnect, (peer,), fut))
        try:
            fut.result(timeout=30)
        except Exception as e:   # the transport closed meanwhile: nothing left to free
            log.debug("disconnect %s: %s", peer, e)

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle:
        """Hand the plan to the I/O thread and return at once. The source bytes must stay
        unchanged until ``handle.source_released``. ``capability``: the grant's, from decode's
        REQ; every data message of the transfer carries it."""
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        if self._closed or self.broken:
            handle.finish(peer_failed(request_id, self.broken or "transport is closed"), release=True)
        else:
            self.commands.put(Submit(peer, request_id, (plan, bytes(notify), bytes(capability)), handle))
            if self.broken and not self.io.alive:   # died meanwhile: nobody will take the command
                fail_command(Submit(peer, request_id, None, handle), self.broken)
        return handle

    def staging(self) -> dict:
        """The staging ring: frames, in use, and waits for a free one so far."""
        return self._staging.stats()

    def writes_pending(self, request_id: str) -> bool:
        """After ``forget``: True while a device copy of the request's bytes may still run."""
        return self._sync.busy(request_id)

    def fencing(self) -> dict:
        """Any thread (a snapshot): sender transfers that ended while zero-copy frames of theirs were
        still queued in zmq (``sources``, ``source_bytes``): their sources stay unreleased until zmq
        lets go of every frame (or the socket to a silent peer is closed with linger 0). A receiver
        holds nothing here: it checks every frame against the live grants, so a late frame of an
        ended request is dropped."""
        rel = list(self._releasing)
        return {"requests": 0, "bytes": 0, "sources": len(rel), "source_bytes": sum(o.handle.nbytes for o in rel)}

    def close(self) -> None:
        """Fail whatever is open, close the sockets and join the I/O thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.commands.put(Close())
        self.io.join(timeout=30)
        self._waker.close()

    # -- I/O thread ------------------------------------------------------------------------
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
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _run(self, endpoint: str) -> None:
        """The loop (``IOThread`` body): commands, receiving, pumping, and a tick for time."""
        if _OMP_PER_THREAD:
            # Copies here go one frame at a time; an OpenMP team would stall on its barrier
            # whenever a busy core descheduled a member. With OpenMP this is per thread.
            torch.set_num_threads(1)
        router = self._socket(zmq.ROUTER)
        try:
            self.bound = bind(router, endpoint, self._ports)
            advertised = advertise_address(self.bound, self._advertise, remote=self._remote,
                                           setting="advertise= (zmq transport option)")
        except (zmq.ZMQError, ValueError) as e:
            router.close(linger=0)
            self._ready.set_exception(ConnectError(f"cannot bind {endpoint}: {e}"))
            return
        self._router = router
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._waker.fd, zmq.POLLIN)
        self._ready.set_result(advertised)
        next_tick = 0.0
        while True:
            soon = self._sync.waiting or self.staging_wait   # device copies, or frames zmq will free
            self.staging_wait = False
            events = dict(self._poller.poll(1 if soon else 50))
            if self._waker.fd in events and not self._on_commands():
                break
            drained = self._router not in events or self._on_router()
            if self._sync.waiting:
                self._on_synced()
            for peer in self._peers.values():
                if peer.probe is not None and events.get(peer.sock, 0) & zmq.POLLOUT:
                    self._probe(peer, 0.0)   # connected: the ping goes out (the tick checks the deadline)
                if events.get(peer.sock, 0) & zmq.POLLIN:
                    self._on_replies(peer)
                if peer.pending is not None or peer.sending:
                    self._pump(peer)
            now = time.monotonic()
            if now >= next_tick:
                self._check_outgoing(now)
                self._check_incoming(now, drained)
                next_tick = now + min(0.1, self.hb_ivl / 2)
        self._fail_all("transport closed")

    def _on_commands(self) -> bool:
        """The commands queued so far (a bounded number per turn); False on ``Close``."""
        self._waker.clear()
        cmds = self.commands.take(_CMDS_PER_TURN)
        for k, cmd in enumerate(cmds):
            if isinstance(cmd, Close):
                for rest in cmds[k + 1:]:
                    fail_command(rest, "transport closed")
                return False
            if isinstance(cmd, Crash):
                raise cmd.error
            if isinstance(cmd, Submit):
                plan, notify, cap = cmd.work
                self._start(cmd.peer, cmd.request_id, plan, notify, cmd.handle, cap)
            elif isinstance(cmd, Connect):
                self._connect(cmd.target, cmd.future)
            elif isinstance(cmd, Call):
                res = cmd.fn(*cmd.args)
                if cmd.future is not None:
                    cmd.future.set_result(res)
        if len(cmds) == _CMDS_PER_TURN:   # more may be queued: come back after a turn of I/O
            self._waker.wake()
        return True

    def _connect(self, endpoint: str, fut: concurrent.futures.Future) -> None:
        try:
            sock = self._dealer(endpoint)
        except zmq.ZMQError as e:
            fut.set_exception(e)
            return
        n = next(self._pids)
        pid = f"{endpoint}#{n}"   # never reused, so a stale id reaches no new peer
        # ``fut`` is answered when the pong to the probe's ping comes back, or fails at its deadline
        peer = self._peers[pid] = Peer(endpoint, sock, Probe(pid, n, fut, time.monotonic() + self.connect_timeout))
        self._poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        self._probe(peer, time.monotonic())

    def _fail_all(self, why: str) -> None:
        """Every transfer this thread owned fails with ``why`` (close, or a crash)."""
        for out in list(self._out.values()):
            out.handle.finish(peer_failed(out.handle.request_id, why))
        for peer in self._peers.values():   # a connect still waiting for its pong
            if peer.probe is not None and not peer.probe.future.done():
                peer.probe.future.set_exception(ConnectError(why))
        self._deliver_completed()
        for key in list(self._in):
            self._fail_in(key, why)
        for _, _, arrival in self._sync.drop():   # bytes landed, the device copy never confirmed
            if arrival is not None:
                self._deliver(Arrival(arrival.request_id, arrival.nbytes, False, why))
        self.commands.fail_all(why)   # commands that raced with close() or the crash

    def _free(self) -> None:
        """After the loop (``IOThread.on_exit``): sockets and context, then the sources."""
        self.commands.fail_all(self.broken or "transport closed")
        for s in [self._router, *(p.sock for p in self._peers.values())]:
            if s is not None:
                s.close(linger=0)
        self._ctx.term()   # queued messages are dropped: nothing reads a source any more
        for out in [*self._out.values(), *self._releasing]:
            out.handle.release_source()
        self._staging.clear()
