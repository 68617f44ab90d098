"""Decode's per-request record: ``KVReceiver`` (one per request, made by
``DecodeEndpoint.receiver``), what each prefill source of it delivered (``Progress``), and the
checks a chunk's metadata passes before it counts (``chunk_problem``). Bookkeeping only: the
endpoint (``kvxfer.endpoint.decode``) holds its lock around every call here.
"""
from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np

from ..control.messages import Room
from ..control.wire import ChunkMeta
from ..topology import aux_source
from .base import EndpointBase, Outcome, RequestBase


class ReceiverHost(EndpointBase):
    """What a ``KVReceiver`` calls on its endpoint (``DecodeEndpoint`` is the one)."""

    @abc.abstractmethod
    def init_request(self, r: "KVReceiver", kv_slots, prefix_len: int, state_slots, aux_slot,
                     swa_slots=None) -> None:
        """The body of ``KVReceiver.init``."""


class Progress:
    """What one prefill source of one receiver has delivered. ``expected``: the bytes decode
    granted that source (computed at ``init`` from decode's own layout, never from what prefill
    declares; -1 before ``init``); the source is complete only when exactly that many landed."""
    __slots__ = ("chunks", "nbytes", "total", "total_bytes", "expected")

    def __init__(self) -> None:
        self.chunks: set[int] = set()
        self.nbytes, self.total, self.total_bytes, self.expected = 0, -1, -1, -1

    def complete(self) -> bool:
        return (self.expected >= 0 and self.total >= 0 and len(self.chunks) == self.total
                and self.nbytes == self.expected == self.total_bytes)


class Pending:
    """``init``'s checked arguments, kept while the request waits for its prefill instance (its
    first handshake, or a lost rank's new one) before anything is granted."""
    __slots__ = ("kv", "prefix", "state", "aux_slot", "swa_slots")

    def __init__(self, kv: np.ndarray, prefix: int, state: np.ndarray, aux_slot: int | None, swa_slots):
        self.kv, self.prefix, self.state, self.aux_slot, self.swa_slots = kv, prefix, state, aux_slot, swa_slots


class KVReceiver(RequestBase):
    """One request on a decode rank; made by ``DecodeEndpoint.receiver`` (see the module docstring).

    Success only when every source (prefill rank x stage x head slice, per ``kvxfer.topology``)
    delivered all its chunks and exactly the bytes ``init`` granted it (counted from decode's own
    layout; a source declaring another total fails the request), and the aux row if one was asked
    for. Besides ``RequestBase``'s attributes: ``gen``, ``request_id`` (``f"{room}.{gen}"``, the
    transport's name for it), ``instance`` (the prefill instance it pulls from), ``granted``
    (``init`` granted the slots), ``aux_slot`` and ``aux`` (the aux bytes that arrived, None
    before), ``acked`` (the prefill ranks that acknowledged)."""
    endpoint: "ReceiverHost"
    __slots__ = ("gen", "request_id", "instance", "contacts", "peer_of", "progress", "acked", "aux_slot", "aux",
                 "aux_from", "granted", "pending")

    def __init__(self, ep: "ReceiverHost", room: Room, gen: int, instance,
                 on_release: Callable[[Outcome], None] | None):
        super().__init__(ep, room, ep.clock() + ep.timeouts.bootstrap, on_release)
        self.gen, self.request_id = gen, f"{room}.{gen}"   # request_id: the transport's name for it
        self.instance = instance
        self.contacts: dict[str, list] = {}   # prefill peer key -> its sources here (empty: dummy); see bind
        self.peer_of: dict[tuple[int, int], str] = {}
        self.progress: dict[tuple[int, int], Progress] = {}
        self.acked: set[str] = set()
        self.aux_slot: int | None = None
        self.aux: bytes | None = None
        self.aux_from: tuple[int, int] | None = None
        self.granted = False
        self.pending: Pending | None = None

    def bind(self, contacts: dict[str, list]) -> None:
        """Endpoint, once its prefill instance is known: the ranks this request asks, and their sources."""
        self.contacts = contacts
        self.peer_of = {(s.p_tp_rank, s.p_pp_rank): key for key, ss in contacts.items() for s in ss}
        self.progress = {src: Progress() for src in self.peer_of}
        self.aux_from = aux_source([s for ss in contacts.values() for s in ss])

    @property
    def bound(self) -> bool:
        return bool(self.contacts)

    def init(self, kv_slots, *, prefix_len: int = 0, state_slots=None, aux_slot: int | None = None,
             swa_slots=None) -> None:
        """Grant the slots and request the KV. ``kv_slots``: the slot of every token of the request;
        the first ``prefix_len`` are already filled (prefix cache) and are neither granted nor sent.
        ``swa_slots`` (hybrid sliding-window pools only, and required there): the "swa" slots of the
        last ``len(swa_slots)`` tokens, 1..window of them; only those tokens' sliding-window layers
        are sent (and of them, only the ones at or after ``prefix_len``).
        ``aux_slot``: the row of the endpoint's aux rows (``AuxRows``) for this request; cleared here,
        filled when the last chunk arrives (so a row read before Success is cleared, never stale).
        While the request's prefill instance is still handshaking, the slots are granted once it
        answered (the request stays Bootstrapping). Raises LayoutError/RequestError on bad
        arguments; never blocks."""
        self.endpoint.init_request(self, kv_slots, int(prefix_len), state_slots, aux_slot, swa_slots)


def chunk_problem(r: KVReceiver, meta: ChunkMeta, nbytes: int, fin: bool, aux_bytes: int) -> str | None:
    """Why chunk ``meta`` (``nbytes`` landed; ``fin``: a last chunk that moved nothing) must fail
    ``r``, or None; sets ``r.aux`` from aux bytes of the source asked for them (``aux_bytes`` long)."""
    src, peer = r.progress.get(meta.source), r.peer_of.get(meta.source)
    fail = None
    if src is None:
        fail = f"a chunk from prefill tp{meta.source[0]}/pp{meta.source[1]}, not a source of this request"
    elif not fin and (meta.chunk in src.chunks or 0 <= src.total <= meta.chunk):
        fail = f"chunk {meta.chunk} from {peer} is a duplicate or beyond its total {src.total}"
    elif src.total >= 0 and meta.total >= 0 and (src.total, src.total_bytes) != (meta.total, meta.nbytes):
        fail = f"{peer} declared two different totals ({src.total} and {meta.total} chunks)"
    elif meta.total >= 0 and meta.nbytes != src.expected:
        fail = (f"source tp{meta.source[0]}/pp{meta.source[1]} ({peer}) declared {meta.nbytes} bytes "
                f"but decode expected {src.expected} (its grant)")
    elif src.nbytes + nbytes > src.expected:
        fail = (f"source tp{meta.source[0]}/pp{meta.source[1]} ({peer}): {src.nbytes + nbytes} bytes landed "
                f"but decode expected {src.expected} (its grant)")
    elif meta.aux is not None:
        if meta.source != r.aux_from or r.aux_slot is None:
            fail = f"aux bytes from {peer}, which was not asked for them"
        elif len(meta.aux) != aux_bytes:
            fail = f"aux rows of {len(meta.aux)} bytes from {peer}, decode's rows are {aux_bytes} bytes"
        else:
            r.aux = meta.aux
    return fail


__all__ = ["KVReceiver", "ReceiverHost", "Progress", "Pending", "chunk_problem"]
