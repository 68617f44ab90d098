"""The pattern a launched rank serves (``kvxfer rank``): every KV byte of a request is a function of
(seed, room, layer, K/V, global head, token position, byte), the same on every host, layout and TP
size, so a decode rank checks what arrived without any other source of truth.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pattern(seed: int, room: int, layer: int, kind: str, heads: Sequence[int], positions: np.ndarray,
            head_bytes: int) -> np.ndarray:
    """``[tokens, heads, head_bytes]`` uint8: the same bytes on every host, layout and TP split."""
    key = (seed * 0x9E3779B97F4A7C15 + room * 0xBF58476D1CE4E5B9 + layer * 0x94D049BB133111EB
           + sum(map(ord, kind)) * 0x2545F4914F6CDD1D) & (2**64 - 1)
    with np.errstate(over="ignore"):
        x = (np.uint64(key) + np.asarray(positions, np.uint64)[:, None, None] * np.uint64(0xD6E8FEB86659FD93)
             + np.asarray(heads, np.uint64)[None, :, None] * np.uint64(0xA0761D6478BD642F)
             + np.arange(head_bytes, dtype=np.uint64)[None, None, :] * np.uint64(0xE7037ED1A0B428DB))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x7FB5D329728EA185)
        x ^= x >> np.uint64(27)
    return (x >> np.uint64(32)).astype(np.uint8)


def parts_of(pool) -> list:
    return [p for p in pool.layout.parts if p.kind in pool.kv_kinds]


def fill(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> None:
    """Write the pattern of ``room`` into ``slots`` (token positions 0..len - 1)."""
    import torch

    from ..pools import torch_dtype
    pos = np.arange(len(slots))
    for p in parts_of(pool):
        raw = torch.from_numpy(pattern(seed, room, p.layer, p.kind, heads, pos, p.head_bytes))
        pool.set_parts(p.layer, slots, [(p.kind, raw.view(torch_dtype(p.dtype)))])


def verify(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> tuple[int, str]:
    """(bytes that differ from the pattern, the first one in words)."""
    import torch
    bad, first = 0, ""
    pos = np.arange(len(slots))
    for p in parts_of(pool):
        got = pool.get_part(p.layer, p.kind, slots).contiguous().view(torch.uint8).cpu().numpy()
        diff = got.reshape(len(slots), len(heads), p.head_bytes) != pattern(seed, room, p.layer, p.kind, heads, pos,
                                                                             p.head_bytes)
        n = int(diff.sum())
        if n and not first:
            t, h, b = (int(i[0]) for i in np.nonzero(diff))
            first = f"layer {p.layer} {p.kind} head {heads[h]} token {t} byte {b}"
        bad += n
    return bad, first


__all__ = ["pattern", "fill", "verify", "parts_of"]
