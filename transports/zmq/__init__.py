"""Two-sided transport over ZeroMQ: run headers plus payload frames, checked before they land.

Each transport binds one ROUTER (it receives there) and connects one DEALER per peer it
sends to. One I/O thread (``kit.IOThread``) owns every socket (zmq sockets are not
thread-safe); callers only enqueue typed commands (``kit.CommandQueue``) and wake it through a
pipe, so ``submit`` never blocks on the network.

``ZMQTransport`` is a facade over parts that each own their state and get their collaborators
in their constructor: ``Sockets`` (``sockets``: context, ROUTER behind ZAP, DEALERs), ``Sender``
(``sender``: peers and outgoing transfers), ``Framer`` (``frames``: runs cut into messages,
zero-copy or staged in the staging ring), ``Receiver`` (``receiver``: every message checked whole
before a byte lands), ``Loop`` (``loop``: the I/O thread's turn). Also: ``options`` (every option,
checked), ``protocol`` (wire messages, parsed and validated once), ``regions``, ``rows`` (device
gathers, region spans), ``devsync`` (arrivals wait for device copies), ``addresses`` (bind, ports).

Admission (``admission="required"``): only senders ``admit`` let in get past the ZMTP handshake,
each presenting its current token; see ``options`` and ``kvxfer.transport.zmqguard``.

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

Where one transfer's time goes (issues 20 and 39; 2 vCPUs, loopback, next to gloo send/recv +
ack): six thread wake-ups (caller -> I/O thread by the pipe, I/O thread -> zmq's I/O thread, and
back, on each side, then I/O thread -> caller), each ~30-50 us here, and one copy more than a
socket recv at the receiver (zmq owns the received buffer; every run is checked before it is
copied). Those do not keep one run of 1 MiB at ~0.5x gloo: ``bench_peers.py``'s ``zmq threads``
row, pyzmq with the same threads and hand-offs and no protocol work, reads ~0.9-1.05x gloo there.
What is left is this transport's own work per transfer, in Python on both I/O threads (hot, 1 MiB,
against that floor: ~1.5-1.9x its CPU per transfer on each side; +~30 us before ``Sender.start``,
+~50 in start and pump, +~40 from the ROUTER's event to ``_on_data``), which the bench's
interleaved rounds, run with cold caches, make larger still. Measured without a gain, so not
done: fixed SNDBUF/RCVBUF (128 KiB-4 MiB: 1 MiB up to 1.5x slower than the kernel's autotuning),
a 1 MiB message copied into zmq instead of zero-copy (issue 39: medians ~10% faster hot, the
bench's best round unchanged), 1-2 MiB messages for one transfer alone (4 KiB x1000, 16 MiB),
and ``submit`` handing a few-run plan's first message to zmq itself under a lock (one wake-up
less: within the noise of a shared 2-core machine, 16 MiB possibly slower; issue 39, as UCX's
caller's turn, the I/O thread asleep on the sockets' file descriptors with its lock let go: 1 MiB
medians 7-9% faster hot, the 1-page request latency unchanged; the caller also taking its ack:
nothing more). Done: a message's header is copied into zmq, untracked; only payload parts go
zero-copy, each with its tracker (a tracked header cost every message one more tracker and
wake-up of pyzmq's garbage-collector thread: one run of 16 MiB, 6 interleaved pairs, 2.19-2.59
-> 2.59-2.98 GB/s; 1 MiB unchanged); the one-message path on a diet (issue 39: pyzmq's flags as
plain ints, the first receive after a POLLIN without asking zmq, the poller told only of changes,
parts sent one by one, one read to clear the waker, arrivals in a SimpleQueue): I/O-thread CPU
per hot 1 MiB transfer 234 -> 210 us (sender) and 210 -> 186 us (receiver), medians of 6
interleaved runs, the transfer's median 724 -> 677 us; the bench's best round unchanged. Of the
~210 us left on each side, each sleep and wake-up costs ~27 us of CPU here (a blocking receive
as much as a poll), and a zero-copy send ~25-35 us: the rest, ~100 us a side, is Python, whose
cost in situ is 3-6x its cost in a loop (the caches are cold after each 1 MiB copy).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvxfer.copy import byte_view
from kvxfer.errors import ConfigError, ConnectError, TransportError
from kvxfer.grant import GrantTable
from kvxfer.plan import TransferPlan
from kvxfer.transport.admission import MAX_TOKEN, Admissions
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport, peer_failed
from kvxfer.transport.kit import (
    Call,
    Close,
    CommandQueue,
    Connect,
    IOThread,
    PipeWaker,
    StagingPool,
    Submit,
    fail_command,
)

from .devsync import WriteSync
from .frames import Framer
from .loop import Loop
from .options import ZMQOptions
from .receiver import Receiver
from .regions import Regions
from .sender import Sender
from .sockets import Sockets

log = logging.getLogger("kvxfer.transport.zmq")

__all__ = ["ZMQTransport", "ZMQOptions"]


class ZMQTransport(Transport):
    """ZeroMQ data plane. Options: keyword arguments, or ``options=ZMQOptions(...)``; each is
    documented (and checked: ``ConfigError``) in ``transports/zmq/options.py``."""
    name = "zmq"

    def __init__(self, options: ZMQOptions | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise ConfigError(f"give zmq options as options= or as keywords, not both (keywords {sorted(kwargs)})")
        opts = self.options = options if options is not None else ZMQOptions.of(kwargs)
        self.id = uuid.uuid4().hex
        self.grants = GrantTable()
        self.admissions = Admissions(opts.admission == "required", opts.max_admitted)
        self.regions = Regions()
        self.staging_pool = StagingPool(frames=opts.staging_frames, name=self.name,
                                        frame_bytes=opts.frame_bytes * (opts.frames_per_message + 1))
        self._sync = WriteSync(opts.event)
        self._arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._write_lock = threading.Lock()             # check + write vs forget: none lands after forget
        self._close_lock = threading.Lock()
        self._closed = False
        try:   # out of fds or threads: an error of the tree, at the boundary
            self._waker = PipeWaker()
        except OSError as e:
            raise TransportError(f"cannot start a zmq transport: {e}") from e
        try:
            self.sockets = Sockets(opts, self.admissions, self.id)
        except zmq.ZMQError as e:
            self._waker.close()
            raise TransportError(f"cannot start a zmq transport: {e}") from e
        self.commands = CommandQueue(self._waker.wake)
        framer = Framer(opts, self.regions, self.staging_pool)
        self.sender = Sender(opts, self.regions, framer, self.staging_pool, self.sockets)
        self.receiver = Receiver(opts, self.regions, self.grants, self.admissions, self._sync, self._write_lock,
                                 self.sockets, self._deliver)
        self.loop = Loop(opts, self.sockets, self.sender, self.receiver, framer, self._sync, self.commands, self._waker)
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.io = self.loop.io = IOThread("kvxfer-zmq-io", lambda: self.loop.run(ready), on_crash=self.loop.fail_all,
                                          on_exit=self.loop.free)
        self.io.start()
        try:
            self.endpoint = ready.result(timeout=30)  # raises ConnectError if the bind failed
        except BaseException:
            self.io.join(5)
            self._waker.close()
            raise

    @property
    def broken(self) -> str | None:
        """Why the I/O thread died (a bug), or None: a broken transport fails every transfer."""
        return self.io.broken

    @property
    def bound(self) -> str:
        """What the ROUTER bound (``endpoint``: what peers are told)."""
        return self.sockets.bound

    # -- caller side (any thread) ----------------------------------------------------------
    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Called once at start-up, before peers send: the pool's byte regions, ids = positions."""
        views = [byte_view(t) for t in regions]
        with self._write_lock:
            self.regions.set(views)
            self.staging_pool.allocate(pin=not self.regions.all_host)
            self._sync.configure(views)
            self.grants.region_sizes = self.regions.size_list

    def descriptor(self) -> dict:
        return {"transport": self.name, "id": self.id, "endpoint": self.endpoint,
                "region_sizes": list(self.grants.region_sizes)}

    def admit(self, descriptor: dict) -> bytes:
        """Decode, before its HELLO to a prefill rank: that rank's transport (``descriptor["id"]``) may
        send here, presenting the returned token (b"" with ``admission`` "open"). Called again for
        the same id: a fresh token; messages of connections made with the old one are dropped."""
        sender = descriptor.get("id") if isinstance(descriptor, dict) else None
        try:
            return self.admissions.admit(sender)   # type: ignore[arg-type]  # checked there
        except ValueError as e:
            raise ConnectError(f"cannot admit {descriptor!r:.200}: {e}") from None

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        """Called by the sender at handshake (blocks briefly); returns the peer id for ``submit``.
        ``token``: what the receiver's ``admit`` gave for us (b"": the receiver admits anyone)."""
        endpoint = descriptor.get("endpoint") if isinstance(descriptor, dict) else None
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ConnectError(f"not a zmq descriptor (no tcp:// or ipc:// endpoint): {descriptor!r}")
        if not isinstance(token, bytes) or len(token) > MAX_TOKEN:
            raise ConnectError(f"an admission token is at most {MAX_TOKEN} bytes, got {type(token).__name__}")
        if self._closed or self.broken:
            raise ConnectError(f"cannot connect to {endpoint}: {self.broken or 'transport closed'}")
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.commands.put(Connect((endpoint, token), fut))
        try:
            return fut.result(timeout=self.options.connect_timeout + 30)
        except Exception as e:   # zmq refused the endpoint, no pong in time, or the thread ended
            raise ConnectError(f"cannot connect to {endpoint}: {e}") from e

    def disconnect(self, peer: str) -> None:
        """Fail the peer's open transfers ("disconnected") and close its DEALER (linger 0: zmq drops
        what is queued for it). Sources of frames zmq still held stay unreleased until zmq lets go
        of them (``fencing``). Idempotent; an unknown peer or a closed transport: no-op."""
        if self._closed or self.broken:
            return
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.commands.put(Call(self.sender.disconnect, (peer,), fut))
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
        return self.staging_pool.stats()

    def writes_pending(self, request_id: str) -> bool:
        """After ``forget``: True while a device copy of the request's bytes may still run."""
        return self._sync.busy(request_id)

    def fencing(self) -> dict:
        """Any thread (a snapshot): sender transfers that ended while zero-copy frames of theirs were
        still queued in zmq (``sources``, ``source_bytes``): their sources stay unreleased until zmq
        lets go of every frame (or the socket to a silent peer is closed with linger 0), whatever the
        receiver said. A receiver holds nothing here: it checks every frame against the live grants,
        so a late frame of an ended request is dropped."""
        return self.sender.fencing()

    def close(self) -> None:
        """Fail whatever is open, close the sockets and join the I/O thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.commands.put(Close())
        self.io.join(timeout=30)
        self._waker.close()
