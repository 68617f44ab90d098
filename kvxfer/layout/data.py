"""The data of a layout: ``Space``, ``Region``, ``Part`` and ``Layout`` (frozen, validated, JSON
round-trip), the dtypes and slot-space names. The words are ``kvxfer.layout``'s glossary."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .. import rowmerge
from ..errors import LayoutError

# Element sizes in bytes. The two fp8 formats are distinct dtypes (torch.float8_e4m3fn and
# torch.float8_e5m2 in pools): same size, different numbers, never mixed.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1, "int32": 4,
}

TOKEN, SWA, STATE = "token", "swa", "state"


def dtype_size(dtype: str) -> int:
    if dtype not in DTYPE_SIZES:
        raise LayoutError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPE_SIZES)}")
    return DTYPE_SIZES[dtype]


def require(cond: bool, msg: str) -> None:
    """``LayoutError(msg)`` unless ``cond``: the check every layout constructor makes."""
    if not cond:
        raise LayoutError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    name: str
    num_slots: int      # padding page included
    page_size: int

    def __post_init__(self):
        require(self.page_size >= 1, f"space {self.name!r}: page_size must be >= 1, got {self.page_size}")
        require(self.num_slots % self.page_size == 0,
                 f"space {self.name!r}: num_slots {self.num_slots} is not a multiple of page_size {self.page_size}")
        require(self.num_slots >= 2 * self.page_size,
                 f"space {self.name!r}: num_slots {self.num_slots} leaves no slot past the padding page "
                 f"(page_size {self.page_size})")

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    name: str
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    layer: int
    kind: str           # "k", "v", "kv" (MLA latent), "k_scale", "conv0", "temporal", ...
    space: str
    region: int         # index into Layout.regions
    base: int           # bytes from the region start
    page_stride: int    # bytes between pages
    token_stride: int   # bytes between in-page slots
    heads: int
    head_stride: int    # bytes between heads
    head_bytes: int     # contiguous bytes of one (slot, head)
    dtype: str

    def __post_init__(self):
        for name in ("base", "page_stride", "token_stride", "head_stride"):
            require(getattr(self, name) >= 0, f"part {self.key}: {name} must be >= 0, got {getattr(self, name)}")
        require(self.heads >= 1, f"part {self.key}: heads must be >= 1, got {self.heads}")
        require(self.head_bytes >= 1, f"part {self.key}: head_bytes must be >= 1, got {self.head_bytes}")
        dtype_size(self.dtype)

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.kind)

    @property
    def head_dim(self) -> int:
        return self.head_bytes // dtype_size(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    kind: str
    spaces: tuple[Space, ...]
    regions: tuple[Region, ...]
    parts: tuple[Part, ...]
    _by_key: dict = field(default=None, init=False, repr=False, compare=False)
    _signature: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self):
        spaces = {s.name: s for s in self.spaces}
        require(len(spaces) == len(self.spaces), f"layout {self.kind}: duplicate space names")
        by_key = {}
        for p in self.parts:
            require(p.key not in by_key, f"layout {self.kind}: part {p.key} appears twice")
            by_key[p.key] = p
            require(p.space in spaces, f"part {p.key}: space {p.space!r} is not one of {sorted(spaces)}")
            require(0 <= p.region < len(self.regions),
                     f"part {p.key}: region {p.region} outside 0..{len(self.regions) - 1}")
            sp = spaces[p.space]
            last = (p.base + (sp.num_pages - 1) * p.page_stride + (sp.page_size - 1) * p.token_stride
                    + (p.heads - 1) * p.head_stride + p.head_bytes)
            nbytes = self.regions[p.region].nbytes
            require(last <= nbytes, f"part {p.key}: reaches byte {last} but region "
                                     f"{self.regions[p.region].name!r} has {nbytes}")
        object.__setattr__(self, "_by_key", by_key)

    # -- lookup --------------------------------------------------------------------
    def part(self, layer: int, kind: str) -> Part:
        try:
            return self._by_key[(layer, kind)]
        except KeyError:
            raise LayoutError(f"layout {self.kind} has no part (layer={layer}, kind={kind!r})") from None

    def has_part(self, key: tuple[int, str]) -> bool:
        return key in self._by_key

    def space(self, name: str) -> Space:
        for s in self.spaces:
            if s.name == name:
                return s
        raise LayoutError(f"layout {self.kind} has no space {name!r}; it has {[s.name for s in self.spaces]}")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({p.layer for p in self.parts}))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({p.kind for p in self.parts}))

    # -- plain data ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data, fresh each call (the caller may change it). Field by field, not
        ``dataclasses.asdict`` (~10x dearer: a copy of every value), as every HELLO sends one."""
        return {
            "kind": self.kind,
            "spaces": [{f: getattr(s, f) for f in _SPACE_FIELDS} for s in self.spaces],
            "regions": [{f: getattr(r, f) for f in _REGION_FIELDS} for r in self.regions],
            "parts": [{f: getattr(p, f) for f in _PART_FIELDS} for p in self.parts],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Layout":
        """The layout ``d`` describes (``to_dict``'s output), or LayoutError. Layouts are frozen, so one
        description read before gives back the same ``Layout``: the last ``PARSED`` descriptions of
        at most ``PARSED_BYTES`` are kept, by their exact bytes (a handshake reads each peer's layout
        a few times, and the ranks of an instance publish one and the same); bounded, so that
        peers' descriptions cannot make it hold much."""
        try:
            key = msgpack.packb(d)   # exact: ints, strings and bools stay apart (1, "1", True)
        except (TypeError, ValueError, OverflowError):   # not plain data: no key; parsed (or refused) as it is
            return cls._parse(d)
        return _parsed(key) if len(key) <= PARSED_BYTES else cls._parse(d)

    @classmethod
    def _parse(cls, d: Mapping) -> "Layout":
        try:
            return cls(kind=str(d["kind"]),
                       spaces=tuple(Space(**s) for s in d["spaces"]),
                       regions=tuple(Region(**r) for r in d["regions"]),
                       parts=tuple(Part(**p) for p in d["parts"]))
        except (KeyError, TypeError) as e:
            raise LayoutError(f"not a layout description: {e}") from None

    @property
    def signature(self) -> str:
        """A digest of the layout's description: equal for equal layouts (computed once)."""
        if not self._signature:
            blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
            object.__setattr__(self, "_signature", hashlib.sha256(blob).hexdigest()[:16])
        return self._signature

    # -- slots -----------------------------------------------------------------------
    def check_slots(self, space: str, slots, what: str = "slots", distinct: bool = False) -> np.ndarray:
        """Return ``slots`` as int64, or raise naming the first bad value. ``distinct``: also
        refuse a slot named twice (two tokens written into one slot: one of them is lost)."""
        sp = self.space(space)
        arr = np.asarray(slots)
        if arr.ndim != 1:   # messages are formatted only on failure: this runs per request
            raise LayoutError(f"{what} for space {space!r} must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise LayoutError(f"{what} must be integers, got dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr, np.int64)
        i = rowmerge.outside(arr, sp.page_size, sp.num_slots)   # one compiled pass, not min() and max()
        if i >= 0:
            where = "in the padding page" if 0 <= arr[i] < sp.page_size else "out of range"
            raise LayoutError(f"{what}[{i}] = {int(arr[i])} is {where}: space {space!r} allows "
                              f"{sp.page_size}..{sp.num_slots - 1} (page_size {sp.page_size}, "
                              f"num_slots {sp.num_slots})")
        if distinct and len(arr) > 1:
            if len(arr) * 16 < sp.num_slots:   # a few slots of a big space: sort them
                ordered = np.sort(arr)
                twice = ordered[1:][ordered[1:] == ordered[:-1]]
            else:                              # many: one counting pass over the space
                twice = np.flatnonzero(np.bincount(arr, minlength=sp.num_slots) > 1)
            if len(twice):
                first = int(np.flatnonzero(arr == twice[0])[1])
                raise LayoutError(f"{what}[{first}] = {int(twice[0])} is named twice: every token needs a "
                                  f"slot of its own ({len(twice)} slot(s) repeated)")
        return arr


_SPACE_FIELDS = tuple(f.name for f in dataclasses.fields(Space))
_REGION_FIELDS = tuple(f.name for f in dataclasses.fields(Region))
_PART_FIELDS = tuple(f.name for f in dataclasses.fields(Part))
PARSED = 16                # layout descriptions ``Layout.from_dict`` keeps parsed (a few kinds of pool)
PARSED_BYTES = 256 << 10   # ... each at most this long packed (a 126-layer FP8 pool with scales: ~80 KiB)


@functools.lru_cache(maxsize=PARSED)
def _parsed(key: bytes) -> Layout:
    """``Layout.from_dict`` of the description packed in ``key`` (failures are not kept)."""
    return Layout._parse(msgpack.unpackb(key, strict_map_key=False))
