"""Memory in SGLang 0.5.23's pool shapes, made here with torch alone (no SGLang), and each pool's
own way of reading a token's row: the reference the byte-exact tests compare kvxfer against.

Shapes (read from the installed SGLang's ``mem_cache``, re-made here, not copied):
    MHATokenToKVPool   per layer K and V ``[slots, heads, dim]``; K and V of a layer are the two
                       halves of one ``[2, rows, heads, dim]`` allocation
    HND                per layer ``[pages, heads, page_size, dim]``
    unified            one uint8 buffer; token ``s``'s entry at ``s * entry_bytes`` holds
                       ``[K_0 | V_0 | K_1 | V_1 | ... | pad]``; per-layer views have the entry as
                       their slot stride
    MLA                per layer ``[slots, 1, kv_lora_rank + rope_dim]``
    Mamba              conv ``[layers, slots, channels, width]``, temporal ``[layers, slots, heads, a, b]``
"""
from __future__ import annotations

import torch

from kvxfer.integrations.sglang.layouts import View
from kvxfer.memory import RawMemory

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.uint8: "uint8"}


def fill(t: torch.Tensor, seed: int) -> None:
    """Every byte of ``t``'s storage from a seeded pattern (NaN bit patterns included)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,))
    flat.copy_(torch.randint(0, 256, flat.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))


def raw(t: torch.Tensor) -> RawMemory:
    """The engine's pointer to ``t`` with its length, as SGLang's KVArgs gives it."""
    return RawMemory(t.data_ptr(), t.numel() * t.element_size(), str(t.device))


def view_of(t: torch.Tensor, layer: int, kind: str, base_ptr: int | None = None, hnd: bool = False) -> View:
    """A ``View`` of one of the engine's strided tensors (offset from ``base_ptr``, else 0)."""
    es = t.element_size()
    return View(layer=layer, kind=kind, offset=0 if base_ptr is None else t.data_ptr() - base_ptr,
                shape=tuple(t.shape), strides=tuple(s * es for s in t.stride()), dtype=DTYPES[t.dtype], hnd=hnd)


class MHA:
    """``MHATokenToKVPool``'s buffers: ``k[l]``/``v[l]`` halves of one allocation per layer."""

    def __init__(self, *, layers: int, heads: int, dim: int, slots: int, page: int, seed: int,
                 dtype=torch.bfloat16, first_layer: int = 0):
        self.page, self.ids = page, list(range(first_layer, first_layer + layers))
        self.fused = [torch.zeros(2, slots + page, heads, dim, dtype=dtype) for _ in range(layers)]
        self.k = [f[0, :slots] for f in self.fused]
        self.v = [f[1, :slots] for f in self.fused]
        for i, f in enumerate(self.fused):
            fill(f, seed * 100 + i)

    def views(self) -> tuple[list[RawMemory], list[View]]:
        mem, views = [], []
        for i, layer in enumerate(self.ids):
            for kind, t in (("k", self.k[i]), ("v", self.v[i])):
                mem.append(raw(t))
                views.append(view_of(t, layer, kind))
        return mem, views

    def row(self, layer: int, kind: str, slots) -> torch.Tensor:   # [tokens, heads, dim]
        return (self.k if kind == "k" else self.v)[self.ids.index(layer)][torch.as_tensor(slots)]


class HND:
    """``SGLANG_USE_HND_KVCACHE``: per layer ``[pages, heads, page_size, dim]``."""

    def __init__(self, *, layers: int, heads: int, dim: int, pages: int, page: int, seed: int, dtype=torch.float16):
        self.page = page
        self.k = [torch.zeros(pages, heads, page, dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(pages, heads, page, dim, dtype=dtype) for _ in range(layers)]
        for i, t in enumerate(self.k + self.v):
            fill(t, seed * 100 + i)

    def views(self) -> tuple[list[RawMemory], list[View]]:
        mem, views = [], []
        for layer in range(len(self.k)):
            for kind, t in (("k", self.k[layer]), ("v", self.v[layer])):
                mem.append(raw(t))
                views.append(view_of(t, layer, kind, hnd=True))
        return mem, views

    def row(self, layer: int, kind: str, slots) -> torch.Tensor:
        s = torch.as_tensor(slots)
        t = (self.k if kind == "k" else self.v)[layer]
        return t[s // self.page, :, s % self.page]


class Unified:
    """A unified pool's MHA (or MLA: ``mla=True``) sub-pool: entries of every layer per token."""

    def __init__(self, *, layers: int, heads: int, dim: int, slots: int, page: int, seed: int,
                 dtype=torch.bfloat16, mla: bool = False, align: int = 64):
        es = torch.empty(0, dtype=dtype).element_size()
        self.page, self.layers, self.mla, self.dtype = page, layers, mla, dtype
        self.row_bytes = heads * dim * es
        per_layer = self.row_bytes * (1 if mla else 2)
        self.entry = -(-layers * per_layer // align) * align
        self.buf = torch.zeros(slots * self.entry + 4096, dtype=torch.uint8)   # the tail: other sub-pools
        fill(self.buf, seed)
        typed = self.buf.view(dtype)
        self.views_by = {}
        for layer in range(layers):
            for kind in (("kv",) if mla else ("k", "v")):
                off = layer * per_layer + (self.row_bytes if kind == "v" else 0)
                self.views_by[(layer, kind)] = torch.as_strided(typed, (slots, heads, dim),
                                                                (self.entry // es, dim, 1), off // es)

    @property
    def page_bytes(self) -> int:
        return self.page * self.entry

    def views(self) -> tuple[RawMemory, list[View]]:
        base = self.buf.data_ptr()
        return raw(self.buf), [view_of(t, layer, kind, base) for (layer, kind), t in self.views_by.items()]

    def row(self, layer: int, kind: str, slots) -> torch.Tensor:
        return self.views_by[(layer, kind)][torch.as_tensor(slots)]


class MLA:
    def __init__(self, *, layers: int, dim: int, slots: int, seed: int, dtype=torch.bfloat16):
        self.kv = [torch.zeros(slots, 1, dim, dtype=dtype) for _ in range(layers)]
        for i, t in enumerate(self.kv):
            fill(t, seed * 100 + i)

    def views(self) -> tuple[list[RawMemory], list[View]]:
        return [raw(t) for t in self.kv], [view_of(t, layer, "kv") for layer, t in enumerate(self.kv)]

    def row(self, layer: int, kind: str, slots) -> torch.Tensor:
        return self.kv[layer][torch.as_tensor(slots)]


class Mamba:
    """``MambaPool``'s state: conv tensors ``[layers, slots, channels, width]`` and temporal."""

    def __init__(self, *, layers: int, slots: int, conv_channels: list[int], width: int, heads: int,
                 head_shape: tuple[int, int], seed: int):
        self.conv = [torch.zeros(layers, slots, c, width, dtype=torch.bfloat16) for c in conv_channels]
        self.temporal = torch.zeros(layers, slots, heads, *head_shape, dtype=torch.float32)
        for i, t in enumerate(self.conv + [self.temporal]):
            fill(t, seed * 100 + i)
