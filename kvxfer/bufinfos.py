"""What engines hand a byte mover for a pool: ``BufInfos`` (pointer, length and page bytes per
region) and, for regions whose pages hold several parts (page-major, host page-first), where each
part sits inside a page (``PagePart``). ``KVPool.get_contiguous_buf_infos`` returns it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .layout import Layout


class PagePart(NamedTuple):
    """Where one part sits inside the pages of a region shared by several parts. Byte of
    (page ``p``, in-page slot ``t``, head ``h``) is ``page0 + p * page_stride +
    offset_in_page + t * token_stride + h * head_stride``. ``page0`` is 0 for page-major;
    a host page-first region holds a block of K pages and then a block of V pages."""
    region: int
    layer: int
    kind: str
    offset_in_page: int
    bytes_per_page: int
    token_stride: int
    head_stride: int
    page0: int
    page_stride: int


@dataclass(frozen=True, slots=True)
class BufInfos:
    """What engines hand to a byte mover. Per region: pointer, length, and the bytes of
    one page (``item_lens``). ``page_parts`` describes, for regions that hold several
    parts per page (page-major, host page-first), where each part sits inside a page:
    ``PagePart(region, layer, kind, offset_in_page, bytes_per_page, token_stride,
    head_stride, page0, page_stride)``."""
    data_ptrs: list[int]
    data_lens: list[int]
    item_lens: list[int]
    page_parts: list[PagePart]



def buf_infos(layout: Layout, buffers: Sequence[torch.Tensor]) -> BufInfos:
    """Per region of ``layout`` over ``buffers``: pointer, length, bytes of one page, and where each
    part of a shared page sits (see ``BufInfos``)."""
    ptrs = [b.data_ptr() for b in buffers]
    lens = [b.numel() for b in buffers]
    item = [0] * len(buffers)
    for p in layout.parts:
        item[p.region] = p.page_stride
    # A block: parts of one region and page stride whose page 0 lies within one page of
    # the first (lowest) of them. Blocks of two or more parts are pages shared by parts.
    page_parts: list[list[PagePart]] = []
    for p in sorted(layout.parts, key=lambda q: (q.region, q.page_stride, q.base)):
        last = page_parts[-1][-1] if page_parts else None
        if not (last and last.region == p.region and last.page_stride == p.page_stride
                and p.base < last.page0 + p.page_stride):
            page_parts.append([])
        page0 = last.page0 if page_parts[-1] else p.base
        # the part's span inside one page (for page-major: page_size * heads * head bytes)
        span = ((layout.space(p.space).page_size - 1) * p.token_stride
                + (p.heads - 1) * p.head_stride + p.head_bytes)
        page_parts[-1].append(PagePart(p.region, p.layer, p.kind, p.base - page0, span,
                                       p.token_stride, p.head_stride, page0, p.page_stride))
    return BufInfos(ptrs, lens, item, [pp for block in page_parts if len(block) > 1 for pp in block])


__all__ = ["BufInfos", "PagePart", "buf_infos"]
