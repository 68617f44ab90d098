"""Torch-backed pools that expose their layout.

One class, ``KVPool``, does everything for every layout: it reads and writes parts
through strided views built from the layout, and copies to and from host memory
through the planner. The named pools below only choose a layout and the names of
the parts that ``set_kv_buffer`` fills, so a page-major pool offers exactly what a
token-major one does.

Who calls what: the serving engine writes KV with ``set_kv_buffer`` (every forward
step, possibly inside a CUDA graph), takes slots from ``pool.allocator()`` (a
``PageAllocator``, ``kvxfer.allocator``), and hands ``regions()`` / ``layout`` to kvxfer's
transports and planner at start-up. ``HostPool`` (``kvxfer.host``: offload, direct-to-host
receive) is built from any pool's layout; host regions are page-locked by ``kvxfer.pinned``.

Device safety (the write path runs on the engine's stream every step): slots given as
a torch tensor on the pool's device (the engine's ``out_cache_loc``) stay there: pages
and in-page offsets are computed on the device, the write is one ``index_put_`` per
part, and nothing reads a device value on the host, so the write can be captured in a
CUDA graph. Such slots are the engine's own and are not range-checked; slots given as
host data (lists, numpy, CPU tensors) are checked against the space first and
uploaded once per call. Layouts are computed without allocating (``mha_layout``).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .allocator import PageAllocator
from .bufinfos import BufInfos, PagePart, buf_infos
from .copy import execute_plan
from .errors import LayoutError
from .layout import (
    STATE,
    SWA,
    TOKEN,
    Layout,
    Part,
    hnd_layout,
    host_layout,
    hybrid_swa_layout,
    mla_layout,
    page_major_layout,
    state_layout,
    token_major_layout,
)
from .pinned import host_buffer, unregister_all
from .plan import plan_transfer

# fp8 formats are distinct torch dtypes: an e5m2 tensor is refused by an e4m3 pool. Raw
# bytes (uint8) are accepted by any one-byte pool.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "uint8": torch.uint8,
                "int32": torch.int32}


def torch_dtype(dtype: str) -> torch.dtype:
    return TORCH_DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class CPUCopy:
    """A request's KV on the host, in a compact layer-first host layout."""
    layout: Layout
    slots: dict[str, np.ndarray]      # where the tokens sit in ``regions``
    positions: dict[str, np.ndarray]  # which of the request's tokens each space holds
    regions: list[torch.Tensor]

    @property
    def num_tokens(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.slots.items()}


def host_array(slots) -> np.ndarray:
    """Slots given as host data (or a tensor, copied to the host: not for the hot path)."""
    if isinstance(slots, torch.Tensor):
        return slots.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(slots, dtype=np.int64)


class KVPool:
    """A pool whose memory is exactly ``layout``: one uint8 tensor per region."""

    #: part kinds that ``set_kv_buffer(layer, slots, *tensors)`` fills, in order
    kv_kinds: tuple[str, ...] = ("k", "v")

    def __init__(self, layout: Layout, device: str | torch.device = "cpu", pin_memory: bool = False):
        self.layout = layout
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self.buffers = [host_buffer(r.nbytes, pin_memory) for r in layout.regions]
            self.pinned = bool(pin_memory)
        else:
            self.buffers = [torch.zeros(r.nbytes, dtype=torch.uint8, device=self.device) for r in layout.regions]
            self.pinned = False
        if self.pinned:   # unregistered when the pool goes (or at close())
            self._unpin = weakref.finalize(self, unregister_all, [b.data_ptr() for b in self.buffers if b.numel()])

    def close(self) -> None:
        """Unregister pinned memory now (idempotent); the pool must not be used after."""
        if self.pinned:
            self._unpin()

    # -- sizes, and the allocator the engine takes slots from ---------------------------
    @property
    def num_pages(self) -> int:
        """Pages of the pool's first space ("token" for KV pools, "state" for state pools),
        padding page included."""
        return self.layout.spaces[0].num_pages

    @property
    def page_size(self) -> int:
        return self.layout.spaces[0].page_size

    def allocator(self, space: str | None = None) -> PageAllocator:
        """A fresh ``PageAllocator`` over the pages of ``space`` (default: the first space)."""
        return PageAllocator.for_space(self.layout.space(space) if space else self.layout.spaces[0])

    # -- what transports and planners see ------------------------------------------------
    def regions(self) -> list[torch.Tensor]:
        return self.buffers

    def get_contiguous_buf_infos(self) -> BufInfos:
        """What engines hand a byte mover (``kvxfer.bufinfos``): pointers, lengths, page bytes."""
        return buf_infos(self.layout, self.buffers)

    # -- slots -------------------------------------------------------------------------
    def space_slots(self, space: str, slots):
        """Map the engine's slot ids (numpy, or a tensor on the pool's device) to ``space``'s
        slots (identity; hybrid SWA maps)."""
        return slots

    def _part_view(self, p: Part) -> torch.Tensor:
        sp = self.layout.space(p.space)
        # [pages, page_size, heads, head_bytes] uint8, strided into the region
        return self.buffers[p.region].as_strided((sp.num_pages, sp.page_size, p.heads, p.head_bytes),
                                                 (p.page_stride, p.token_stride, p.head_stride, 1), p.base)

    def _slot_index(self, space: str, slots, trusted: bool = False) -> torch.Tensor:
        """``space``'s slots as an int64 tensor on the pool's device. A tensor already there is
        used on the device (no copy, no sync, no range check unless the pool is on the CPU);
        host data is checked (``trusted``: already checked by the caller) and uploaded once."""
        if isinstance(slots, torch.Tensor) and slots.device == self.device:
            s = self.space_slots(space, slots.to(torch.int64).reshape(-1))
            if self.device.type == "cpu" and not trusted:   # checking a CPU tensor costs no device sync
                self.layout.check_slots(space, s.numpy())
            return s
        s = self.space_slots(space, host_array(slots))
        if not trusted:
            s = self.layout.check_slots(space, s)
        return torch.from_numpy(np.ascontiguousarray(s, dtype=np.int64)).to(self.device)

    def _index(self, p: Part, slots, trusted: bool = False, memo: dict | None = None) -> tuple[torch.Tensor, ...]:
        """(page, in-page slot) index tensors of ``slots`` in ``p``'s space; ``memo`` keeps them
        per space for one call, so host slots are checked and uploaded once per call."""
        if memo is not None and p.space in memo:
            return memo[p.space]
        t = self._slot_index(p.space, slots, trusted)
        page_size = self.layout.space(p.space).page_size
        out = torch.div(t, page_size, rounding_mode="floor"), torch.remainder(t, page_size)
        if memo is not None:
            memo[p.space] = out
        return out

    # -- typed part access -------------------------------------------------------------
    def get_part(self, layer: int, kind: str, slots) -> torch.Tensor:
        """``[tokens, heads, head_dim]`` of part (layer, kind) at ``slots`` (a copy)."""
        p = self.layout.part(layer, kind)
        page, off = self._index(p, slots)
        return self._part_view(p)[page, off].view(torch_dtype(p.dtype))   # [tokens, heads, head_dim]

    def _prepare(self, p: Part, slots, data: torch.Tensor, name: str, trusted: bool = False,
                 memo: dict | None = None):
        page, off = self._index(p, slots, trusted, memo)
        want = (page.shape[0], p.heads, p.head_dim)
        if tuple(data.shape) != want:
            raise LayoutError(f"{name} for layer {p.layer} has shape {tuple(data.shape)}, expected {want} "
                              f"(tokens, heads, head_dim)")
        # a pool takes its own dtype; one-byte pools (fp8) also take raw bytes (uint8)
        if data.dtype != torch_dtype(p.dtype) and not (data.dtype == torch.uint8 and data.element_size()
                                                       == torch_dtype(p.dtype).itemsize):
            raise LayoutError(f"{name} for layer {p.layer} has dtype {data.dtype}, pool dtype is {p.dtype}")
        raw = data.contiguous().view(torch.uint8).reshape(page.shape[0], p.heads, p.head_bytes)
        return page, off, raw.to(self.device, non_blocking=True)

    def set_parts(self, layer: int, slots, named: Sequence[tuple[str, torch.Tensor]], *,
                  trusted: bool = False) -> None:
        """Write several parts of one layer; every argument is checked before any byte is written.
        One ``index_put_`` per part on the pool's device (capturable in a CUDA graph when the
        slots and tensors are on the device). ``trusted``: the caller checked host slots."""
        memo: dict = {}
        ready = [(self.layout.part(layer, kind),
                  *self._prepare(self.layout.part(layer, kind), slots, t, kind, trusted, memo)) for kind, t in named]
        for p, page, off, raw in ready:
            self._part_view(p).index_put_((page, off), raw)

    def set_kv_buffer(self, layer: int, slots, *tensors: torch.Tensor, **extra: torch.Tensor) -> None:
        """Write ``tensors`` (for MHA: k, v; MLA: kv; each ``[tokens, heads, head_dim]``) at ``slots``.
        Keyword tensors name further parts, e.g. ``k_scale=...``."""
        if len(tensors) != len(self.kv_kinds):
            raise LayoutError(f"set_kv_buffer takes {len(self.kv_kinds)} tensors {self.kv_kinds}, got {len(tensors)}")
        self.set_parts(layer, slots, list(zip(self.kv_kinds, tensors)) + list(extra.items()))

    def get_kv_buffer(self, layer: int, slots) -> tuple[torch.Tensor, ...]:
        return tuple(self.get_part(layer, kind, slots) for kind in self.kv_kinds)

    def set_kv_buffer_prefix_valid(self, layer: int, slots_2d, commit_lens, *tensors: torch.Tensor,
                                   **extra: torch.Tensor) -> None:
        """Rows of ``slots_2d`` ``[batch, cols]``; write only columns below each row's commit length.
        ``tensors`` (and keyword parts such as ``k_scale``) are ``[batch, cols, heads, head_dim]``.

        No boolean-mask indexing (it syncs): every column is written, and columns past a row's
        commit length go to slot 0, the padding page that exists for dummy writes. Host input
        is checked first (committed slots in range, lengths in 0..cols); device input is not."""
        if len(tensors) != len(self.kv_kinds):
            raise LayoutError(f"set_kv_buffer takes {len(self.kv_kinds)} tensors {self.kv_kinds}, got {len(tensors)}")
        on_device = isinstance(slots_2d, torch.Tensor) and slots_2d.device == self.device \
            and self.device.type != "cpu"
        s2 = slots_2d if isinstance(slots_2d, torch.Tensor) else torch.as_tensor(np.asarray(slots_2d))
        lens = commit_lens if isinstance(commit_lens, torch.Tensor) else torch.as_tensor(np.asarray(commit_lens))
        if s2.dim() != 2 or tuple(lens.shape) != (s2.shape[0],):
            raise LayoutError(f"slots_2d shape {tuple(s2.shape)} and commit_lens shape "
                              f"{tuple(lens.shape)} disagree: want [batch, cols] and [batch]")
        for t in (*tensors, *extra.values()):
            if tuple(t.shape[:2]) != tuple(s2.shape):
                raise LayoutError(f"tensor shape {tuple(t.shape)} does not start with slots_2d shape "
                                  f"{tuple(s2.shape)}")
        s2, lens = s2.to(self.device, torch.int64), lens.to(self.device, torch.int64)
        mask = torch.arange(s2.shape[1], device=self.device)[None, :] < lens[:, None]
        flat = torch.where(mask, s2, torch.zeros((), dtype=torch.int64, device=self.device)).reshape(-1)
        if not on_device:   # host input: checked on the host, as every host slot is
            h_lens, h_slots, h_mask = lens.cpu(), s2.cpu().numpy(), mask.cpu().numpy()
            if (h_lens < 0).any() or (h_lens > s2.shape[1]).any():
                raise LayoutError(f"commit_lens must be in 0..{s2.shape[1]}, got {h_lens.tolist()}")
            for sp in {p.space for p in self.layout.parts if p.layer == layer}:
                self.layout.check_slots(sp, self.space_slots(sp, h_slots[h_mask]))
        n = flat.shape[0]
        self.set_parts(layer, flat, [(k, t.reshape(n, *t.shape[2:]))
                                     for k, t in [*zip(self.kv_kinds, tensors), *extra.items()]], trusted=True)

    # -- host copies through the planner -----------------------------------------------
    def _spaces_of(self, slots) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per space: the slots of the tokens it holds, and those tokens' positions.
        A space may hold a subset (a sliding window maps only its last tokens)."""
        s = host_array(slots)
        out, pos = {}, {}
        for sp in self.layout.spaces:
            mapped = self.space_slots(sp.name, s)
            keep = np.flatnonzero(mapped != 0) if mapped is not s else np.arange(len(s))
            out[sp.name], pos[sp.name] = mapped[keep], keep
        return out, pos

    def get_cpu_copy(self, slots) -> CPUCopy:
        """The KV at ``slots`` (every part) copied to host memory."""
        src, positions = self._spaces_of(slots)
        # One padding page plus enough pages for the tokens; at least one, as a Space requires.
        sizes = {sp.name: (max(-(-len(src[sp.name]) // sp.page_size), 1) + 1) * sp.page_size
                 for sp in self.layout.spaces}
        host = host_layout(self.layout, "layer_first", sizes)
        dst = {sp.name: sp.page_size + np.arange(len(src[sp.name])) for sp in self.layout.spaces}
        regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in host.regions]
        if any(len(v) for v in src.values()):
            execute_plan(plan_transfer(self.layout, src, host, dst), self.buffers, regions)
        return CPUCopy(host, dst, positions, regions)

    def load_cpu_copy(self, copy: CPUCopy, slots) -> None:
        """Write a ``get_cpu_copy`` result into ``slots`` (may differ from where it came from)."""
        s = host_array(slots)
        dst = {}
        for name, pos in copy.positions.items():
            if len(pos) and pos.max() >= len(s):
                raise LayoutError(f"load_cpu_copy: copy holds token {int(pos.max())} of space {name!r}, "
                                  f"only {len(s)} slots given")
            dst[name] = self.space_slots(name, s)[pos]
        if any(len(v) for v in dst.values()):
            execute_plan(plan_transfer(copy.layout, copy.slots, self.layout, dst), copy.regions, self.buffers)


def mha_layout(*, layers: int | Sequence[int], heads: int, head_dim: int, dtype: str, num_pages: int,
               page_size: int, layout: str = "token_major", v_head_dim: int | None = None,
               scale_block: int | None = None) -> Layout:
    """The layout of an ``MHAPool`` (no memory allocated): token-major, HND or page-major."""
    if layout == "token_major":
        return token_major_layout(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype,
                                  num_slots=num_pages * page_size, page_size=page_size, v_head_dim=v_head_dim,
                                  scale_block=scale_block)
    if layout == "hnd":
        return hnd_layout(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, num_pages=num_pages,
                          page_size=page_size, v_head_dim=v_head_dim, scale_block=scale_block)
    if layout == "page_major":
        return page_major_layout(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, num_pages=num_pages,
                                 page_size=page_size, v_head_dim=v_head_dim, scale_block=scale_block)
    raise LayoutError(f"MHA layout {layout!r} is not one of {MHAPool.LAYOUTS}")


class MHAPool(KVPool):
    """Multi-head (or GQA) KV: K and V per layer, in a token-major, HND or page-major layout."""
    LAYOUTS = ("token_major", "hnd", "page_major")

    def __init__(self, *, layers: int | Sequence[int], heads: int, head_dim: int, dtype: str, num_pages: int,
                 page_size: int, layout: str = "token_major", v_head_dim: int | None = None,
                 scale_block: int | None = None, device: str | torch.device = "cpu"):
        super().__init__(mha_layout(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, num_pages=num_pages,
                                    page_size=page_size, layout=layout, v_head_dim=v_head_dim,
                                    scale_block=scale_block), device)


class MLAPool(KVPool):
    """MLA latent KV ``[slots, 1, kv_lora_rank + rope_dim]`` per layer, or page-major."""
    kv_kinds = ("kv",)
    LAYOUTS = ("token_major", "page_major")

    def __init__(self, *, layers: int | Sequence[int], kv_lora_rank: int, rope_dim: int, dtype: str,
                 num_pages: int, page_size: int, layout: str = "token_major", device: str | torch.device = "cpu"):
        if layout not in self.LAYOUTS:
            raise LayoutError(f"MLA layout {layout!r} is not one of {self.LAYOUTS}")
        super().__init__(mla_layout(layers=layers, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype=dtype,
                                    num_slots=num_pages * page_size, page_size=page_size,
                                    page_major=layout == "page_major"), device)


class StatePool(KVPool):
    """Mamba-style per-request state; ``set_kv_buffer(layer, slots, conv0, ..., temporal)``."""

    def __init__(self, *, layers: int | Sequence[int], conv_blocks: Sequence[int], conv_width: int,
                 temporal_heads: int, temporal_head_shape: Sequence[int], num_slots: int,
                 conv_dtype: str = "bfloat16", temporal_dtype: str = "float32",
                 device: str | torch.device = "cpu"):
        self.kv_kinds = tuple(f"conv{i}" for i in range(len(conv_blocks))) + ("temporal",)
        self.temporal_head_shape = tuple(temporal_head_shape)
        super().__init__(state_layout(layers=layers, conv_blocks=conv_blocks, conv_width=conv_width,
                                      temporal_heads=temporal_heads, temporal_head_shape=temporal_head_shape,
                                      num_slots=num_slots, conv_dtype=conv_dtype,
                                      temporal_dtype=temporal_dtype), device)


class HybridSWAPool(KVPool):
    """Full-attention layers in space "token" and sliding-window layers in space "swa".

    The engine addresses both with its full-pool slot ids; ``full_to_swa`` maps them
    to the smaller sliding-window pool (0 = not mapped), as SGLang's hybrid pool does.
    The map is kept on the host (``full_to_swa``, for planning) and mirrored on the pool's
    device (``full_to_swa_device``), so device slot tensors map without leaving the device.
    """

    def __init__(self, *, full_layers: Sequence[int], swa_layers: Sequence[int], heads: int, head_dim: int,
                 dtype: str, num_pages: int, swa_num_pages: int, page_size: int, window: int,
                 layout: str = "token_major", device: str | torch.device = "cpu"):
        # layouts only: nothing allocated
        full = mha_layout(layers=full_layers, heads=heads, head_dim=head_dim, dtype=dtype, num_pages=num_pages,
                          page_size=page_size, layout=layout)
        swa = mha_layout(layers=swa_layers, heads=heads, head_dim=head_dim, dtype=dtype, num_pages=swa_num_pages,
                         page_size=page_size, layout=layout)
        self.window = int(window)
        self.full_to_swa = np.zeros(num_pages * page_size, dtype=np.int64)
        super().__init__(hybrid_swa_layout(full, swa), device)
        # on the CPU the mirror is the same memory; on a device, change the map only through
        # map_swa / unmap_swa / load_swa_map, which keep both
        self.full_to_swa_device = (torch.from_numpy(self.full_to_swa) if self.device.type == "cpu" else
                                   torch.zeros(num_pages * page_size, dtype=torch.int64, device=self.device))

    def _mirror(self, full: np.ndarray, swa: np.ndarray) -> None:
        self.full_to_swa[full] = swa
        if self.device.type != "cpu":
            self.full_to_swa_device[torch.from_numpy(full).to(self.device)] = torch.from_numpy(swa).to(self.device)

    def load_swa_map(self, full_to_swa: np.ndarray) -> None:
        """Replace the whole map (e.g. copied from another pool); 0 = not mapped."""
        m = np.asarray(full_to_swa, dtype=np.int64)
        if m.shape != self.full_to_swa.shape:
            raise LayoutError(f"load_swa_map: map of shape {m.shape}, this pool's is {self.full_to_swa.shape}")
        mapped = m[m != 0]
        if len(mapped):
            self.layout.check_slots(SWA, mapped, "full_to_swa")
        self._mirror(np.arange(len(m)), m)

    def map_swa(self, full_slots, swa_slots) -> None:
        full = self.layout.check_slots(TOKEN, host_array(full_slots), "full_slots")
        swa = self.layout.check_slots(SWA, host_array(swa_slots), "swa_slots")
        if len(full) != len(swa):
            raise LayoutError(f"map_swa: {len(full)} full slots vs {len(swa)} swa slots")
        self._mirror(full, swa)

    def unmap_swa(self, full_slots) -> np.ndarray:
        full = self.layout.check_slots(TOKEN, host_array(full_slots), "full_slots")
        old = self.full_to_swa[full]
        self._mirror(full, np.zeros_like(full))
        return old[old > 0]

    def space_slots(self, space: str, slots):
        if space != SWA:
            return slots
        if isinstance(slots, torch.Tensor):   # on the device: a gather, no check, no sync
            return self.full_to_swa_device[slots]
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self.full_to_swa)):
            raise LayoutError(f"full slot outside 0..{len(self.full_to_swa) - 1}")
        return self.full_to_swa[slots]


__all__ = ["KVPool", "MHAPool", "MLAPool", "StatePool", "HybridSWAPool", "PageAllocator", "CPUCopy",
           "BufInfos", "PagePart", "torch_dtype", "mha_layout", "STATE"]
