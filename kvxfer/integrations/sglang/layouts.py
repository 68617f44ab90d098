"""SGLang's KV pools as kvxfer layouts over SGLang's own memory (pure: imports no SGLang).

Each builder takes plain facts (pointers with their lengths as ``RawMemory``, shapes, strides in
bytes, page sizes, layer ids) and returns a ``Described``: a ``Layout`` and the engine memory of
each of its regions, ready for ``EnginePool`` (which checks the description against the memory
and copies nothing). The facts come from what SGLang hands a transfer backend (``KVArgs``:
pointers, lengths, per-page item bytes, page size) or, where the plugin reaches them, from the
pool objects (``kvxfer.integrations.sglang.pools`` reads them there).

The shapes mirrored (slot 0's page is padding in every SGLang pool, as in kvxfer):
    MHATokenToKVPool        per layer K and V ``[slots, heads, head_dim]`` (NHD): ``strided_kv``
                            with one region per view, or ``mha_from_kv_args`` from KVArgs alone
    MHATokenToKVPool (HND)  per layer ``[pages, heads, page_size, head_dim]``
                            (``SGLANG_USE_HND_KVCACHE``): ``strided_kv`` (``View.hnd``)
    UnifiedMHA/MLA pools    one uint8 buffer; physical token ``s`` has an entry of
                            ``entry_bytes`` at ``s * entry_bytes`` holding every layer's rows
                            (``[K_0 | V_0 | K_1 | ...]``); a page envelope is ``page_size``
                            entries: ``strided_kv`` over one shared region (head slices inside
                            the envelopes), or ``unified_envelopes`` (whole envelopes, what
                            KVArgs alone says); ``physical_slots`` maps virtual ids through the
                            allocator's virtual -> physical page table
    MLATokenToKVPool        per layer latent ``[slots, 1, kv_lora_rank + rope_dim]``: ``strided_kv``
                            or ``mla_from_kv_args``
    SWAKVPool (hybrid)      a full pool beside a sliding-window pool: ``hybrid_swa``
    MambaPool (state)       conv ``[layers, slots, channels, width]`` (one tensor per conv
                            shape, channels in TP-sharded sub-blocks) and temporal
                            ``[layers, slots, heads, ...]``: ``mamba_state``
    the seed's PageMajorMHATokenToKVPool (not constructible in SGLang 0.5.23)
                            one raw buffer, each page ``[L0 K | L0 V | L1 K | ...]``, each part
                            ``[page_size, heads, head_dim]``: ``seed_page_major``

Who calls what: the SGLang backend's manager, once per rank at start-up; tests call them on
memory they made in SGLang's shapes. Every refusal is a ``LayoutError`` naming the fact.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ...errors import LayoutError
from ...layout import (
    STATE,
    TOKEN,
    Layout,
    Part,
    Region,
    Space,
    dtype_size,
    hybrid_swa_layout,
    page_major_layout,
)
from ...memory import EnginePool, RawMemory


class Described(NamedTuple):
    """A layout and the engine's memory of each of its regions (``memory[i]`` holds region ``i``)."""
    layout: Layout
    memory: tuple[RawMemory, ...]

    def pool(self, **kwargs) -> EnginePool:
        """``EnginePool(layout, memory, **kwargs)``: checked against the memory, nothing copied."""
        return EnginePool(self.layout, self.memory, **kwargs)


class View(NamedTuple):
    """One per-layer strided view of the engine's: ``[slots, heads, head_dim]`` (NHD, strides
    ``(token, head, element)``) or, ``hnd``, ``[pages, heads, page_size, head_dim]`` (strides
    ``(page, head, token, element)``). ``offset``: its first byte, from the start of its region;
    ``strides``: in bytes; ``dtype``: a kvxfer dtype name."""
    layer: int
    kind: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    hnd: bool = False


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _view_part(v: View, region: int, page_size: int, space: str) -> Part:
    """The part a view describes (checked: rank, unit element stride, page divisibility)."""
    es = dtype_size(v.dtype)
    rank = 4 if v.hnd else 3
    if len(v.shape) != rank or len(v.strides) != rank:
        raise LayoutError(f"view of layer {v.layer} {v.kind!r}: shape {v.shape} / strides {v.strides} are not "
                          f"{'[pages, heads, page_size, dim]' if v.hnd else '[slots, heads, dim]'}")
    if v.strides[-1] != es:
        raise LayoutError(f"view of layer {v.layer} {v.kind!r}: its last axis has a stride of {v.strides[-1]} "
                          f"bytes, not one {v.dtype} element ({es}): a head's row must be contiguous")
    if v.hnd:
        pages, heads, in_page, dim = v.shape
        if in_page != page_size:
            raise LayoutError(f"HND view of layer {v.layer} {v.kind!r}: {in_page} tokens per page, the pool's "
                              f"page_size is {page_size}")
        page_stride, head_stride, token_stride = v.strides[:3]
    else:
        slots, heads, dim = v.shape
        token_stride, head_stride = v.strides[:2]
        page_stride = page_size * token_stride
    return Part(layer=v.layer, kind=v.kind, space=space, region=region, base=v.offset, page_stride=page_stride,
                token_stride=token_stride, heads=heads, head_stride=head_stride, head_bytes=dim * es, dtype=v.dtype)


def _slots_of(v: View, page_size: int) -> int:
    return v.shape[0] * page_size if v.hnd else v.shape[0]


def strided_kv(memory: RawMemory | Sequence[RawMemory], views: Sequence[View], *, page_size: int,
               num_slots: int | None = None, space: str = TOKEN, kind: str = "sglang") -> Described:
    """KV parts from the engine's per-layer views. ``memory``: one block holding every view (a
    unified pool's raw buffer: the views' offsets are from its start), or one block per view
    (token-major / HND / MLA pools: each view at offset 0 of its own block). ``num_slots``:
    the slots (padding page included; default: the views' rows), a multiple of ``page_size``."""
    page_size = _positive("page_size", page_size)
    if not views:
        raise LayoutError("strided_kv needs at least one view")
    shared = isinstance(memory, RawMemory)
    blocks: list[RawMemory] = [memory] if isinstance(memory, RawMemory) else list(memory)
    if not shared and len(blocks) != len(views):
        raise LayoutError(f"{len(views)} views but {len(blocks)} memory blocks: one block per view, or one "
                          f"RawMemory holding them all")
    rows = {_slots_of(v, page_size) for v in views}
    n = _positive("num_slots", num_slots if num_slots is not None else min(rows))
    if n % page_size:
        raise LayoutError(f"num_slots {n} is not a multiple of page_size {page_size}")
    if max(rows) < n:
        raise LayoutError(f"num_slots {n} is more than a view holds ({min(rows)} rows)")
    parts = tuple(_view_part(v, 0 if shared else i, page_size, space) for i, v in enumerate(views))
    if shared:
        regions: tuple[Region, ...] = (Region(name="raw", nbytes=blocks[0].nbytes),)
    else:
        regions = tuple(Region(name=f"{p.kind}{p.layer}", nbytes=_part_end(p, n, page_size)) for p in parts)
    sp = Space(name=space, num_slots=n, page_size=page_size)
    return Described(Layout(kind=kind, spaces=(sp,), regions=regions, parts=parts), tuple(blocks))


def _part_end(p: Part, num_slots: int, page_size: int) -> int:
    """The byte after the last one part ``p`` touches in ``num_slots`` slots."""
    return (p.base + (num_slots // page_size - 1) * p.page_stride + (page_size - 1) * p.token_stride
            + (p.heads - 1) * p.head_stride + p.head_bytes)


def _kv_args_blocks(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], n: int,
                    device: str) -> list[tuple[RawMemory, int]]:
    if not len(ptrs) == len(lens) == len(item_lens) == n:
        raise LayoutError(f"KVArgs lists of {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
                          f"lengths: {n} of each expected")
    return [(RawMemory(int(p), int(nb), device), int(il)) for p, nb, il in zip(ptrs, lens, item_lens)]


def _row_dim(item_len: int, page_size: int, heads: int, es: int, what: str) -> int:
    row, rem = divmod(item_len, page_size * heads * es)
    if rem or row < 1:
        raise LayoutError(f"{what}: {item_len} bytes per page is not page_size {page_size} x {heads} head(s) x "
                          f"whole {es}-byte elements")
    return row


def mha_from_kv_args(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], *, layers: Sequence[int],
                     page_size: int, heads: int, dtype: str, device: str = "cpu") -> Described:
    """An MHA pool from ``KVArgs`` alone: ``kv_data_ptrs`` is K of every layer, then V of every
    layer, each ``[slots, heads, head_dim]``; ``kv_item_lens`` one page of each (head_dim follows)."""
    ids, es = [int(x) for x in layers], dtype_size(dtype)
    blocks = _kv_args_blocks(ptrs, lens, item_lens, 2 * len(ids), device)
    views, mem = [], []
    for i, (block, item) in enumerate(blocks):
        dim = _row_dim(item, page_size, heads, es, f"KVArgs entry {i}")
        row = heads * dim * es
        views.append(View(layer=ids[i % len(ids)], kind="k" if i < len(ids) else "v", offset=0,
                          shape=(block.nbytes // row, heads, dim), strides=(row, dim * es, es), dtype=dtype))
        mem.append(block)
    n = min(v.shape[0] for v in views) // page_size * page_size
    return strided_kv(mem, views, page_size=page_size, num_slots=n, kind="sglang_mha")


def mla_from_kv_args(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], *, layers: Sequence[int],
                     page_size: int, dtype: str, device: str = "cpu") -> Described:
    """An MLA pool from ``KVArgs`` alone: one latent buffer per layer ``[slots, 1, dim]``."""
    ids, es = [int(x) for x in layers], dtype_size(dtype)
    blocks = _kv_args_blocks(ptrs, lens, item_lens, len(ids), device)
    views = []
    for i, (block, item) in enumerate(blocks):
        dim = _row_dim(item, page_size, 1, es, f"KVArgs entry {i}")
        views.append(View(layer=ids[i], kind="kv", offset=0, shape=(block.nbytes // (dim * es), 1, dim),
                          strides=(dim * es, dim * es, es), dtype=dtype))
    n = min(v.shape[0] for v in views) // page_size * page_size
    return strided_kv([b for b, _ in blocks], views, page_size=page_size, num_slots=n, kind="sglang_mla")


def unified_envelopes(raw: RawMemory, *, page_bytes: int, page_size: int) -> Described:
    """A unified pool as SGLang's own backends see it (``get_contiguous_buf_infos``: the raw
    buffer, one item per page envelope): each token's entry as one opaque row. Only pools of
    identical entries can exchange these (no head slicing: the handshake refuses another TP)."""
    page_bytes, page_size = _positive("page_bytes", page_bytes), _positive("page_size", page_size)
    if page_bytes % page_size:
        raise LayoutError(f"page envelope of {page_bytes} bytes does not hold {page_size} equal entries")
    entry = page_bytes // page_size
    pages = raw.nbytes // page_bytes
    view = View(layer=0, kind="envelope", offset=0, shape=(pages * page_size, 1, entry), strides=(entry, entry, 1),
                dtype="uint8")
    return strided_kv(raw, [view], page_size=page_size, kind="sglang_unified_envelopes")


def seed_page_major(raw: RawMemory, *, layers: Sequence[int], heads: int, head_dim: int, dtype: str,
                    page_size: int, num_pages: int, v_head_dim: int | None = None) -> Described:
    """The seed's ``PageMajorMHATokenToKVPool`` bytes: one raw buffer ``[pages][layer][K|V]
    [page_size, heads, head_dim]`` (``page_major_layer_major``)."""
    layout = page_major_layout(layers=list(layers), heads=heads, head_dim=head_dim, dtype=dtype,
                               num_pages=num_pages, page_size=page_size, v_head_dim=v_head_dim)
    return Described(layout, (raw,))


def hybrid_swa(full: Described, swa: Described) -> Described:
    """A full-attention pool (space "token") beside a sliding-window pool (space "swa"), as
    ``SWAKVPool`` holds them; the engine's full -> swa slot map goes to ``EnginePool(swa_map=)``."""
    layout = hybrid_swa_layout(full.layout, swa.layout)
    return Described(layout, full.memory + swa.memory)


class StateTensor(NamedTuple):
    """One Mamba state tensor ``[layers, slots, *per_slot]`` of the engine's, in its own block.
    ``blocks``: for a conv tensor, the channel sub-blocks TP shards separately (``[x | B | C]``,
    GDN's ``[q | k | v]``; default: one block of all channels)."""
    memory: RawMemory
    per_slot: tuple[int, ...]
    dtype: str
    blocks: tuple[int, ...] | None = None


def mamba_state(conv: Sequence[StateTensor], temporal: StateTensor, *, layers: Sequence[int],
                num_slots: int) -> Described:
    """Mamba state per request slot (space "state", page size 1, slot 0 padding): conv tensor
    ``i`` ``[layers, slots, channels, width]`` as parts ``conv{i}.{b}`` (one per sub-block, heads =
    its channels), temporal ``[layers, slots, heads, ...]`` as part ``temporal`` (heads sharded)."""
    ids, n = [int(x) for x in layers], _positive("num_slots", num_slots)
    regions: list[Region] = []
    parts: list[Part] = []
    memory: list[RawMemory] = []
    for i, t in enumerate(conv):
        if len(t.per_slot) != 2:
            raise LayoutError(f"conv state {i}: per-slot shape {t.per_slot} is not [channels, width]")
        channels, width = t.per_slot
        blocks = t.blocks or (channels,)
        if sum(blocks) != channels or min(blocks) < 1:
            raise LayoutError(f"conv state {i}: sub-blocks {list(blocks)} do not add up to its {channels} channels")
        es = dtype_size(t.dtype)
        row = channels * width * es
        at = 0
        for layer_i, layer in enumerate(ids):
            ch = 0
            for b, count in enumerate(blocks):
                parts.append(Part(layer=layer, kind=f"conv{i}.{b}", space=STATE, region=len(regions),
                                  base=layer_i * n * row + ch * width * es, page_stride=row, token_stride=row,
                                  heads=count, head_stride=width * es, head_bytes=width * es, dtype=t.dtype))
                ch += count
            at = (layer_i + 1) * n * row
        regions.append(Region(name=f"conv{i}", nbytes=at))
        memory.append(t.memory)
    if not temporal.per_slot:
        raise LayoutError("temporal state needs a per-slot shape [heads, ...]")
    es = dtype_size(temporal.dtype)
    head_bytes = math.prod(temporal.per_slot[1:]) * es
    row = temporal.per_slot[0] * head_bytes
    for layer_i, layer in enumerate(ids):
        parts.append(Part(layer=layer, kind="temporal", space=STATE, region=len(regions), base=layer_i * n * row,
                          page_stride=row, token_stride=row, heads=temporal.per_slot[0], head_stride=head_bytes,
                          head_bytes=head_bytes, dtype=temporal.dtype))
    regions.append(Region(name="temporal", nbytes=len(ids) * n * row))
    memory.append(temporal.memory)
    layout = Layout(kind="sglang_mamba", spaces=(Space(name=STATE, num_slots=n, page_size=1),),
                    regions=tuple(regions), parts=tuple(parts))
    return Described(layout, tuple(memory))


def physical_slots(virtual_slots, v2p_pages, page_size: int) -> np.ndarray:
    """Physical token ids of ``virtual_slots`` through a unified allocator's page table
    (``v2p_pages[virtual page] = physical page``; 0 = not mapped, the padding page): SGLang
    translates before it hands ids to a transfer backend; this is the same map, checked."""
    page_size = _positive("page_size", page_size)
    v = np.asarray(virtual_slots, dtype=np.int64).reshape(-1)
    table = np.asarray(v2p_pages, dtype=np.int64).reshape(-1)
    pages = v // page_size
    bad = (v < 0) | (pages >= len(table))
    if bad.any():
        i = int(np.argmax(bad))
        raise LayoutError(f"virtual slot {int(v[i])} is outside the page table ({len(table)} pages of {page_size})")
    phys = table[pages]
    unmapped = phys < 1
    if unmapped.any():
        i = int(np.argmax(unmapped))
        raise LayoutError(f"virtual slot {int(v[i])} is on virtual page {int(pages[i])}, which maps to no "
                          f"physical page ({int(phys[i])}): freed or never allocated")
    return phys * page_size + v % page_size


__all__ = ["Described", "View", "StateTensor", "strided_kv", "mha_from_kv_args", "mla_from_kv_args",
           "unified_envelopes", "seed_page_major", "hybrid_swa", "mamba_state", "physical_slots"]
