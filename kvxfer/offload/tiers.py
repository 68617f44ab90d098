"""The tiers under the device: host pools, the file tier, and the records they hold.

Who calls what: the engine builds a ``HostPool`` at start-up (``HostPool.for_pool``);
everything else here is used only by ``kvxfer.offload.DecodeOffloadManager``. Its
background thread calls ``Tiers.alloc`` for each copy (which evicts LRU records to
the ``FileStore`` when host memory is full); its ``reload``/``restore``/``flush`` call
``Tiers.materialize``/``find``/``flush``. Nothing here talks to a device or a group.

A *record* is one contiguous piece of a request's KV: a *chunk* (``stride`` tokens of
the streamed spaces, whole pages) or a *tail* (the last partial stride plus the
snapshot spaces: a sliding window, a state slot). On file it is held in its
**compact layout** (``compact_layout``): the layer-first host layout of exactly its
token counts, so a record found by a process with another host layout or another
page table still loads.

Keys form a hash chain over token ids, so a prefix offloaded once is found again::

    page_key[i] = blake2b(page_key[i-1] | token_ids of page i)      (page_key[-1] = seed)
    tail_key    = blake2b(page_key[last full page] | "tail" | remaining token ids | n)

The seed names the layout signature and the TP shard, so keys of different models or
ranks never meet. A chunk file is named by its last page key (it covers the whole
prefix); ``find`` looks records up by their first page key.

On disk, per record: ``<key>.bin`` (the payload: for each part of the compact layout,
its rows in position order, back to back) and ``<key>.meta`` (msgpack: format, layout,
positions, keys, length, blake2b digest). Never pickle. Both are written to a temp name
and renamed; the meta goes last, so a record without meta does not exist. ``get``
checks format, layout, length and digest before returning a byte.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..copy import execute_plan
from ..errors import LayoutError, RequestError, StorageError
from ..host import HostPool
from ..layout import Layout, restrict_layout
from ..plan import Planner
from .records import DONE, Record, State, compact_layout, compact_slots
from .store import FileStore

log = logging.getLogger("kvxfer.offload")


@dataclass(slots=True)
class OffloadStats:
    records_offloaded: int = 0
    bytes_offloaded: int = 0
    records_deduped: int = 0
    records_evicted: int = 0      # host -> file
    records_dropped: int = 0      # unreferenced cache freed (no file tier)
    records_reloaded: int = 0
    bytes_reloaded: int = 0
    file_reads: int = 0
    offload_copy_s: float = 0.0   # seconds spent copying (after the readiness waits), offload
    reload_copy_s: float = 0.0    # ... and reload: what the planning and bookkeeping add is the rest


class Tiers:
    """Host memory (LRU) over an optional file tier, and the index of every record by its
    first key. Thread-safe: the manager's scheduler thread and its background thread share
    ``cond`` (methods named ``*_locked`` expect it held)."""

    def __init__(self, host: HostPool, store: FileStore | None):
        self.host, self.store = host, store
        self.cond = threading.Condition()
        self.index: dict[bytes, list[Record]] = {}
        self.lru: OrderedDict[int, Record] = OrderedDict()
        self.stats = OffloadStats()
        self._planners: OrderedDict[tuple, tuple] = OrderedDict()
        self._plock = threading.Lock()

    # -- bookkeeping (cond held) ------------------------------------------------------
    def add_locked(self, rec: Record) -> Record:
        self.index.setdefault(rec.first, []).append(rec)
        return rec

    def hold_locked(self, rec: Record, notify: bool = True) -> None:
        """``rec`` is now in host memory: evictable, most recently used. ``notify`` False: the
        caller notifies once for a batch of records."""
        rec.state = State.HOST
        self.lru[id(rec)] = rec
        if notify:
            self.cond.notify_all()

    def touch_locked(self, rec: Record) -> None:
        if id(rec) in self.lru:
            self.lru.move_to_end(id(rec))

    def drop_locked(self, rec: Record, notify: bool = True) -> None:
        if rec.host_slots is not None:
            self.host.free(rec.host_slots)
            rec.host_slots = None
        rec.state = State.DROPPED
        self.lru.pop(id(rec), None)
        same = self.index.get(rec.first, [])
        if rec in same:
            same.remove(rec)
        if notify:
            self.cond.notify_all()

    # -- host memory ---------------------------------------------------------------------
    def alloc(self, tokens: Mapping[str, int], wait: bool, closing: Callable[[], bool]) -> dict[str, np.ndarray]:
        """Host slots for a record. When host memory is full, evict the least recently used
        unpinned record to the file tier (without one: drop unreferenced cache); when nothing
        can go, wait for room (``wait``) or raise RequestError."""
        return self.alloc_many([tokens], wait, closing)[0]

    def alloc_many(self, sizes: Sequence[Mapping[str, int]], wait: bool,
                   closing: Callable[[], bool]) -> list[dict[str, np.ndarray]]:
        """Host slots for the records of ``sizes`` copied together, in one allocation: evict
        (as ``alloc``) until all fit or nothing more can go, then take the leading records that
        fit. Returns at least one (waiting for room when ``wait``, else RequestError)."""
        biggest: dict[str, int] = {}
        for tokens in sizes:
            for s, n in tokens.items():
                biggest[s] = max(n, biggest.get(s, 0))
        for s, n in biggest.items():
            if n > self.host.capacity(s):
                raise LayoutError(f"a record of {n} tokens in space {s!r} exceeds the host pool "
                                  f"({self.host.capacity(s)} slots): raise HostPool size")
        while True:
            with self.cond:
                fit = self.host.fits(sizes)
                victims = self._victims_locked(sizes) if fit < len(sizes) else []
                if not victims:
                    if fit:
                        return self.host.alloc_many(sizes[:fit])
                    if not wait or closing():
                        short = sorted(s for s, n in self._pages_needed(sizes).items()
                                       if n > self.host.allocators[s].free_pages)
                        raise RequestError(f"host pool is full (spaces {short}) and nothing can be "
                                           f"evicted" + ("" if self.store else ": set OffloadConfig.storage_dir"))
                    self.cond.wait(0.05)
                    continue
                for v in victims:
                    v.pins += 1
            self._evict(victims)

    def _pages_needed(self, sizes: Sequence[Mapping[str, int]]) -> dict[str, int]:
        need: dict[str, int] = {}
        for tokens in sizes:
            for s, n in tokens.items():
                need[s] = need.get(s, 0) + self.host.allocators[s].pages_for(n)
        return need

    def _victims_locked(self, sizes: Sequence[Mapping[str, int]]) -> list[Record]:
        """Least recently used evictable records, enough to make room for all of ``sizes`` (or
        every one there is): evicted in one go rather than one per allocation attempt."""
        need, victims = self._pages_needed(sizes), []
        free = {s: self.host.allocators[s].free_pages for s in need}
        for r in self.lru.values():
            short = {s for s in need if need[s] > free[s]}
            if not short:
                break
            if r.pins == 0 and r.state == State.HOST and (self.store is not None or r.refs == 0) \
                    and short & set(r.positions):
                victims.append(r)
                for s, slots in r.host_slots.items():
                    if s in free:
                        free[s] += self.host.allocators[s].pages_for(len(slots))
        return victims

    def _evict(self, recs: list[Record]) -> None:
        """Move pinned ``recs`` out of host memory: to the file tier, or dropped when nothing
        refers to them and there is no file tier."""
        wrote = set()
        try:
            for rec in recs:
                if self.store is not None and not rec.on_file:
                    self.write_file(rec)   # file I/O without the lock; the pin keeps the host slots
                    wrote.add(id(rec))
        finally:
            with self.cond:
                freed = []   # host slots of every record that leaves: freed with one call per space
                for rec in recs:
                    rec.pins -= 1
                    rec.on_file |= id(rec) in wrote
                    if rec.pins == 0 and rec.state == State.HOST:
                        if rec.on_file:
                            freed.append(rec.host_slots)
                            rec.host_slots, rec.state = None, State.FILE
                            self.lru.pop(id(rec), None)
                            self.stats.records_evicted += 1
                        elif rec.refs == 0:
                            freed.append(rec.host_slots)
                            rec.host_slots = None
                            self.drop_locked(rec, notify=False)   # one notify below
                            self.stats.records_dropped += 1
                if freed:
                    self.host.free({s: np.concatenate([f[s] for f in freed if s in f])
                                    for s in {s for f in freed for s in f}})
                self.cond.notify_all()

    def flush(self) -> int:
        """Write every host record not yet on file; returns how many were written."""
        with self.cond:
            todo = [r for r in self.lru.values() if not r.on_file]
            for r in todo:
                r.pins += 1
        try:
            for r in todo:
                self.write_file(r)
                with self.cond:
                    r.on_file = True
        finally:
            with self.cond:
                for r in todo:
                    r.pins -= 1
                self.cond.notify_all()
        return len(todo)

    # -- the compact record format ----------------------------------------------------------
    def compact(self, tokens: Mapping[str, int]) -> tuple[Layout, Planner, Planner]:
        """A record size's compact layout, with host->compact and compact->device planners."""
        key = tuple(sorted(tokens.items()))
        with self._plock:
            if key not in self._planners:
                F = compact_layout(self.host.device_layout, tokens)
                spaces = [s.name for s in F.spaces]
                self._planners[key] = (F, Planner(restrict_layout(self.host.layout, spaces), F),
                                       Planner(F, self.host.device_layout))
                if len(self._planners) > 64:
                    self._planners.popitem(last=False)
            self._planners.move_to_end(key)
            return self._planners[key]

    def _to_compact(self, rec: Record) -> tuple[Layout, list[torch.Tensor]]:
        F, to_f, _ = self.compact(rec.tokens)
        regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in F.regions]
        execute_plan(to_f.plan(rec.host_slots, compact_slots(F, rec.tokens)), self.host.regions(), regions)
        return F, regions

    def write_file(self, rec: Record) -> None:
        self.store.put(rec.meta(), *self._to_compact(rec))

    def materialize(self, rec: Record) -> list[torch.Tensor]:
        """The (pinned) record's bytes in its compact layout, from host memory or the file tier."""
        if rec.state == State.HOST:
            return self._to_compact(rec)[1]
        self.stats.file_reads += 1
        return self.store.get(rec.key, expect=self.compact(rec.tokens)[0])[2]

    # -- lookup ------------------------------------------------------------------------------
    def find(self, first: bytes, chain: list[bytes] | None, pos: int, page_size: int, rank: int) -> Record | None:
        """A stored record starting with key ``first``: a chunk at position ``pos`` whose page
        keys continue ``chain``, or (``chain`` None) a tail. Host index first, then files."""
        def fits(keys, kind, start) -> bool:
            if chain is None:
                return kind == "tail"
            i = pos // page_size
            return kind == "chunk" and start == pos and tuple(chain[i:i + len(keys)]) == tuple(keys)
        with self.cond:
            mine = [r for r in self.index.get(first, ()) if r.state in DONE and fits(r.page_keys, r.kind, r.start)]
        if mine:
            return max(mine, key=lambda r: len(r.page_keys))
        for key in (self.store.find(first) if self.store is not None else ()):
            try:
                meta = self.store.read_meta(key)
            except StorageError as e:
                log.warning("skipping unreadable record: %s", e)
                continue
            if fits(meta.page_keys, meta.kind, meta.start):
                with self.cond:
                    return self.add_locked(Record.of_meta(meta, State.FILE, rank, on_file=True))
        return None
