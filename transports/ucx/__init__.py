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

One transfer announced (S sender, R receiver, each on its own I/O thread; ``eager_writes=False``,
or a grant R did not pregrant)::

    S -> R  ANNOUNCE  request id, deadline, every destination run (one int64 array; packed runs
                      that continue each other at R as one), packed bytes inline when few
    R       GrantTable.check + region bounds; refused: FAIL to S, Arrival(ok=False);
            inline bytes land now; nothing else to come (no puts, no frames): ACK at once
    R -> S  GO        a data tag for the packed frames (host: R has posted their receives)
    S       puts (big runs cut in frames), packed frames (staged: as send-ring slots free),
            one ep flush per peer and turn
    S -> R  DONE      after the flush and the last frame, so every put is visible at R
    R       every frame received (in place; staged into small pieces here: into a receive-ring
            slot as one is free, re-checked against the grant and scattered), Arrival(ok=True)
    R -> S  ACK       only now is the handle DONE
By default (``eager_writes``) R pregrants each request at ``expect`` (``eager``): S, pregranted,
sends the ANNOUNCE and puts at once, without waiting for GO, and sends DONE once flushed (its handle
DONE then: the bytes are in R's memory); R checks the ANNOUNCE as above, tracks the transfer (its
deadline, S's death) and, at DONE, delivers its arrival and ACKs. No control round trip.

``UCXTransport`` is a facade over parts that each own their state and get their collaborators
in their constructor; every part but ``Planner`` and the any-thread reads works on the I/O thread.
Who calls whom (each part only calls parts below it)::

    UCXTransport -> Planner (submit), Join (connect), Admission (admit), Calls (register, disconnect),
                    Pregrants and Receiver (expect, forget), Landing and Pregrants (writes_pending),
                    Fencing (fencing), Inbox (rejected), Loop (a caller's turn: submit, expect, forget)
    Loop         -> Inbox, Receiver, Sender, EagerSends, Outbox, Rehandshake, Fencing, Lifecycle
    Inbox        -> Join (a front HELLO), Control (every checked message)
    Control      -> Receiver, Sender, Join, Rehandshake, Fencing, Pregrants, Landing, Outbox, Peers
    Join         -> Admission, Lifecycle, Peers, Workers, Outbox
    Admission    -> Fencing, Sender, Receiver, Peers
    Fencing      -> Sender, Receiver, Landing, Pregrants, Peers, Workers
    Lifecycle    -> Sender, Receiver, Rehandshake, Landing, EagerSends, Regions, Peers, Outbox
    Rehandshake  -> Sender, Outbox, Workers, Peers
    Receiver     -> Landing, Pregrants, Regions, Outbox;   Sender -> EagerSends, Regions, Outbox
    Pregrants, EagerSends -> Peers, Outbox;   Outbox -> Peers;   Regions -> Workers

Files: ``options`` (every option, checked), ``bindings`` (ctypes over libucp), ``protocol``
(control messages, validated once), ``state`` (the records: ``Peer``, ``Incoming``,
``Outgoing``), ``turn`` (the loop's turn, leftover requests, calls to the I/O thread),
``workers`` (contexts, workers, identity), ``regions`` (registration), ``peers`` (the peer table),
``outbox`` (control batches out), ``inbox`` (control batches in, routed by their tag), ``control``
(what each message does; the fencing rules), ``join`` (the front worker, connect), ``admission``,
``planner`` (a transfer prepared in the caller's thread), ``sender``, ``receiver``, ``landing``
(what may still land), ``frames`` (the staged frame cut), ``eager`` (pregrants, FENCEs),
``rehandshake``, ``fencing``, ``lifecycle`` (disconnect, shutdown), ``loop``, ``settings``
(thresholds, UCX settings), and this module (the contract).

Tests and diagnostics may read the parts through the transport's attributes (``peers``,
``sender``, ``receiver``, ``landing``, ``pregrants``, ``eager``, ``outbox``, ``regions``,
``workers``, ...) and run a function on the I/O thread with ``call_io``; a part's attributes and
methods without a leading underscore are its public names.

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

Threads: one I/O thread per transport (``kit.IOThread``) owns the worker. It loops while
something happens and sleeps on the worker's event fd otherwise (busy polling was 3-40x slower on
this 2-core machine whenever other processes ran). ``register``, ``connect`` and ``close`` hand
work to it and wait; ``submit`` plans and gathers in the caller's thread and never waits on a
peer. While the I/O thread sleeps, ``submit``, ``expect`` and ``forget`` do its part themselves,
holding its lock (``Loop.caller_turn``): ``submit`` posts its puts and progresses them, for at
most ``loop.CALLER_BUDGET`` more; otherwise they enqueue a command, signalling the worker only
when the I/O thread sleeps. So UCX calls, and the parts' state, belong to whichever thread holds
that lock, one at a time: where the parts say "on the I/O thread", read that. A thread that dies
of a bug fails every transfer it owned and marks the transport ``broken``. ``close()`` frees the
worker, context, endpoints and shared memory itself: nothing waits for the garbage collector.
"""
from __future__ import annotations

import atexit
import functools
import logging
import queue
import socket
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.copy import byte_view
from kvxfer.errors import ConfigError, PeerError, PlanError, TransportError
from kvxfer.grant import GrantTable
from kvxfer.plan import TransferPlan
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport
from kvxfer.transport.kit import Call, Close, CommandQueue, IOThread, StagingPool, Submit, fail_command

from .admission import Admission
from .bindings import frame_iovs
from .control import Control
from .eager import EagerSends, Pregrants
from .fencing import Fencing
from .inbox import Inbox
from .join import Join
from .landing import Landing
from .lifecycle import Lifecycle
from .loop import Loop
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers
from .planner import INLINE_BELOW, Planner
from .protocol import ABORT, ANNOUNCE, CTRL_TAG, DATA_BIT, DONE, FRAME_BITS, HELLO
from .receiver import Receiver
from .regions import Regions
from .rehandshake import Rehandshake
from .sender import Sender
from .settings import PUT_BELOW, PUT_BELOW_MANY, UCX_DEFAULTS, ucx_settings
from .turn import Calls, Leftovers, Turn
from .workers import Workers

__all__ = ["UCXTransport", "UCXOptions", "UCX_DEFAULTS", "PUT_BELOW", "PUT_BELOW_MANY", "INLINE_BELOW",
           "ucx_settings", "CTRL_TAG", "DATA_BIT", "FRAME_BITS", "HELLO", "ANNOUNCE", "DONE", "ABORT", "Array",
           "ucx_api", "frame_iovs"]

log = logging.getLogger("kvxfer.transport.ucx")


class UCXTransport(Transport):
    """UCX data plane of one rank. Options: keyword arguments (``get_transport("ucx", ...)``), or
    ``options=UCXOptions(...)``; each is documented (and checked: ``ConfigError``) in
    ``transports/ucx/options.py``."""
    name = "ucx"

    def __init__(self, options: UCXOptions | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise ConfigError(f"give ucx options as options= or as keywords, not both (keywords {sorted(kwargs)})")
        opts = self.options = options if options is not None else UCXOptions.of(kwargs)
        self.id = uuid.uuid4().hex
        self.grants = GrantTable()
        self._arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self.workers = workers = Workers(opts)   # UCX refused its settings: ConfigError / TransportError here
        self.turn, self.leftovers = turn, leftovers = Turn(), Leftovers()
        self.commands = commands = CommandQueue(workers.wake)
        self.io = IOThread(f"kvxfer-ucx-{self.id[:6]}", lambda: self.loop.run(), on_crash=self._crashed,
                           on_exit=lambda: self.loop.free())
        self.calls = calls = Calls(commands, self.io, turn)
        rings = (StagingPool(frames=opts.staging_frames, frame_bytes=opts.frame_bytes, name="ucx-send"),
                 StagingPool(frames=opts.staging_frames, frame_bytes=opts.frame_bytes, name="ucx-recv"))
        self.send_ring, self.recv_ring = rings
        self.regions = regions = Regions(workers, self.grants)
        self.peers = peers = Peers(opts, leftovers)
        self.outbox = outbox = Outbox(self.id, opts, peers, turn)
        self.pregrants = Pregrants(self.grants, peers, outbox, opts.pregrant_window_bytes,
                                   opts.pregrant_window_requests)
        self.eager = EagerSends(opts.few_runs, self.grants, peers, outbox, workers)
        self.landing = Landing(self.grants, leftovers)
        self.planner = Planner(opts, regions, workers, self.send_ring)
        self.sender = Sender(regions, workers, peers, outbox, self.eager, self.send_ring, leftovers, turn)
        self.receiver = Receiver(opts, self.grants, regions, workers, peers, self.landing, self.pregrants, outbox,
                                 self.recv_ring, leftovers, turn, self._deliver)
        self.rehandshake = Rehandshake(self.sender, outbox, workers, peers)
        self.lifecycle = Lifecycle(opts, workers, regions, peers, outbox, self.sender, self.receiver, self.landing,
                                   self.eager, self.rehandshake, commands, leftovers, turn)
        self.fence = Fencing(self.id, opts, self.grants, workers, peers, self.sender, self.receiver, self.landing,
                             self.pregrants)
        self.admission = Admission(self.id, opts, peers, self.fence, self.sender, self.receiver, calls)
        self.join = Join(self.id, opts, self.grants, workers, peers, outbox, self.admission, self.lifecycle, calls)
        self.control = Control(opts, self.grants, workers, outbox, self.sender, self.receiver, self.landing,
                               self.pregrants, self.rehandshake, self.fence, self.join, peers)
        self.inbox = Inbox(self.id, opts, self.grants, workers, peers, self.join, self.control, leftovers, turn)
        self.loop = Loop(opts, commands, calls, turn, workers, peers, outbox, self.inbox, self.sender, self.eager,
                         self.receiver, self.landing, self.rehandshake, self.fence, self.lifecycle, leftovers, rings)
        self._closed = False
        self.io.start()
        _LIVE.add(self)

    @property
    def broken(self) -> str | None:
        """Why the I/O thread died (a bug), or None: a broken transport fails every transfer."""
        return self.io.broken

    # ---- called from user threads ---------------------------------------------------------
    def call_io(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(*args)`` on the I/O thread and wait for its result: for tests and diagnostics,
        which read or change the parts there (every part but ``planner`` is the I/O thread's)."""
        return self.calls.call(fn, *args)

    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Both sides, once, before descriptor(): map every region for RMA (blocks briefly), and
        allocate the staging rings on the regions' CUDA device (host rings: at first use)."""
        self.calls.call(self.regions.register, [byte_view(t) for t in regions])
        cuda = [t.device for t in self.regions.tensors if t.is_cuda]
        if cuda:   # on the I/O thread, whose streams use them; and no caller's turn (``loop``)
            self.loop.callers = False
            for ring in (self.send_ring, self.recv_ring):
                self.calls.call(ring.allocate, False, cuda[0])

    def memory_types(self) -> list[str]:
        """What UCX registered each region as ("host", "cuda", ...; "" for an empty region)."""
        return self.calls.call(self.regions.memory_types)

    def staging(self) -> dict:
        """Any thread: each staging ring's frames, in use, peak and waits (``send``, ``recv``; for
        both also ``held`` slots and the ``spill`` frames standing in for them)."""
        return {"send": {**self.send_ring.stats(), **self.sender.spill.stats()},
                "recv": {**self.recv_ring.stats(), **self.receiver.spill.stats()}}

    def descriptor(self) -> dict:
        """Plain JSON-safe data a peer needs: the front worker's address (``join``), region
        addresses, sizes, rkeys, where this process runs and its shared-memory settings."""
        w, r = self.workers, self.regions
        return {"transport": self.name, "id": self.id, "address": w.front_address.hex(),
                "hostname": socket.gethostname()[:255], "host": w.host_id,
                "region_base": [int(b) for b in r.base], "region_sizes": list(self.grants.region_sizes),
                "rkeys": [k.hex() for k in r.rkeys_packed], "shm_settings": w.shm_settings}

    def admit(self, descriptor: dict) -> bytes:
        """Receiver, any thread: the peer with ``descriptor["id"]`` may join (``admission``)."""
        return self.admission.admit(descriptor)

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        """Sender, once per receiver: join it and make our data endpoint to it (``join``)."""
        return self.join.connect(descriptor, token)

    def disconnect(self, peer: str) -> None:
        """Sender or receiver: end ``peer`` (an id from connect(), or a sender of ours). Its
        transfers fail now, with a reason; its endpoint, rkeys and records go once nothing it
        could still write here, and no put of ours that reads a source, is left (see
        ``lifecycle``). Idempotent; an unknown peer is a no-op; connect() may follow."""
        if self._closed or self.broken or not self.io.alive:
            return
        self.calls.call(self.lifecycle.disconnect, str(peer))

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle:
        """Sender, per chunk: plans runs and gathers packed ones here; never waits on a peer. While
        the I/O thread sleeps, starts the transfer here too (``Loop.caller_turn``): returns done
        when its puts were flushed within ``loop.CALLER_BUDGET``. ``capability``: the grant's
        (decode's REQ); the ANNOUNCE carries it."""
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        p = self.peers.get(peer)
        why = (f"transport is broken: {self.broken}" if self.broken else "transport closed" if self._closed
               else f"peer {peer!r} is not connected" if p is None or p.sizes is None or p.closing
               else f"peer {peer} is silent (dead or stalled)" if p.gone else None)
        if why:
            handle.finish(PeerError(f"request {request_id}: {why}"), release=True)
            return handle
        assert p is not None
        try:
            out = self.planner.prepare_transfer(p, handle, plan, bytes(notify), bytes(capability))
        except (PlanError, TransportError) as e:
            handle.finish(e, release=True)
            return handle
        if self.loop.caller_turn(lambda: self.sender.start_out(out),   # the I/O thread sleeps: start it here
                                 lambda: out.state == "flushing"):
            return handle
        self.commands.put(Submit(peer, request_id, out, handle))
        if self.broken and not self.io.alive:   # died meanwhile: nobody will take the command
            fail_command(Submit(peer, request_id, None, handle), self.broken)
        return handle

    def expect(self, request_id: str, ranges, capability: bytes = b"", senders: frozenset[str] | None = None) -> None:
        """Receiver: grant ``ranges`` to the request; with ``eager_writes`` its PREGRANTs go to
        ``senders`` only when given, sent from here while the I/O thread sleeps (a caller's turn),
        else by that thread next. Never waits for it: decode calls this under its own lock, which
        an arrival callback on the I/O thread may be waiting for (a caller's turn takes its lock
        only when free, and leaves arrivals to it)."""
        super().expect(request_id, ranges, capability)
        if self.options.eager_writes and not self._closed and not self.broken:
            args = (request_id, None if senders is None else frozenset(senders))
            if not self.loop.caller_turn(lambda: self.pregrants.pregrant(*args)):   # sent before we return
                self.commands.put(Call(self.pregrants.pregrant, args))

    def forget(self, request_id: str) -> bool:
        """Receiver: the request ended; its transfers in flight fail, later writes are dropped
        (done here while the I/O thread sleeps, as ``expect``'s PREGRANTs). Its FENCEs are lazy:
        they leave with the next batch to each peer, or at the loop's next tick (``Outbox``)."""
        if self.options.eager_writes:   # writes_pending until its pregranted peers said FENCED (``eager``)
            self.pregrants.queue(request_id)
        live = self.grants.forget(request_id)
        if not self._closed and not self.broken and not self.loop.caller_turn(
                lambda: self.receiver.drop_request(request_id)):
            self.commands.put(Call(self.receiver.drop_request, (request_id,)))
        return live

    def writes_pending(self, request_id: str) -> bool:
        """Decode's endpoint, any thread, after ``forget``: True while a sender that had GO for this
        request has not proven its puts flushed (DONE or ABORT after its flush, or a re-handshake),
        or frames posted into the grant are not done, and the sender is not proven dead. A silent
        sender keeps it True (silence is not death); see ``fencing()``. Until it is False the
        grant's memory must not be reused. Transfers of the request still open here count too:
        ``forget`` fails them on the I/O thread a moment later. Eager: until FENCED (``eager``)."""
        return self.landing.pending(request_id) or self.pregrants.pending(request_id)

    def fencing(self) -> dict:
        """Any thread: what is held because a failed or silent peer could still write or read it
        (``Fencing.snapshot``), and ``rehandshakes``: HELLOs with a new epoch we sent (``Rehandshake``)."""
        return {**self.fence.snapshot(), "rehandshakes": self.rehandshake.count}

    @property
    def rejected(self) -> Counter:
        """Rejected incoming writes and messages by reason (``Inbox.rejected``)."""
        return self.inbox.rejected()

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

    def _crashed(self, why: str) -> None:
        """The loop died of a bug (``IOThread.on_crash``): every transfer it owned fails."""
        self._closed = True
        self.lifecycle.shutdown(why)

    def _deliver(self, arrival: Arrival) -> None:   # after the turn's sends: a woken reader would take the GIL
        self.turn.later.append(functools.partial(super()._deliver, arrival))

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
