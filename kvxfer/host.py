"""``HostPool``: host memory for a device pool, in a host layout (offload, direct-to-host receive)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .allocator import PageAllocator
from .errors import LayoutError
from .layout import HOST_STYLES, Layout, host_layout
from .pools import KVPool


class HostPool(KVPool):
    """Host memory for a device pool in a host layout; a pool like any other (``layout``,
    ``regions()``), so planners and transports target it unchanged (direct-to-host
    receive registers ``regions()`` with a transport). Pinned when CUDA is present:
    a plain allocation registered with the driver (``kvxfer.pinned.host_buffer``), never a
    ``pin_memory=True`` tensor, which the caching host allocator rounds up to a power of
    two. ``alloc``/``free`` hand out whole host pages per space (page 0 is padding) from
    one ``PageAllocator`` per space; ``close()`` unregisters the memory.

    Its memory is resident from the start: every byte is zeroed (in ``HOST_CHUNK`` pieces),
    so no offload pays first-touch page faults."""

    def __init__(self, layout: Layout, *, device_layout: Layout, pin_memory: bool | None = None):
        super().__init__(layout, "cpu", pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
        self.device_layout = device_layout
        self.allocators = {s.name: PageAllocator.for_space(s) for s in layout.spaces}

    @classmethod
    def for_pool(cls, pool: KVPool, *, layout: str = "layer_first", size: int | Mapping[str, int],
                 pin_memory: bool | None = None) -> "HostPool":
        """Host pool for any pool, from its layout alone. ``size``: usable host slots, one int
        for every space or ``{space: n}``; rounded up to whole pages (plus the padding page)."""
        if layout not in HOST_STYLES:
            raise LayoutError(f"HostPool layout {layout!r} is not one of {HOST_STYLES}")
        sizes = {}
        for sp in pool.layout.spaces:
            n = size if isinstance(size, int) else size.get(sp.name)
            if n is None or n < 1:
                raise LayoutError(f"HostPool.for_pool: size for space {sp.name!r} must be >= 1 slot, got {n}")
            sizes[sp.name] = (-(-int(n) // sp.page_size) + 1) * sp.page_size
        return cls(host_layout(pool.layout, layout, sizes), device_layout=pool.layout, pin_memory=pin_memory)

    def capacity(self, space: str) -> int:
        a = self.allocators[space]
        return a.capacity * a.page_size

    def free_slots(self, space: str) -> int:
        a = self.allocators[space]
        return a.free_pages * a.page_size

    def alloc(self, tokens: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Slots for ``tokens[space]`` tokens in every space, or None (nothing taken)."""
        got = self.alloc_many([tokens])
        return got[0] if got else None

    def fits(self, sizes: Sequence[Mapping[str, int]]) -> int:
        """How many leading records of ``sizes`` fit in the free pages now (all together)."""
        left = {s: a.free_pages for s, a in self.allocators.items()}
        for i, tokens in enumerate(sizes):
            for s, n in tokens.items():
                left[s] -= self.allocators[s].pages_for(n)
            if any(v < 0 for v in left.values()):
                return i
        return len(sizes)

    def alloc_many(self, sizes: Sequence[Mapping[str, int]]) -> list[dict[str, np.ndarray]] | None:
        """Slots for every record of ``sizes`` (whole pages each), taken as one block per space
        when there is one, so records copied together sit back to back; None if they do not
        all fit (nothing taken)."""
        if self.fits(sizes) < len(sizes):
            return None
        out: list[dict[str, np.ndarray]] = [{} for _ in sizes]
        for space in {s for tokens in sizes for s in tokens}:
            a = self.allocators[space]
            counts = [int(tokens.get(space, 0)) for tokens in sizes]
            need = [a.pages_for(n) for n in counts]
            pages = a.take(sum(need))
            slots = a.slots_of(pages, len(pages) * a.page_size)   # every slot of those pages, in order
            first = 0
            for rec, n, k in zip(out, counts, need):   # a record's slots: a slice (whole pages of its own)
                rec[space] = slots[first: first + n]
                first += k * a.page_size
        return [{s: rec[s] for s in tokens} for rec, tokens in zip(out, sizes)]

    def free(self, slots: Mapping[str, np.ndarray]) -> None:
        for s, v in slots.items():
            self.allocators[s].free(v)


__all__ = ["HostPool"]
