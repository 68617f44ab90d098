"""Layouts as data: where every byte of a KV pool lives.

Glossary (the words mean this everywhere in kvxfer):

slot       one index of a slot space: a token position's cell in a token pool, or a
           request's cell in a state pool. Slots ``[0, page_size)`` are padding: engines
           point dummy writes there, so no request may use them.
page       ``page_size`` consecutive slots; slot ``s`` is in page ``s // page_size``
           at in-page offset ``s % page_size``.
space      a set of slots with one page size ("token", "swa" for a sliding-window
           pool, "state" for per-request state). Each part is indexed by one space.
region     one registered block of bytes (a torch tensor's storage). Transports move
           bytes between regions and know nothing else.
part       one logical array of a pool, e.g. the K cache of layer 3: for each
           (slot, head) it holds ``head_bytes`` contiguous bytes at
           ``base + page * page_stride + in_page * token_stride + head * head_stride``
           inside its region. Every layout in the field is a set of parts with
           different strides: that is the whole trick.
head       the sharded axis of a part (a KV head, an MLA latent row, a conv channel).
shard      a rank's share of the heads: see ``kvxfer.plan.HeadSlice``.
run        ``(src_region, src_offset, dst_region, dst_offset, nbytes)``: one contiguous
           copy; a plan is a list of runs.
layer      the global layer index; a pipeline stage's pool holds a subset.

A ``Layout`` is plain data: ``to_dict()`` / ``Layout.from_dict()`` round-trip
through JSON or msgpack, and ``signature`` is a stable hash of it. Constructors below
build the layouts seen in the wild; nothing else in kvxfer special-cases a layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import LayoutError

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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise LayoutError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    name: str
    num_slots: int      # padding page included
    page_size: int

    def __post_init__(self):
        _require(self.page_size >= 1, f"space {self.name!r}: page_size must be >= 1, got {self.page_size}")
        _require(self.num_slots % self.page_size == 0,
                 f"space {self.name!r}: num_slots {self.num_slots} is not a multiple of page_size {self.page_size}")
        _require(self.num_slots >= 2 * self.page_size,
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
            _require(getattr(self, name) >= 0, f"part {self.key}: {name} must be >= 0, got {getattr(self, name)}")
        _require(self.heads >= 1, f"part {self.key}: heads must be >= 1, got {self.heads}")
        _require(self.head_bytes >= 1, f"part {self.key}: head_bytes must be >= 1, got {self.head_bytes}")
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

    def __post_init__(self):
        spaces = {s.name: s for s in self.spaces}
        _require(len(spaces) == len(self.spaces), f"layout {self.kind}: duplicate space names")
        by_key = {}
        for p in self.parts:
            _require(p.key not in by_key, f"layout {self.kind}: part {p.key} appears twice")
            by_key[p.key] = p
            _require(p.space in spaces, f"part {p.key}: space {p.space!r} is not one of {sorted(spaces)}")
            _require(0 <= p.region < len(self.regions),
                     f"part {p.key}: region {p.region} outside 0..{len(self.regions) - 1}")
            sp = spaces[p.space]
            last = (p.base + (sp.num_pages - 1) * p.page_stride + (sp.page_size - 1) * p.token_stride
                    + (p.heads - 1) * p.head_stride + p.head_bytes)
            nbytes = self.regions[p.region].nbytes
            _require(last <= nbytes, f"part {p.key}: reaches byte {last} but region "
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
        return {
            "kind": self.kind,
            "spaces": [dataclasses.asdict(s) for s in self.spaces],
            "regions": [dataclasses.asdict(r) for r in self.regions],
            "parts": [dataclasses.asdict(p) for p in self.parts],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Layout":
        try:
            return cls(kind=str(d["kind"]),
                       spaces=tuple(Space(**s) for s in d["spaces"]),
                       regions=tuple(Region(**r) for r in d["regions"]),
                       parts=tuple(Part(**p) for p in d["parts"]))
        except (KeyError, TypeError) as e:
            raise LayoutError(f"not a layout description: {e}") from None

    @property
    def signature(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

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
        arr = arr.astype(np.int64, copy=False)
        if arr.min() < sp.page_size or arr.max() >= sp.num_slots:
            bad = (arr < sp.page_size) | (arr >= sp.num_slots)
            i = int(np.argmax(bad))
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


# ------------------------------------------------------------------------------------
# Constructors. Each computes strides once; all return plain Layouts.
# ------------------------------------------------------------------------------------
def _layer_ids(layers: int | Sequence[int]) -> list[int]:
    ids = list(range(layers)) if isinstance(layers, int) else [int(x) for x in layers]
    _require(len(ids) >= 1, f"layers must name at least one layer, got {layers!r}")
    _require(len(set(ids)) == len(ids), f"layers has duplicates: {ids}")
    return ids


def _kv_dims(head_dim: int, v_head_dim: int | None) -> list[tuple[str, int]]:
    _require(head_dim >= 1, f"head_dim must be >= 1, got {head_dim}")
    v = head_dim if v_head_dim is None else v_head_dim
    _require(v >= 1, f"v_head_dim must be >= 1, got {v}")
    return [("k", head_dim), ("v", v)]


def _per_layer(ids, dims, sp: Space, heads: int, *, hnd: bool, dtype: str, head_bytes: Callable[[int], int],
               suffix: str = "", first_region: int = 0) -> tuple[list[Region], list[Part]]:
    """One region per (layer, K/V): ``[slots, heads, dim]`` (NHD) or, with ``hnd``,
    ``[pages, heads, page_size, dim]``; ``head_bytes(dim)`` is one head's bytes of one token."""
    regions: list[Region] = []
    parts: list[Part] = []
    for layer in ids:
        for kind, dim in dims:
            hb = head_bytes(dim)
            token_stride, head_stride = (hb, sp.page_size * hb) if hnd else (heads * hb, hb)
            parts.append(Part(layer=layer, kind=f"{kind}{suffix}", space=sp.name, region=first_region + len(regions),
                              base=0, page_stride=sp.page_size * heads * hb, token_stride=token_stride,
                              heads=heads, head_stride=head_stride, head_bytes=hb, dtype=dtype))
            regions.append(Region(name=f"{kind}{suffix}{layer}", nbytes=sp.num_slots * heads * hb))
    return regions, parts


def _scale_regions(ids, heads, dims, space: Space, scale_block: int | None, first_region: int):
    """Per-block fp32 scales, one token-major region per (layer, K/V): ``[slots, heads, dim // block]``."""
    if scale_block is None:
        return [], []
    for _, dim in dims:
        _require(dim % scale_block == 0, f"head dim {dim} is not a multiple of scale_block {scale_block}")
    return _per_layer(ids, dims, space, heads, hnd=False, dtype="float32", head_bytes=lambda d: d // scale_block * 4,
                      suffix="_scale", first_region=first_region)


def token_major_layout(*, layers: int | Sequence[int], heads: int, head_dim: int, dtype: str,
                       num_slots: int, page_size: int = 1, v_head_dim: int | None = None,
                       scale_block: int | None = None, space: str = TOKEN) -> Layout:
    """Per-layer K and V ``[slots, heads, head_dim]`` (NHD), one region each."""
    ids, dims, es = _layer_ids(layers), _kv_dims(head_dim, v_head_dim), dtype_size(dtype)
    sp = Space(name=space, num_slots=num_slots, page_size=page_size)
    regions, parts = _per_layer(ids, dims, sp, heads, hnd=False, dtype=dtype, head_bytes=lambda d: d * es)
    sr, sparts = _scale_regions(ids, heads, dims, sp, scale_block, len(regions))
    return Layout(kind="token_major", spaces=(sp,), regions=tuple(regions + sr), parts=tuple(parts + sparts))


def hnd_layout(*, layers: int | Sequence[int], heads: int, head_dim: int, dtype: str,
               num_pages: int, page_size: int, v_head_dim: int | None = None,
               scale_block: int | None = None, space: str = TOKEN) -> Layout:
    """Per-layer K and V ``[pages, heads, page_size, head_dim]`` (HND), one region each."""
    ids, dims, es = _layer_ids(layers), _kv_dims(head_dim, v_head_dim), dtype_size(dtype)
    sp = Space(name=space, num_slots=num_pages * page_size, page_size=page_size)
    regions, parts = _per_layer(ids, dims, sp, heads, hnd=True, dtype=dtype, head_bytes=lambda d: d * es)
    sr, sparts = _scale_regions(ids, heads, dims, sp, scale_block, len(regions))
    return Layout(kind="hnd", spaces=(sp,), regions=tuple(regions + sr), parts=tuple(parts + sparts))


def page_major_layout(*, layers: int | Sequence[int], heads: int, head_dim: int, dtype: str,
                      num_pages: int, page_size: int, v_head_dim: int | None = None,
                      scale_block: int | None = None, space: str = TOKEN) -> Layout:
    """One raw buffer ``[pages][layer][K|V][page_size, heads, head_dim]``."""
    ids, dims, es = _layer_ids(layers), _kv_dims(head_dim, v_head_dim), dtype_size(dtype)
    sp = Space(name=space, num_slots=num_pages * page_size, page_size=page_size)
    page_bytes = len(ids) * page_size * heads * sum(d for _, d in dims) * es
    parts, offset = [], 0
    for layer in ids:
        for kind, dim in dims:
            hb = dim * es
            parts.append(Part(layer=layer, kind=kind, space=space, region=0, base=offset,
                              page_stride=page_bytes, token_stride=heads * hb,
                              heads=heads, head_stride=hb, head_bytes=hb, dtype=dtype))
            offset += page_size * heads * hb
    regions = [Region(name="pages", nbytes=num_pages * page_bytes)]
    sr, sparts = _scale_regions(ids, heads, dims, sp, scale_block, len(regions))
    return Layout(kind="page_major", spaces=(sp,), regions=tuple(regions + sr), parts=tuple(parts + sparts))


def mla_layout(*, layers: int | Sequence[int], kv_lora_rank: int, rope_dim: int, dtype: str,
               num_slots: int, page_size: int = 1, page_major: bool = False, space: str = TOKEN) -> Layout:
    """Per-layer latent ``[slots, 1, kv_lora_rank + rope_dim]``, identical on every TP rank;
    or, ``page_major``, one raw buffer ``[pages][layer][page_size, 1, kv_lora_rank + rope_dim]``."""
    ids, es = _layer_ids(layers), dtype_size(dtype)
    _require(kv_lora_rank >= 1 and rope_dim >= 0, f"kv_lora_rank {kv_lora_rank} / rope_dim {rope_dim} invalid")
    hb = (kv_lora_rank + rope_dim) * es
    sp = Space(name=space, num_slots=num_slots, page_size=page_size)
    chunk = page_size * hb
    if page_major:
        parts = tuple(Part(layer=layer, kind="kv", space=space, region=0, base=i * chunk,
                           page_stride=len(ids) * chunk, token_stride=hb, heads=1, head_stride=hb, head_bytes=hb,
                           dtype=dtype) for i, layer in enumerate(ids))
        regions: tuple[Region, ...] = (Region(name="pages", nbytes=sp.num_pages * len(ids) * chunk),)
    else:
        parts = tuple(Part(layer=layer, kind="kv", space=space, region=i, base=0, page_stride=chunk,
                           token_stride=hb, heads=1, head_stride=hb, head_bytes=hb, dtype=dtype)
                      for i, layer in enumerate(ids))
        regions = tuple(Region(name=f"kv{layer}", nbytes=num_slots * hb) for layer in ids)
    return Layout(kind="mla_page_major" if page_major else "mla", spaces=(sp,), regions=regions, parts=parts)


def state_layout(*, layers: int | Sequence[int], conv_blocks: Sequence[int], conv_width: int,
                 temporal_heads: int, temporal_head_shape: Sequence[int], num_slots: int,
                 conv_dtype: str = "bfloat16", temporal_dtype: str = "float32") -> Layout:
    """Mamba-style state per request slot.

    conv     ``[layers, slots, sum(conv_blocks), conv_width]``: channels made of
             sub-blocks (e.g. [x | B | C] or [q | k | v]) that TP shards separately,
             so each sub-block is its own part ``conv0, conv1, ...``.
    temporal ``[layers, slots, temporal_heads, *temporal_head_shape]``.
    """
    ids = _layer_ids(layers)
    ces, tes = dtype_size(conv_dtype), dtype_size(temporal_dtype)
    _require(len(conv_blocks) >= 1 and all(c >= 1 for c in conv_blocks),
             f"conv_blocks must be positive channel counts, got {list(conv_blocks)}")
    conv_dim = int(sum(conv_blocks))
    conv_row = conv_dim * conv_width * ces
    t_hb = int(np.prod(temporal_head_shape)) * tes
    t_row = temporal_heads * t_hb
    sp = Space(name=STATE, num_slots=num_slots, page_size=1)
    parts = []
    for i, layer in enumerate(ids):
        ch = 0
        for b, n in enumerate(conv_blocks):
            parts.append(Part(layer=layer, kind=f"conv{b}", space=STATE, region=0,
                              base=i * num_slots * conv_row + ch * conv_width * ces,
                              page_stride=conv_row, token_stride=conv_row, heads=int(n),
                              head_stride=conv_width * ces, head_bytes=conv_width * ces, dtype=conv_dtype))
            ch += n
        parts.append(Part(layer=layer, kind="temporal", space=STATE, region=1, base=i * num_slots * t_row,
                          page_stride=t_row, token_stride=t_row, heads=temporal_heads,
                          head_stride=t_hb, head_bytes=t_hb, dtype=temporal_dtype))
    regions = (Region(name="conv", nbytes=len(ids) * num_slots * conv_row),
               Region(name="temporal", nbytes=len(ids) * num_slots * t_row))
    return Layout(kind="state", spaces=(sp,), regions=regions, parts=tuple(parts))


def hybrid_swa_layout(full: Layout, swa: Layout) -> Layout:
    """A full-attention pool (space "token") beside a sliding-window pool (space "swa")."""
    _require(not set(full.layers) & set(swa.layers),
             f"full and sliding-window layers overlap: {sorted(set(full.layers) & set(swa.layers))}")
    _require(len(full.spaces) == 1 and len(swa.spaces) == 1, "hybrid_swa_layout takes two single-space layouts")
    n = len(full.regions)
    sw_space = dataclasses.replace(swa.spaces[0], name=SWA)
    parts = full.parts + tuple(dataclasses.replace(p, space=SWA, region=p.region + n) for p in swa.parts)
    regions = full.regions + tuple(dataclasses.replace(r, name=f"swa_{r.name}") for r in swa.regions)
    return Layout(kind="hybrid_swa", spaces=(full.spaces[0], sw_space), regions=regions, parts=parts)


HOST_STYLES = ("layer_first", "page_first")


def host_layout(device: Layout, style: str, num_slots: int | Mapping[str, int]) -> Layout:
    """A host layout holding every part of ``device``, built from its parts alone.

    layer_first: per space one region ``[kind][layer][slots][heads, head]``
                 (for MHA: ``(K|V, layer, slots, heads, dim)``).
    page_first:  per space one region ``[kind][pages][layer][page_size, heads, head]``
                 (for MHA: ``(K|V, pages, layer, page_size, heads, dim)``).
    """
    _require(style in HOST_STYLES, f"host layout style {style!r} is not one of {HOST_STYLES}")
    regions: list[Region] = []
    parts: list[Part] = []
    spaces: list[Space] = []
    for dsp in device.spaces:
        n = num_slots if isinstance(num_slots, int) else num_slots.get(dsp.name)
        _require(n is not None, f"host layout: no num_slots given for space {dsp.name!r}")
        sp = Space(name=dsp.name, num_slots=int(n), page_size=dsp.page_size)
        spaces.append(sp)
        mine = sorted((p for p in device.parts if p.space == dsp.name), key=lambda p: (p.kind, p.layer))
        offset, region = 0, len(regions)
        kinds = sorted({p.kind for p in mine})
        for kind in kinds:
            of_kind = [p for p in mine if p.kind == kind]
            rows = [p.heads * p.head_bytes for p in of_kind]
            page_bytes = sum(rows) * sp.page_size
            in_page = 0
            for p, row in zip(of_kind, rows):
                if style == "layer_first":
                    base, page_stride = offset, sp.page_size * row
                    offset += sp.num_slots * row
                else:
                    base, page_stride = offset + in_page, page_bytes
                    in_page += sp.page_size * row
                parts.append(Part(layer=p.layer, kind=p.kind, space=sp.name, region=region, base=base,
                                  page_stride=page_stride, token_stride=row, heads=p.heads,
                                  head_stride=p.head_bytes, head_bytes=p.head_bytes, dtype=p.dtype))
            if style == "page_first":
                offset += sp.num_pages * page_bytes
        regions.append(Region(name=f"host_{dsp.name}", nbytes=offset))
    return Layout(kind=f"host_{style}", spaces=tuple(spaces), regions=tuple(regions), parts=tuple(parts))


# ------------------------------------------------------------------------------------
# Layouts of a rank: KV parts plus optional state parts, as one layout (one region list
# for the transport, one Planner per source covering both).
# ------------------------------------------------------------------------------------
def combine_layouts(kv: Layout, state: Layout | None = None) -> Layout:
    """``kv``'s parts and regions followed by ``state``'s (region ids shifted)."""
    if state is None:
        return kv
    n = len(kv.regions)
    parts = kv.parts + tuple(dataclasses.replace(p, region=p.region + n) for p in state.parts)
    return Layout(kind=f"{kv.kind}+{state.kind}", spaces=kv.spaces + state.spaces,
                  regions=kv.regions + state.regions, parts=parts)


def is_hybrid(layout: Layout) -> bool:
    """True for a hybrid sliding-window layout (a "swa" slot space beside the token space)."""
    return any(s.name == SWA for s in layout.spaces)


# ------------------------------------------------------------------------------------
# The compact record layout
# ------------------------------------------------------------------------------------
def restrict_layout(layout: Layout, spaces) -> Layout:
    """``layout`` with only the parts (and spaces) of ``spaces``; region ids unchanged."""
    keep = set(spaces)
    return Layout(kind=layout.kind, spaces=tuple(s for s in layout.spaces if s.name in keep),
                  regions=layout.regions, parts=tuple(p for p in layout.parts if p.space in keep))
