"""UCX transport: one-sided put for runs, tagged iov frames for packed runs, tagged control.

Mechanism, by measurement (scripts/bench_transport.py, scripts/bench_ucx.py): runs are written
with ``ucp_put_nbx`` through the ``libucp`` bundled with ``ucxx`` (on the handles ucxx creates),
a transfer's puts in one call (``hotpath.c``); nothing is posted by the receiver. Runs shorter
than ``PUT_BELOW`` are packed instead: their bytes, back to back, travel as tagged
frames of at most ``frame_bytes``. Near peers in host memory: a frame is a UCX iov on both
sides (``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx`` with ``ucp_dt_make_iov``): the sender sends
from the source runs and the receiver posts its receive into the granted destination runs, so
neither gathers nor scatters. CUDA memory, and host memory to peers reached over the network
(``stage_host``), is *staged* (``frames``): frames of whole runs, gathered one by one into a
fixed ring of ``staging_frames`` slots. The receiver takes them into a ring of its own and
scatters each frame as it lands (a host receiver with ``stage_host="never"`` posts them in
place: iovs cut the same way). A transfer of any size takes at most the rings. Control
messages (``protocol``) are batched per peer and loop turn into one tagged message.

One transfer (S sender, R receiver, each on its own I/O thread)::

    S -> R  ANNOUNCE  request id, deadline, every destination run (one int64 array; packed runs
                      that continue each other at R as one), packed bytes inline when few
    R       GrantTable.check + region bounds; refused: FAIL to S, Arrival(ok=False);
            inline bytes land now; nothing else to come (no puts, no frames): ACK at once
    R -> S  GO        a data tag for the packed frames (host: R has posted their receives)
    S       puts (big runs cut in frames), packed frames (staged: as send-ring slots free),
            one ep flush per peer and turn
    S -> R  DONE      after the flush and the last frame, so every put is visible at R
    R       every frame received (in place; staged: into a receive-ring slot as one is free,
            re-checked against the grant and scattered), Arrival(ok=True)
    R -> S  ACK       only now is the handle DONE
With ``eager_writes`` R pregrants each request at ``expect`` (``eager``): S, pregranted, puts at
once, then sends the ANNOUNCE as DONE once flushed (its handle DONE then); R checks it and ACKs.

Files: ``bindings`` (ctypes over libucp), ``protocol`` (control messages, validated once),
``sender``, ``receiver``, ``frames`` (the staged frame cut), ``control`` (peers, control batches,
heartbeats), ``fencing``, ``eager`` (pregrants, FENCEs), ``settings`` (thresholds, UCX settings),
``join`` (the front worker, connect, admission), ``inbox`` (control batches in, routed by their
tag), ``lifecycle`` (start-up, shutdown), ``state`` (records), ``options`` (every option,
checked), and this module (the contract, the I/O loop).

Trust model: R checks every announced run before it answers GO, so an honest sender (even one
with a wrong plan) never writes outside a grant (``eager_writes``: S checks its PREGRANT's ranges). A
*malicious* peer holding the rkeys of our ``descriptor()`` can put anywhere inside the regions
given to ``register()`` (nothing else) without announcing: give descriptors only to peers
trusted with the whole pool, as with NIXL or any RDMA transport. Control batches carry a
per-peer channel secret (``protocol``), so a third party cannot send DONE, ABORT, FAIL or
FENCED in another peer's name. Caps (``options``) bound the control message size, incoming
transfers per peer and in total, and peers.

Liveness: endpoints have error handling OFF (on, it excludes shared memory: ~10x slower), so a
dead peer raises nothing, except for a peer in another host or network namespace reached through
``FAR_TLS`` (no shared memory to lose): there both endpoints have it on (``Peer.err``; HELLO
says so), a connection that fails (its process died: TCP reset) is reported, its transfers fail
at once and what it held is released (``fencing``). Each side pings its peers every
``heartbeat`` s; a peer silent for ``peer_timeout`` s fails its transfers; every transfer also
fails at its deadline, on both sides. Silence is not death: memory a silent peer could still
write or read stays held (``writes_pending``, ``source_released``) until it is proven flushed or
impossible; see ``control`` ("Fencing") and ``fencing()``. Without error handling UCX's
single-copy shared-memory transport (cma) abort()s the process when it touches a dead peer: the
UCS log hook in ``bindings`` turns that into a failed call.

Peers: a peer joins through the front worker our descriptor names (TCP, tags only): its HELLO
is checked before anything is made for it, and only then does it learn our data worker's
address (``join``). ``connect`` waits for a round trip over the data endpoint (``connect_timeout``), so an
address that does not reach fails there, by name. A peer whose descriptor says it is on another
host or in another network namespace is reached through a second worker without shared memory
and cma (``settings.FAR_TLS``; the user's own TLS setting wins); each connection's transports
are logged. ``disconnect`` ends one peer and frees it once fencing allows (``lifecycle``).

Threads: one I/O thread per transport (``kit.IOThread``) owns the worker and makes every UCX
call. It loops while something happens and sleeps on the worker's event fd otherwise (busy
polling was 3-40x slower on this 2-core machine whenever other processes ran). ``register``,
``connect`` and ``close`` hand work to it and wait; ``submit`` plans and gathers in the caller's
thread, enqueues, and never waits on the network; it signals the worker only when the I/O thread
sleeps. A thread that dies of a bug fails every transfer it owned and marks the transport
``broken``. ``close()`` frees the worker, context, endpoints and shared memory itself: nothing
waits for the garbage collector.
"""
from __future__ import annotations

import atexit
import collections
import functools
import itertools
import logging
import os
import queue
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.copy import byte_view
from kvxfer.errors import ConfigError, PeerError, PlanError, TransportError
from kvxfer.grant import GrantTable
from kvxfer.plan import TransferPlan
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport
from kvxfer.transport.kit import Call, Close, CommandQueue, IOThread, StagingPool, Submit, fail_command

from . import bindings as ucp
from .admission import UCXAdmission
from .bindings import frame_iovs
from .control import UCXControl, host_identity, process_start
from .eager import UCXEager
from .fencing import UCXFencing
from .frames import RingSpill, network_only
from .inbox import UCXInbox
from .join import UCXJoin, make_front
from .lifecycle import UCXLifecycle
from .loop import UCXLoop
from .options import UCXOptions
from .protocol import ABORT, ANNOUNCE, CTRL_TAG, DATA_BIT, DONE, FRAME_BITS, HELLO
from .receiver import UCXReceiver
from .sender import INLINE_BELOW, UCXSender
from .settings import (
    PUT_BELOW,
    PUT_BELOW_MANY,
    UCX_DEFAULTS,
    shared_memory_settings,
    tls_explicit,
    ucx_settings,
    with_tcp_defaults,
)
from .state import Incoming, Outgoing, Peer

__all__ = ["UCXTransport", "UCXOptions", "UCX_DEFAULTS", "PUT_BELOW", "PUT_BELOW_MANY", "INLINE_BELOW", "ucx_settings",
           "CTRL_TAG", "DATA_BIT", "FRAME_BITS", "HELLO", "ANNOUNCE", "DONE", "ABORT", "Array", "ucx_api", "frame_iovs"]

log = logging.getLogger("kvxfer.transport.ucx")

class UCXTransport(UCXLoop, UCXLifecycle, UCXAdmission, UCXJoin, UCXInbox, UCXControl, UCXFencing, UCXEager,
                   UCXSender, UCXReceiver, Transport):
    """UCX data plane of one rank. Options: keyword arguments (``get_transport("ucx", ...)``), or
    ``options=UCXOptions(...)``; each is documented (and checked: ``ConfigError``) in
    ``transports/ucx/options.py``."""
    name = "ucx"

    def __init__(self, options: UCXOptions | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise ConfigError(f"give ucx options as options= or as keywords, not both (keywords {sorted(kwargs)})")
        opts = self.options = options if options is not None else UCXOptions.of(kwargs)
        tls, ucx_config = opts.tls, opts.ucx_config
        self.stage_host, self.eager_writes = opts.stage_host, opts.eager_writes
        self.admission, self._admission_on = opts.admission, False
        self._admitted: collections.OrderedDict[str, bytes] = collections.OrderedDict()   # id -> token
        self._admit_lock = threading.Lock()
        config = with_tcp_defaults(ucx_settings(tls, ucx_config, os.environ), os.environ)
        self._shm_settings = shared_memory_settings(config, os.environ)
        self.id = uuid.uuid4().hex
        self.frame_bytes, self.put_below, self.put_below_many = opts.frame_bytes, opts.put_below, opts.put_below_many
        self.few_runs, self.heartbeat, self.peer_timeout = opts.few_runs, opts.heartbeat, opts.peer_timeout
        self.max_control_bytes, self.max_incoming = opts.max_control_bytes, opts.max_incoming
        self.max_incoming_per_peer, self.max_peers = opts.max_incoming_per_peer, opts.max_peers
        self.fence_grace, self.connect_timeout = opts.fence_grace, opts.connect_timeout
        self.quarantine_timeout = opts.quarantine_timeout
        self._host_id, self._pid = host_identity(), os.getpid()
        self._start_ticks = process_start(self._pid) or 0
        self._fence_released = self._fence_expired = 0
        try:   # UCX's own errors end here, mapped into the tree
            self._ctx = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.RMA,
                                                                  ucx_api.Feature.WAKEUP))
            self._worker = ucx_api.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()  # so the idle I/O thread can sleep on the worker fd
            # The front worker: what descriptor() names; it takes one HELLO per peer (``join``).
            self._front_ctx, self._front_worker = make_front(config, config.get("TLS") if tls_explicit(
                tls, ucx_config, os.environ) else None)
        except (ucx_api.UCXConfigError, ucx_api.UCXInvalidParamError) as e:
            raise ConfigError(f"UCX refused the settings {config} (ucx options tls and ucx_config, defaults, and "
                              f"UCX_* in the environment; UCX's log says which): {type(e).__name__}: {e}") from e
        except ucx_api.UCXError as e:
            raise TransportError(f"cannot start a UCX transport with the settings {config}: "
                                 f"{type(e).__name__}: {e}") from e
        self._whandle, self._address = self._worker.handle, self._worker.address.tobytes()
        # A second worker (FAR_TLS: no shared memory, no cma), made at the first peer on another
        # host or network namespace; the I/O thread progresses and sleeps on both.
        self._config, self._tls_explicit = config, tls_explicit(tls, ucx_config, os.environ)
        self._far_ctx = self._far_worker = None
        self._far_address = b""
        self._workers = [self._worker, self._front_worker]
        self._poller, self._polled = None, 0   # ``lifecycle._idle``
        self.grants = GrantTable()
        self._regions: list[torch.Tensor] = []
        self._base, self._base_list, self._region_sizes = np.zeros(0, np.int64), [], np.zeros(0, np.int64)
        self._is_host, self._host_list, self._host_views, self._all_host = np.zeros(0, bool), [], [], True
        self._cuda_devices: set[torch.device] = set()
        self._memh: list[int | None] = []
        self._params: list[ucp.RequestParam] = []
        self._put_params = self._put_params_far = ucp.EMPTY_TABLE   # see register()
        self._rkeys_packed: list[bytes] = []
        self._peers: dict[str, Peer] = {}
        self._by_tag: dict[int, Peer] = {}   # control tag -> the peer whose batches carry it (``join``)
        self._retired_tags: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._junk: collections.Counter = collections.Counter()   # messages dropped unread, by why (``rejected``)
        self._out: dict[int, Outgoing] = {}
        self._in: dict[tuple[str, int], Incoming] = {}
        self._by_dtag: dict[int, Incoming] = {}   # data tag (random: ``receiver._on_announce``) -> transfer
        self._unflushed: dict[str, list] = {}   # puts issued this turn, per peer
        self._flushing: list = []               # flushed, DONE not sent yet
        self._holding: list = []                # failed with puts maybe in flight: source not released
        self._ctrl_sends: list = []  # (request, buffer): buffers live until sent
        self._ctrl_recvs: list = []  # (request, buffer, length, peer or None: front) in arrival order
        self._ctrl_bytes, self._ctrl_waiting, self._front_inflight = 0, set(), 0   # ``inbox`` budgets (bytes)
        self._zombies: list = []     # requests of ended transfers that still own buffers
        # Receiver: ended transfers whose sender had GO, so puts of theirs may still land, until
        # its DONE or ABORT (sent once its puts are flushed), its re-handshake, or proof that it
        # is dead (never its silence): (peer, xid) -> (rid, nbytes, since).
        self._landing: dict[tuple[str, int], tuple[str, int, float]] = {}
        self._landing_rids: collections.Counter = collections.Counter()
        self._open_rids: collections.Counter = collections.Counter()   # request id -> open incoming transfers
        # Receiver: ended transfers whose posted frame receives may still land:
        # (peer, rid, frames, nbytes, since).
        self._draining: list = []
        # Eager writes (``eager``): request id -> peers pregranted; forgotten -> (peers yet to say
        # FENCED, since); forgotten, not yet fenced by the I/O thread (any thread adds).
        self._pregrants: dict[str, set[str]] = {}
        self._fences: dict[str, tuple[set[str], float]] = {}
        self._fence_queued: set[str] = set()
        self._fence_flushing: list[Peer] = []
        self._parked, self._park_order = {}, collections.deque()   # waiting for a PREGRANT (``eager._park``)
        self._closing: list[Peer] = []   # disconnected, freed once nothing of them is held
        # Channel secret and epoch of disconnected peers (at most max_peers), for a later connect.
        self._retired: collections.OrderedDict[str, tuple[bytes, int]] = collections.OrderedDict()
        # Peers whose error-handling endpoint UCX closed (failure) or we closed, queued by the close
        # callback for the I/O loop (``UCXFencing._check_failed``); stale ones are skipped there.
        self._failed_eps: collections.deque = collections.deque(maxlen=4 * opts.max_peers)
        self._xids = itertools.count(1)
        self.commands = CommandQueue(self._wake)
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._later: list[Callable[[], object]] = []   # see _deliver
        self._flush_param = ucp.RequestParam()
        self._far_put_param = ucp.RequestParam(op_attr_mask=ucp.OP_ATTR_MULTI_SEND)   # see register()
        self._staging = StagingPool(frames=opts.staging_frames, frame_bytes=self.frame_bytes, name="ucx-send")
        self._rx_ring = StagingPool(frames=opts.staging_frames, frame_bytes=self.frame_bytes, name="ucx-recv")
        self._spill = RingSpill(self.frame_bytes)   # frames standing in for held ring slots (``frames``)
        # UCX_TLS in the environment counts too: UCX reads it where the config sets none
        self._network_only = network_only(config.get("TLS") or os.environ.get("UCX_TLS", ""))
        self._closed = self._stop = self._sleeping = False
        self._next_tick, self._acts = 0.0, 0
        self.io = IOThread(f"kvxfer-ucx-{self.id[:6]}", self._loop, on_crash=self._crashed, on_exit=self._exit)
        self.io.start()
        _LIVE.add(self)

    @property
    def broken(self) -> str | None:
        """Why the I/O thread died (a bug), or None: a broken transport fails every transfer."""
        return self.io.broken

    # ---- called from user threads ---------------------------------------------------------
    def _call(self, fn, *args):
        """Run ``fn`` on the I/O thread and wait for it (start-up and shutdown only)."""
        if self._stop or self.broken:
            raise TransportError(f"UCX transport is {'broken: ' + self.broken if self.broken else 'closed'}")
        fut: Future = Future()
        self.commands.put(Call(fn, args, fut))
        return fut.result(timeout=60)

    def _wake(self) -> None:
        """After queueing a command: signal the worker if the I/O thread sleeps (or is about to).

        The thread sets ``_sleeping`` before its last look at the queue, so a command queued
        while the flag is unset is seen by that look, and one queued later sees the flag."""
        h = self._whandle
        if self._sleeping and h is not None:
            ucp.worker_signal(h)

    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Both sides, once, before descriptor(): map every region for RMA (blocks briefly), and
        allocate the staging rings on the regions' CUDA device (host rings: at first use)."""
        self._call(self._do_register, [byte_view(t) for t in regions])
        cuda = [t.device for t in self._regions if t.is_cuda]
        if cuda:   # on the I/O thread, whose streams use them
            for ring in (self._staging, self._rx_ring):
                self._call(ring.allocate, False, cuda[0])

    def staging(self) -> dict:
        """Any thread: each staging ring's frames, in use, peak and waits (``send``, ``recv``; for
        ``recv`` also ``held`` slots and the ``spill`` frames standing in for them)."""
        return {"send": self._staging.stats(), "recv": {**self._rx_ring.stats(), **self._spill.stats()}}

    def _exit(self) -> None:   # IOThread.on_exit: the UCX objects, then the receive ring
        self._free()
        self._rx_ring.clear()

    def descriptor(self) -> dict:
        """Plain JSON-safe data a peer needs: the front worker's address (``join``), region
        addresses, sizes, rkeys, where this process runs and its shared-memory settings."""
        return {"transport": self.name, "id": self.id, "address": self._front_worker.address.tobytes().hex(),
                "hostname": socket.gethostname()[:255], "host": self._host_id,
                "region_base": [int(b) for b in self._base], "region_sizes": list(self.grants.region_sizes),
                "rkeys": [k.hex() for k in self._rkeys_packed], "shm_settings": self._shm_settings}

    def disconnect(self, peer: str) -> None:
        """Sender or receiver: end ``peer`` (an id from connect(), or a sender of ours). Its
        transfers fail now, with a reason; its endpoint, rkeys and records go once nothing it
        could still write here, and no put of ours that reads a source, is left (see
        ``lifecycle``). Idempotent; an unknown peer is a no-op; connect() may follow."""
        if self._closed or self.broken or not self.io.alive:
            return
        self._call(self._do_disconnect, str(peer))

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle:
        """Sender, per chunk: plans runs and gathers packed ones here; never waits on the network.
        ``capability``: the grant's (decode's REQ); the ANNOUNCE carries it."""
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        p = self._peers.get(peer)
        why = (f"transport is broken: {self.broken}" if self.broken else "transport closed" if self._closed
               else f"peer {peer!r} is not connected" if p is None or p.sizes is None or p.closing
               else f"peer {peer} is silent (dead or stalled)" if p.gone else None)
        if why:
            handle.finish(PeerError(f"request {request_id}: {why}"), release=True)
            return handle
        try:
            out = self._prepare_transfer(p, handle, plan, bytes(notify), bytes(capability))
        except (PlanError, TransportError) as e:
            handle.finish(e, release=True)
            return handle
        self.commands.put(Submit(peer, request_id, out, handle))
        if self.broken and not self.io.alive:   # died meanwhile: nobody will take the command
            fail_command(Submit(peer, request_id, None, handle), self.broken)
        return handle

    def expect(self, request_id: str, ranges, capability: bytes = b"", senders: frozenset[str] | None = None) -> None:
        """Receiver: grant ``ranges`` to the request; with ``eager_writes`` the I/O thread sends
        its PREGRANTs next, to ``senders`` only when given (never waited for here: decode calls
        this under its own lock, which an arrival callback on the I/O thread may be waiting for)."""
        super().expect(request_id, ranges, capability)
        if self.eager_writes and not self._closed and not self.broken:
            self.commands.put(Call(self._pregrant, (request_id, None if senders is None else frozenset(senders))))

    def forget(self, request_id: str) -> bool:
        """Receiver: the request ended; its transfers in flight fail, later writes are dropped."""
        if self.eager_writes:   # writes_pending until its pregranted peers said FENCED (``eager``)
            self._fence_queued.add(request_id)
        live = self.grants.forget(request_id)
        if not self._closed and not self.broken:
            self.commands.put(Call(self._drop_request, (request_id,)))
        return live

    def close(self) -> None:
        """Fail what is in flight, say BYE, free every UCX resource (worker, context, endpoints,
        shared memory) now, not when the garbage collector finds this object. Idempotent."""
        if self._closed:
            return
        self._closed = True  # submit() refuses from here on
        if not self.broken and self.io.alive:
            self.commands.put(Close())
        self.io.join(timeout=10)
        _LIVE.discard(self)

    def _deliver(self, arrival: Arrival) -> None:   # after the turn's sends: a woken reader would take the GIL
        self._later.append(functools.partial(super()._deliver, arrival))

    def __del__(self):
        if not getattr(self, "_closed", True):
            log.warning("UCXTransport %s was garbage-collected without close()", self.id[:8])


_LIVE: "weakref.WeakSet[UCXTransport]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Close transports the program forgot: ucxx's destructors could spin on a dead peer at exit."""
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:
            log.exception("closing a UCX transport at exit")
