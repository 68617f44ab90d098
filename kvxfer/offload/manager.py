"""Decode-side KV offload: one manager per decode rank, coordinated over its TP group.

Who calls what, and when. Every call is made by the engine's scheduler thread, and
every rank of a TP group makes the same calls in the same order (the scheduler runs in
lock-step across the group, as in SGLang). Calls marked (collective) talk to the group.

start-up      ``host = HostPool.for_pool(pool, layout="layer_first", size=...)``
              ``mgr = DecodeOffloadManager(pool, host, OffloadConfig(stride=...), group=cpu_group)``
              configuration that cannot work raises ``LayoutError`` here, naming field and values;
              ``group`` must be CPU-capable (gloo): any other backend is refused here.
every step    ``mgr.step([(rid, token_ids, slots), ...], ready=event)`` after the forward was
              *enqueued*. Never blocks: when a request crosses a stride boundary it queues that
              stride's copy; a background thread moves the bytes through the planner
              (``Planner`` / ``execute_plan``, the same for every layout), on its own CUDA
              stream (offloads) when the pool is on a GPU.
ready         The readiness contract: ``ready`` is any object with ``query()`` and
              ``synchronize()`` (a ``torch.cuda.Event`` recorded after the step's KV writes, in
              production) that completes when the KV of the step is written. No byte of the
              step's source slots is read before it completed: a CUDA event is waited for on the
              offload stream, anything else is synchronized on the background thread. Without
              ``ready``, the manager records an event on the current CUDA stream at the call
              (GPU), or takes the KV as written (CPU). ``release`` takes ``ready`` too.
              ``mgr.poll()`` (collective while releases are pending: all_reduce(MIN)) returns
              the requests whose device slots the engine may free *now*: the same list on
              every rank, and only requests that every rank holds on host (or on file).
suspend/finish ``mgr.release(rid, token_ids, slots)``: queues the last partial stride and the
              snapshot spaces; the engine keeps the slots until a later ``poll()`` lists rid.
resume        ``mgr.reload(rid, slots)`` (collective for replicated KV): blocking, byte-exact
              into freshly allocated slots; ``mgr.reload_many({rid: slots, ...})`` resumes a
              batch with one plan and one copy. For a request this manager does not know (a shared
              prefix, or files written before a restart) call ``mgr.restore(rid, token_ids)``
              (collective) first.
end           ``mgr.forget(rid)``: the request is done; its records stay as cache (LRU).
direct-to-host ``grant = mgr.receive_to_host(rid, token_ids)``; prefill plans into
              ``host.layout`` at ``grant.slots`` (``host.regions()`` are registered with the
              transport like a device pool's), then ``mgr.commit_received(rid)``; later reload.
shutdown      ``mgr.flush()`` writes host records to the file tier; ``mgr.close()``.

Words. A *record* is one stored piece of a request: a *chunk* (``stride`` tokens of the
*streamed* spaces, which are append-only, page-aligned) or a *tail* (the last partial
stride plus the *snapshot* spaces, meaningful only at release: a sliding window, a
state slot). For hybrid SWA, full-attention layers stream and sliding-window layers keep
only their window. Records are keyed by a hash chain over token ids
(``kvxfer.storage``), shared by requests with the same prefix, and move host -> file
under LRU. Replicated KV (MLA): each record is stored by one rank of the group, chosen
from its key; the others keep a *phantom* and receive the bytes by broadcast on reload.

This module keeps the requests; ``recorder`` makes their records, ``copier`` moves the bytes, ``group``
talks to the TP group, ``config`` holds the settings and result types (re-exported here).
"""
from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import LayoutError, PeerError, RequestError
from ..host import HostPool
from ..pools import KVPool
from .config import HostGrant, OffloadConfig, PollResult, check_ready
from .copier import Copier, concat_slots
from .group import TPGroup, check_cpu_group, group_min
from .recorder import OffloadRequest, Recorder
from .records import DONE, GONE, Record, RecordMeta, State, key_seed, page_keys, tail_key
from .store import FileStore
from .tiers import OffloadStats, Tiers


class DecodeOffloadManager:
    """Offload of one decode rank. ``group``: its TP group as a gloo (CPU) process group, or
    None for a single rank. See the module docstring for the calling contract."""

    def __init__(self, pool: KVPool, host: HostPool, config: OffloadConfig, *, group=None):
        check_cpu_group(group, "DecodeOffloadManager")
        self.pool, self.host, self.config, self.group = pool, host, config, group
        self._tp = TPGroup(group, config.group_timeout_s)
        self.rank, self.size = self._tp.rank, self._tp.size
        lay = pool.layout
        self.replicated = lay.kind == "mla" if config.replicated is None else bool(config.replicated)
        self.stream = tuple(s.name for s in lay.spaces if s.name in config.stream_spaces)
        self.snapshot = tuple(s.name for s in lay.spaces if s.name not in self.stream)
        if host.device_layout.signature != lay.signature:
            raise LayoutError(f"host pool was built for layout {host.device_layout.kind} "
                              f"({host.device_layout.signature}), this pool is {lay.kind} ({lay.signature})")
        for s in self.stream:
            ps = lay.space(s).page_size
            if config.stride % ps:
                raise LayoutError(f"OffloadConfig.stride {config.stride} is not a multiple of page_size {ps} "
                                  f"of space {s!r}: use {-(-config.stride // ps) * ps}")
            if host.capacity(s) < config.stride:
                raise LayoutError(f"host pool space {s!r} holds {host.capacity(s)} slots, less than one "
                                  f"OffloadConfig.stride ({config.stride} tokens): give HostPool size >= "
                                  f"{config.stride}")
        self._kps = lay.space(self.stream[0]).page_size if self.stream else 1   # pages of the key chain
        namespace = f"{lay.signature}|" + ("replicated" if self.replicated else f"tp{self.rank}of{self.size}")
        self._seed = key_seed(namespace)
        store = None
        if config.storage_dir:
            store = FileStore(Path(config.storage_dir) / hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest())
        self.tiers = Tiers(host, store)
        self.stats: OffloadStats = self.tiers.stats
        self._cond = self.tiers.cond
        self._requests: dict[str, OffloadRequest] = {}
        self._releasing: list[str] = []
        self._copier = Copier(pool, host, self.tiers, rank=self.rank)
        self._recorder = Recorder(pool, self.tiers, stride=config.stride, stream=self.stream, snapshot=self.snapshot,
                                  kps=self._kps, seed=self._seed, rank=self.rank, size=self.size,
                                  replicated=self.replicated)

    # ---------------------------------------------------------------- engine calls
    def step(self, batch: Iterable[tuple[str, Sequence[int], Sequence[int]]], *, ready=None) -> int:
        """Each decode step, for every running request: (rid, its token ids so far, the engine
        slots of those tokens as a host array). Queues the strides completed since the last
        call; returns how many copies it queued. O(1) per request between stride boundaries.
        ``ready``: completes when this step's KV is written (see the module docstring); the
        queued copies read nothing before it."""
        check_ready(ready)
        queued = []
        for rid, token_ids, slots in batch:
            req = self._requests.get(rid) or self._requests.setdefault(rid, OffloadRequest(rid))
            if req.phase != "running":
                raise RequestError(f"step: request {rid} is {req.phase}, not running (reload it first)")
            while self.stream and req.streamed + self.config.stride <= len(token_ids):
                queued.append(self._recorder.chunk(req, token_ids, slots))
        return self._enqueue(queued, ready)

    def release(self, rid: str, token_ids: Sequence[int], slots: Sequence[int], *, ready=None) -> None:
        """The engine suspends or finishes ``rid`` and stops writing its KV: queue what is not on
        host yet. Its device slots stay the engine's until ``poll()`` lists it. ``ready``: as
        for ``step`` (the last KV writes of ``rid``)."""
        check_ready(ready)
        req = self._requests.get(rid) or self._requests.setdefault(rid, OffloadRequest(rid))
        if req.phase != "running":
            raise RequestError(f"release: request {rid} is {req.phase}, not running")
        queued = []
        while self.stream and req.streamed + self.config.stride <= len(token_ids):
            queued.append(self._recorder.chunk(req, token_ids, slots))
        queued.append(self._recorder.tail(req, token_ids, slots))
        self._enqueue(queued, ready)
        req.phase = "releasing"
        self._releasing.append(rid)

    def poll(self) -> PollResult:
        """(collective while releases are pending) Requests whose offload finished on every rank.
        Raises PeerError when the group is broken (a rank died or stalled): nothing is released."""
        if not self._releasing:
            return PollResult([], [])
        pending = list(self._releasing)
        with self._cond:
            votes = [self._vote(self._requests[r]) for r in pending]
        if self.size > 1:
            h = zlib.crc32("\0".join(pending).encode()) & 0x7FFFFFFF
            head = self._tp.min([len(pending), -len(pending), h, -h], "release vote")
            if head[0] != -head[1] or head[2] != -head[3]:
                self._tp.broken = "TP ranks disagree on which requests are being released"
                raise PeerError(f"{self._tp.broken} (this rank: {pending}); no device slots were released")
            votes = self._tp.min(votes, "release vote")
        released, failed = [], []
        for rid, v in zip(pending, votes):
            req = self._requests[rid]
            if v == 1:
                req.phase = "offloaded"
                released.append(rid)
            elif v < 0:   # the engine still holds the KV on device; forget(rid) drops the records
                req.phase = "running"
                errs = [r.error for r in req.records if r.error]
                failed.append((rid, errs[0] if errs else "another rank of the TP group failed to offload"))
        self._releasing = [r for r in self._releasing if self._requests[r].phase == "releasing"]
        return PollResult(released, failed)

    def positions(self, rid: str) -> dict[str, np.ndarray]:
        """Request positions held per space: what ``reload`` needs slots for. For a hybrid SWA
        pool, map sliding-window slots for ``positions(rid)["swa"]`` before reloading."""
        out: dict[str, list] = {}
        for rec in self._get(rid).records:
            for s, p in rec.positions.items():
                out.setdefault(s, []).append(p)
        return {s: np.concatenate(v) for s, v in out.items()}

    def reload(self, rid: str, slots: Sequence[int]) -> None:
        """Blocking: copy the offloaded request into fresh engine ``slots`` (position i ->
        slots[i]; other spaces through ``pool.space_slots``), byte-exact; it runs again after.
        Collective for replicated KV (each record's storing rank broadcasts it)."""
        self.reload_many([(rid, slots)])

    def reload_many(self, batch: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]]) -> None:
        """``reload`` of several requests with one plan and one copy: what an engine that resumes a
        batch of requests in a step calls. ``batch``: ``{rid: slots}`` or ``(rid, slots)`` pairs.
        Every request is checked first (known, offloaded, listed once, its slots cover it): on a
        bad one it raises and copies nothing. Collective for replicated KV: every rank of the
        group passes the same requests in the same order."""
        items = list(batch.items() if isinstance(batch, Mapping) else batch)
        for it in items:
            if not (isinstance(it, tuple) and len(it) == 2):
                raise RequestError(f"reload_many takes {{rid: slots}} or (rid, slots) pairs, got {it!r:.80}")
        seen: set[str] = set()
        for rid, _ in items:
            req = self._get(rid)
            if req.phase != "offloaded":
                raise RequestError(f"reload: request {rid} is {req.phase}, not offloaded")
            if rid in seen:
                raise RequestError(f"reload_many: request {rid} is listed twice")
            seen.add(rid)
        todo: list[tuple[Record, dict[str, np.ndarray]]] = []
        whole: dict[str, list[np.ndarray]] = {}   # every record's destination, in todo's order, per space
        for rid, slots in items:
            for space, d in self._destinations(rid, slots, todo).items():
                whole.setdefault(space, []).append(d)
        if todo:
            self._copier.load(todo, self._tp.bcast if self.replicated and self.size > 1 else None,
                              whole={s: v[0] if len(v) == 1 else np.concatenate(v) for s, v in whole.items()})
        for rid, _ in items:
            self._requests[rid].phase = "running"

    def _destinations(self, rid: str, slots: Sequence[int],
                      todo: list[tuple[Record, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
        """Map ``rid``'s positions to device ``slots`` (position i -> slots[i], other spaces
        through ``pool.space_slots``), checked; append each record's share to ``todo`` (views of
        the request's arrays) and return the request's whole destination per space."""
        s, recs = np.asarray(slots, dtype=np.int64), self._requests[rid].records
        # every record's positions at once, per space: one mapping and one check for the request
        per_space: dict[str, list[np.ndarray]] = {}
        for rec in recs:
            for space, pos in rec.positions.items():
                per_space.setdefault(space, []).append(pos)
        mapped = {}
        for space, parts in per_space.items():
            pos = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if len(pos) and pos.max() >= len(s):
                raise LayoutError(f"reload {rid}: {len(s)} slots given, the request holds position "
                                  f"{int(pos.max())} in space {space!r}")
            d = mapped[space] = np.asarray(self.pool.space_slots(space, s[pos]), np.int64)
            if (d == 0).any():
                raise LayoutError(f"reload {rid}: no {space!r} slot mapped for positions "
                                  f"{pos[d == 0][:8].tolist()} (see positions(rid))")
        at = dict.fromkeys(mapped, 0)
        for rec in recs:
            dst = {}
            for space, pos in rec.positions.items():
                a = at[space]
                dst[space], at[space] = mapped[space][a:a + len(pos)], a + len(pos)
            todo.append((rec, dst))
        return mapped

    def forget(self, rid: str) -> None:
        """The request is over (after ``poll`` released it, after a failure, or on abort). Its
        queued copies are cancelled; a copy already reading its device slots is waited for (one
        batch at most). Its finished records stay as cache until evicted."""
        req = self._requests.get(rid)
        if req is None:
            return
        if req.phase == "releasing":
            raise RequestError(f"forget: request {rid} is being released; wait until poll() lists it")
        recs = req.records
        with self._cond:
            for rec in recs:   # never shared while queued or receiving (sharing needs a finished record)
                if rec.state in (State.QUEUED, State.RECEIVING):
                    self.tiers.drop_locked(rec)   # cancelled: the worker skips it
            self._cond.wait_for(lambda: all(r.state != State.COPYING for r in recs))   # reads our slots
            for rec in recs:
                rec.refs -= 1
                if rec.refs == 0 and rec.state == State.FAILED:
                    self.tiers.drop_locked(rec)
        del self._requests[rid]

    def restore(self, rid: str, token_ids: Sequence[int]) -> int:
        """(collective) Attach to ``rid`` the longest prefix of ``token_ids`` held on host or in
        the file tier on every rank; returns its length in tokens (0: none). ``reload`` then
        fills it. With snapshot spaces (SWA, state) only an exact match counts."""
        if rid in self._requests:
            raise RequestError(f"restore: request {rid} is already known")
        tok, n = np.asarray(token_ids, dtype=np.int64), len(token_ids)
        chain = page_keys(self._seed, tok, self._kps) if self.stream else []
        agreed = n
        while True:  # every rank runs the same rounds: stop only when all counts agree
            found, pos, tail = [], 0, None
            while self.stream and pos + self._kps <= agreed:
                rec = self._find(chain[pos // self._kps], chain, pos)
                if rec is None or pos + rec.tokens[self.stream[0]] > agreed:
                    break
                found.append(rec)
                pos += rec.tokens[self.stream[0]]
            if agreed == n and (pos < n or self.snapshot):
                tail = self._find(tail_key(chain[pos // self._kps - 1] if pos else self._seed, tok[pos:], n))
            count = n if tail is not None else 0 if self.snapshot else pos
            if self.size == 1 or self.replicated:   # replicated: every rank saw the storers' answers
                break
            lo, neg_hi = self._tp.min([count, -count], "restore vote")
            if lo == -neg_hi:
                break
            agreed = lo
        req = OffloadRequest(rid, phase="offloaded")
        if count:
            req.chunks, req.tail, req.streamed, req.chain = found, tail, pos, chain[:pos // self._kps]
        with self._cond:
            for rec in req.records:
                rec.refs += 1
        self._requests[rid] = req
        return count

    def receive_to_host(self, rid: str, token_ids: Sequence[int], *,
                        positions: Mapping[str, Sequence[int]] | None = None) -> HostGrant:
        """Reserve host slots for a request that prefill writes straight into host memory (no
        device slots). The streamed spaces take every token; ``positions`` gives the request
        positions of snapshot spaces (default none). Raises RequestError when the host is full.
        Replicated KV: only the storing rank's records are granted (others get empty arrays)."""
        if rid in self._requests:
            raise RequestError(f"receive_to_host: request {rid} is already known")
        tok = np.asarray(token_ids, dtype=np.int64)
        req = self._requests[rid] = OffloadRequest(rid, phase="receiving")
        ident = np.arange(len(tok), dtype=np.int64)
        while self.stream and req.streamed + self.config.stride <= len(tok):
            self._recorder.chunk(req, tok, ident, receive=True)
        self._recorder.tail(req, tok, ident, snap={s: np.asarray(v, np.int64) for s, v in (positions or {}).items()})
        mine = [r for r in req.records if r.state == State.RECEIVING]
        try:
            for rec in mine:
                rec.host_slots = self.tiers.alloc(rec.tokens, wait=False, closing=lambda: self._copier.closing)
        except Exception:
            req.phase = "running"
            self.forget(rid)
            raise
        return HostGrant(concat_slots(self.pool, mine, lambda r: r.positions),
                         concat_slots(self.pool, mine, lambda r: r.host_slots))

    def commit_received(self, rid: str, ok: bool = True) -> None:
        """Every byte of the grant landed (``ok``), or the transfer failed (host slots freed)."""
        req = self._get(rid)
        if req.phase != "receiving":
            raise RequestError(f"commit_received: request {rid} is {req.phase}, not receiving")
        req.phase = "running"
        if not ok:
            return self.forget(rid)
        with self._cond:
            for rec in req.records:
                if rec.state == State.RECEIVING:
                    self.tiers.hold_locked(rec)
        req.phase = "offloaded"

    def flush(self) -> int:
        """Write every host record to the file tier (blocking); returns how many were written."""
        if self.tiers.store is None:
            raise LayoutError("flush: OffloadConfig.storage_dir is not set, there is no file tier")
        self.drain()
        return self.tiers.flush()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no copy is queued or running (tests, benchmarks, shutdown)."""
        return self._copier.drain(timeout)

    def close(self) -> None:
        """Stop the background thread (idempotent). Host memory and files stay as they are."""
        self._copier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


    def _enqueue(self, recs: list[Record | None], ready=None) -> int:
        return self._copier.enqueue(recs, ready)

    def _vote(self, req: OffloadRequest) -> int:
        """1: every record of ``req`` is safe on this rank; 0: not yet; -1: failed."""
        if any(r.state in GONE for r in req.records):
            return -1
        return int(all(r.state in DONE for r in req.records))

    def _get(self, rid: str) -> OffloadRequest:
        if rid not in self._requests:
            raise RequestError(f"request {rid} is not known to this offload manager")
        return self._requests[rid]

    # ---------------------------------------------------------------- the group
    def _find(self, first: bytes, chain: list[bytes] | None = None, pos: int = 0) -> Record | None:
        """A usable record starting with key ``first``. Replicated KV: its storing rank looks and
        broadcasts what it found, so every rank gets the same answer (collective)."""
        storer = self._recorder.storer(first)
        found = self.tiers.find(first, chain, pos, self._kps, self.rank) if storer == self.rank else None
        if not (self.replicated and self.size > 1):
            return found
        blob = found.meta().pack() if found is not None else b""
        n = torch.tensor([len(blob)], dtype=torch.int64)
        self._tp.bcast(n, storer, "restore broadcast")
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(int(n), dtype=torch.uint8)
        if int(n):
            self._tp.bcast(buf, storer, "restore broadcast")
        if storer == self.rank or not int(n):
            return found
        meta = RecordMeta.unpack(bytes(buf.numpy()))
        with self._cond:
            same = [r for r in self.tiers.index.get(first, ()) if r.key == meta.key and r.state not in GONE]
            return same[0] if same else self.tiers.add_locked(Record.of_meta(meta, State.PHANTOM, storer, False))


__all__ = ["OffloadConfig", "HostPool", "DecodeOffloadManager", "PollResult", "HostGrant", "OffloadStats",
           "group_min", "check_cpu_group"]
