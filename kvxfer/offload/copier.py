"""The byte moves of offload: device -> host on a background thread, host or file -> device
on the caller's thread. One ``Copier`` per manager.

Records queued together (a burst of stride boundaries, a batch of releases) share one plan
and one execution (``Planner`` / ``execute_plan``, the same for every layout). On a GPU,
offloads and reloads run on two streams of their own, so a blocking reload never queues
behind offloads, and every copy first waits for the readiness event of the KV it reads.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..copy import execute_plan, host_table
from ..errors import RequestError
from ..host import HostPool
from ..plan import Planner
from ..pools import KVPool
from .records import DONE, Record, State, compact_slots
from .tiers import Tiers

log = logging.getLogger("kvxfer.offload")
EMPTY = np.zeros(0, np.int64)
MAX_BATCH = 64   # records the background thread copies with one plan

#: ``(tensor, source rank, what)``: a broadcast over the TP group, in place
Broadcast = Callable[[torch.Tensor, int, str], None]


def concat_slots(pool: KVPool, items: Iterable, side: Callable) -> dict[str, np.ndarray]:
    """Per space of ``pool``: the slots ``side(item)`` of every item, concatenated."""
    items = list(items)
    return {s.name: np.concatenate([side(it).get(s.name, EMPTY) for it in items] or [EMPTY])
            for s in pool.layout.spaces}


class Copier:
    """Copies records between ``pool`` and ``host`` (and the file tier of ``tiers``). ``enqueue``
    hands records to the background thread; ``load`` copies records back, blocking."""

    def __init__(self, pool: KVPool, host: HostPool, tiers: Tiers, *, rank: int):
        self.pool, self.host, self.tiers, self.rank = pool, host, tiers, rank
        self.stats = tiers.stats
        self._cond = tiers.cond
        self.closing = False
        self._cuda = pool.device.type == "cuda"
        self._d2h, self._h2d = Planner(pool.layout, host.layout), Planner(host.layout, pool.layout)
        # both pools' regions live as long as they do: read once, not on every copy (on the CPU)
        self._pool_regions = host_table(pool.regions()) or pool.regions()
        self._host_regions = host_table(host.regions()) or host.regions()
        # offloads and reloads on separate streams: a blocking reload never queues behind offloads
        self._offload_stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._reload_stream = torch.cuda.Stream(pool.device) if self._cuda else None
        # records waiting for the background thread, and how many it holds (taken, not finished),
        # under a condition of their own: one notify per enqueue call, and the thread is woken by
        # nothing else (the tiers' condition is notified on every record change)
        self._queue = threading.Condition(threading.Lock())
        self._pending: list[Record] = []
        self._busy = 0
        self._worker = threading.Thread(target=self._run, name=f"kvxfer-offload-r{rank}", daemon=True)
        self._worker.start()

    def enqueue(self, recs: list[Record | None], ready=None) -> int:
        """Queue the records (None: nothing to copy) behind ``ready`` (without it: an event
        recorded now on the current CUDA stream, or nothing on the CPU); returns how many."""
        queued = [r for r in recs if r is not None]
        if queued:
            event = ready
            if event is None and self._cuda:
                event = torch.cuda.current_stream(self.pool.device).record_event()
            for rec in queued:
                rec.event = event
            with self._queue:
                self._pending.extend(queued)
                self._queue.notify_all()   # drain() waits on this condition too: wake the worker for sure
        return len(queued)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no copy is queued or running."""
        with self._queue:
            return self._queue.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        if not self.closing:
            with self._queue:
                self.closing = True   # the worker copies what is queued, then ends
                self._queue.notify_all()
            with self._cond:          # a copy waiting for host room gives up
                self._cond.notify_all()
            self._worker.join(timeout=30)

    # ---------------------------------------------------------------- device -> host
    def _run(self) -> None:
        """The background thread: device -> host copies in step order. Records queued together
        (a burst of boundaries, a batch of releases) share one plan and one execution; it sleeps
        on the condition until a record is queued (no polling)."""
        carry: list[Record] = []
        while True:
            with self._queue:
                while not (carry or self._pending or self.closing):
                    self._queue.wait()
                if not (carry or self._pending):
                    return   # closing, and nothing is left
                take = max(0, MAX_BATCH - len(carry))
                recs = carry + self._pending[:take]
                del self._pending[:take]
                self._busy = len(recs)
            carry = []
            try:
                carry = self._offload(recs)
            except Exception as e:
                log.exception("offload of %d records failed", len(recs))
                with self._cond:
                    for rec in recs:
                        if rec.state in (State.QUEUED, State.COPYING):
                            if rec.host_slots is not None:
                                self.host.free(rec.host_slots)
                                rec.host_slots = None
                            rec.state, rec.error = State.FAILED, f"{type(e).__name__}: {e}"
            finally:
                with self._queue:
                    self._busy = len(carry)
                    self._queue.notify_all()
                with self._cond:   # forget() waits for records that stopped copying
                    self._cond.notify_all()

    def _offload(self, recs: list[Record]) -> list[Record]:
        """Copy ``recs`` (those still queued) to host in one plan, into one host allocation:
        wait for room for the first, take what fits for the others (evicting as needed), and
        return the rest, for the next round."""
        queued = [r for r in recs if r.state == State.QUEUED]
        if not queued:
            return []
        got = self.tiers.alloc_many([r.tokens for r in queued], wait=True, closing=lambda: self.closing)
        todo: list[Record] = []
        with self._cond:
            for rec, slots in zip(queued, got):
                if rec.state != State.QUEUED:   # cancelled by forget() while we waited for room
                    self.host.free(slots)
                    continue
                rec.host_slots, rec.state = slots, State.COPYING
                todo.append(rec)
        carry = queued[len(got):]
        if not todo:
            return carry
        plan = self._d2h.plan(concat_slots(self.pool, todo, lambda r: r.src),
                              concat_slots(self.pool, todo, lambda r: r.host_slots))
        took = self._copy(plan, self._pool_regions, self._host_regions, [r.event for r in todo],
                          self._offload_stream)
        with self._cond:
            self.stats.offload_copy_s += took
            for rec in todo:
                rec.src = rec.event = None
                self.tiers.hold_locked(rec, notify=False)
            self.stats.records_offloaded += len(todo)
            self._cond.notify_all()
            self.stats.bytes_offloaded += plan.nbytes
        return carry

    def _copy(self, plan, src, dst, events=(), stream=None) -> float:
        """Execute ``plan`` once every event of ``events`` completed (the readiness contract):
        CUDA events are waited for on ``stream`` (the GPU orders the copy after the writes),
        any other ready object is synchronized here, on the calling thread, first. Returns the
        seconds the copy took, the waits for host-side events not counted."""
        events = list({id(e): e for e in events if e is not None}.values())
        for event in events:
            if not (self._cuda and isinstance(event, torch.cuda.Event)):
                event.synchronize()
        t = time.perf_counter()
        if self._cuda:  # on its own stream, after the steps (or reload) that own the slots
            with torch.cuda.stream(stream):
                for event in events:
                    if isinstance(event, torch.cuda.Event):
                        stream.wait_event(event)
                execute_plan(plan, src, dst)
            stream.synchronize()
        else:
            execute_plan(plan, src, dst)
        return time.perf_counter() - t

    # ---------------------------------------------------------------- host or file -> device
    def load(self, todo: list[tuple[Record, dict[str, np.ndarray]]], bcast: Broadcast | None = None,
             whole: dict[str, np.ndarray] | None = None) -> None:
        """Copy records to device slots: those in host memory with one plan; records on file,
        and (``bcast`` given: replicated KV over a group) records broadcast by their storing
        rank, one by one. ``whole``: every record's destination slots, concatenated in order
        per space (the caller has them: saves concatenating them again)."""
        with self._cond:
            for rec, _ in todo:
                if rec.state not in DONE:
                    raise RequestError(f"record {rec.key.hex()} is {rec.state.name}, not offloaded")
            for rec, _ in todo:   # pinned: never evicted while we read it
                rec.pins += 1
                self.tiers.touch_locked(rec)
            together = [(r, d) for r, d in todo if r.state == State.HOST] if bcast is None else []
        try:
            event = torch.cuda.current_stream(self.pool.device).record_event() if self._cuda else None
            if together:
                dst = ({sp.name: whole.get(sp.name, EMPTY) for sp in self.pool.layout.spaces}
                       if whole is not None and len(together) == len(todo)
                       else concat_slots(self.pool, together, lambda rd: rd[1]))
                plan = self._h2d.plan(concat_slots(self.pool, together, lambda rd: rd[0].host_slots), dst)
                self.stats.reload_copy_s += self._copy(plan, self._host_regions, self._pool_regions, [event],
                                                       self._reload_stream)
                self.stats.bytes_reloaded += plan.nbytes
            done = {id(r) for r, _ in together}
            for rec, dst in todo:
                if id(rec) in done:
                    continue
                compact, _, from_compact = self.tiers.compact(rec.tokens)
                if bcast is not None:
                    regions = (self.tiers.materialize(rec) if rec.storer == self.rank
                               else [torch.zeros(r.nbytes, dtype=torch.uint8) for r in compact.regions])
                    for t in regions:
                        bcast(t, rec.storer, "reload broadcast")
                else:
                    regions = self.tiers.materialize(rec)
                plan = from_compact.plan(compact_slots(compact, rec.tokens), dst)
                self.stats.reload_copy_s += self._copy(plan, regions, self._pool_regions, [event],
                                                       self._reload_stream)
                self.stats.bytes_reloaded += plan.nbytes
            self.stats.records_reloaded += len(todo)
        finally:
            with self._cond:
                for rec, _ in todo:
                    rec.pins -= 1
                self._cond.notify_all()


__all__ = ["Copier", "concat_slots", "Broadcast", "MAX_BATCH"]
