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

import enum
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import torch

from .errors import LayoutError, RequestError, StorageError
from .layout import HOST_STYLES, Layout, host_layout
from .plan import Planner, execute_plan
from .pools import KVPool

log = logging.getLogger("kvxfer.storage")

FORMAT = "kvxfer-offload-record-v1"


# ------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------
def key_seed(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def page_keys(prev: bytes, token_ids: np.ndarray, page_size: int) -> list[bytes]:
    """Chain keys of the whole pages of ``token_ids``, continuing from ``prev``.

    One blake2b per page (hashing, not copying: ~1 us a page, called once per stride)."""
    tok = np.ascontiguousarray(token_ids, dtype=np.int64)
    out = []
    for i in range(len(tok) // page_size):
        prev = hashlib.blake2b(prev + tok[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


def tail_key(prev: bytes, token_ids: np.ndarray, total: int) -> bytes:
    tok = np.ascontiguousarray(token_ids, dtype=np.int64)
    return hashlib.blake2b(prev + b"tail" + tok.tobytes() + int(total).to_bytes(8, "little"),
                           digest_size=16).digest()


# ------------------------------------------------------------------------------------
# The compact record layout
# ------------------------------------------------------------------------------------
def restrict_layout(layout: Layout, spaces) -> Layout:
    """``layout`` with only the parts (and spaces) of ``spaces``; region ids unchanged."""
    keep = set(spaces)
    return Layout(kind=layout.kind, spaces=tuple(s for s in layout.spaces if s.name in keep),
                  regions=layout.regions, parts=tuple(p for p in layout.parts if p.space in keep))


def compact_layout(device: Layout, tokens: Mapping[str, int]) -> Layout:
    """Layer-first host layout of exactly ``tokens[space]`` tokens per space (plus padding page).
    Token ``i`` of a space sits in slot ``page_size + i`` (see ``compact_slots``)."""
    spaces = [s for s in device.spaces if tokens.get(s.name, 0) > 0]
    sizes = {s.name: (-(-int(tokens[s.name]) // s.page_size) + 1) * s.page_size for s in spaces}
    return host_layout(restrict_layout(device, sizes), "layer_first", sizes)


def compact_slots(layout: Layout, tokens: Mapping[str, int]) -> dict[str, np.ndarray]:
    return {s.name: s.page_size + np.arange(int(tokens[s.name]), dtype=np.int64) for s in layout.spaces}


def _spans(layout: Layout, tokens: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """(region, start, stop) of every part's used rows: the payload, in part order.
    A layer-first part keeps its rows contiguous, so this is one span per part."""
    out = []
    for p in layout.parts:
        ps = layout.space(p.space).page_size
        if p.token_stride != p.heads * p.head_bytes or p.page_stride != ps * p.token_stride:
            raise ValueError(f"part {p.key} is not laid out layer-first (rows are not contiguous)")
        start = p.base + ps * p.token_stride
        out.append((p.region, start, start + int(tokens[p.space]) * p.token_stride))
    return out


# ------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class RecordMeta:
    """What a record file says about itself (plain data)."""
    key: bytes
    first: bytes                        # first page key (chunk) or the tail key (tail)
    kind: str                           # "chunk" | "tail"
    start: int                          # first position of the streamed spaces
    positions: dict[str, np.ndarray]    # the request positions held, per space
    page_keys: tuple[bytes, ...]

    @property
    def tokens(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.positions.items() if len(v)}

    def to_dict(self) -> dict:
        return {"key": self.key, "first": self.first, "kind": self.kind, "start": self.start,
                "positions": {k: np.asarray(v, np.int64).tobytes() for k, v in self.positions.items()},
                "page_keys": list(self.page_keys)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RecordMeta":
        try:
            return cls(key=bytes(d["key"]), first=bytes(d["first"]), kind=str(d["kind"]), start=int(d["start"]),
                       positions={str(k): np.frombuffer(v, np.int64).copy() for k, v in d["positions"].items()},
                       page_keys=tuple(bytes(k) for k in d["page_keys"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StorageError(f"malformed record meta ({type(e).__name__}: {e})") from None

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def unpack(cls, blob: bytes) -> "RecordMeta":
        return cls.from_dict(msgpack.unpackb(blob, raw=False, strict_map_key=False))


class FileStore:
    """One directory of record files. Thread-safe; safe to share between processes that
    write distinct keys (writes are atomic renames)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._by_first: dict[bytes, set[bytes]] | None = None

    def _path(self, key: bytes, ext: str) -> Path:
        return self.root / f"{key.hex()}.{ext}"

    def has(self, key: bytes) -> bool:
        return self._path(key, "meta").exists()

    def find(self, first: bytes) -> list[bytes]:
        """Keys of the records whose first page key (or tail key) is ``first``."""
        with self._lock:
            if self._by_first is None:  # once per process: read the small meta files
                self._by_first = {}
                for m in self.root.glob("*.meta"):
                    try:
                        meta = self.read_meta(bytes.fromhex(m.stem))
                    except (StorageError, ValueError):
                        continue
                    self._by_first.setdefault(meta.first, set()).add(meta.key)
            return sorted(self._by_first.get(first, ()))

    def put(self, meta: RecordMeta, layout: Layout, regions: list[torch.Tensor]) -> None:
        """Write the record held in ``regions`` (its compact ``layout``)."""
        tokens = meta.tokens
        views = [regions[r][a:b].numpy() for r, a, b in _spans(layout, tokens)]
        h = hashlib.blake2b(digest_size=16)
        for v in views:
            h.update(v)
        nbytes = sum(v.nbytes for v in views)
        head = {"format": FORMAT, **meta.to_dict(), "layout": layout.to_dict(), "nbytes": nbytes, "digest": h.digest()}
        tmp = self._path(meta.key, f"bin.tmp{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            for v in views:
                f.write(memoryview(v))
        os.replace(tmp, self._path(meta.key, "bin"))
        tmpm = tmp.with_suffix(".mtmp")
        tmpm.write_bytes(msgpack.packb(head, use_bin_type=True))
        os.replace(tmpm, self._path(meta.key, "meta"))
        with self._lock:
            if self._by_first is not None:
                self._by_first.setdefault(meta.first, set()).add(meta.key)

    def _head(self, key: bytes) -> dict:
        path = self._path(key, "meta")
        try:
            head = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
        except FileNotFoundError:
            raise StorageError(f"record {key.hex()} is not in {self.root}") from None
        except Exception as e:  # msgpack raises many types on garbage
            raise StorageError(f"record {key.hex()}: meta file {path} is not msgpack ({type(e).__name__})") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("key") != key:
            raise StorageError(f"record {key.hex()}: meta file {path} is not a {FORMAT} record for this key")
        return head

    def read_meta(self, key: bytes) -> RecordMeta:
        return RecordMeta.from_dict(self._head(key))

    def get(self, key: bytes, expect: Layout | None = None) -> tuple[RecordMeta, Layout, list[torch.Tensor]]:
        """Read and verify a record: its meta, compact layout and filled regions (CPU).
        ``expect``: the compact layout the caller needs; a record for another layout is refused."""
        head = self._head(key)
        meta = RecordMeta.from_dict(head)
        try:
            layout = Layout.from_dict(head["layout"])
            tokens = meta.tokens
            if sorted(tokens) != sorted(s.name for s in layout.spaces) or any(
                    tokens[s.name] + s.page_size > s.num_slots for s in layout.spaces):
                raise StorageError(f"record {key.hex()}: positions {tokens} do not fit its layout")
            spans = _spans(layout, tokens)
        except (KeyError, TypeError, ValueError) as e:
            raise StorageError(f"record {key.hex()}: malformed layout in meta ({type(e).__name__}: {e})") from None
        if expect is not None and layout.signature != expect.signature:
            raise StorageError(f"record {key.hex()} was written for layout {layout.signature}, "
                               f"this pool needs {expect.signature}")
        want = sum(b - a for _, a, b in spans)
        path = self._path(key, "bin")
        data = bytearray(want)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                got = f.readinto(data) if size == want else -1
        except FileNotFoundError:
            raise StorageError(f"record {key.hex()}: payload {path} is missing") from None
        if size != want or got != want or head.get("nbytes") != want:
            raise StorageError(f"record {key.hex()}: payload {path} has {size} bytes, "
                               f"meta says {head.get('nbytes')}, layout needs {want}")
        if hashlib.blake2b(data, digest_size=16).digest() != head.get("digest"):
            raise StorageError(f"record {key.hex()}: payload {path} fails its blake2b digest (corrupt)")
        regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in layout.regions]
        src, pos = torch.frombuffer(data, dtype=torch.uint8) if want else torch.zeros(0, dtype=torch.uint8), 0
        for r, a, b in spans:  # one slice per part
            regions[r][a:b] = src[pos: pos + b - a]
            pos += b - a
        return meta, layout, regions

    def delete(self, key: bytes) -> None:
        for ext in ("meta", "bin"):
            self._path(key, ext).unlink(missing_ok=True)
        with self._lock:
            if self._by_first is not None:
                for keys in self._by_first.values():
                    keys.discard(key)


# ------------------------------------------------------------------------------------
# Host memory
# ------------------------------------------------------------------------------------
class HostPages:
    """Whole pages of one host space; page 0 is padding. A request for ``n`` pages gets ``n``
    consecutive free pages when there are any (first fit), so a record (or a batch of records
    copied together) is one block and copies as one strided view; otherwise the lowest free
    pages. Freeing twice raises. The free count is kept, not recounted: the background thread
    allocates for every copy, and a host pool can hold a million pages."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        self._free = np.ones(num_pages, dtype=bool)
        self._free[0] = False
        self._num_free = num_pages - 1

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return self._num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def take(self, need: int) -> np.ndarray | None:
        """``need`` free pages (first fit of a free block, else the lowest), or None."""
        if need > self._num_free:
            return None
        if need == 0:
            return np.zeros(0, np.int64)
        edges = np.flatnonzero(np.diff(self._free.view(np.int8), prepend=np.int8(0), append=np.int8(0)))
        starts, ends = edges[0::2], edges[1::2]   # free blocks [start, end)
        fits = np.flatnonzero(ends - starts >= need)
        pages = (np.arange(starts[fits[0]], starts[fits[0]] + need) if len(fits)
                 else np.flatnonzero(self._free)[:need])
        self._free[pages] = False
        self._num_free -= need
        return pages

    def slots_of(self, pages: np.ndarray, num_tokens: int) -> np.ndarray:
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()[:num_tokens]

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        pages = self.take(self.pages_for(num_tokens))
        return None if pages is None else self.slots_of(pages, num_tokens)

    def free(self, slots) -> None:
        pages = np.unique(np.asarray(slots, dtype=np.int64) // self.page_size)
        if len(pages) and (pages.min() < 1 or pages.max() >= self.num_pages or self._free[pages].any()):
            raise LayoutError(f"host free: pages {pages.tolist()[:8]} are padding, out of range or already free")
        self._free[pages] = True
        self._num_free += len(pages)


class HostPool(KVPool):
    """Host memory for a device pool in a host layout; a pool like any other (``layout``,
    ``regions()``), so planners and transports target it unchanged (direct-to-host
    receive registers ``regions()`` with a transport). Pinned when CUDA is present.
    ``alloc``/``free`` hand out whole host pages per space (page 0 is padding).

    Its memory is resident from the start: ``torch.zeros`` writes every byte, so no offload
    pays first-touch page faults (pinned memory is resident anyway)."""

    def __init__(self, layout: Layout, *, device_layout: Layout, pin_memory: bool | None = None):
        super().__init__(layout, "cpu", pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
        self.device_layout = device_layout
        self.allocators = {s.name: HostPages(s.num_pages, s.page_size) for s in layout.spaces}

    @classmethod
    def for_pool(cls, pool: KVPool, *, layout: str = "layer_first", size: int | Mapping[str, int],
                 pin_memory: bool | None = None) -> "HostPool":
        """Host pool for any pool, from its layout alone. ``size``: usable host slots, one int
        for every space or ``{space: n}``; rounded up to whole pages (plus the padding page)."""
        if layout not in HOST_STYLES:
            raise LayoutError(f"HostPool layout {layout!r} is not one of {HOST_STYLES}")
        sizes = {}
        for sp in pool.layout.spaces:
            n = size if isinstance(size, int) else size.get(sp.name)
            if n is None or n < 1:
                raise LayoutError(f"HostPool.for_pool: size for space {sp.name!r} must be >= 1 slot, got {n}")
            sizes[sp.name] = (-(-int(n) // sp.page_size) + 1) * sp.page_size
        return cls(host_layout(pool.layout, layout, sizes), device_layout=pool.layout, pin_memory=pin_memory)

    def capacity(self, space: str) -> int:
        a = self.allocators[space]
        return a.capacity * a.page_size

    def free_slots(self, space: str) -> int:
        a = self.allocators[space]
        return a.free_pages * a.page_size

    def alloc(self, tokens: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Slots for ``tokens[space]`` tokens in every space, or None (nothing taken)."""
        got = self.alloc_many([tokens])
        return got[0] if got else None

    def fits(self, sizes: Sequence[Mapping[str, int]]) -> int:
        """How many leading records of ``sizes`` fit in the free pages now (all together)."""
        left = {s: a.free_pages for s, a in self.allocators.items()}
        for i, tokens in enumerate(sizes):
            for s, n in tokens.items():
                left[s] -= self.allocators[s].pages_for(n)
            if any(v < 0 for v in left.values()):
                return i
        return len(sizes)

    def alloc_many(self, sizes: Sequence[Mapping[str, int]]) -> list[dict[str, np.ndarray]] | None:
        """Slots for every record of ``sizes`` (whole pages each), taken as one block per space
        when there is one, so records copied together sit back to back; None if they do not
        all fit (nothing taken)."""
        if self.fits(sizes) < len(sizes):
            return None
        out: list[dict[str, np.ndarray]] = [{} for _ in sizes]
        for space in {s for tokens in sizes for s in tokens}:
            a = self.allocators[space]
            counts = [int(tokens.get(space, 0)) for tokens in sizes]
            need = [a.pages_for(n) for n in counts]
            pages = a.take(sum(need))
            slots = a.slots_of(pages, len(pages) * a.page_size)   # every slot of those pages, in order
            first = 0
            for rec, n, k in zip(out, counts, need):   # a record's slots: a slice (whole pages of its own)
                rec[space] = slots[first: first + n]
                first += k * a.page_size
        return [{s: rec[s] for s in tokens} for rec, tokens in zip(out, sizes)]

    def free(self, slots: Mapping[str, np.ndarray]) -> None:
        for s, v in slots.items():
            self.allocators[s].free(v)


# ------------------------------------------------------------------------------------
# Records and the tiers that hold them
# ------------------------------------------------------------------------------------
class State(enum.IntEnum):
    QUEUED = 0      # waiting for the background copy (device -> host)
    COPYING = 1
    RECEIVING = 2   # direct-to-host: a transport is writing it
    HOST = 3
    FILE = 4        # evicted: only in the file tier
    PHANTOM = 5     # replicated KV stored by another rank of the group
    FAILED = 6
    DROPPED = 7     # cancelled, or unreferenced cache evicted without a file tier


DONE = (State.HOST, State.FILE, State.PHANTOM)
GONE = (State.FAILED, State.DROPPED)


@dataclass(slots=True, eq=False)
class Record:
    """One stored piece of a request (see ``kvxfer.offload``); shared by requests with refs."""
    key: bytes
    first: bytes
    kind: str                           # "chunk" | "tail"
    start: int
    positions: dict[str, np.ndarray]    # request positions held, per space (empty spaces omitted)
    page_keys: tuple[bytes, ...]
    state: State
    storer: int = 0                     # group rank that holds the bytes
    src: dict | None = None             # device slots to copy from, while queued
    event: object = None                # CUDA event: the step that wrote the KV
    host_slots: dict | None = None
    on_file: bool = False
    refs: int = 1
    pins: int = 0                       # > 0: in use by a copy; never evicted
    error: str = ""

    @property
    def tokens(self) -> dict[str, int]:
        return {s: len(p) for s, p in self.positions.items()}

    def meta(self) -> RecordMeta:
        return RecordMeta(key=self.key, first=self.first, kind=self.kind, start=self.start,
                          positions=self.positions, page_keys=self.page_keys)

    @classmethod
    def of_meta(cls, meta: RecordMeta, state: State, storer: int, on_file: bool) -> "Record":
        return cls(key=meta.key, first=meta.first, kind=meta.kind, start=meta.start, positions=meta.positions,
                   page_keys=meta.page_keys, state=state, storer=storer, on_file=on_file, refs=0)


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

    def hold_locked(self, rec: Record) -> None:
        """``rec`` is now in host memory: evictable, most recently used."""
        rec.state = State.HOST
        self.lru[id(rec)] = rec
        self.cond.notify_all()

    def touch_locked(self, rec: Record) -> None:
        if id(rec) in self.lru:
            self.lru.move_to_end(id(rec))

    def drop_locked(self, rec: Record) -> None:
        if rec.host_slots is not None:
            self.host.free(rec.host_slots)
            rec.host_slots = None
        rec.state = State.DROPPED
        self.lru.pop(id(rec), None)
        same = self.index.get(rec.first, [])
        if rec in same:
            same.remove(rec)
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
        for tokens in sizes:
            for s, n in tokens.items():
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
                            self.drop_locked(rec)
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


__all__ = ["FileStore", "RecordMeta", "StorageError", "HostPool", "Tiers", "Record", "State", "OffloadStats",
           "compact_layout", "compact_slots", "restrict_layout", "page_keys", "tail_key", "key_seed"]
