"""Ready before report: an incoming transfer's arrival waits until its bytes are on the device.

A receiving region on a CUDA device gets each message's bytes from host memory (the received
zmq frame) by copies enqueued on the transport's own stream; an event recorded after them says
when they are complete. The I/O thread never waits on it: the transfer's arrival and ack are
held (``hold``) and handed out (``ready``) once the event's ``query()`` turns True, so one
peer's copies never stall another's messages. ``writes_pending(request_id)`` stays True while
an event of that request is pending, so its memory is not reused under a copy still running.

``event`` (injectable, tests): a factory of objects with ``record(stream=None)`` and
``query()``; when given, every write records one, on host regions too (a CPU test's stand-in
that completes late proves the arrival waits). Default: ``torch.cuda.Event`` for device writes
only; host writes are complete when they return.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch


class WriteSync:
    """I/O thread, except ``busy`` (any thread)."""

    def __init__(self, event: Callable[[], Any] | None = None):
        self.factory = event
        self.stream: Any = None                 # torch.cuda.Stream of the device regions
        self.pending: dict[str, Any] = {}       # request id -> event after its latest write
        self.waiting: collections.deque[tuple[Any, Any]] = collections.deque()   # (event, held item)

    def configure(self, regions: Sequence[torch.Tensor]) -> None:
        """At ``register``: a stream on the regions' device, when one is a CUDA device."""
        dev = next((r.device for r in regions if r.device.type == "cuda"), None)
        self.stream = torch.cuda.Stream(dev) if dev is not None else None

    def needed(self, device: bool) -> bool:
        return device or self.factory is not None

    def write(self, request_id: str, fn: Callable[[], None], device: bool) -> Any:
        """Run ``fn`` (the copies), enqueued on the transport's stream when it writes a device
        region; record an event after it and return it."""
        if device and self.stream is not None:
            with torch.cuda.stream(self.stream):
                fn()
            ev = (self.factory or torch.cuda.Event)()
            ev.record(self.stream)
        else:
            fn()
            ev = self.factory() if self.factory is not None else _Done()
            ev.record()
        self.pending[request_id] = ev
        return ev

    def busy(self, request_id: str) -> bool:
        """Any thread: may a copy of this request still be running?"""
        ev = self.pending.get(request_id)
        return ev is not None and not ev.query()

    def hold(self, event: Any, item: Any) -> None:
        """``item`` (an arrival and its ack) is handed out by ``ready`` once ``event`` completed."""
        self.waiting.append((event, item))

    def ready(self) -> list:
        """Held items whose events completed, in the order they were held (one stream completes
        its events in order, so waiting at the first pending one delays nothing)."""
        out = []
        while self.waiting and self.waiting[0][0].query():
            out.append(self.waiting.popleft()[1])
        return out

    def prune(self) -> None:
        """Forget the events that completed (the loop's tick); bounded by the open requests."""
        if self.pending:
            self.pending = {r: ev for r, ev in self.pending.items() if not ev.query()}

    def drop(self) -> list:
        """Everything held (the transport closes): the items, never handed out."""
        items = [item for _, item in self.waiting]
        self.waiting.clear()
        return items


class _Done:
    """A host write is complete when it returns."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True
