"""Decode's per-request record: ``KVReceiver`` (one per request, made by
``DecodeEndpoint.receiver``), what each prefill source of it delivered (``Progress``), and the
checks a chunk's metadata passes before it counts (``chunk_problem``). Bookkeeping only: the
endpoint (``kvxfer.endpoint.decode``) holds its lock around every call here.
"""
from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping

import numpy as np

from ..control.messages import Room
from ..control.wire import ChunkMeta
from ..errors import RequestError
from ..grant import ByteRanges
from ..layout import SWA, Layout
from ..topology import aux_source
from .base import EndpointBase, KVPoll, Outcome, Timeouts
from .request import RequestBase


class ReceiverHost(EndpointBase):
    """What a ``KVReceiver`` and the ``PrefillLinks`` call on their endpoint (``DecodeEndpoint`` is
    the one); the links' hooks run under the endpoint lock."""

    @abc.abstractmethod
    def init_request(self, r: "KVReceiver", kv_slots, prefix_len: int, state_slots, aux_slot,
                     swa_slots=None) -> None:
        """The body of ``KVReceiver.init``."""

    @abc.abstractmethod
    def instance_ready(self, inst, later: list) -> None:
        """Prefill instance ``inst`` answered its handshake: the requests that waited for it go on."""

    @abc.abstractmethod
    def instance_failed(self, inst, why: str, later: list) -> None:
        """``inst``'s handshake failed: the requests that waited for it fail with ``why``."""

    @abc.abstractmethod
    def rank_lost(self, key: str, why: str, later: list) -> None:
        """Prefill rank ``key`` is lost: its granted requests fail."""

    @abc.abstractmethod
    def rank_rejoined(self, key: str, why: str, read_at: float, later: list) -> None:
        """A new handshake with ``key`` answered (``why`` empty) or failed: waiting requests go on, or
        those that waited since before ``read_at`` (the registry read it followed) fail."""


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
    first handshake, or a lost rank's new one) before anything is granted; ``since``: when it began
    to wait (``time.monotonic``)."""
    __slots__ = ("kv", "prefix", "state", "aux_slot", "swa_slots", "since")

    def __init__(self, kv: np.ndarray, prefix: int, state: np.ndarray, aux_slot: int | None, swa_slots):
        self.kv, self.prefix, self.state, self.aux_slot, self.swa_slots = kv, prefix, state, aux_slot, swa_slots
        self.since = time.monotonic()


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


def grant_ranges(r: KVReceiver, planners: dict, slots: dict[str, np.ndarray]) -> tuple[ByteRanges, dict]:
    """Exactly the bytes ``r``'s sources will write: each source's heads and layers at ``slots`` (per
    space; "swa": the window slots of the sliding-window layers that will be sent), with the planners
    of each prefill rank (``PrefillLinks.planners``); and how many bytes each source of ``r`` writes
    (0 for a source with nothing to send)."""
    cols: list[list[np.ndarray]] = [[], [], []]
    expected = dict.fromkeys(r.progress, 0)
    for key in r.contacts:
        for src, pl in planners[key]:
            mine = {k: v for k, v in slots.items() if k in {a for a, _ in pl.spaces}}
            runs = pl.plan(mine, mine).runs()
            for c, a in zip(cols, (runs.dst_region, runs.dst_offset, runs.nbytes)):
                c.append(a)
            expected[src] = expected.get(src, 0) + int(runs.nbytes.sum(dtype=np.int64))
    return ByteRanges(*(np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols)), expected


def window_slots(layout: Layout, swa_window: int, kv: np.ndarray, swa_slots) -> np.ndarray:
    """The checked window slots of a hybrid pool's request (``init``'s ``swa_slots``); empty for any
    other pool; RequestError naming what is wrong."""
    if not swa_window:
        if swa_slots is not None:
            raise RequestError("swa_slots given, but this endpoint's pool has no sliding-window layers")
        return np.zeros(0, np.int64)
    if swa_slots is None:
        raise RequestError(f"this pool has sliding-window layers: pass swa_slots, the {SWA!r} slots of the "
                           f"last 1..{swa_window} tokens (the window decode keeps)")
    swa = layout.check_slots(SWA, np.asarray(swa_slots), "swa_slots", distinct=True)
    most = min(swa_window, len(kv))
    if not 1 <= len(swa) <= most:
        raise RequestError(f"swa_slots has {len(swa)} slot(s) but must cover the last 1..{most} tokens "
                           f"(sliding window {swa_window}, request of {len(kv)} tokens)")
    return swa


def waited_for(r: KVReceiver, timeouts: Timeouts, lost: Mapping[str, str]) -> str:
    """What a request past its phase deadline waited for, in words (``lost``: prefill ranks lost now)."""
    if r.state == KVPoll.Bootstrapping:
        if not r.bound:
            what = f"prefill instance {r.instance.name or r.instance.ref[0]} did not answer its handshake"
        elif r.pending is not None:
            what = "lost prefill rank(s) " + ", ".join(k for k in r.contacts if k in lost) + " did not return"
        elif not r.granted:
            what = "init() was not called"
        else:
            what = "no acknowledgement from " + ", ".join(sorted(set(r.contacts) - r.acked))
        return f"{what} within {timeouts.bootstrap}s"
    if r.state == KVPoll.WaitingForInput:
        return f"no chunk arrived within {timeouts.waiting}s"
    return f"the transfer made no progress within {timeouts.transfer}s"


__all__ = ["KVReceiver", "ReceiverHost", "Progress", "Pending", "chunk_problem", "grant_ranges", "window_slots",
           "waited_for"]
