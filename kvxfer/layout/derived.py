"""Layouts made from other layouts: a host copy of a device layout (``host_layout``, the offload
tier's), a rank's KV and state parts as one layout (``combine_layouts``), and a layout cut to
some slot spaces (``restrict_layout``, the compact registry record)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .data import SWA, Layout, Part, Region, Space, require

HOST_STYLES = ("layer_first", "page_first")


def host_layout(device: Layout, style: str, num_slots: int | Mapping[str, int]) -> Layout:
    """A host layout holding every part of ``device``, built from its parts alone.

    layer_first: per space one region ``[kind][layer][slots][heads, head]``
                 (for MHA: ``(K|V, layer, slots, heads, dim)``).
    page_first:  per space one region ``[kind][pages][layer][page_size, heads, head]``
                 (for MHA: ``(K|V, pages, layer, page_size, heads, dim)``).
    """
    require(style in HOST_STYLES, f"host layout style {style!r} is not one of {HOST_STYLES}")
    regions: list[Region] = []
    parts: list[Part] = []
    spaces: list[Space] = []
    for dsp in device.spaces:
        n = num_slots if isinstance(num_slots, int) else num_slots.get(dsp.name)
        require(n is not None, f"host layout: no num_slots given for space {dsp.name!r}")
        sp = Space(name=dsp.name, num_slots=int(n), page_size=dsp.page_size)
        spaces.append(sp)
        mine = sorted((p for p in device.parts if p.space == dsp.name), key=lambda p: (p.kind, p.layer))
        offset, region = 0, len(regions)
        kinds = sorted({p.kind for p in mine})
        for kind in kinds:
            of_kind = [p for p in mine if p.kind == kind]
            rows = [p.heads * p.head_bytes for p in of_kind]
            page_bytes = sum(rows) * sp.page_size
            in_page = 0
            for p, row in zip(of_kind, rows):
                if style == "layer_first":
                    base, page_stride = offset, sp.page_size * row
                    offset += sp.num_slots * row
                else:
                    base, page_stride = offset + in_page, page_bytes
                    in_page += sp.page_size * row
                parts.append(Part(layer=p.layer, kind=p.kind, space=sp.name, region=region, base=base,
                                  page_stride=page_stride, token_stride=row, heads=p.heads,
                                  head_stride=p.head_bytes, head_bytes=p.head_bytes, dtype=p.dtype))
            if style == "page_first":
                offset += sp.num_pages * page_bytes
        regions.append(Region(name=f"host_{dsp.name}", nbytes=offset))
    return Layout(kind=f"host_{style}", spaces=tuple(spaces), regions=tuple(regions), parts=tuple(parts))


# ------------------------------------------------------------------------------------
# Layouts of a rank: KV parts plus optional state parts, as one layout (one region list
# for the transport, one Planner per source covering both).
# ------------------------------------------------------------------------------------
def combine_layouts(kv: Layout, state: Layout | None = None) -> Layout:
    """``kv``'s parts and regions followed by ``state``'s (region ids shifted)."""
    if state is None:
        return kv
    n = len(kv.regions)
    parts = kv.parts + tuple(dataclasses.replace(p, region=p.region + n) for p in state.parts)
    return Layout(kind=f"{kv.kind}+{state.kind}", spaces=kv.spaces + state.spaces,
                  regions=kv.regions + state.regions, parts=parts)


def is_hybrid(layout: Layout) -> bool:
    """True for a hybrid sliding-window layout (a "swa" slot space beside the token space)."""
    return any(s.name == SWA for s in layout.spaces)


# ------------------------------------------------------------------------------------
# The compact record layout
# ------------------------------------------------------------------------------------
def restrict_layout(layout: Layout, spaces) -> Layout:
    """``layout`` with only the parts (and spaces) of ``spaces``; region ids unchanged."""
    keep = set(spaces)
    return Layout(kind=layout.kind, spaces=tuple(s for s in layout.spaces if s.name in keep),
                  regions=layout.regions, parts=tuple(p for p in layout.parts if p.space in keep))

