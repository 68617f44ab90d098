"""The records of a request: ``OffloadRequest`` (what one request has stored) and ``Recorder``,
which turns a request's token ids and slots into records (a ``chunk`` per ``stride`` tokens of the
streamed spaces, a ``tail`` at release), reusing an equal finished record of the same prefix.

Who calls what: ``DecodeOffloadManager`` (its scheduler-thread calls ``step``, ``release``,
``receive_to_host``) calls ``chunk`` and ``tail``; the records they return are queued to the
copier by the manager. Records are added to the tiers under ``tiers.cond``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..pools import KVPool
from .records import DONE, Record, State, page_keys, tail_key
from .tiers import OffloadStats, Tiers

EMPTY = np.zeros(0, np.int64)


@dataclass(slots=True, eq=False)
class OffloadRequest:
    """One request an offload manager knows: its key chain, its records and its phase."""
    rid: str
    chain: list[bytes] = field(default_factory=list)   # page keys of positions [0, streamed)
    streamed: int = 0                                   # positions [0, streamed) are in chunks
    chunks: list[Record] = field(default_factory=list)
    tail: Record | None = None
    phase: str = "running"                              # running | releasing | offloaded | receiving

    @property
    def records(self) -> list[Record]:
        return self.chunks + ([self.tail] if self.tail is not None else [])


class Recorder:
    """Records of one decode rank's requests (see the module docstring). ``stream``: the spaces
    stored in chunks as a request grows; ``snapshot``: those stored at release only; ``kps``: the
    page size of the key chain; ``seed``: its first key (the rank's namespace)."""

    def __init__(self, pool: KVPool, tiers: Tiers, *, stride: int, stream: tuple[str, ...],
                 snapshot: tuple[str, ...], kps: int, seed: bytes, rank: int, size: int, replicated: bool):
        self.pool, self.tiers, self.stride, self.stream, self.snapshot = pool, tiers, stride, stream, snapshot
        self.kps, self.seed, self.rank, self.size, self.replicated = kps, seed, rank, size, replicated
        self.stats: OffloadStats = tiers.stats

    def storer(self, first: bytes) -> int:
        """The rank of the group that stores a record whose first key is ``first`` (replicated KV:
        one rank, from the key; else this one)."""
        return int.from_bytes(first[:8], "little") % self.size if self.replicated else self.rank

    def chunk(self, req: OffloadRequest, token_ids, slots, receive: bool = False) -> Record | None:
        """The next ``stride`` positions of the streamed spaces become a record, or reuse an
        equal one (same prefix). Returns the record to copy, if any."""
        a, n = req.streamed, self.stride
        keys = page_keys(req.chain[-1] if req.chain else self.seed, np.asarray(token_ids[a:a + n]), self.kps)
        req.chain.extend(keys)
        req.streamed = a + n
        # worked out before taking the lock, which the background thread holds while it allocates:
        # the scheduler thread waits for it as little as it can
        src = {s: np.asarray(self.pool.space_slots(s, np.asarray(slots[a:a + n], np.int64)), np.int64)
               for s in self.stream}
        pos = np.arange(a, a + n, dtype=np.int64)
        with self.tiers.cond:
            if not receive:
                for old in self.tiers.index.get(keys[0], ()):   # only finished records: a queued copy
                    if old.start == a and old.page_keys == tuple(keys) and old.state in DONE:  # reads its own slots
                        old.refs += 1
                        req.chunks.append(old)
                        self.stats.records_deduped += 1
                        self.tiers.touch_locked(old)
                        return None
            rec = self.new(keys[-1], keys[0], "chunk", a, {s: pos for s in self.stream}, tuple(keys), src, receive)
        req.chunks.append(rec)
        return rec if rec.state == State.QUEUED else None

    def tail(self, req: OffloadRequest, token_ids, slots, snap=None) -> Record | None:
        """The last partial stride plus the snapshot spaces: at release, the slots mapped now
        (a window, a state slot); for a receive, ``snap``'s positions."""
        if not self.snapshot and snap is None and req.streamed == len(token_ids):   # nothing left over
            self.supersede_tail(req)
            return None
        a, s_all, tok = req.streamed, np.asarray(slots, dtype=np.int64), np.asarray(token_ids, dtype=np.int64)
        positions = {s: np.arange(a, len(tok), dtype=np.int64) for s in self.stream}
        src = {s: np.asarray(self.pool.space_slots(s, s_all[a:len(tok)]), np.int64) for s in self.stream}
        for s in self.snapshot:
            if snap is not None:
                positions[s], src[s] = snap.get(s, EMPTY), EMPTY
            else:
                mapped = np.asarray(self.pool.space_slots(s, s_all), np.int64)
                positions[s] = np.flatnonzero(mapped != 0)
                src[s] = mapped[positions[s]]
        positions = {s: p for s, p in positions.items() if len(p)}
        self.supersede_tail(req)
        if not positions:
            return None
        key = tail_key(req.chain[-1] if req.chain else self.seed, tok[a:], len(tok))
        with self.tiers.cond:
            req.tail = self.new(key, key, "tail", a, positions, (), {s: src[s] for s in positions}, snap is not None)
        return req.tail if req.tail.state == State.QUEUED else None

    def supersede_tail(self, req: OffloadRequest) -> None:
        """``req``'s previous tail (an earlier release's) is dropped: a new one replaces it."""
        if req.tail is not None:   # the previous release's tail is superseded
            with self.tiers.cond:
                req.tail.refs -= 1
            req.tail = None

    def new(self, key, first, kind, start, positions, keys, src, receive) -> Record:
        """A record added to the tiers (under ``tiers.cond``): queued to copy, receiving, or a
        phantom when another rank stores it."""
        storer = self.storer(first)
        state = State.PHANTOM if storer != self.rank else State.RECEIVING if receive else State.QUEUED
        return self.tiers.add_locked(Record(key=key, first=first, kind=kind, start=start, positions=positions,
                                            page_keys=keys, state=state, storer=storer,
                                            src=None if receive else src))
