"""A transport that wraps any registered transport and injects faults, for tests.

Tests build it instead of monkeypatching a transport instance::

    t = get_transport("faulty", inner="zmq", inner_options={...})
    t.faults.fail_submits = 1                 # the next submit fails at once
    t.faults.submit_delay = 0.5               # submits reach the inner transport 0.5 s late
    t.faults.delay_requests["rid"] = 2.0      # submits of "rid" reach it 2 s late
    t.faults.hold_pending.add("rid")          # writes_pending("rid") stays True until removed
    t.faults.drop_arrivals.add("rid")         # arrivals of "rid" are dropped (counted in .dropped)
    t.faults.late_acks.add("rid")             # handles of "rid" stay PENDING after their bytes landed,
                                              # until removed, or failed by disconnecting their peer
    t.crash_io(RuntimeError("bug"))           # the inner transport's I/O thread dies, as of a bug

Every other call goes to the inner transport unchanged: the wrapper keeps the contract, so an
endpoint (or the conformance suite) cannot tell it from the inner one until a fault fires.
``faults`` may be changed from any thread at any time; each submit, arrival or
``writes_pending`` call reads it once.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvxfer.errors import ConfigError, PeerError
from kvxfer.grant import ByteRanges
from kvxfer.plan import TransferPlan
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport
from kvxfer.transport.kit import Crash
from kvxfer.transport.registry import get_transport

INJECTED = "injected fault"


@dataclass
class Faults:
    """What to break; tests set these fields (see the module docstring)."""
    fail_submits: int = 0                        # the next N submits fail at once
    fail_requests: set[str] = field(default_factory=set)   # submits of these request ids fail
    submit_delay: float = 0.0                    # seconds before a submit reaches the inner transport
    delay_requests: dict[str, float] = field(default_factory=dict)   # the same, for these request ids
    hold_pending: set[str] = field(default_factory=set)    # writes_pending says True for these
    drop_arrivals: set[str] = field(default_factory=set)   # arrivals of these are dropped
    late_acks: set[str] = field(default_factory=set)       # the sender hears late that these landed


class FaultyTransport(Transport):
    """Options: ``inner`` (the registered name of the wrapped transport, default "local"),
    ``inner_options`` (its keyword options), ``faults`` (a ``Faults``; default none)."""
    name = "faulty"

    def __init__(self, *, inner: str = "local", inner_options: dict | None = None, faults: Faults | None = None):
        if inner == self.name:
            raise ConfigError("a faulty transport cannot wrap another one by name")
        self.inner = get_transport(inner, **(inner_options or {}))
        self.faults = faults or Faults()
        self.dropped = 0
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._cut: set[str] = set()   # peers disconnected: their late acks fail, as a transport's do

    # -- the contract, forwarded ----------------------------------------------------------
    @property
    def grants(self):
        return self.inner.grants

    def register(self, regions: Sequence[torch.Tensor]) -> None:
        self.inner.register(regions)

    def descriptor(self) -> dict:
        return self.inner.descriptor()

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        return self.inner.connect(descriptor, token)

    def admit(self, descriptor: dict) -> bytes:
        return self.inner.admit(descriptor)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._cut.add(peer)
        self.inner.disconnect(peer)

    def expect(self, request_id: str, ranges: ByteRanges, capability: bytes = b"",
               senders: frozenset[str] | None = None) -> None:
        self.inner.expect(request_id, ranges, capability, senders)

    def fencing(self) -> dict:
        return self.inner.fencing()

    def forget(self, request_id: str) -> bool:
        return self.inner.forget(request_id)

    @property
    def rejected(self):
        return self.inner.rejected

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"", capability: bytes = b"") -> TransferHandle:
        f = self.faults
        with self._lock:
            fail = f.fail_submits > 0 or request_id in f.fail_requests
            if f.fail_submits > 0:
                f.fail_submits -= 1
            delay = f.delay_requests.get(request_id, f.submit_delay)
        if fail:
            handle = TransferHandle(request_id, plan.nbytes, timeout)
            handle.finish(PeerError(f"request {request_id}: {INJECTED}: submit failed"), release=True)
            return handle
        if request_id in f.late_acks:
            handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
            inner = self.inner.submit(peer, request_id, plan, timeout=timeout, notify=notify, capability=capability)
            _follow(inner, handle, lambda: request_id in f.late_acks and peer not in self._cut,
                    lambda: PeerError(f"request {request_id}: {INJECTED}: peer {peer} was disconnected before "
                                      f"its ack") if peer in self._cut else None)
            return handle
        if delay <= 0:
            return self.inner.submit(peer, request_id, plan, timeout=timeout, notify=notify,
                                     capability=capability)
        # Late: the caller gets a handle now; the inner transfer starts after the delay, with what
        # is left of the deadline, and its end completes the caller's handle.
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)

        def start() -> None:
            left = handle.deadline - time.monotonic()
            inner = self.inner.submit(peer, request_id, plan, timeout=max(left, 0.001), notify=notify,
                                      capability=capability)
            _follow(inner, handle)
        timer = threading.Timer(delay, start)
        timer.daemon = True
        with self._lock:
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()
        return handle

    def writes_pending(self, request_id: str) -> bool:
        return request_id in self.faults.hold_pending or self.inner.writes_pending(request_id)

    def arrivals(self, timeout: float = 0.0) -> list[Arrival]:
        return [a for a in self.inner.arrivals(timeout) if self._keep(a)]

    def set_arrival_callback(self, fn: Callable[[Arrival], None]) -> bool:
        def filtered(a: Arrival) -> None:
            if self._keep(a):
                fn(a)
        return self.inner.set_arrival_callback(filtered)

    def close(self) -> None:
        with self._lock:
            timers, self._timers = self._timers, []
        for t in timers:
            t.cancel()
        self.inner.close()

    # -- faults -----------------------------------------------------------------------------
    def crash_io(self, error: BaseException | None = None) -> None:
        """Make the inner transport's I/O thread die, as of a bug (transports on the kit)."""
        commands = getattr(self.inner, "commands", None)
        if commands is None:
            raise TypeError(f"transport {self.inner.name!r} has no I/O thread to crash")
        commands.put(Crash(error or RuntimeError(f"{INJECTED}: I/O thread crash")))

    @property
    def broken(self) -> str | None:
        return getattr(self.inner, "broken", None)

    def _keep(self, a: Arrival) -> bool:
        if a.request_id in self.faults.drop_arrivals:
            with self._lock:
                self.dropped += 1
            return False
        return True


def _follow(inner: TransferHandle, outer: TransferHandle, hold: Callable[[], bool] = lambda: False,
            error: Callable[[], Exception | None] = lambda: None) -> None:
    """Complete ``outer`` as ``inner`` completes, once ``hold()`` is false, with ``error()`` if it
    gives one (a thread per delayed or late-acked submit: tests only)."""
    def wait() -> None:
        inner.wait()
        while not inner.source_released or hold():   # the caller may reuse the source only after the inner one
            time.sleep(0.005)
        outer.finish(error() or inner.error, release=True)
    threading.Thread(target=wait, daemon=True, name="kvxfer-faulty-follow").start()
