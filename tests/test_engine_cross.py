"""Pools over two engines' memory, one each side (issue 33): vLLM's KV tensors on prefill (its
paged layout, HND by stride order, blocks of 16) move byte-exact into SGLang's per-layer buffers on
decode (described from ``KVArgs`` pointers alone, pages of 4), with heterogeneous TP (prefill TP 1,
decode TP 2 rank 1: heads 2..3), both ways; neither pool allocates or copies the engines' memory.
No engine is imported: the builders read the tensors' shapes and strides (vLLM) and the pointers,
lengths and item sizes an engine hands (SGLang)."""
from __future__ import annotations

import numpy as np
import torch

from kvxfer.copy import execute_plan
from kvxfer.integrations.sglang.layouts import mha_from_kv_args
from kvxfer.integrations.vllm.layouts import paged_kv
from kvxfer.plan import HeadSlice, plan_transfer

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 4, 8, 16, 6
PAGE, SLOTS = 4, 96


def vllm_caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views ``[blocks, kv_heads, block_size, K|V]``, HND memory (heads before tokens)."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g,
                                                            dtype=torch.float16) for i in range(LAYERS)}


def sglang_buffers(heads: int) -> list[torch.Tensor]:
    """SGLang's ``MHATokenToKVPool``: K of every layer, then V of every layer, ``[slots, heads, dim]``."""
    return [torch.full((SLOTS, heads, DIM), -7.0, dtype=torch.float16) for _ in range(2 * LAYERS)]


def described(bufs: list[torch.Tensor], heads: int):
    return mha_from_kv_args([b.data_ptr() for b in bufs], [b.numel() * b.element_size() for b in bufs],
                            [PAGE * heads * DIM * 2] * len(bufs), layers=range(LAYERS), page_size=PAGE, heads=heads,
                            dtype="float16")


def test_vllm_prefill_to_sglang_decode_and_back_with_head_slices():
    caches = vllm_caches(1)
    ptrs = [t.data_ptr() for t in caches.values()]
    vkv = paged_kv(caches, head_size=DIM)
    v_pool = vkv.pool()
    assert [r.data_ptr() for r in v_pool.regions()] == ptrs          # vLLM's own memory
    bufs = sglang_buffers(HEADS // 2)
    d = described(bufs, HEADS // 2)
    s_pool = d.pool()
    assert [r.data_ptr() for r in s_pool.regions()] == [b.data_ptr() for b in bufs]
    # a request of 37 tokens: vLLM blocks 2, 5, 1 on prefill; SGLang slots 40.. on decode
    p_slots = vkv.slots([2, 5, 1], 37)
    d_slots = np.arange(40, 40 + 37)
    plan = plan_transfer(vkv.layout, p_slots, d.layout, d_slots, src_heads=HeadSlice(1, 2), dst_heads=HeadSlice(0, 1))
    before = [b.clone() for b in bufs]
    execute_plan(plan, v_pool.regions(), s_pool.regions())
    for i, (name, t) in enumerate(caches.items()):
        # vLLM token j of the request: block ids[j // 16], in-block j % 16; heads 2..3 of 4
        blocks, offs = np.array([2, 5, 1])[np.arange(37) // BLOCK], np.arange(37) % BLOCK
        want_k = t[blocks, 2:4, offs, :DIM]
        want_v = t[blocks, 2:4, offs, DIM:]
        assert torch.equal(bufs[i][40:77], want_k) and torch.equal(bufs[LAYERS + i][40:77], want_v), name
    for b, old in zip(bufs, before):                                 # nothing else changed
        assert torch.equal(b[:40], old[:40]) and torch.equal(b[77:], old[77:])
    # and back: SGLang decode -> a fresh vLLM prefill cache, heads 2..3 only
    back = {n: torch.zeros_like(t) for n, t in caches.items()}
    bkv = paged_kv(back, head_size=DIM)
    execute_plan(plan_transfer(d.layout, d_slots, bkv.layout, p_slots, src_heads=HeadSlice(0, 1),
                               dst_heads=HeadSlice(1, 2)), s_pool.regions(), bkv.pool().regions())
    for n in caches:
        for j, blk in enumerate([2, 5, 1]):
            k = min(BLOCK, 37 - j * BLOCK)
            assert torch.equal(back[n][blk, 2:4, :k], caches[n][blk, 2:4, :k])
            assert not back[n][blk, :2].any()
