"""One side of an SGLang instance for the backend tests, built from SGLang's own objects (runs in
the SGLang venv, inside ``sglang_worker``): the KV pool of a kind (``MHATokenToKVPool``, the
unified pool's ``UnifiedMHATokenToKVPool``, ``MLATokenToKVPool``, ``SWAKVPool``,
``HybridLinearKVPool`` with its ``MambaPool``), SGLang's page allocator, ``MetadataBuffers``, the
``KVArgs`` SGLang's ``_init_kv_manager`` would fill (through SGLang's own ``build_kv_layer_ids``
and ``setup_state_kv_args``) and the manager, made the way the plugin's hook makes it (inside
``engine_context``). Bytes are a pattern of (room, layer, kind, global head, position), so each
side computes what the other must have sent without talking to it.
"""
from __future__ import annotations

import types
import zlib

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import (
    KVClassType,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
    build_kv_layer_ids,
    get_kv_class,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_memory_pool import MHASubPoolSpec, UnifiedKVPool, UnifiedMHATokenToKVPool
from sglang.srt.server_args import ServerArgs

from kvxfer.integrations.sglang.pools import EngineContext, engine_context
from kvxfer.ranks import heads_held

KV_HEADS, DIM, MLA_DIM, LAYERS, WINDOW, SLOTS, MAX_TOKENS = 4, 16, 48, 4, 6, 256, 64
CONV_GROUPS = [64, 16, 16]            # Mamba2's conv channels [x | B | C], each TP-sharded on its own
DTYPE = torch.bfloat16


def pattern(room: int, layer: int, kind: str, rows: int, cols: int, row_bytes: int) -> torch.Tensor:
    """``[rows, cols, row_bytes]`` uint8, the same on every process for the same arguments."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{room}/{layer}/{kind}".encode()))
    return torch.randint(0, 256, (rows, cols, row_bytes), generator=g, dtype=torch.uint8)


class Side:
    """One rank's pools, allocator, metadata rows and kvxfer manager (see the module docstring)."""

    def __init__(self, kind: str, role: str, tp: int, rank: int, page: int, bport: int, config):
        self.kind, self.role, self.tp, self.rank, self.page = kind, role, tp, rank, page
        self.heads = len(heads_held(KV_HEADS, tp, rank)) if kind != "mla" else 1
        self.head_ids = list(heads_held(KV_HEADS, tp, rank)) if kind != "mla" else [0]
        self.req_to_token_pool = None
        self.mamba = None
        if kind in ("mha", "unified", "mamba"):
            self.attn_layers = [0, 2] if kind == "mamba" else list(range(LAYERS))
        elif kind == "mla":
            self.attn_layers = list(range(LAYERS))
        else:
            self.attn_layers = [0, 1, 2, 3]
        self.pool = self._make_pool()
        self.alloc = PagedTokenToKVPoolAllocator(SLOTS, page, DTYPE, "cpu", self._alloc_target(), False)
        self.swa_alloc = PagedTokenToKVPoolAllocator(64, page, DTYPE, "cpu", self.pool.swa_kv_pool, False) \
            if kind == "swa" else None
        self.mamba_free = list(range(1, 9)) if kind == "mamba" else []
        self.meta = MetadataBuffers(16, hidden_size=64, hidden_states_dtype=DTYPE, max_sampling_mask_tokens=4)
        self.meta_alloc = ReqToMetadataIdxAllocator(16)
        self.kv_args = self._kv_args()
        server_args = ServerArgs(model_path="x", tp_size=tp, host="127.0.0.1", port=31000 + bport % 1000,
                                 disaggregation_mode=role, disaggregation_transfer_backend="kvxfer",
                                 disaggregation_bootstrap_port=bport)
        manager = get_kv_class(TransferBackend("kvxfer"), KVClassType.MANAGER)
        ctx = EngineContext(kv_pool=self.pool, req_to_token_pool=self.req_to_token_pool, num_layers=LAYERS,
                            sliding_window=WINDOW if kind == "swa" else None, num_kv_heads=KV_HEADS)
        with engine_context(ctx):
            self.mgr = manager(self.kv_args, role, server_args, kind == "mla", config=config)
        self.initial = (self.alloc.available_size(), self.swa_alloc.available_size() if self.swa_alloc else 0,
                        len(self.mamba_free), self.meta_alloc.available_size())

    # -- SGLang's objects ------------------------------------------------------------------------
    def _make_pool(self):
        common = dict(page_size=self.page, dtype=DTYPE, device="cpu", enable_memory_saver=False)
        if self.kind == "mha":
            return MHATokenToKVPool(size=SLOTS, head_num=self.heads, head_dim=DIM, layer_num=LAYERS, **common)
        if self.kind == "mla":
            return MLATokenToKVPool(size=SLOTS, kv_lora_rank=32, qk_rope_head_dim=16, layer_num=LAYERS, **common)
        if self.kind == "unified":   # the full-attention sub-pool of a unified buffer, beside another sub-pool
            self.unified = UnifiedKVPool(
                total_bytes=1 << 20, device="cpu", enable_memory_saver=False, page_size=self.page,
                sub_pool_specs=[MHASubPoolSpec(name="full", layer_num=LAYERS, grow_direction="up",
                                               head_num=self.heads, head_dim=DIM, store_dtype=DTYPE),
                                MHASubPoolSpec(name="other", layer_num=1, grow_direction="down",
                                               head_num=self.heads, head_dim=DIM, store_dtype=DTYPE)])
            return UnifiedMHATokenToKVPool(unified_buffer=self.unified, sub_pool_name="full", page_size=self.page)
        if self.kind == "swa":
            pool = SWAKVPool(size=SLOTS, size_swa=64, head_num=self.heads, head_dim=DIM,
                             swa_attention_layer_ids=[1, 3], full_attention_layer_ids=[0, 2], **{
                                 k: v for k, v in common.items() if k != "enable_memory_saver"})
            pool.register_mapping(torch.zeros(SLOTS + self.page, dtype=torch.int64))
            return pool
        shape = Mamba2StateShape.create(tp_world_size=self.tp, intermediate_size=64, n_groups=2, num_heads=4,
                                        head_dim=8, state_size=8, conv_kernel=4, conv_shard_groups=CONV_GROUPS)
        self.mamba = MambaPool(size=8, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[1, 3]),
                               mamba_layer_ids=[1, 3], device="cpu")
        self.req_to_token_pool = types.SimpleNamespace(mamba_pool=self.mamba)
        return HybridLinearKVPool(size=SLOTS, head_num=self.heads, head_dim=DIM, full_attention_layer_ids=[0, 2],
                                  mamba_pool=self.mamba, **{k: v for k, v in common.items()
                                                            if k != "enable_memory_saver"})

    def _alloc_target(self):
        return self.pool.full_kv_pool if self.kind in ("swa", "mamba") else self.pool

    def _kv_args(self) -> KVArgs:
        """What SGLang's ``_init_kv_manager`` fills (the fields this backend reads)."""
        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.gpu_id = self.rank, 0, 0, 0
        a.kv_cache_dtype_str, a.page_size, a.prefill_start_layer, a.num_draft_entries = "auto", self.page, 0, 0
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = self.pool.get_contiguous_buf_infos()
        a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                                            num_draft_entries=0, num_hidden_layers=LAYERS)
        if self.kind != "mla" and self.role == "prefill":   # decode's _init_kv_manager sets neither
            a.kv_head_num, a.total_kv_head_num = self.heads, KV_HEADS
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(a, self.pool, None, LAYERS, req_to_token_pool=self.req_to_token_pool)
        return a

    # -- the pattern, read and written through SGLang's own per-layer views ------------------------
    def kinds(self, layer: int) -> list[str]:
        return ["kv"] if self.kind == "mla" else ["k", "v"]

    def view(self, layer: int, kind: str) -> torch.Tensor:
        return self.pool.get_value_buffer(layer) if kind == "v" else self.pool.get_key_buffer(layer)

    def is_swa(self, layer: int) -> bool:
        return self.kind == "swa" and layer in (1, 3)

    def expected(self, room: int, layer: int, kind: str, positions: torch.Tensor) -> torch.Tensor:
        cols, dim = (1, MLA_DIM) if self.kind == "mla" else (KV_HEADS, DIM)
        full = pattern(room, layer, kind, MAX_TOKENS, cols, dim * 2)[positions]
        return full[:, self.head_ids].view(DTYPE)

    def write(self, room: int, layer: int, kind: str, positions, slots) -> None:
        positions, slots = torch.as_tensor(positions), torch.as_tensor(slots)
        if len(positions):
            self.view(layer, kind)[slots] = self.expected(room, layer, kind, positions)

    def matches(self, room: int, layer: int, kind: str, positions, slots) -> bool:
        positions, slots = torch.as_tensor(positions), torch.as_tensor(slots)
        if not len(positions):
            return True
        got = self.view(layer, kind)[slots].contiguous().view(torch.uint8)
        return torch.equal(got, self.expected(room, layer, kind, positions).contiguous().view(torch.uint8))

    def state_expected(self, room: int, li: int):
        """(conv row, temporal row) of Mamba state layer index ``li`` on this rank."""
        conv = pattern(room, 100 + li, "conv", 1, sum(CONV_GROUPS), 3 * 2)[0].view(DTYPE)
        parts, at = [], 0
        for g in CONV_GROUPS:
            n = g // self.tp
            parts.append(conv[at + self.rank * n: at + (self.rank + 1) * n])
            at += g
        temporal = pattern(room, 100 + li, "temporal", 1, 4, 8 * 8 * 4)[0].view(torch.float32).view(4, 8, 8)
        n = 4 // self.tp
        return torch.cat(parts), temporal[self.rank * n:(self.rank + 1) * n]

    def storages(self) -> list[torch.Tensor]:
        """Every byte of the rank's KV and state memory, as uint8 views (for the untouched check)."""
        if self.kind == "unified":
            ts = [self.unified._raw]
        elif self.kind == "mla":
            ts = list(self.pool.kv_buffer)
        elif self.kind == "swa":
            ts = self.pool.full_kv_pool.k_buffer + self.pool.full_kv_pool.v_buffer + \
                self.pool.swa_kv_pool.k_buffer + self.pool.swa_kv_pool.v_buffer
        else:
            full = self.pool.full_kv_pool if self.kind == "mamba" else self.pool
            ts = full.k_buffer + full.v_buffer
            if self.mamba is not None:
                ts = ts + list(self.mamba.mamba_cache.conv) + [self.mamba.mamba_cache.temporal]
        return [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),),
                                                        (1,)) for t in ts]

    def leaks(self) -> dict:
        now = (self.alloc.available_size(), self.swa_alloc.available_size() if self.swa_alloc else 0,
               len(self.mamba_free), self.meta_alloc.available_size())
        return {"initial": list(self.initial), "now": list(now)}


def prefix_valid_check() -> dict:
    """SGLang's unified MHA pool's ``set_kv_buffer_prefix_valid``: SGLang's own raises; with the
    plugin loaded, kvxfer's writes row ``i``'s first ``commit_lens[i]`` columns and nothing else
    (columns past a row's length go to the padding page 0)."""
    unified = UnifiedKVPool(total_bytes=1 << 18, device="cpu", enable_memory_saver=False, page_size=4,
                            sub_pool_specs=[MHASubPoolSpec(name="full", layer_num=2, grow_direction="up", head_num=4,
                                                           head_dim=DIM, store_dtype=DTYPE),
                                            MHASubPoolSpec(name="other", layer_num=1, grow_direction="down",
                                                           head_num=4, head_dim=DIM, store_dtype=DTYPE)])
    pool = UnifiedMHATokenToKVPool(unified_buffer=unified, sub_pool_name="full", page_size=4)
    envelopes = pool.get_page_envelope_buffer()          # [pages, page bytes], the pool's own bytes
    envelopes.copy_(pattern(7, 0, "raw", 1, envelopes.shape[0], envelopes.shape[1])[0])
    original = type(pool).set_kv_buffer_prefix_valid.__wrapped__
    try:
        original(pool, types.SimpleNamespace(layer_id=1), None, None, None, None)
        sglang_says = "no error"
    except NotImplementedError as e:
        sglang_says = str(e)
    loc = torch.tensor([[8, 9, 10, 11], [16, 17, 18, 19]])
    lens = torch.tensor([3, 1])
    k, v = (pattern(8, 1, kind, 8, 4, DIM * 2).view(DTYPE) for kind in ("k", "v"))
    before = envelopes.clone()
    pool.set_kv_buffer_prefix_valid(types.SimpleNamespace(layer_id=1), loc, lens, k, v)
    written = torch.tensor([8, 9, 10, 16])
    ok = torch.equal(pool.k_buffer[1][written].view(torch.uint8), k[[0, 1, 2, 4]].view(torch.uint8)) and \
        torch.equal(pool.v_buffer[1][written].view(torch.uint8), v[[0, 1, 2, 4]].view(torch.uint8))
    entry = envelopes.shape[1] // 4                       # one token's entry: every layer's K and V
    changed = sorted(int(i) for i in torch.nonzero((envelopes.view(-1, entry) != before.view(-1, entry)).any(1)))
    return {"sglang_says": sglang_says, "written_ok": bool(ok), "changed_slots": changed}
