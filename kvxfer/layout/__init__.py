"""Layouts as data: where every byte of a KV pool lives.

Glossary (the words mean this everywhere in kvxfer):

slot       one index of a slot space: a token position's cell in a token pool, or a
           request's cell in a state pool. Slots ``[0, page_size)`` are padding: engines
           point dummy writes there, so no request may use them.
page       ``page_size`` consecutive slots; slot ``s`` is in page ``s // page_size``
           at in-page offset ``s % page_size``.
space      a set of slots with one page size ("token", "swa" for a sliding-window
           pool, "state" for per-request state). Each part is indexed by one space.
region     one registered block of bytes (a torch tensor's storage). Transports move
           bytes between regions and know nothing else.
part       one logical array of a pool, e.g. the K cache of layer 3: for each
           (slot, head) it holds ``head_bytes`` contiguous bytes at
           ``base + page * page_stride + in_page * token_stride + head * head_stride``
           inside its region. Every layout in the field is a set of parts with
           different strides: that is the whole trick.
head       the sharded axis of a part (a KV head, an MLA latent row, a conv channel).
shard      a rank's share of the heads: see ``kvxfer.plan.HeadSlice``.
run        ``(src_region, src_offset, dst_region, dst_offset, nbytes)``: one contiguous
           copy; a plan is a list of runs.
layer      the global layer index; a pipeline stage's pool holds a subset.

A ``Layout`` is plain data: ``to_dict()`` / ``Layout.from_dict()`` round-trip
through JSON or msgpack, and ``signature`` is a stable hash of it.

Where things are: the data (``Space``, ``Region``, ``Part``, ``Layout``) in ``kvxfer.layout.data``;
the constructors of the layouts seen in the wild in ``kvxfer.layout.builders`` (nothing else in
kvxfer special-cases a layout); layouts made from layouts (host copies, a rank's KV and state as
one, a layout cut to some spaces) in ``kvxfer.layout.derived``. Import them from here.
"""
from .builders import hnd_layout, hybrid_swa_layout, mla_layout, page_major_layout, state_layout, token_major_layout
from .data import DTYPE_SIZES, STATE, SWA, TOKEN, Layout, Part, Region, Space, dtype_size
from .derived import HOST_STYLES, combine_layouts, host_layout, is_hybrid, restrict_layout

__all__ = [
    "DTYPE_SIZES", "STATE", "SWA", "TOKEN", "Layout", "Part", "Region", "Space", "dtype_size",
    "hnd_layout", "hybrid_swa_layout", "mla_layout", "page_major_layout", "state_layout", "token_major_layout",
    "HOST_STYLES", "combine_layouts", "host_layout", "is_hybrid", "restrict_layout",
]
