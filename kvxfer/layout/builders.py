"""Constructors of the layouts seen in the wild: token-major (NHD), HND, page-major, MLA, state
(conv and temporal), and a hybrid sliding-window pool. Each computes strides once and returns a
plain ``Layout``; nothing else in kvxfer special-cases a layout."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .data import STATE, SWA, TOKEN, Layout, Part, Region, Space, dtype_size, require


def _layer_ids(layers: int | Sequence[int]) -> list[int]:
    ids = list(range(layers)) if isinstance(layers, int) else [int(x) for x in layers]
    require(len(ids) >= 1, f"layers must name at least one layer, got {layers!r}")
    require(len(set(ids)) == len(ids), f"layers has duplicates: {ids}")
    return ids


def _kv_dims(head_dim: int, v_head_dim: int | None) -> list[tuple[str, int]]:
    require(head_dim >= 1, f"head_dim must be >= 1, got {head_dim}")
    v = head_dim if v_head_dim is None else v_head_dim
    require(v >= 1, f"v_head_dim must be >= 1, got {v}")
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
        require(dim % scale_block == 0, f"head dim {dim} is not a multiple of scale_block {scale_block}")
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
    require(kv_lora_rank >= 1 and rope_dim >= 0, f"kv_lora_rank {kv_lora_rank} / rope_dim {rope_dim} invalid")
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
    require(len(conv_blocks) >= 1 and all(c >= 1 for c in conv_blocks),
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
    require(not set(full.layers) & set(swa.layers),
             f"full and sliding-window layers overlap: {sorted(set(full.layers) & set(swa.layers))}")
    require(len(full.spaces) == 1 and len(swa.spaces) == 1, "hybrid_swa_layout takes two single-space layouts")
    n = len(full.regions)
    sw_space = dataclasses.replace(swa.spaces[0], name=SWA)
    parts = full.parts + tuple(dataclasses.replace(p, space=SWA, region=p.region + n) for p in swa.parts)
    regions = full.regions + tuple(dataclasses.replace(r, name=f"swa_{r.name}") for r in swa.regions)
    return Layout(kind="hybrid_swa", spaces=(full.spaces[0], sw_space), regions=regions, parts=parts)


