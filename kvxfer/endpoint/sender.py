"""Prefill's per-request record: ``KVSender`` (one per request, made by
``PrefillEndpoint.sender``), and ``stalled``, what a sender past its deadline waited for. The
endpoint (``kvxfer.endpoint.prefill``) holds its lock around everything here but ``send``.

Readiness: a chunk is submitted to the transport only when the request is bound (every decode
rank's grant came) and its ``ready`` event's ``query()`` returned True; until then it waits in
the sender's queue, and the chunks after it wait behind it (their order is the chunk order
decode counts). ``query()`` is called by ``send`` itself (an event already complete costs no
tick) and then by the channel thread at every tick, never blocking; kvxfer never calls
``synchronize()`` on the sender path. An event that never completes fails the request at its
phase deadline ("timed out ... ready event"), and nothing of that chunk is ever read.
The engine records the event on the stream that wrote the chunk's KV (and state), after the
writes, and calls ``send`` right away; from the event's completion until ``on_release`` it must
not write those slots again.
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence

from ..control.messages import Room
from ..metrics import record_transfer
from ..transport.base import TransferHandle
from .aux import AuxRecord
from .base import EndpointBase, KVPoll, Outcome
from .chunks import Chunk, Target
from .request import RequestBase

log = logging.getLogger("kvxfer.request")


class SenderHost(EndpointBase):
    """What a ``KVSender``, the ``DecodeLinks`` and the ``RequestTable`` call on their endpoint
    (``PrefillEndpoint`` is the one)."""

    @abc.abstractmethod
    def retire_requests(self, peer: str, why: str, later: list) -> int:
        """Under the endpoint lock: decode peer ``peer`` is gone; what it asked for ends with ``why``.
        Returns how many requests ended so."""

    @abc.abstractmethod
    def send_chunk(self, s: "KVSender", kv_slots, start, layers, last, aux, state_slots, ready,
                   aux_row=None) -> bool:
        """The body of ``KVSender.send``."""

    @abc.abstractmethod
    def pump(self, s: "KVSender", later: list) -> None:
        """Under the endpoint lock: submit what bound sender ``s`` queued, up to a chunk not ready."""

    @abc.abstractmethod
    def end_request(self, s: "KVSender", outcome: Outcome, reason: str, later: list) -> None:
        """Under the endpoint lock: end ``s`` once with ``outcome`` and ``reason``."""


class KVSender(RequestBase):
    """One request on a prefill rank; made by ``PrefillEndpoint.sender`` (see the module docstring)."""
    endpoint: "SenderHost"
    __slots__ = ("targets", "group", "expected", "queued", "handles", "reading", "next_pos", "last_sent",
                 "lease_end", "overdue")

    def __init__(self, ep: "SenderHost", room: Room, on_release: Callable[[Outcome], None] | None):
        super().__init__(ep, room, ep.clock() + ep.timeouts.bootstrap, on_release)
        self.targets: dict[int, Target] = {}
        self.group: tuple[str, int] | None = None      # the decode (instance, dp rank) it is bound to
        self.expected: frozenset[int] = frozenset()     # the decode TP ranks that must ask
        self.queued: list[Chunk] = []   # not submitted yet: not bound, or waiting for a ready event
        self.handles: list[tuple[TransferHandle, int, Target]] = []   # in flight: (handle, runs in its plan, to whom)
        self.reading: list[TransferHandle] = []    # handles whose transport may still read the KV
        self.next_pos, self.last_sent, self.lease_end, self.overdue = 0, False, float("inf"), False

    def send(self, kv_slots, *, start: int | None = None, layers: Sequence[int] | None = None, last: bool = False,
             aux: AuxRecord | bytes | None = None, aux_row: int | None = None, state_slots=None,
             ready=None) -> bool:
        """Scheduler, per chunk: send the KV of tokens ``start .. start + len(kv_slots)`` (default:
        right after the previous chunk), of ``layers`` (default: all; for per-layer-group streaming
        pass ``start`` too). The last chunk carries the aux row (``aux``: its bytes, or an ``AuxRecord``;
        ``aux_row``: a row of the endpoint's ``AuxRows``, read when the chunk is submitted, after its
        ``ready`` event) and the state at ``state_slots``. A
        hybrid SWA pool must have mapped (``full_to_swa``) every token of decode's window by this
        call. ``ready``: None when the KV (and state) of this chunk is written already, else an
        object with ``query() -> bool`` (e.g. ``torch.cuda.Event`` recorded on the forward's stream
        after it wrote them); no transport reads the chunk before ``query()`` returned True.
        Never blocks on the network; False when the request has already ended."""
        return self.endpoint.send_chunk(self, kv_slots, start, layers, last, aux, state_slots, ready, aux_row)

    @property
    def kv_releasable(self) -> bool:
        """True once prefill may reuse this request's KV and ``on_release`` returned: decode
        confirmed, or the request ended and no transfer still reads it, or the lease ran out and
        no transport still holds the KV (``TransferHandle.source_released``)."""
        return self.released


def stalled(s: KVSender) -> str:
    """What a sender past its deadline was waiting for, in words."""
    if s.state == KVPoll.Bootstrapping:
        return "no request from " + ("decode rank(s) " + ", ".join(map(str, sorted(set(s.expected) -
                                                                                  set(s.targets))))
                                     if s.group else "any decode rank")
    if s.queued and s.queued[0].ready is not None:
        return f"the ready event of {s.queued[0].what()} did not complete (query() stayed False)"
    return "no chunk was sent" if s.state == KVPoll.WaitingForInput else "the transfer made no progress"



def call_on_request(on_request: Callable[[Room, int], None], room: Room, tokens: int) -> None:
    """The engine's ``on_request(room, tokens)``, outside the endpoint lock; its bug is logged,
    never the channel thread's death."""
    try:
        on_request(room, tokens)
    except Exception:
        log.exception("on_request callback failed for room %s", room)


def count_transfers(transport: str, done: list[tuple[int, int, float]]) -> None:
    """Count reaped transfers (bytes, runs, seconds) in ``kvxfer.metrics``, outside the lock."""
    for nbytes, runs, seconds in done:
        record_transfer(transport, "send", nbytes, runs, seconds)


__all__ = ["KVSender", "SenderHost", "stalled", "call_on_request", "count_transfers"]
