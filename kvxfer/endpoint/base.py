"""Per-request KV transfer: the contract, and what both sides share.

The per-rank endpoints own the transport, the control channel and the planners; they live
in ``kvxfer.endpoint.prefill`` (``PrefillEndpoint``, ``KVSender``) and
``kvxfer.endpoint.decode`` (``DecodeEndpoint``, ``KVReceiver``). This module holds what both
endpoints share: ``Timeouts`` and ``EndpointBase``, and the seam between an endpoint and its
requests, whose own base is in ``kvxfer.endpoint.request`` (``KVPoll``, the state a scheduler
polls; ``Outcome``, how a request ended; ``RequestBase``). TP-group agreement (``reduce_poll``,
``LocalGroup``) is in ``kvxfer.endpoint.group``.

Words
-----
room        the engine's number for a request (``sender(room)``, ``receiver(room)``); both
            sides use the same room for the same request.
gen         decode's generation of a room: a fresh one per ``receiver(room)``, so a room can be
            used again after its request ended.
request_id  the transport's name for one request, ``f"{room}.{gen}"`` (``Transport.submit``,
            ``expect``, ``forget``): writes under an ended request id are dropped.

Who calls what, and when
------------------------
Prefill rank, once at start-up:
    ``ep = PrefillEndpoint(spec, kv_pool, state=..., transport="zmq", bind=..., advertise=...,
    on_request=cb)``; ``ep.register(url)`` (bootstrap registration + heartbeats; refuses, naming
    the setting, to advertise loopback to a bootstrap on another host). HELLOs from decode ranks
    are answered on the channel thread: compatibility check, planners per source,
    ``transport.connect``. ``cb(room, tokens)`` runs when a decode rank asks for a room that has
    no sender yet (the engine then calls ``sender(room)``).
Decode rank, once at start-up (blocking, at most ``timeout`` seconds in all; raises
``CompatibilityError`` naming every mismatch, ``ConnectError`` otherwise):
    ``ep = DecodeEndpoint(spec, kv_pool, state=..., aux=AuxBuffer(...))``;
    ``ep.connect(bootstrap=url, instance=..., timeout=60)``. Afterwards a recovery thread
    (``kvxfer.endpoint.recovery``) re-reads the registry on a lost prefill rank, on a failed
    request and every ``Timeouts.registry`` seconds, and handshakes with a restarted rank.
Decode scheduler, per request (never blocks):
    ``r = ep.receiver(room, on_release=cb)``     Bootstrapping
    ``r.init(kv_slots, prefix_len=, state_slots=, aux_slot=, swa_slots=)``  after allocating slots:
                                                 grants them (``transport.expect``), clears the aux
                                                 row, sends the request to every prefill rank it needs
    ``r.poll()`` / ``r.wait(t)``                 -> WaitingForInput (every prefill rank acknowledged)
                                                 -> Transferring (first chunk) -> Success | Failed
    ``cb(outcome)``                              once, after the grant ended (any outcome): on
                                                 ``Outcome.Success`` keep the slots for decoding,
                                                 otherwise free them
Prefill scheduler, per request (never blocks on the network):
    ``s = ep.sender(room, on_release=cb)``       Bootstrapping until every decode rank's request came
    ``s.send(kv_slots, last=..., aux=..., state_slots=..., ready=event)``  per chunk as prefill
                                                 computes it (any number of tokens; may start early:
                                                 chunks queue until the grants arrive). ``ready``: an
                                                 object with ``query()`` (a CUDA event recorded after
                                                 the forward wrote the chunk's KV); no transport reads
                                                 the chunk before ``ready.query()`` is True.
    ``s.poll()``; ``cb(outcome)`` once prefill may reuse the KV (lease); ``s.kv_releasable``
                                                 turns True after ``cb`` returned
Either side, any time: ``abort(reason)``, ``failure_exception()``, ``clear()``.
Either endpoint, any time: ``ep.broken`` (None, or why the endpoint can no longer serve: its
    control channel thread died of a bug). Then every request it owned has ended Failed with
    that reason, a prefill rank has deregistered, and ``sender()`` / ``receiver()`` raise
    ``RequestError`` naming it; ``close()`` still frees everything.
Each TP group, per scheduler step: ``reduce_poll(states, group)`` (MIN over the group).

Hybrid sliding-window pools (``HybridSWAPool``: full-attention layers in space "token",
sliding-window layers in space "swa"; both sides hybrid with the same window, checked at the
handshake): decode passes ``swa_slots``, its "swa" slots for the last ``len(swa_slots)`` tokens
(1..window), and the request carries them. Full layers move for every token past the prefix;
sliding-window layers only for those window tokens past the prefix, read on prefill through
the pool's ``full_to_swa`` when ``send`` is called. A window token prefill holds no "swa" slot
for fails the request: nothing is sent from an unmapped slot.

States only move forward (``KVPoll``); Failed is final. Every request ends, within the
deadline of its phase (``Timeouts``, measured on the endpoint's ``clock``), with one
``Outcome``: Success, Failed (with a reason), TimedOut or Aborted. A dead or stopped peer is
found by heartbeats. A grant is released exactly once (``transport.forget`` then
``on_release``); writes that arrive after are dropped by the transport (a fresh request id
per receiver), so a late write never lands in slots that now belong to another request.
Each side counts every request end once (``kvxfer.metrics.record_request_end``, which also
writes the per-request log line) and prefill counts every completed transfer
(``record_transfer``).

The seam between requests and endpoints (all public, all documented here):
    request -> endpoint: ``guard()`` (the endpoint lock; callbacks queued in ``later`` run
        after it), ``changed`` (a condition notified when any state moved), ``clock``,
        ``end_request(req, outcome, reason, later)``; the sides add ``send_chunk`` (prefill,
        for ``KVSender.send``) and ``init_request`` (decode, for ``KVReceiver.init``).
    endpoint -> request, under the endpoint lock: ``advance(state, deadline)``,
        ``mark_ended(outcome, reason)``; outside it: ``run_release()``.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..control.auth import as_secret
from ..control.channel import ControlChannel, Heartbeat
from ..control.compat import layout_record
from ..control.records import RankInfo
from ..errors import ConfigError, LayoutError, PlanError, RequestError
from ..layout import SWA, Layout, combine_layouts
from ..plan import Planner
from ..pools import KVPool
from ..ranks import RankSpec, check_heads, swa_window
from ..transport.base import Transport
from ..transport.registry import get_transport
from .aux import AUX_MIN_BYTES, AuxRows
from .request import END_STATES, Clock, KVPoll, Outcome, RequestBase

log = logging.getLogger("kvxfer.request")


# Seconds an endpoint with no request for ``LINGER`` s asks its channel to wait between ticks
# (``on_tick``); the channel's heartbeat turns it sooner (every ``Heartbeat.interval / 2``), and a
# request begun meanwhile wakes it (``guard``). Busy, or lately, an endpoint ticks every 5-50 ms: a
# stream of requests never pays that wake-up.
IDLE_TICK, LINGER = 1.0, 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Deadlines, in seconds, per phase. Each starts when its phase starts and is measured on
    the endpoint's ``clock`` (``time.monotonic`` unless a test passes another)."""
    bootstrap: float = 30.0     # Bootstrapping: decode's request reaches and binds every prefill rank
    waiting: float = 300.0      # WaitingForInput: until the first chunk is submitted (prefill compute time)
    transfer: float = 30.0      # Transferring: longest time without progress (a chunk or a completion)
    lease: float = 30.0         # prefill holds a request's KV after its end until decode confirms
    handshake: float = 10.0     # at most, one HELLO round trip at start-up (``connect(timeout=)`` caps it)
    registry: float = 5.0       # decode re-reads the registry at least this often (a replaced prefill rank)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)

    def __post_init__(self):
        for name in ("bootstrap", "waiting", "transfer", "lease", "handshake", "registry"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"timeout {name} must be > 0 seconds, got {getattr(self, name)}")


# ------------------------------------------------------------------------------------
# Endpoints
# ------------------------------------------------------------------------------------
# Transports whose data port takes only the peers an endpoint admitted (``Transport.admit``) once
# told so (UCX would also require it by itself once ``admit`` is called).
ADMISSION_OPTION: dict[str, object] = {"zmq": "required", "local": "required", "ucx": True}


def admitting(transport: str | Transport, options: Mapping | None) -> dict:
    """The options an endpoint makes its transport with: admission required where the transport
    takes the option and the caller did not set it (a bare transport in a test stays open)."""
    out = dict(options or {})
    if isinstance(transport, str) and transport in ADMISSION_OPTION:
        out.setdefault("admission", ADMISSION_OPTION[transport])
    return out


class EndpointBase(abc.ABC):
    """What both endpoints share: the pools' combined layout, the transport, the lock, the
    clock, the channel tick, close. A side implements ``end_request`` and the hooks ``_tick``
    (deadlines; returns seconds until it wants the next tick), ``_live`` (running requests)
    and ``_after_close``."""
    role = "?"
    channel: ControlChannel   # made by each side's __init__ (a ROUTER on prefill, DEALERs on decode)

    def __init__(self, spec: RankSpec, kv: KVPool, *, state: KVPool | None, transport: str | Transport,
                 transport_options: Mapping | None, timeouts: Timeouts, secret, aux: AuxRows | None,
                 aux_bytes: int, clock: Clock = time.monotonic):
        spaces = [s.name for s in kv.layout.spaces]
        token_spaces = [name for name in spaces if name != SWA]
        if len(token_spaces) != 1:
            raise LayoutError(f"the KV pool must have one token slot space (plus {SWA!r} for a hybrid "
                              f"sliding-window pool), it has {spaces}")
        if aux is not None and not isinstance(aux, AuxRows):
            raise TypeError(f"aux must be an AuxRows (the engine's aux buffers) or None, got {type(aux).__name__}")
        if aux is None and aux_bytes != 0 and aux_bytes < AUX_MIN_BYTES:
            raise ConfigError(f"aux_bytes must be 0 (no aux record) or >= {AUX_MIN_BYTES}, got {aux_bytes}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds (like time.monotonic), got {clock!r}")
        check_heads(spec, kv)
        self.spec, self.timeouts, self.secret, self.clock = spec, timeouts, as_secret(secret), clock
        # aux rows: the engine's buffers (their row sizes), or AuxRecords of ``aux_bytes`` (no buffer)
        self.aux_rows = aux
        self.aux_bytes = aux.record_bytes if aux is not None else int(aux_bytes)
        self.aux_format = aux.row_bytes if aux is not None else (self.aux_bytes,) if self.aux_bytes else ()
        self.layout = combine_layouts(kv.layout, None if state is None else state.layout)
        self.token_space = token_spaces[0]
        self.swa_window = swa_window(kv)            # 0: no sliding-window layers
        self._kv_pool = kv                           # hybrid SWA: prefill reads its full_to_swa per chunk
        self.kv_kinds = sorted({p.kind for p in kv.layout.parts})
        self.state_kinds = sorted({p.kind for p in state.layout.parts}) if state is not None else []
        self._owns_transport = isinstance(transport, str)
        self.transport: Transport = get_transport(transport, **admitting(transport, transport_options)) \
            if isinstance(transport, str) else transport
        self.transport.register(kv.regions() + (state.regions() if state is not None else []))
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)   # any request's state moved (see wait(until=))
        self.xport_lock = threading.Lock()   # transports are not promised to be thread-safe
        self._closed = self._transport_closed = False
        self.broken: str | None = None        # why the endpoint cannot serve any more (see ``on_dead``)
        self._active_at = time.monotonic()    # when the tick last saw a request (``rest``)

    @contextlib.contextmanager
    def guard(self):
        """The endpoint lock; callbacks queued in the yielded list run after it is released. A change
        that gave a quiet endpoint a request to look after wakes its dozing channel (``nudge``)."""
        later: list[Callable[[], None]] = []
        with self._lock:
            yield later
        for fn in later:
            fn()
        channel = getattr(self, "channel", None)
        if channel is not None and channel.dozing and not self.quiet():
            self._active_at = time.monotonic()
            channel.nudge()

    @abc.abstractmethod
    def quiet(self) -> bool:
        """No request for ``on_tick`` to look after: the channel may doze (``IDLE_TICK``)."""

    def rest(self, busy: float) -> float:
        """The wait a tick asks for (channel thread): ``busy`` while there are requests and ``LINGER``
        s after the last (real time: the cadence is CPU cost, not a deadline), then ``IDLE_TICK``."""
        real = time.monotonic()
        if not self.quiet():
            self._active_at = real
        return IDLE_TICK if real - self._active_at > LINGER else busy

    @abc.abstractmethod
    def end_request(self, req: Any, outcome: Outcome, reason: str, later: list) -> None:
        """End ``req`` once with ``outcome`` (under ``guard``); each side's bookkeeping."""

    @property
    def info(self) -> RankInfo:
        """This rank's record for the registry and the handshake (plain data)."""
        channel = getattr(self, "channel", None)
        return RankInfo(spec=self.spec, control=channel.address if channel else "",
                        data={self.transport.name: self.transport.descriptor()},
                        layout=layout_record(self.layout, self.swa_window), aux_bytes=self.aux_bytes,
                        aux_rows=self.aux_format)

    def make_planner(self, src: Layout, dst: Layout, src_heads, dst_heads, layers, kinds) -> Planner | None:
        """A planner for ``kinds`` of ``layers``; None when no part matches (e.g. no state here)."""
        if not kinds or not layers:
            return None
        try:
            return Planner(src, dst, src_heads=src_heads, dst_heads=dst_heads, kinds=kinds, layers=layers)
        except PlanError as e:
            if str(e).startswith("nothing to plan"):
                return None
            raise

    def on_tick(self, now: float) -> float:
        """Channel thread, every turn: deadlines and leases on this endpoint's clock (``now``, the
        channel's real time, is not used: a test's clock may differ)."""
        with self.guard() as later:
            if not self.quiet():   # a request the tick ends still counts (``rest``)
                self._active_at = time.monotonic()
            return self._tick(self.clock(), later)

    @abc.abstractmethod
    def _tick(self, now: float, later: list) -> float:
        """Deadlines and leases at ``now``; seconds until the side wants the next tick."""

    @abc.abstractmethod
    def _live(self) -> Sequence[RequestBase]:
        """The requests still running on this side."""

    # -- a thread that died ------------------------------------------------------------------
    def on_dead(self, exc: BaseException) -> None:
        """The control channel's ``on_dead``: its thread ended by an exception (a bug; input never
        kills it). Called once, on that thread, after its sockets closed. The endpoint breaks."""
        self.break_endpoint(f"control channel thread died: {exc!r}")

    def break_endpoint(self, why: str) -> None:
        """A thread this endpoint needs died (``why``): every request it owned ends Failed with the
        reason, ``broken`` says it, ``_on_broken`` runs (prefill: deregister), and the transport,
        when this endpoint made it, is closed so that what only ticks would have released (leases,
        slots a write could still land in) is released now. Any thread; once."""
        with self.guard() as later:
            if self.broken is not None or self._closed:
                return
            self.broken = why
            log.error("%s endpoint %s is broken: %s", self.role, self.spec.key, why)
            for r in list(self._live()):
                self.end_request(r, Outcome.Failed, f"{self.role} endpoint broken: {why}", later)
        self._on_broken(why)
        if self._owns_transport:   # nothing reads or writes the pools any more: release what is held
            self._close_transport()
            with self.guard() as later:
                self._after_close(later)

    def _on_broken(self, why: str) -> None:
        """Hook, outside the lock, once the endpoint broke (prefill: deregister). Optional."""
        return None

    def check_usable(self) -> None:
        """RequestError, with the reason, when the endpoint is broken or closed (``sender`` / ``receiver``)."""
        if self.broken is not None:
            raise RequestError(f"{self.role} endpoint {self.spec.key} is broken: {self.broken}")
        if self._closed:
            raise RequestError(f"{self.role} endpoint {self.spec.key} is closed")

    def _close_transport(self) -> None:
        with self.xport_lock:
            if self._transport_closed:
                return
            self._transport_closed = True
        self.transport.close()

    def close(self) -> None:
        """Fail what is running, stop the threads, close the transport if this endpoint made it."""
        if self._closed:
            return
        with self.guard() as later:
            for r in list(self._live()):
                self.end_request(r, Outcome.Failed, f"{self.role} endpoint closed", later)
        self._closed = True
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self._owns_transport:
            self._close_transport()
        with self.guard() as later:
            self._after_close(later)

    def _after_close(self, later: list) -> None:
        """Hook: release what only the (now stopped) threads would have released. Optional."""
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# KVPoll, END_STATES, Outcome, RequestBase and Clock are ``kvxfer.endpoint.request``'s, named here too: engines'
# glue imports them from this module
__all__ = ["KVPoll", "END_STATES", "Outcome", "Timeouts", "RequestBase", "EndpointBase", "Clock"]
