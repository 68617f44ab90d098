"""Same-process transport: copies with the reference executor. The suite's reference.

Writes go through the receiver's ``GrantTable`` exactly as on a wire transport, so
tests that need no network still exercise the grant checks. The grant check and the copy
hold the receiver's write lock, as ``forget`` does: no byte lands after ``forget`` returns.

Admission (``LocalTransport(admission="required")``): as on a network transport, a receiver takes
writes only from senders its ``admit`` let in, connected with their current token; a sender
re-admitted since it connected is refused ("unknown peer").
"""
from __future__ import annotations

import queue
import threading
import uuid
import weakref
from collections.abc import Sequence

import torch

from kvxfer.copy import byte_view, copy_runs
from kvxfer.errors import ConfigError, ConnectError
from kvxfer.grant import GrantTable
from kvxfer.plan import TransferPlan
from kvxfer.transport.admission import Admissions
from kvxfer.transport.base import (
    DEFAULT_TIMEOUT,
    Arrival,
    TransferHandle,
    Transport,
    peer_failed,
)

_LIVE: "weakref.WeakValueDictionary[str, LocalTransport]" = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()


class LocalTransport(Transport):
    name = "local"

    def __init__(self, *, admission: str = "open", **_options):
        if admission not in ("open", "required"):
            raise ConfigError(f"admission {admission!r} must be 'open' or 'required'")
        self.admissions = Admissions(admission == "required")
        self.id = uuid.uuid4().hex
        self.regions: list[torch.Tensor] = []
        self.grants = GrantTable()
        self._arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._write_lock = threading.Lock()   # check + copy vs forget: none lands after forget
        self._closed = False
        self._peers: dict[str, str | None] = {}   # connected peer -> its admission of us (None: open)
        self._peers_lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE[self.id] = self

    def register(self, regions: Sequence[torch.Tensor]) -> None:
        views = [byte_view(t) for t in regions]
        with self._write_lock:
            self.regions = views
            self.grants.region_sizes = [r.numel() for r in views]

    def descriptor(self) -> dict:
        return {"transport": self.name, "id": self.id, "region_sizes": self.grants.region_sizes}

    def admit(self, descriptor: dict) -> bytes:
        try:
            return self.admissions.admit(descriptor.get("id"))
        except (ValueError, AttributeError) as e:
            raise ConnectError(f"cannot admit {descriptor!r:.200}: {e}") from None

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        peer_id = descriptor.get("id")
        with _LIVE_LOCK:
            dst = _LIVE.get(peer_id)
        if dst is None:
            raise ConnectError(f"local peer {peer_id!r} does not exist in this process")
        key = None
        if dst.admissions.required:
            key = dst.admissions.check(self.id, bytes(token))
            if key is None:
                raise ConnectError(f"local peer {peer_id} refused our admission token (it did not admit us, "
                                   f"or admitted us again since)")
        with self._peers_lock:
            self._peers[peer_id] = key
        return peer_id

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``: later submits to it fail. A local copy runs inside ``submit``, so no
        transfer is ever open here and no source is held. Idempotent; unknown peers: no-op."""
        with self._peers_lock:
            self._peers.pop(peer, None)

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle:
        handle = TransferHandle(request_id, plan.nbytes, timeout)
        with self._peers_lock:
            known, key = peer in self._peers, self._peers.get(peer)
        if not known:
            handle.finish(peer_failed(request_id, f"unknown peer {peer!r} (disconnected, or never connected)"))
            return handle
        with _LIVE_LOCK:
            dst = _LIVE.get(peer)
        if dst is None or dst._closed:
            handle.finish(peer_failed(request_id, f"local peer {peer} is closed"))
            return handle
        if dst.admissions.required and not dst.admissions.current(key):
            dst.grants.reject(request_id, "unknown peer: a sender whose admission was replaced or dropped")
            handle.finish(peer_failed(request_id, f"local peer {peer} no longer admits us"))
            return handle
        dst._receive(request_id, plan, self.regions, notify, handle, bytes(capability))
        return handle

    def _receive(self, request_id, plan, src_regions, notify, handle, capability: bytes = b"") -> None:
        runs = plan.runs()
        with self._write_lock:
            reason = self.grants.check(request_id, runs.dst_region, runs.dst_offset, runs.nbytes, capability)
            if reason is None:
                copy_runs(src_regions, self.regions, runs)
        if reason is None:
            self._arrivals.put(Arrival(request_id, plan.nbytes, True, "", notify))
            handle.finish()
        else:
            self._arrivals.put(Arrival(request_id, plan.nbytes, False, reason, notify))
            handle.finish(peer_failed(request_id, f"receiver rejected the write: {reason}"))

    def set_arrival_callback(self, fn) -> bool:
        """Not here: the submitter's thread writes, and would run the receiver's callback under
        the sender's locks. Poll ``arrivals()``."""
        return False

    def close(self) -> None:
        self._closed = True
