"""Facts from SGLang's pool objects (and ``KVArgs``), turned into kvxfer pools over SGLang's memory.

SGLang builds a transfer backend's manager with ``KVArgs`` only (pointers, lengths, per-page item
bytes). Those say enough for token-major MHA and MLA pools and for whole unified envelopes; head
slices inside a unified pool's entries, HND, hybrid sliding-window pools and Mamba state need the
pool objects. The plugin's hook around SGLang's ``PrefillBootstrapQueue._init_kv_manager`` and
``DecodePreallocQueue._init_kv_manager`` hands them over as ``EngineContext`` (``engine_context``),
for the duration of that call; the manager reads them once, here.

Who calls what: ``KvxferKVManager.__init__`` calls ``describe(kv_args, ctx, attn_tp_size)`` once
per rank; the objects are read duck-typed (their public tensors, shapes and strides), so this
module imports no SGLang. Everything it cannot describe is refused with a ``LayoutError`` that
names the pool and what is missing.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ...endpoint.aux import AuxRows
from ...errors import LayoutError
from ...memory import RawMemory, memory_view
from .layouts import (
    Described,
    StateTensor,
    View,
    hybrid_swa,
    mamba_state,
    mha_from_kv_args,
    mla_from_kv_args,
    strided_kv,
    unified_envelopes,
)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.uint8: "uint8"}
_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                "half": "float16", "float32": "float32", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


class EngineContext(NamedTuple):
    """What the plugin's hook hands the manager: the rank's KV pool object (``token_to_kv_pool``),
    its request pool (Mamba state lives there), the model's layer count, sliding window and KV
    head count (decode's ``KVArgs`` do not carry the latter)."""
    kv_pool: Any
    req_to_token_pool: Any = None
    num_layers: int | None = None
    sliding_window: int | None = None
    num_kv_heads: int | None = None


_CONTEXT: contextvars.ContextVar[EngineContext | None] = contextvars.ContextVar("kvxfer_sglang_pools", default=None)


@contextlib.contextmanager
def engine_context(ctx: EngineContext) -> Iterator[None]:
    """Make ``ctx`` what a manager built inside the ``with`` block describes (the plugin's hook
    around ``_init_kv_manager``; tests build managers inside one)."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> EngineContext | None:
    return _CONTEXT.get()


class Description(NamedTuple):
    """A rank's pools: KV (with the hybrid pool's full -> swa map and window), optional state."""
    kv: Described
    state: Described | None = None
    swa_map: Any = None
    window: int | None = None


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPES:
        raise LayoutError(f"{what}: KV dtype {dtype} is not one kvxfer moves ({sorted(map(str, _DTYPES))})")
    return _DTYPES[dtype]


def _block(t: torch.Tensor) -> RawMemory:
    return RawMemory(t.data_ptr(), t.numel() * t.element_size(), str(t.device))


def _view(t: torch.Tensor, layer: int, kind: str, base: int | None, hnd: bool, what: str) -> View:
    es = t.element_size()
    return View(layer=layer, kind=kind, offset=0 if base is None else t.data_ptr() - base, shape=tuple(t.shape),
                strides=tuple(s * es for s in t.stride()), dtype=dtype_name(t.dtype, what), hnd=hnd)


def _layer_ids(pool, n: int) -> list[int]:
    ids = getattr(pool, "model_layer_ids", None)   # a sub-pool of a hybrid pool names its global layers
    if ids is not None and len(ids) == n:
        return [int(x) for x in ids]
    start = int(getattr(pool, "start_layer", 0) or 0)
    return list(range(start, start + n))


def _shared_raw(pool) -> tuple[RawMemory, int]:
    """A unified sub-pool's raw buffer as SGLang registers it (pointer, bytes, page envelope)."""
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    dev = str(pool.k_buffer[0].device if hasattr(pool, "k_buffer") else pool.kv_buffer[0].device)
    return RawMemory(int(ptrs[0]), int(lens[0]), dev), int(items[0])


def describe_attention(pool, layer_ids: list[int] | None = None) -> Described:
    """An MHA (NHD, HND, unified) or MLA (plain, unified) pool object of SGLang's, from its views."""
    name = type(pool).__name__
    page = int(pool.page_size)
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "is_quantized_kv_cache", False):
        raise LayoutError(f"{name}: quantized KV with scale buffers is not described by the kvxfer backend yet")
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout not in ("nhd", "hnd", "page_major"):
            raise LayoutError(f"{name}: KV layout {layout!r} (ROCm AITER's shuffled tiles) has no affine byte map")
        tensors = [("k", t) for t in pool.k_buffer] + [("v", t) for t in pool.v_buffer]
        per_kind = len(pool.k_buffer)
        kinds = ["k", "v"]
    elif hasattr(pool, "kv_buffer"):
        tensors, per_kind, kinds, layout = [("kv", t) for t in pool.kv_buffer], len(pool.kv_buffer), ["kv"], "nhd"
    else:
        raise LayoutError(f"{name}: not an MHA or MLA pool (no k_buffer/v_buffer or kv_buffer); the kvxfer backend "
                          f"describes MHATokenToKVPool, MLATokenToKVPool, their unified forms, SWAKVPool and "
                          f"HybridLinearKVPool")
    ids = layer_ids or _layer_ids(pool, per_kind)
    if getattr(pool, "requires_physical_write_loc", False):   # a unified sub-pool: one shared raw buffer
        raw, _ = _shared_raw(pool)
        views = [_view(t, ids[i % per_kind], k, raw.ptr, False, name) for i, (k, t) in enumerate(tensors)]
        entry = views[0].strides[0]
        rows = min(v.shape[0] for v in views)
        n = min(rows, raw.nbytes // entry) // page * page
        return strided_kv(raw, views, page_size=page, num_slots=n, kind=f"sglang_unified_{'_'.join(kinds)}")
    hnd = layout == "hnd"
    views = [_view(t, ids[i % per_kind], k, None, hnd, name) for i, (k, t) in enumerate(tensors)]
    return strided_kv([_block(t) for _, t in tensors], views, page_size=page,
                      kind=f"sglang_{'hnd' if hnd else 'mla' if kinds == ['kv'] else 'mha'}")


def describe_mamba(mamba_pool, attn_tp_size: int) -> Described:
    """A ``MambaPool``'s state (conv tensors and temporal), each tensor its own block."""
    cache = mamba_pool.mamba_cache
    conv, temporal = list(cache.conv), cache.temporal
    if getattr(mamba_pool, "conv_slice_axis", 0) != 0:
        raise LayoutError("MambaPool: conv state with its window axis first (Kimi's [K-1, channels]) is not "
                          "described by the kvxfer backend yet")
    layers = [int(x) for x in mamba_pool.mamba_layer_ids]
    groups = mamba_pool.get_state_conv_shard_groups() if hasattr(mamba_pool, "get_state_conv_shard_groups") \
        else None
    tensors = []
    for i, t in enumerate(conv):
        if not t.is_contiguous():
            raise LayoutError("MambaPool: conv state is a strided view (the unified pool's entries): not described "
                              "by the kvxfer backend yet")
        g = groups[i * len(layers)] if groups else None
        blocks = tuple(int(x) // attn_tp_size for x in g) if g else None
        tensors.append(StateTensor(_block(t), tuple(t.shape[2:]), dtype_name(t.dtype, "MambaPool conv"), blocks))
    if not temporal.is_contiguous():
        raise LayoutError("MambaPool: temporal state is a strided view: not described by the kvxfer backend yet")
    temp = StateTensor(_block(temporal), tuple(temporal.shape[2:]), dtype_name(temporal.dtype, "MambaPool temporal"))
    return mamba_state(tensors, temp, layers=layers, num_slots=int(temporal.shape[1]))


def _describe_object(ctx: EngineContext, attn_tp_size: int) -> Description:
    pool = ctx.kv_pool
    name = type(pool).__name__
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):   # SWAKVPool and its unified form
        full, swa = pool.full_kv_pool, pool.swa_kv_pool
        if getattr(full, "requires_physical_write_loc", False) or getattr(swa, "requires_physical_write_loc", False):
            raise LayoutError(f"{name}: the full and sliding-window sub-pools share one raw buffer; kvxfer's "
                              f"EnginePool refuses regions that alias (it cannot know the allocators keep them "
                              f"apart): run without --enable-unified-memory")
        mapping = {int(g): (int(local), bool(is_swa)) for g, (local, is_swa) in pool.layers_mapping.items()}
        full_ids = [g for g, (_, s) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if not s]
        swa_ids = [g for g, (_, s) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if s]
        swa_map = getattr(pool, "full_to_swa_index_mapping", None)
        if swa_map is None or not ctx.sliding_window:
            raise LayoutError(f"{name}: a hybrid pool needs its full -> swa slot map (register_mapping) and the "
                              f"model's sliding window before the manager is made")
        kv = hybrid_swa(describe_attention(full, full_ids), describe_attention(swa, swa_ids))
        return Description(kv, None, swa_map, int(ctx.sliding_window))
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "mamba_pool"):   # HybridLinearKVPool
        ids = sorted(int(x) for x in getattr(pool, "full_attention_layer_id_mapping", {}))
        kv = describe_attention(pool.full_kv_pool, ids or None)
        return Description(kv, describe_mamba(pool.mamba_pool, attn_tp_size))
    return Description(describe_attention(pool))


def describe(kv_args, ctx: EngineContext | None, attn_tp_size: int, is_mla: bool = False) -> Description:
    """The rank's pools: from the pool objects when the plugin's hook handed them over, else from
    ``KVArgs`` alone (token-major MHA on prefill, MLA, whole unified envelopes)."""
    if getattr(kv_args, "num_draft_entries", 0):
        raise LayoutError("speculative decoding's draft KV buffers are not described by the kvxfer backend yet")
    if ctx is not None and ctx.kv_pool is not None:
        return _describe_object(ctx, attn_tp_size)
    types = [getattr(t, "value", t) for t in getattr(kv_args, "state_types", []) or []]
    if types:
        raise LayoutError(f"state {types} needs the pool objects, which the kvxfer plugin's hook on "
                          f"_init_kv_manager did not hand over (is the plugin loaded? SGLANG_PLUGINS)")
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    dtype = _DTYPE_NAMES.get(str(kv_args.kv_cache_dtype_str), "uint8")
    page, dev = int(kv_args.page_size), _device_of(kv_args)
    if len(ptrs) == 1:
        return Description(unified_envelopes(RawMemory(int(ptrs[0]), int(lens[0]), dev), page_bytes=int(items[0]),
                                             page_size=page))
    layers = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if is_mla:   # one latent buffer per layer
        ids = layers or list(range(int(kv_args.prefill_start_layer or 0), int(kv_args.prefill_start_layer or 0)
                                   + len(ptrs)))
        return Description(mla_from_kv_args(ptrs, lens, items, layers=ids, page_size=page, dtype=dtype, device=dev))
    if getattr(kv_args, "kv_head_num", None) is None:
        raise LayoutError("KVArgs do not say an MHA pool's KV heads per rank (decode's never do): the kvxfer "
                          "plugin's hook on _init_kv_manager must hand the pool object over (is the plugin loaded?)")
    start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    ids = layers[: len(ptrs) // 2] or list(range(start, start + len(ptrs) // 2))
    return Description(mha_from_kv_args(ptrs, lens, items, layers=ids, page_size=page, heads=int(kv_args.kv_head_num),
                                        dtype=dtype, device=dev))


def _device_of(kv_args) -> str:
    gpu = getattr(kv_args, "gpu_id", None)
    return "cpu" if gpu is None or not torch.cuda.is_available() else f"cuda:{int(gpu)}"


def metadata_rows(kv_args) -> AuxRows | None:
    """SGLang's ``MetadataBuffers`` (``kv_args.aux_data_*``: one buffer per field, one row per
    request) as kvxfer aux rows over the same memory; a cleared row is all zeros, which SGLang's
    metadata gate reads as "not landed" (bootstrap_room 0). SGLang keeps them in host memory (on
    CUDA machines too), unless its NVLink memory pool is asked for: refused."""
    ptrs = list(getattr(kv_args, "aux_data_ptrs", None) or [])
    if not ptrs:
        return None
    if os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL") == "INTRA_NODE_NVLINK":   # SGLang then puts them on the GPU
        raise LayoutError("SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK puts SGLang's metadata buffers in GPU "
                          "memory; the kvxfer backend reads them as host memory: unset it")
    views = []
    for i, (ptr, nbytes, item) in enumerate(zip(ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)):
        if item <= 0 or nbytes % item:
            raise LayoutError(f"metadata buffer {i}: {nbytes} bytes are not whole rows of {item}")
        flat = memory_view(RawMemory(int(ptr), int(nbytes), "cpu"), int(nbytes), f"metadata buffer {i}")
        views.append(flat.view(int(nbytes) // int(item), int(item)))
    return AuxRows(views, clear_value=0)


__all__ = ["metadata_rows", "EngineContext", "Description", "engine_context", "current_context", "describe",
           "describe_attention", "describe_mamba", "dtype_name"]
