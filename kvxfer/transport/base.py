"""The transport contract, the grant table every receiver uses, and the plugin registry.

A transport moves the bytes of a ``TransferPlan`` from local regions into a peer's
regions. It knows regions, byte offsets and peers; never layers, heads or slots.

Who calls what, and when
------------------------
Both sides, once at start-up (may block briefly):
    ``register(regions)``   the pool's byte regions, in layout order (ids = positions).
    ``descriptor()``        plain data (msgpack/JSON-safe) the peer needs to reach us;
                            the control plane carries it in the handshake.
Decode (receiver), before its control-plane HELLO to each prefill rank (and again before each
re-handshake with it):
    ``admit(descriptor) -> token``  that rank's ``descriptor()`` from its registry record: the
                            peer with that descriptor's "id" may open a data path here. The token
                            (bytes, at most ``MAX_TOKEN``) goes to that rank inside decode's
                            signed HELLO. A fresh token each call; the id's older ones stop
                            working. Default: b"" (the transport binds nothing: every peer that
                            reaches it may connect, as before).
Prefill (sender), once per decode peer at handshake:
    ``connect(descriptor, token=b"") -> peer``
                            ``token``: what that decode rank's HELLO carried for this transport;
                            the transport presents it on its data path, so the receiver binds
                            the connection to the identity it admitted. A receiver that requires
                            admission refuses a data-path handshake whose id it did not admit
                            or whose token is not the id's latest: counted, nothing allocated
                            (no peer entry, no buffer, no endpoint), and the sender's
                            ``connect`` fails with ``ConnectError``. Which receivers require it
                            is each transport's option (UCX: ``admission``, required once
                            ``admit`` was called; zmq and local: ``admission="required"``, which
                            the endpoints set; zmq checks the token at the ZMTP handshake, so
                            nothing from anyone else is buffered).
Prefill, when a decode peer re-handshaked with a new epoch, or was lost:
    ``disconnect(peer)``    fails its transfers and frees what ``connect`` made for it.
Prefill, per chunk of a request (never blocks on the network):
    ``submit(peer, request_id, plan, timeout=..., notify=b"", capability=b"") -> TransferHandle``
    ``capability``: the grant's capability decode sent in its REQ (``expect`` below); every
    data message and completion of the transfer carries it. Empty: the grant has none.
    The handle is done when the receiver confirmed that every byte landed, failed
    with a reason (rejected, peer died) or timed out at its deadline. ``wait`` blocks
    at most until that deadline; ``poll`` never blocks. The source bytes may be reused
    once ``handle.source_released``: after a failure a transport may still hold them
    for a while (queued zero-copy frames, puts in flight).
Decode (receiver), per request:
    ``expect(request_id, ranges, capability=b"", senders=None)``  before the sender may write:
                                    the byte ranges the request's slot grant covers. Runs
                                    outside are rejected whole, counted and logged. ``capability``
                                    (``secrets.token_bytes(16)`` per grant, sent to the granted
                                    prefill rank in the REQ): data and completions without it
                                    are dropped without touching the request, counted, and
                                    answered as for an unknown id; a zero-byte completion
                                    without it completes nothing. ``senders``: the transport ids
                                    (``descriptor()["id"]``) of the peers that will write the
                                    request, when decode knows them; a transport that tells its
                                    senders of a grant ahead (UCX ``eager_writes``) tells only
                                    these. None: every connected peer. It never changes who may
                                    write: a peer not named is checked and admitted as before.
    ``arrivals()``                  completed (or rejected) incoming transfers; the
                                    control plane polls it. Never blocks for long.
    ``set_arrival_callback(fn)``    instead, once at start-up: the transport calls ``fn``
                                    per arrival on its own thread (no poller to wake).
    ``forget(request_id)``          the request ended: later writes are dropped.
    ``writes_pending(request_id)``  after forget: True while writes the sender issued before
                                    may still land (one-sided puts in flight). The grant's
                                    memory is reused only once it is False. Silence is not
                                    death: a peer that stopped answering keeps it True until
                                    its writes are proven flushed or impossible (``fencing``).
Both, any time: ``fencing() -> dict`` what is quarantined because a failed or silent peer could
still write it (receiver) or read it (sender): counts and bytes; see each transport.
Both, at the end: ``close()`` (idempotent).
Both, any time (never blocks): ``broken`` is None, or why the transport's I/O thread died of a
bug; a broken transport has failed every transfer it owned and fails every later one, so the
endpoint should report itself broken and deregister.

Network transports build on ``kvxfer.transport.kit`` (I/O thread, typed commands, staging, run
helpers, peer clock): a transport module holds only what is its own.

Transports are found through the ``kvxfer.transports`` entry-point group:
``get_transport("zmq")``. kvxfer never imports a transport module by name.
"""
from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..errors import PeerError, TransferTimeout
from ..grant import ByteRanges, GrantTable
from ..plan import TransferPlan

log = logging.getLogger("kvxfer.transport")


DEFAULT_TIMEOUT = 30.0
MAX_TOKEN = 64   # bytes of an admission token (``Transport.admit``)


class TransferStatus(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


class TransferHandle:
    """One submitted transfer. Thread-safe; completed once by the transport.

    ``source_released`` says the transport will never read the source bytes again, so the
    caller may reuse them. A transport that copies the source before ``submit`` returns, or
    reads it only until the handle is done, creates its handles with ``holds_source=False``
    (released == done). One that may still read the source after a failure (zero-copy frames
    queued in a socket, RMA puts in flight) passes ``holds_source=True`` and calls
    ``release_source()`` once nothing of it is referenced, for every handle, failed or not.
    """
    __slots__ = ("request_id", "nbytes", "deadline", "_claim", "_done", "_status", "_error", "started", "_released")
    _error: Exception | None

    def __init__(self, request_id: str, nbytes: int, timeout: float, *, holds_source: bool = False):
        self.request_id, self.nbytes = request_id, nbytes
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        # Two bare locks, not a threading.Event (~6x dearer to make and set, one per transfer):
        # ``_claim`` is taken by the one finish() that completes the handle, ``_done`` is held
        # until then (waiters take it and give it back at once).
        self._claim, self._done = threading.Lock(), threading.Lock()
        self._done.acquire()
        self._status, self._error = TransferStatus.PENDING, None
        self._released = None if holds_source else True   # None: the transport says when

    # -- transport side ----------------------------------------------------------------
    def finish(self, error: Exception | None = None, *, release: bool = False) -> bool:
        """Complete the handle; the first call wins (atomically, from any thread). Returns
        whether this call completed it. ``release``: the source was never read, or is no longer
        referenced (``release_source``)."""
        if release:
            self._released = True
        if not self._claim.acquire(False):
            return False
        self._status, self._error = (TransferStatus.DONE, None) if error is None else (TransferStatus.FAILED, error)
        self._done.release()
        return True

    def release_source(self) -> None:
        """The transport holds no reference to the source bytes any more (holds_source handles)."""
        self._released = True

    @property
    def source_released(self) -> bool:
        """Done or failed, and the transport will not read the source again: it may be reused."""
        return self.poll() != TransferStatus.PENDING and self._released is True

    # -- caller side --------------------------------------------------------------------
    def poll(self) -> TransferStatus:
        if self._status == TransferStatus.PENDING and time.monotonic() > self.deadline:
            self.finish(TransferTimeout(f"transfer for request {self.request_id} passed its deadline"))
        return self._status

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or failed (at most until the deadline); True when done."""
        limit = self.deadline - time.monotonic()
        if timeout is not None:
            limit = min(limit, timeout)
        if self._done.acquire(timeout=max(limit, 0)):
            self._done.release()
        return self.poll() == TransferStatus.DONE

    @property
    def error(self) -> Exception | None:
        self.poll()
        return self._error

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise the failure if any."""
        self.wait(timeout)
        if self._status == TransferStatus.PENDING:
            raise TransferTimeout(f"transfer for request {self.request_id} still running after {timeout}s")
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"TransferHandle({self.request_id!r}, {self._status.name}, {self.nbytes} bytes)"


class Arrival(NamedTuple):
    """A completed (ok) or rejected (not ok) incoming transfer, as the receiver saw it."""
    request_id: str
    nbytes: int
    ok: bool
    reason: str = ""
    notify: bytes = b""


def drain(q: "queue.SimpleQueue", timeout: float = 0.0) -> list:
    """Everything in ``q``, waiting up to ``timeout`` for the first item (``arrivals`` of every transport)."""
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        return out


class Transport(ABC):
    """Data plane of one rank. See the module docstring for the calling contract.

    Admission (who may open a data path to a receiver): the decode endpoint calls
    ``admit(prefill_descriptor)`` before its HELLO to that prefill rank and sends the token in the
    HELLO; the prefill endpoint passes it to ``connect(descriptor, token)``; the transport presents
    it on its data path. A receiver that requires admission refuses, counts and allocates nothing
    for a data-path handshake whose id it did not admit or whose token is not the id's latest, so
    sender ids are bound to the identity the control plane authenticated, never to whoever came
    first. ``admit`` returns b"" by default: such a transport binds nothing, and its ``connect``
    ignores the token.

    The receiving side's defaults below expect a subclass to keep ``grants`` (a
    ``GrantTable``), ``_arrivals`` (a queue of ``Arrival``) and ``_write_lock`` (held while a
    message is checked and written, so that no byte lands after ``forget`` returns), and to
    hand every arrival to ``_deliver``.
    """
    name: str = "?"
    grants: GrantTable
    _arrivals: "queue.SimpleQueue[Arrival]"
    _write_lock: threading.Lock
    _on_arrival: Callable[[Arrival], None] | None = None

    @abstractmethod
    def register(self, regions: Sequence[torch.Tensor]) -> None: ...

    @abstractmethod
    def descriptor(self) -> dict: ...

    @abstractmethod
    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        """Prefill, once per decode peer at handshake: reach the peer of ``descriptor``; ``token``: what
        that decode rank's HELLO carried for this transport (``admit``), presented on the data path."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer ``connect`` returned; without it every re-handshake leaks a peer.

        Who calls it, and when: the prefill endpoint, for a decode peer that handshaked again
        with a new epoch (before it connects the new descriptor: a transport may hand back the
        same key for the same descriptor) or whose rank was superseded by a live successor.

        What it does: every transfer to ``peer`` still open fails at once with a reason that
        names the disconnect; later ``submit`` calls to ``peer`` fail as for an unknown peer.
        The peer's sockets, endpoints and records are freed, but nothing that the network may
        still read or write is let go early: a source stays held (``source_released`` False)
        until the transport no longer reads it (queued zero-copy frames dropped, puts flushed
        or made impossible), and memory the peer could still write is released only once its
        writes are flushed or impossible. Blocks briefly (a round trip to the transport's I/O
        thread, never the network). Idempotent; an unknown peer (or a closed transport) is a
        no-op.
        """

    def admit(self, descriptor: dict) -> bytes:
        """Decode (receiver), before its HELLO to a prefill rank: that rank's ``descriptor()`` (from
        its registry record) may open a data path here. Returns a token (at most 64 bytes) the decode
        endpoint sends that rank inside its signed HELLO; the prefill rank hands it to
        ``connect(descriptor, token)``, which presents it on the data path, so the receiver binds the
        connection to the admitted identity. Called again for the same peer id, the old token stops
        working. b"": this transport binds nothing (the default)."""
        return b""

    @abstractmethod
    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle: ...

    def expect(self, request_id: str, ranges: ByteRanges, capability: bytes = b"",
               senders: frozenset[str] | None = None) -> None:
        self.grants.expect(request_id, ranges, capability)   # ``senders``: nobody is told ahead here

    def fencing(self) -> dict:
        """Memory held back because a failed or silent peer could still write it (receiver:
        requests, bytes) or read it (sender: transfers, bytes). Two-sided or local transports
        hold none here (zmq reports its queued zero-copy frames)."""
        return {"requests": 0, "bytes": 0, "sources": 0, "source_bytes": 0}

    def forget(self, request_id: str) -> bool:
        """End the grant. Waits out a message being written, so no byte of it lands afterwards."""
        with self._write_lock:
            return self.grants.forget(request_id)

    def writes_pending(self, request_id: str) -> bool:
        """After ``forget``: may bytes of this request still land? Never for a two-sided
        transport (its receiver writes every byte itself, and not after forget)."""
        return False

    def arrivals(self, timeout: float = 0.0) -> list[Arrival]:
        return drain(self._arrivals, timeout)

    def set_arrival_callback(self, fn: Callable[[Arrival], None]) -> bool:
        """Receiver, once before transfers arrive: call ``fn(arrival)`` on the transport's own
        thread for each arrival instead of queueing it for ``arrivals()`` (one thread wake-up
        less per transfer). ``fn`` must be quick and must never wait for this transport's
        thread (no ``connect`` or ``close`` inside). False: not supported, poll ``arrivals()``."""
        self._on_arrival = fn
        return True

    def _deliver(self, arrival: Arrival) -> None:
        fn = self._on_arrival
        if fn is None:
            self._arrivals.put(arrival)
            return
        try:
            fn(arrival)
        except Exception:   # the receiver's bug must not take the transport thread down
            log.exception("arrival callback failed for request %s", arrival.request_id)

    @abstractmethod
    def close(self) -> None: ...

    @property
    def rejected(self) -> Counter:
        """Rejected incoming writes by reason (keys: ``kvxfer.grant.Reason`` values only)."""
        return self.grants.rejected

    @property
    def broken(self) -> str | None:
        """None while the transport works; else why its I/O thread died (see the module docstring)."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def peer_failed(request_id: str, why: str) -> PeerError:
    return PeerError(f"request {request_id}: {why}")
