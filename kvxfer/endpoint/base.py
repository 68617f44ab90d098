"""Per-request KV transfer: the contract, and what both sides share.

The per-rank endpoints own the transport, the control channel and the planners; they live
in ``kvxfer.prefill`` (``PrefillEndpoint``, ``KVSender``) and ``kvxfer.decode``
(``DecodeEndpoint``, ``KVReceiver``) and are re-exported here. This module holds the shared
types: ``KVPoll``, ``Timeouts``, ``AuxRecord``/``AuxBuffer``, the ``_Request``/``_Endpoint``
bases, and ``reduce_poll``.

Who calls what, and when
------------------------
Prefill rank, once at start-up:
    ``ep = PrefillEndpoint(spec, kv_pool, state=..., transport="zmq")``; ``ep.register(url)``
    (bootstrap registration + heartbeats). HELLOs from decode ranks are answered on the
    channel thread: compatibility check, planners per source, ``transport.connect``.
Decode rank, once at start-up (blocking; raises ``CompatibilityError`` naming every mismatch):
    ``ep = DecodeEndpoint(spec, kv_pool, state=..., aux=AuxBuffer(...))``; ``ep.connect(bootstrap=url)``.
Decode scheduler, per request ("room"; never blocks):
    ``r = ep.receiver(room)``                    Bootstrapping
    ``r.init(kv_slots, prefix_len=, state_slots=, aux_slot=, swa_slots=)``  after allocating slots:
                                                 grants them (``transport.expect``) and sends the
                                                 request to every prefill rank it needs
    ``r.poll()`` / ``r.wait(t)``                 -> WaitingForInput (every prefill rank acknowledged)
                                                 -> Transferring (first chunk) -> Success | Failed
Prefill scheduler, per request (never blocks on the network):
    ``s = ep.sender(room)``                      Bootstrapping until every decode rank's request came
    ``s.send(kv_slots, last=..., aux=..., state_slots=...)``  per chunk as prefill computes it
                                                 (whole pages except the last; may start early:
                                                 chunks queue until the grants arrive)
    ``s.poll()``; ``s.kv_releasable`` / ``on_release`` when prefill may reuse the KV (lease)
Either side, any time: ``abort(reason)``, ``failure_exception()``, ``clear()``.
Each TP group, per scheduler step: ``reduce_poll(states, group)`` (all-reduce MIN).

Hybrid sliding-window pools (``HybridSWAPool``: full-attention layers in space "token",
sliding-window layers in space "swa"; both sides hybrid with the same window, checked at the
handshake): decode passes ``swa_slots``, its "swa" slots for the last ``len(swa_slots)`` tokens
(1..window), and the request carries them. Full layers move for every token past the prefix;
sliding-window layers only for those window tokens past the prefix, read on prefill through
the pool's ``full_to_swa`` when ``send`` is called. A window token prefill holds no "swa" slot
for fails the request: nothing is sent from an unmapped slot.

States only move forward (``KVPoll``); Failed is final. Every request ends, within the
deadline of its phase (``Timeouts``), in Success or Failed with a reason (``outcome`` says
failed / aborted / timed_out). A dead or stopped peer is found by heartbeats. A grant is
released exactly once (``transport.forget`` then ``on_release``); writes that arrive after
are dropped by the transport (transport request id ``f"{room}.{gen}"``, a fresh generation
per receiver), so a late write never lands in slots that now belong to another request.
Each side counts every request end once (``kvxfer.metrics.record_request_end``, which also
writes the per-request log line) and prefill counts every completed transfer
(``record_transfer``).
"""
from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..control.auth import as_secret
from ..control.channel import ControlChannel, Heartbeat
from ..control.compat import layout_record
from ..errors import LayoutError, PlanError, RequestError
from ..layout import SWA, Layout, combine_layouts
from ..plan import Planner
from ..pools import KVPool
from ..ranks import RankInfo, RankSpec
from ..transport.base import Transport
from ..transport.registry import get_transport
from .aux import AUX_MIN_BYTES

log = logging.getLogger("kvxfer.request")


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Deadlines, in seconds, per phase. Each starts when its phase starts."""
    bootstrap: float = 30.0     # Bootstrapping: decode's request reaches and binds every prefill rank
    waiting: float = 300.0      # WaitingForInput: until the first chunk (prefill compute time)
    transfer: float = 30.0      # Transferring: longest time without progress (a chunk or a completion)
    lease: float = 30.0         # prefill holds a request's KV after its last chunk until decode confirms
    handshake: float = 10.0     # one HELLO round trip at start-up
    heartbeat: Heartbeat = field(default_factory=Heartbeat)

    def __post_init__(self):
        for name in ("bootstrap", "waiting", "transfer", "lease", "handshake"):
            if getattr(self, name) <= 0:
                raise ValueError(f"timeout {name} must be > 0 seconds, got {getattr(self, name)}")


# ------------------------------------------------------------------------------------
# Shared endpoint machinery
# ------------------------------------------------------------------------------------
_END = (KVPoll.Success, KVPoll.Failed)


class _Request:
    """What KVSender and KVReceiver share: forward-only state, end once, release once."""
    __slots__ = ("room", "state", "outcome", "reason", "deadline", "created", "ended_at", "_ep", "_done",
                 "_on_release", "_released", "__weakref__")

    def __init__(self, ep, room: int, deadline: float, on_release):
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 63:
            raise ValueError(f"room must be an int in 0..2**63-1, got {room!r}")
        self._ep, self.room, self.deadline = ep, room, deadline
        self.state, self.outcome, self.reason = KVPoll.Bootstrapping, "", ""
        self.created, self.ended_at = time.monotonic(), 0.0   # time.monotonic() of creation, of the end state
        self._done, self._on_release, self._released = threading.Event(), on_release, False

    def poll(self) -> KVPoll:
        """Never blocks."""
        return self.state

    def wait(self, timeout: float | None = None, until: KVPoll = KVPoll.Success) -> KVPoll:
        """Block until the state reaches ``until`` (default: the end) or Failed, at most ``timeout``;
        returns the state then. For callers that would otherwise spin on ``poll``."""
        if until >= KVPoll.Success:
            self._done.wait(timeout)
        else:
            with self._ep._changed:
                self._ep._changed.wait_for(lambda: self.state >= until or self.state == KVPoll.Failed, timeout)
        return self.state

    def failure_exception(self) -> RequestError | None:
        return RequestError(self.reason) if self.state == KVPoll.Failed else None

    def _advance(self, state: KVPoll, deadline: float) -> None:
        if self.state not in _END and state > self.state:   # forward only
            self.state, self.deadline = state, deadline
            self._ep._changed.notify_all()

    def _release(self) -> None:
        """Runs once, outside the endpoint lock (the callback may take engine locks)."""
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            try:
                self._on_release(self)
            except Exception:
                log.exception("on_release callback of room %s failed", self.room)

    def abort(self, reason: str = "") -> None:
        with self._ep._guard() as later:
            self._ep._end(self, KVPoll.Failed, "aborted", f"aborted by {self._ep.role}" + (f": {reason}" if reason
                                                                                            else ""), later)

    def clear(self) -> None:
        """Done with the request. The endpoint keeps nothing of an ended request, so this only
        aborts one that is still running (e.g. the engine dropped it)."""
        if self.state not in _END:
            self.abort("cleared")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(room={self.room}, {self.state.name}{', ' + self.reason if self.reason else ''})"


def _swa_window(kv: KVPool) -> int:
    """The sliding window of a hybrid pool (``HybridSWAPool.window``), 0 for any other pool."""
    if not any(s.name == SWA for s in kv.layout.spaces):
        return 0
    window = getattr(kv, "window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise LayoutError(f"a pool with a {SWA!r} slot space must say its sliding window in tokens "
                          f"(an int >= 1, as HybridSWAPool.window does), got {window!r}")
    return window


class _Endpoint:
    role = "?"

    def __init__(self, spec: RankSpec, kv: KVPool, *, state: KVPool | None, transport: str | Transport,
                 transport_options: Mapping | None, timeouts: Timeouts, secret, aux_bytes: int):
        spaces = [s.name for s in kv.layout.spaces]
        token_spaces = [name for name in spaces if name != SWA]
        if len(token_spaces) != 1:
            raise LayoutError(f"the KV pool must have one token slot space (plus {SWA!r} for a hybrid "
                              f"sliding-window pool), it has {spaces}")
        if aux_bytes != 0 and aux_bytes < AUX_MIN_BYTES:
            raise ValueError(f"aux_bytes must be 0 (no aux record) or >= {AUX_MIN_BYTES}, got {aux_bytes}")
        self.spec, self.timeouts, self.secret = spec, timeouts, as_secret(secret)
        self.aux_bytes = int(aux_bytes)
        self.layout = combine_layouts(kv.layout, None if state is None else state.layout)
        self.token_space = token_spaces[0]
        self.swa_window = _swa_window(kv)            # 0: no sliding-window layers
        self._kv_pool = kv                           # hybrid SWA: prefill reads its full_to_swa per chunk
        self.kv_kinds = sorted({p.kind for p in kv.layout.parts})
        self.state_kinds = sorted({p.kind for p in state.layout.parts}) if state is not None else []
        self._owns_transport = isinstance(transport, str)
        self.transport = get_transport(transport, **dict(transport_options or {})) if self._owns_transport \
            else transport
        self.transport.register(kv.regions() + (state.regions() if state is not None else []))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)   # any request's state moved (see wait(until=))
        self._xport_lock = threading.Lock()   # transports are not promised to be thread-safe
        self._closed = False
        self.channel: ControlChannel | None = None

    @contextlib.contextmanager
    def _guard(self):
        """The endpoint lock; callbacks queued in ``later`` run after it is released."""
        later: list[Callable[[], None]] = []
        with self._lock:
            yield later
        for fn in later:
            fn()

    @property
    def info(self) -> RankInfo:
        """This rank's record for the registry and the handshake (plain data)."""
        return RankInfo(spec=self.spec, control=self.channel.address if self.channel else "",
                        data={self.transport.name: self.transport.descriptor()},
                        layout=layout_record(self.layout, self.swa_window), aux_bytes=self.aux_bytes)

    def _planner(self, src: Layout, dst: Layout, src_heads, dst_heads, layers, kinds) -> Planner | None:
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
        with self._guard() as later:
            return self._tick(now, later)

    def close(self) -> None:
        """Fail what is running, stop the threads, close the transport if this endpoint made it."""
        if self._closed:
            return
        with self._guard() as later:
            for r in list(self._live()):
                self._end(r, KVPoll.Failed, "failed", f"{self.role} endpoint closed", later)
        self._closed = True
        if self.channel is not None:
            self.channel.close()
        if self._owns_transport:
            self.transport.close()
        with self._guard() as later:
            self._after_close(later)

    def _after_close(self, later) -> None:
        """Hook: release what only the (now stopped) threads would have released."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------
# TP-group agreement
# ------------------------------------------------------------------------------------
def reduce_poll(states: Sequence[KVPoll | int], group=None) -> list[KVPoll]:
    """All-reduce the poll states of every rank of ``group`` with MIN: a request is Success only
    when every rank has its part, and Failed as soon as one rank failed. Collective: every rank
    calls it with the same requests in the same order, once per scheduler step."""
    if not states:
        return []
    import torch.distributed as dist
    t = torch.tensor([int(s) for s in states], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(int(x)) for x in t.tolist()]
