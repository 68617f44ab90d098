"""Pools over memory the engine owns: ``EnginePool(layout, memory)``.

A serving engine allocates its KV cache itself (vLLM hands its connector one tensor per layer,
SGLang hands raw pointers with their lengths). ``EnginePool`` describes that memory with a
``Layout`` (the builders in ``kvxfer.integrations`` mirror each engine's shapes) and checks the
description against the memory before anything uses it; nothing is copied or reallocated:
``regions()`` are byte views over exactly the engine's memory (the same ``data_ptr``).

What is checked, each refusal a ``LayoutError`` naming the region, the part and the memory:
    count      one memory block per region of the layout
    kind       a tensor, or ``RawMemory(ptr, nbytes, device)``: a bare pointer has no length
    pointer    not null; on the host, inside this process's mapped, writable memory
    density    a tensor's elements cover its bytes once each (a strided view with gaps or
               overlaps would let a run write bytes that are not the tensor's)
    size       every region's bytes fit in its memory
    device     every block on one device (``device=`` when given)
    dtype      a tensor of a typed dtype holds parts of that dtype only (raw bytes: any)
    alignment  every part's base, strides and head bytes, and the memory's address, are
               multiples of its dtype's size
    overlap    no two blocks share a byte; no two parts (nor two heads or tokens of one part)
               share a byte in the first and last usable pages

Who calls what: an engine adapter, once per rank at start-up; the pool then goes to the endpoint
(``PrefillEndpoint(spec, pool, ...)``) like any other. A device pool stays on its device: no check
reads device memory, so the CUDA path is proven on CPU with ``device="meta"`` stand-ins.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import LayoutError
from .layout import SWA, Layout, Part, dtype_size
from .pools import TORCH_DTYPES, KVPool, host_array


@dataclass(frozen=True, slots=True)
class RawMemory:
    """A block of memory given as a pointer (SGLang's ``KVArgs``): address, length in bytes,
    device ("cpu", "cuda:0", ...). The engine keeps it alive as long as the pool is used."""
    ptr: int
    nbytes: int
    device: str | torch.device = "cpu"


def _mapped_ranges() -> np.ndarray:
    """``[n, 2]`` writable address ranges of this process (``/proc/self/maps``); empty elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            rows = [line.split(None, 2) for line in f]
    except OSError:
        return np.zeros((0, 2), np.uint64)
    spans = [r[0].split("-") for r in rows if len(r) >= 2 and "w" in r[1]]
    return np.array([(int(a, 16), int(b, 16)) for a, b in spans], dtype=np.uint64).reshape(-1, 2)


def _inside_mapped(ptr: int, nbytes: int, ranges: np.ndarray) -> bool:
    """True when ``[ptr, ptr + nbytes)`` is covered by ``ranges`` (adjacent mappings count as one)."""
    if not len(ranges):
        return True   # no /proc: nothing to check against
    order = np.argsort(ranges[:, 0])
    lo, hi = ranges[order, 0].astype(object), ranges[order, 1].astype(object)
    at, end = ptr, ptr + nbytes
    for a, b in zip(lo, hi):
        if b <= at:
            continue
        if a > at:
            return False
        at = b
        if at >= end:
            return True
    return False


def _dense_bytes(t: torch.Tensor) -> int | None:
    """Bytes a tensor covers when its elements tile them exactly once (any axis order), else None."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return None
        expect *= size
    return t.numel() * t.element_size()


def _cpu_view(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


class _CudaArray:
    """``__cuda_array_interface__`` over a raw device pointer, so torch wraps it without a copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def memory_view(block: torch.Tensor | RawMemory, nbytes: int, what: str) -> torch.Tensor:
    """``nbytes`` bytes from the start of ``block`` as a flat uint8 tensor over the same memory."""
    if isinstance(block, RawMemory):
        dev = torch.device(block.device)
        if dev.type == "cpu":
            return _cpu_view(block.ptr, nbytes)
        if dev.type == "cuda":
            return torch.as_tensor(_CudaArray(block.ptr, nbytes), device=dev)
        raise LayoutError(f"{what}: raw memory on device {dev} cannot be wrapped (cpu or cuda)")
    return torch.empty(0, dtype=torch.uint8, device=block.device).set_(
        block.untyped_storage(), block.storage_offset() * block.element_size(), (nbytes,), (1,))


def _block_facts(block, what: str, ranges: np.ndarray | None) -> tuple[int, int, torch.device]:
    """(address, bytes, device) of one memory block, checked on its own."""
    if isinstance(block, RawMemory):
        try:
            dev = torch.device(block.device)
        except (RuntimeError, TypeError):
            raise LayoutError(f"{what}: device {block.device!r} is not a device") from None
        if isinstance(block.ptr, bool) or not isinstance(block.ptr, int) or block.ptr <= 0:
            raise LayoutError(f"{what}: pointer {block.ptr!r} is null or not an address")
        if isinstance(block.nbytes, bool) or not isinstance(block.nbytes, int) or block.nbytes <= 0:
            raise LayoutError(f"{what}: length {block.nbytes!r} must be a positive number of bytes")
        if dev.type == "cpu" and ranges is not None and not _inside_mapped(block.ptr, block.nbytes, ranges):
            raise LayoutError(f"{what}: {block.nbytes} bytes at {block.ptr:#x} are not writable memory of this "
                              f"process (unmapped or read-only): a stale or wrong pointer")
        return block.ptr, block.nbytes, dev
    if isinstance(block, torch.Tensor):
        n = _dense_bytes(block)
        if n is None:
            raise LayoutError(f"{what}: tensor of shape {tuple(block.shape)} and strides {tuple(block.stride())} "
                              f"does not cover its bytes exactly once (a strided view with gaps or overlaps): "
                              f"describe the whole buffer it is a view of")
        return block.data_ptr(), n, block.device
    if isinstance(block, int) and not isinstance(block, bool):
        raise LayoutError(f"{what}: a pointer without a length: pass RawMemory(ptr, nbytes, device)")
    raise LayoutError(f"{what}: memory must be a torch.Tensor or RawMemory, got {type(block).__name__}")


def _check_part_fits(p: Part, layout: Layout, block, ptr: int, what: str) -> None:
    es = dtype_size(p.dtype)
    if isinstance(block, torch.Tensor) and block.dtype not in (torch.uint8, torch.int8) \
            and block.dtype != TORCH_DTYPES[p.dtype]:
        raise LayoutError(f"part {p.key} is {p.dtype} but {what} is a {block.dtype} tensor: describe the "
                          f"engine's dtype, or pass its bytes (a uint8 view)")
    odd = [n for n in ("base", "page_stride", "token_stride", "head_stride", "head_bytes") if getattr(p, n) % es]
    if odd or ptr % es:
        where = f"{odd[0]} {getattr(p, odd[0])}" if odd else f"address {ptr:#x}"
        raise LayoutError(f"part {p.key} ({p.dtype}, {es}-byte elements) in {what} is misaligned: {where} is not "
                          f"a multiple of {es}")


MAX_INTERVALS = 1 << 22   # byte intervals checked for overlap per region (start-up cost ~ a second at most)


def _page_intervals(p: Part, layout: Layout, pages: np.ndarray, limit: int) -> np.ndarray:
    """Start offsets of ``p``'s (page, token, head) pieces on ``pages`` (at most ``limit`` of them)."""
    sp = layout.space(p.space)
    tok, head = np.arange(sp.page_size, dtype=np.int64), np.arange(p.heads, dtype=np.int64)
    per_page = len(tok) * len(head)
    if len(pages) * per_page > limit:   # a huge page: its first tokens only
        tok = tok[: max(1, limit // max(len(pages) * p.heads, 1))]
    return (p.base + pages[:, None, None] * p.page_stride + tok[None, :, None] * p.token_stride
            + head[None, None, :] * p.head_stride).ravel()


def _first_overlap(starts: list[np.ndarray], ends: list[np.ndarray], period: int = 0) -> tuple[int, int, int] | None:
    """(owner a, owner b, offset) of the first two intervals that share a byte, else None; with
    ``period``, offsets are taken modulo it (an interval crossing the period is split in two)."""
    s = np.concatenate(starts)
    e = np.concatenate(ends)
    o = np.concatenate([np.full(len(x), i) for i, x in enumerate(starts)])
    if period:
        shift = (s // period) * period
        s, e = s - shift, e - shift
        wrap = e > period
        s, e, o = (np.concatenate([s, np.zeros(int(wrap.sum()), np.int64)]),
                   np.concatenate([np.minimum(e, period), e[wrap] - period]), np.concatenate([o, o[wrap]]))
    order = np.argsort(s, kind="stable")
    s, e, o = s[order], e[order], o[order]
    reach = np.maximum.accumulate(e)
    bad = np.flatnonzero(s[1:] < reach[:-1])
    if not len(bad):
        return None
    k = int(bad[0]) + 1
    j = int(np.flatnonzero(e[:k] > s[k])[0])
    return int(o[j]), int(o[k]), int(s[k])


def _check_overlap(layout: Layout, region: int, what: str) -> None:
    """No two parts of ``region`` (nor two tokens or heads of one part) share a byte. Parts whose byte
    spans meet are checked together: those that repeat with one page stride exactly, their pieces of
    one page modulo the stride (whole-page offsets between parts, as layers of one buffer have, are
    caught); parts of different strides on their first and last usable page."""
    parts = sorted((p for p in layout.parts if p.region == region), key=lambda p: _span(p, layout))
    per = max(1, MAX_INTERVALS // (2 * max(len(parts), 1)))
    clusters: list[list[Part]] = []
    end = -1
    for p in parts:   # parts whose spans meet, transitively
        lo, hi = _span(p, layout)
        if not clusters or lo >= end:
            clusters.append([])
        clusters[-1].append(p)
        end = max(end, hi)
    for group in clusters:
        strides = {p.page_stride for p in group}
        if len(strides) == 1:
            starts = [_page_intervals(p, layout, np.zeros(1, np.int64), per) for p in group]
            hit = _first_overlap(starts, [st + p.head_bytes for st, p in zip(starts, group)], strides.pop())
        else:
            pages = [np.unique(np.array([1, layout.space(p.space).num_pages - 1], np.int64)) for p in group]
            starts = [_page_intervals(p, layout, pg, per) for p, pg in zip(group, pages)]
            hit = _first_overlap(starts, [st + p.head_bytes for st, p in zip(starts, group)])
        if hit:
            a, b = group[hit[0]], group[hit[1]]
            who = f"part {a.key}" + (" (two of its own tokens or heads)" if a is b else f" and part {b.key}")
            raise LayoutError(f"{who} share bytes at offset {hit[2]} (within a page) of {what}: overlapping parts "
                              f"(a wrong base or stride)")


def _span(p: Part, layout: Layout) -> tuple[int, int]:
    """The bytes from ``p``'s first piece to the end of its last: [first, end)."""
    sp = layout.space(p.space)
    return p.base, (p.base + (sp.num_pages - 1) * p.page_stride + (sp.page_size - 1) * p.token_stride
                    + (p.heads - 1) * p.head_stride + p.head_bytes)


class EnginePool(KVPool):
    """A pool over memory the engine owns (see the module docstring). ``memory[i]`` holds region
    ``i`` of ``layout``. ``kv_kinds``: the part kinds ``set_kv_buffer`` fills (default: "k", "v"
    or "kv", whichever the layout has). A hybrid sliding-window layout also needs the engine's
    ``swa_map`` (full slot -> "swa" slot, 0 = not mapped; a tensor or array the engine keeps
    current, read at each use) and its ``window`` in tokens."""

    def __init__(self, layout: Layout, memory: Sequence[torch.Tensor | RawMemory], *,
                 device: str | torch.device | None = None, kv_kinds: Sequence[str] | None = None,
                 swa_map=None, window: int | None = None):
        memory = list(memory)
        if len(memory) != len(layout.regions):
            names = ", ".join(r.name for r in layout.regions[:4]) + ("..." if len(layout.regions) > 4 else "")
            raise LayoutError(f"layout {layout.kind} has {len(layout.regions)} region(s) ({names}) but "
                              f"{len(memory)} memory block(s) were given: one per region")
        ranges = _mapped_ranges() if any(isinstance(m, RawMemory) for m in memory) else None
        facts = []
        for i, (r, block) in enumerate(zip(layout.regions, memory)):
            what = f"the memory of region {i} ({r.name!r})"
            ptr, nbytes, dev = _block_facts(block, what, ranges)
            if r.nbytes > nbytes:
                raise LayoutError(f"region {i} ({r.name!r}) needs {r.nbytes} bytes but its memory holds {nbytes}: "
                                  f"the layout describes more than the engine allocated (too small)")
            facts.append((ptr, r.nbytes, dev))
            for p in layout.parts:
                if p.region == i:
                    _check_part_fits(p, layout, block, ptr, what)
        devices = {str(d) for _, _, d in facts}
        want = None if device is None else str(torch.device(device))
        if len(devices) > 1 or want is not None and devices != {want}:
            raise LayoutError(f"a pool lives on one device: its memory is on {sorted(devices)}"
                              f"{f', the pool on {want}' if want else ''}")
        order = sorted(range(len(facts)), key=lambda k: facts[k][0])
        for a, b in zip(order, order[1:]):
            if facts[a][0] + facts[a][1] > facts[b][0] and facts[a][2].type != "meta":
                raise LayoutError(f"regions {a} ({layout.regions[a].name!r}) and {b} ({layout.regions[b].name!r}) "
                                  f"share memory: overlapping blocks (describe a shared buffer as one region)")
        for i, r in enumerate(layout.regions):
            _check_overlap(layout, i, f"region {i} ({r.name!r})")
        self.layout = layout
        self.device = torch.device(devices.pop())
        self.buffers = [memory_view(m, r.nbytes, f"region {i}") for i, (m, r) in enumerate(zip(memory, layout.regions))]
        self.pinned = False
        self.memory = memory   # the engine's objects, kept alive with the pool
        kinds = {p.kind for p in layout.parts}
        self.kv_kinds = tuple(kv_kinds) if kv_kinds is not None else \
            ("k", "v") if {"k", "v"} <= kinds else ("kv",) if "kv" in kinds else tuple(sorted(kinds))
        if any(s.name == SWA for s in layout.spaces):
            if swa_map is None or isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise LayoutError("a hybrid sliding-window layout needs swa_map= (full slot -> 'swa' slot, 0 = "
                                  "unmapped) and window= (tokens, >= 1)")
        self.swa_map, self.window = swa_map, window

    def close(self) -> None:
        """Nothing to free: the memory is the engine's."""

    def space_slots(self, space: str, slots):
        if space != SWA or self.swa_map is None:
            return slots
        m = self.swa_map
        if isinstance(slots, torch.Tensor):   # on the device: a gather, no check, no sync
            return (m if isinstance(m, torch.Tensor) else torch.from_numpy(np.asarray(m)))[slots]
        s = host_array(slots)
        if isinstance(m, torch.Tensor):
            return m[torch.from_numpy(s).to(m.device)].cpu().numpy().astype(np.int64, copy=False)
        return np.asarray(m, dtype=np.int64)[s]


__all__ = ["EnginePool", "RawMemory", "memory_view"]
