"""The file tier: records written as one file each (msgpack header + raw bytes), found by key.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import msgpack
import torch

from ..errors import StorageError
from ..layout import Layout
from .records import FORMAT, RecordMeta, record_spans

log = logging.getLogger("kvxfer.offload")


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
        views = [regions[r][a:b].numpy() for r, a, b in record_spans(layout, tokens)]
        h = hashlib.blake2b(digest_size=16)
        for v in views:
            h.update(v.data)
        nbytes = sum(v.nbytes for v in views)
        head = {"format": FORMAT, **meta.to_dict(), "layout": layout.to_dict(), "nbytes": nbytes, "digest": h.digest()}
        tmp = self._path(meta.key, f"bin.tmp{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            for v in views:
                f.write(v.data)
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
            spans = record_spans(layout, tokens)
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
