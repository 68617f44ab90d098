"""Offload records: content keys (a hash chain over token ids per page), record metadata and
states, and the compact host layout a record is stored in.
"""
from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import numpy as np

from ..errors import StorageError
from ..layout import Layout, host_layout, restrict_layout

try:
    from .. import keychain
except ImportError as e:   # an install that did not build it
    raise ImportError(f"kvxfer's compiled helper (kvxfer/keychain.c) is not built: {e}. "
                      "Run scripts/setup, or pip install -e . (needs a C compiler and the Python headers)") from e

FORMAT = "kvxfer-offload-record-v1"


# ------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------
def key_seed(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def page_keys(prev: bytes, token_ids, page_size: int) -> list[bytes]:
    """Chain keys of the whole pages of ``token_ids``, continuing from ``prev``:
    ``blake2b(key before | the page's ids as int64, digest_size=16)`` per page, in one call of the
    compiled ``keychain.chain`` (~0.3 us a page; a stride's 8 pages in ~3 us)."""
    return keychain.chain(prev, np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1), page_size)


def tail_key(prev: bytes, token_ids: np.ndarray, total: int) -> bytes:
    tok = np.ascontiguousarray(token_ids, dtype=np.int64)
    return hashlib.blake2b(prev + b"tail" + tok.tobytes() + int(total).to_bytes(8, "little"),
                           digest_size=16).digest()


def compact_layout(device: Layout, tokens: Mapping[str, int]) -> Layout:
    """Layer-first host layout of exactly ``tokens[space]`` tokens per space (plus padding page).
    Token ``i`` of a space sits in slot ``page_size + i`` (see ``compact_slots``)."""
    spaces = [s for s in device.spaces if tokens.get(s.name, 0) > 0]
    sizes = {s.name: (-(-int(tokens[s.name]) // s.page_size) + 1) * s.page_size for s in spaces}
    return host_layout(restrict_layout(device, sizes), "layer_first", sizes)


def compact_slots(layout: Layout, tokens: Mapping[str, int]) -> dict[str, np.ndarray]:
    return {s.name: s.page_size + np.arange(int(tokens[s.name]), dtype=np.int64) for s in layout.spaces}


def record_spans(layout: Layout, tokens: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """(region, start, stop) of every part's used rows: the payload, in part order.
    A layer-first part keeps its rows contiguous, so this is one span per part."""
    out = []
    for p in layout.parts:
        ps = layout.space(p.space).page_size
        if p.token_stride != p.heads * p.head_bytes or p.page_stride != ps * p.token_stride:
            raise StorageError(f"part {p.key} is not laid out layer-first (rows are not contiguous)")
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
