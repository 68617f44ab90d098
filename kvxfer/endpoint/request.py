"""A request's life, shared by both sides: ``KVPoll`` (the state a scheduler polls), ``Outcome``
(how a request ended) and ``RequestBase`` (forward-only state, end once, release once), the base of
``KVSender`` (``kvxfer.endpoint.sender``) and ``KVReceiver`` (``kvxfer.endpoint.receiver``).

Who calls what: the scheduler calls ``poll``, ``wait``, ``abort``, ``clear`` and
``failure_exception``; the request's endpoint (a ``RequestHost``: ``kvxfer.endpoint.base``'s
``EndpointBase``) calls ``advance`` and ``mark_ended`` under its lock and ``run_release`` after it.
The contract as a whole is in ``kvxfer.endpoint.base``'s docstring.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..control.messages import Room, check_room
from ..errors import RequestError

log = logging.getLogger("kvxfer.request")

Clock = Callable[[], float]


class KVPoll(enum.IntEnum):
    """The state a scheduler polls. Ordered: a TP group agrees on the MIN (``reduce_poll``)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


END_STATES = (KVPoll.Success, KVPoll.Failed)


class Outcome(enum.Enum):
    """How a request ended; its value is the metrics label (``kvxfer_requests_total{state=}``).
    Every outcome but Success is ``KVPoll.Failed`` to a poller."""
    Success = "success"
    Failed = "failed"          # an error: a rejected write, a lost peer, bad arguments from the peer
    TimedOut = "timed_out"     # a phase deadline passed (``Timeouts``)
    Aborted = "aborted"        # ``abort()`` on either side, or the engine dropped it (``clear()``)

    @property
    def state(self) -> KVPoll:
        return KVPoll.Success if self is Outcome.Success else KVPoll.Failed


class RequestHost(Protocol):
    """What a request needs of its endpoint (``EndpointBase`` is one): the seam, in
    ``kvxfer.endpoint.base``'s docstring."""
    role: str
    clock: Clock
    changed: threading.Condition

    def guard(self) -> contextlib.AbstractContextManager[list[Callable[[], None]]]: ...

    def end_request(self, req: Any, outcome: Outcome, reason: str, later: list) -> None: ...


class RequestBase:
    """What KVSender and KVReceiver share: forward-only state, end once, release once.

    The scheduler calls ``poll``, ``wait``, ``abort``, ``clear``, ``failure_exception``. The
    endpoint calls ``advance`` and ``mark_ended`` under its lock and ``run_release`` after it.

    Attributes (read-only to the scheduler): ``room``; ``state`` (what ``poll`` returns);
    ``outcome`` (an ``Outcome`` once ended, else None); ``reason`` (why it failed, "" on
    Success); ``deadline`` (the current phase's, on the endpoint's clock); ``created`` and
    ``ended_at`` (the endpoint's clock at creation and at the end, 0.0 while running);
    ``released`` (the release ran and ``on_release`` returned).
    """
    __slots__ = ("room", "state", "outcome", "reason", "deadline", "created", "transferring_at", "ended_at", "endpoint",
                 "_ended", "_on_release", "_release_state", "__weakref__")

    def __init__(self, endpoint: RequestHost, room: Room, deadline: float,
                 on_release: Callable[[Outcome], None] | None):
        check_room(room)
        self.endpoint, self.room, self.deadline = endpoint, room, deadline
        self.state, self.reason = KVPoll.Bootstrapping, ""
        self.outcome: Outcome | None = None            # set once, at the end
        self.created, self.ended_at = endpoint.clock(), 0.0   # the endpoint's clock at creation, at the end
        self.transferring_at = 0.0                     # the endpoint's clock when the first chunk moved
        self._ended, self._on_release = threading.Event(), on_release
        self._release_state = 0                        # 0 not yet, 1 on_release running, 2 returned

    # -- the scheduler --------------------------------------------------------------------
    def poll(self) -> KVPoll:
        """Never blocks."""
        return self.state

    def wait(self, timeout: float | None = None, until: KVPoll = KVPoll.Success) -> KVPoll:
        """Block until the state reaches ``until`` (default: the end) or Failed, at most ``timeout``
        real seconds; returns the state then. For callers that would otherwise spin on ``poll``."""
        if until >= KVPoll.Success:
            self._ended.wait(timeout)
        else:
            with self.endpoint.changed:
                self.endpoint.changed.wait_for(lambda: self.state >= until or self.state == KVPoll.Failed, timeout)
        return self.state

    def failure_exception(self) -> RequestError | None:
        return RequestError(self.reason) if self.state == KVPoll.Failed else None

    @property
    def released(self) -> bool:
        """True once the grant (decode) or the KV (prefill) is released and ``on_release`` returned."""
        return self._release_state == 2

    def abort(self, reason: str = "") -> None:
        """End the request as Aborted (tells the peers); nothing if it ended already."""
        ep = self.endpoint
        with ep.guard() as later:
            ep.end_request(self, Outcome.Aborted, f"aborted by {ep.role}" + (f": {reason}" if reason else ""),
                           later)

    def clear(self) -> None:
        """Done with the request. The endpoint keeps nothing of an ended request, so this only
        aborts one that is still running (e.g. the engine dropped it)."""
        if self.state not in END_STATES:
            self.abort("cleared")

    # -- the endpoint ---------------------------------------------------------------------
    def advance(self, state: KVPoll, deadline: float) -> None:
        """Endpoint, under its lock: move forward to ``state`` with a new phase deadline."""
        if self.state not in END_STATES and state > self.state:
            self.state, self.deadline = state, deadline
            if state == KVPoll.Transferring:
                self.transferring_at = self.endpoint.clock()
            self.endpoint.changed.notify_all()

    def mark_ended(self, outcome: Outcome, reason: str) -> bool:
        """Endpoint, under its lock: the end state, once. False when it had ended already."""
        if self.state in END_STATES:
            return False
        self.state, self.outcome, self.reason, self.ended_at = outcome.state, outcome, reason, self.endpoint.clock()
        self._ended.set()   # first: the scheduler may be waiting on it
        self.endpoint.changed.notify_all()
        return True

    def run_release(self) -> None:
        """Endpoint, outside its lock (the callback may take engine locks): ``on_release(outcome)``
        once; ``released`` turns True only after it returned."""
        if self._release_state:
            return
        self._release_state = 1
        try:
            if self._on_release is not None and self.outcome is not None:
                self._on_release(self.outcome)
        except Exception:
            log.exception("on_release callback of room %s failed", self.room)
        finally:
            self._release_state = 2

    def __repr__(self) -> str:
        return f"{type(self).__name__}(room={self.room}, {self.state.name}{', ' + self.reason if self.reason else ''})"
