"""``PageAllocator``: whole pages of one slot space, page 0 padding.

The one allocator of kvxfer: engines take device slots with it (``KVPool.allocator()``),
and ``HostPool`` keeps one per host space for the offload manager's background thread.
"""
from __future__ import annotations

import numpy as np

from .errors import LayoutError
from .layout import Space


class PageAllocator:
    """Whole pages of one slot space; page 0 is padding and never handed out. The one
    allocator of kvxfer: engines take device slots with it (``pool.allocator()``), and
    ``HostPool`` keeps one per host space for the offload manager's background thread.

    ``alloc(n)`` returns the slots of the first ``n`` positions of freshly taken pages: ``n``
    pages' worth of consecutive free pages when there are any (first fit), so a request (or a
    batch of offload records copied together) is one block and copies as one strided view;
    otherwise the lowest free pages. ``free`` takes them back; freeing a page twice raises
    (a grant is released exactly once) and frees nothing. The free count is kept, not
    recounted: a host pool can hold a million pages and is allocated from on every copy.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise LayoutError(f"PageAllocator needs at least 2 pages (page 0 is padding), got {num_pages}")
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        # one entry per page and a last one that is never free: with page 0 (padding, never
        # free) it bounds every free block, so the blocks' edges are one comparison
        self._free = np.ones(num_pages + 1, dtype=bool)
        self._free[0] = self._free[num_pages] = False
        self._num_free = self.num_pages - 1

    @classmethod
    def for_space(cls, space: Space) -> "PageAllocator":
        return cls(space.num_pages, space.page_size)

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def take(self, need: int) -> np.ndarray | None:
        """``need`` free pages (first fit of a free block, else the lowest), or None (nothing taken)."""
        if need > self._num_free:
            return None
        if need == 0:
            return np.zeros(0, np.int64)
        f = self._free
        edges = (f[1:] != f[:-1]).nonzero()[0] + 1
        starts, ends = edges[0::2], edges[1::2]   # free blocks [start, end)
        first = int((ends - starts >= need).argmax())
        a = int(starts[first])
        if int(ends[first]) - a >= need:   # one block: a slice, not an index
            f[a:a + need] = False
            pages = np.arange(a, a + need)
        else:
            pages = f.nonzero()[0][:need]
            f[pages] = False
        self._num_free -= need
        return pages

    def slots_of(self, pages: np.ndarray, num_tokens: int) -> np.ndarray:
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()[:num_tokens]

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """Slots for ``num_tokens`` tokens, or None when not enough pages are free."""
        pages = self.take(self.pages_for(num_tokens))
        return None if pages is None else self.slots_of(pages, int(num_tokens))

    def free(self, slots) -> None:
        pages = np.asarray(slots, dtype=np.int64) // self.page_size
        if len(pages) == 0:
            return
        if len(pages) > 1:   # distinct pages (np.unique without its fixed cost: one sort, one mask)
            pages = np.sort(pages)
            pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        if pages[0] < 1 or pages[-1] >= self.num_pages:   # sorted: the ends are the extremes
            raise LayoutError(f"free: page outside 1..{self.num_pages - 1}")
        if self._free[pages].any():
            raise LayoutError(f"free: page {int(pages[self._free[pages]][0])} is already free (double free)")
        self._free[pages] = True
        self._num_free += len(pages)


__all__ = ["PageAllocator"]
