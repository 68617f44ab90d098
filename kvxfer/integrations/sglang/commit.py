"""Prefix-valid commit for SGLang's unified (page-major) MHA pool, over kvxfer's pool.

SGLang 0.5.23's ``UnifiedMHATokenToKVPool.set_kv_buffer_prefix_valid`` raises ("prefix-valid
commit is unsupported under the unified layout"): its kernel assumes per-layer contiguous rows,
and the unified pool's rows are strided through every layer's entry. kvxfer's pools write any
strided layout, so the plugin installs ``prefix_valid_commit`` in its place (``plugin.install``):
the same arguments and meaning (write row ``i``'s first ``commit_lens[i]`` columns of ``loc_2d``,
physical token ids, with ``cache_k`` / ``cache_v`` of ``loc_2d.numel()`` rows), through an
``EnginePool`` over the pool's own views (made once per pool, nothing copied). Columns past a
row's length go to slot 0, the padding page SGLang reserves for dummy writes; no boolean mask
(no device sync). Scaled (fp8 with per-layer scales) commits are refused in words.

Who calls what: SGLang's speculative decoding (``dflash_worker_v2``, ``dspark``) calls the pool
method during its forward; the first call describes the pool.
"""
from __future__ import annotations

import weakref

from ...errors import LayoutError
from .pools import describe_attention

_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # SGLang pool -> its EnginePool


def kvxfer_pool(pool):
    """The ``EnginePool`` over an SGLang pool's memory (made on first use, kept with the pool)."""
    p = _POOLS.get(pool)
    if p is None:
        p = _POOLS[pool] = describe_attention(pool).pool()
    return p


def prefix_valid_commit(self, layer, loc_2d, commit_lens, cache_k, cache_v, k_scale=None, v_scale=None,
                        layer_id_override=None):
    """``UnifiedMHATokenToKVPool.set_kv_buffer_prefix_valid`` (see the module docstring)."""
    if any(s is not None and float(s) != 1.0 for s in (k_scale, v_scale)):
        raise NotImplementedError("kvxfer's prefix-valid commit writes the KV as given: scaled (fp8) K/V "
                                  "(k_scale/v_scale) is not supported on the unified pool")
    layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
    if loc_2d.dim() != 2 or commit_lens.dim() != 1 or commit_lens.shape[0] != loc_2d.shape[0]:
        raise LayoutError(f"loc_2d {tuple(loc_2d.shape)} and commit_lens {tuple(commit_lens.shape)}: want [batch, "
                         f"cols] and [batch]")
    rows, cols = loc_2d.shape
    if cache_k.shape[0] != rows * cols or cache_v.shape[0] != rows * cols:
        raise LayoutError(f"KV rows {cache_k.shape[0]}/{cache_v.shape[0]} do not match loc_2d {tuple(loc_2d.shape)}")

    def stored(t):
        t = t.to(self.dtype)
        return t.view(self.store_dtype) if self.store_dtype != self.dtype else t
    k = stored(cache_k).reshape(rows, cols, *cache_k.shape[1:])
    v = stored(cache_v).reshape(rows, cols, *cache_v.shape[1:])
    kvxfer_pool(self).set_kv_buffer_prefix_valid(layer_id, loc_2d, commit_lens, k, v)


__all__ = ["prefix_valid_commit", "kvxfer_pool"]
