"""The SGLang backend's parts that need no SGLang (fast tier): the plugin stays inert without
SGLang; SGLang's poll semantics over a kvxfer request (an end state shown only once kvxfer
released the request); page and slot arithmetic; settings and rank topology; the plugin's hook
functions; pools described from pool-like objects and from ``KVArgs`` alone; SGLang's metadata
buffers as aux rows whose cleared rows read as "not landed" to SGLang's gate.
"""
from __future__ import annotations

import enum
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from sglang_shapes import MHA, Unified, fill

from kvxfer.endpoint.base import KVPoll
from kvxfer.errors import ConfigError, LayoutError
from kvxfer.integrations import sglang as sglang_plugin
from kvxfer.integrations.sglang import plugin
from kvxfer.integrations.sglang.config import BackendConfig, bootstrap_url, instance_name, rank_topology
from kvxfer.integrations.sglang.pools import (
    EngineContext,
    current_context,
    describe,
    describe_attention,
    engine_context,
    metadata_rows,
)
from kvxfer.integrations.sglang.states import (
    SGLangPoll,
    expand_pages,
    prefix_placeholders,
    state_slots,
    window_slots,
)


def test_register_is_inert_without_sglang():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed in this venv: the inert path is not the one taken")
    assert sglang_plugin.register() is None
    assert "sglang" not in sys.modules and not plugin._installed


def fake(state, released=False, reason=""):
    return types.SimpleNamespace(state=state, released=released, reason=reason)


def test_an_end_state_shows_only_once_kvxfer_released_the_request():
    p = SGLangPoll()
    assert p.show(None) == KVPoll.Bootstrapping
    assert p.show(fake(KVPoll.Bootstrapping), floor=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert p.show(fake(KVPoll.Transferring)) == KVPoll.Transferring
    assert p.show(fake(KVPoll.WaitingForInput)) == KVPoll.Transferring           # never backwards
    assert p.show(fake(KVPoll.Failed, released=False, reason="lost")) == KVPoll.Transferring   # a write may land
    assert p.conclude_state is None
    assert p.show(fake(KVPoll.Failed, released=True, reason="lost")) == KVPoll.Failed
    assert p.conclude_state == KVPoll.Failed and p.reason == "lost"
    assert p.show(fake(KVPoll.Success, released=True)) == KVPoll.Failed           # Failed is final
    q = SGLangPoll()
    assert q.show(fake(KVPoll.Success, released=False)) == KVPoll.Bootstrapping   # prefill: KV still read
    assert q.show(fake(KVPoll.Success, released=True)) == KVPoll.Success
    r = SGLangPoll()
    r.fail("duplicate room")
    assert r.show(fake(KVPoll.Transferring)) == KVPoll.Failed and r.reason == "duplicate room"


def test_pages_become_slots_and_state_indices_are_found_by_type():
    assert expand_pages([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    kinds = [types.SimpleNamespace(value="swa"), types.SimpleNamespace(value="mamba")]
    assert state_slots([np.array([5, 6]), [torch.tensor([3])]], kinds, "mamba").tolist() == [3]
    assert state_slots([np.array([5, 6]), None], kinds, "swa").tolist() == [5, 6]
    assert state_slots(None, kinds, "mamba") is None and state_slots([None, None], kinds, "mamba") is None


def test_prefix_placeholders_are_distinct_real_slots_outside_the_grant():
    suffix = np.array([16, 17, 18, 9, 8])
    ph = prefix_placeholders(6, suffix, page_size=4)
    assert len(ph) == 6 and len(set(ph.tolist())) == 6 and ph.min() >= 4
    assert not set(ph.tolist()) & set(suffix.tolist())
    assert len(prefix_placeholders(0, suffix, 4)) == 0


def test_the_sliding_window_takes_the_last_window_tokens_of_sglangs_window_pages():
    # 22 tokens, window 6, page 4: SGLang's window pages start at token 16 (page-aligned below 16)
    slots = window_slots([5, 2], page_size=4, seq_len=22, prefix=0, window=6)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9][-6:]
    # a prefix past the window's start: the window starts at the prefix
    assert window_slots([3], page_size=4, seq_len=22, prefix=20, window=6).tolist() == [12, 13]
    with pytest.raises(LayoutError, match="window page"):
        window_slots([5], page_size=4, seq_len=22, prefix=0, window=6)


def test_rank_topology_bootstrap_urls_and_names():
    sa = types.SimpleNamespace(tp_size=8, dp_size=2, pp_size=1, attn_cp_size=1, enable_dp_attention=True)
    assert rank_topology(types.SimpleNamespace(engine_rank=5, pp_rank=0), sa) == (4, 1, 2, 1, 1, 0)
    # decode hands the attention-TP rank and its DP rank
    assert rank_topology(types.SimpleNamespace(engine_rank=1, pp_rank=0, system_dp_rank=1), sa) == (4, 1, 2, 1, 1, 0)
    sa.enable_dp_attention = False
    t = rank_topology(types.SimpleNamespace(engine_rank=5, pp_rank=0, system_dp_rank=1), sa)
    assert (t.tp_size, t.tp_rank, t.dp_rank) == (8, 5, 1)
    sa.attn_cp_size = 2
    with pytest.raises(ConfigError, match="context-parallel"):
        rank_topology(types.SimpleNamespace(engine_rank=0, pp_rank=0), sa)
    assert bootstrap_url("10.0.0.1:8998") == "http://10.0.0.1:8998"
    assert bootstrap_url("[::1]:8998") == "http://[::1]:8998"
    assert instance_name("p", "::1", 8998) == "sglang-p-::1-8998"
    assert instance_name("d", "host name/x", 1) == "sglang-d-host_name_x-1"


def test_settings_from_the_environment_are_checked_in_words(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\n")
    cfg = BackendConfig.from_env({"KVXFER_TRANSPORT": "ucx", "KVXFER_SECRET_FILE": str(secret),
                                  "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "12"})
    assert (cfg.transport, cfg.secret, cfg.timeouts.waiting, cfg.timeouts.bootstrap) == ("ucx", b"s3cret", 12.0, 300.0)
    for env, words in (({"KVXFER_TRANSPORT": "rdma"}, "KVXFER_TRANSPORT='rdma'"),
                       ({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "soon"}, "not a number"),
                       ({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "-1"}, "must be > 0"),
                       ({"KVXFER_SECRET_FILE": str(tmp_path / "none")}, "cannot be read")):
        with pytest.raises(ConfigError, match=words):
            BackendConfig.from_env(env)


def test_the_backend_enum_gains_kvxfer_and_keeps_every_member():
    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        FAKE = "fake"
    new = plugin.extended_backends(TransferBackend)
    assert [m.value for m in new] == ["mooncake", "fake", "kvxfer"] and new("kvxfer").name == "KVXFER"
    assert new.__name__ == "TransferBackend" and new.__module__ == TransferBackend.__module__
    assert plugin.extended_backends(new) is new
    kinds = enum.Enum("KVClassType", {"KVARGS": "kvargs", "SENDER": "sender"})
    seen = []
    assert plugin.around_get_kv_class(lambda b, c: seen.append((b, c)) or "sglang's", new.FAKE, kinds.SENDER) \
        == "sglang's"
    assert plugin.around_get_kv_class(lambda b, c: "KVArgs", new.KVXFER, kinds.KVARGS) == "KVArgs"
    assert seen == [(new.FAKE, kinds.SENDER)]


def test_the_init_kv_manager_hook_hands_the_pools_over_for_that_call_only():
    queue = types.SimpleNamespace(token_to_kv_pool="the pool", scheduler=types.SimpleNamespace(
        req_to_token_pool="reqs", sliding_window_size=128, model_config=types.SimpleNamespace(
            num_hidden_layers=61, get_total_num_kv_heads=lambda: 8)))
    inside = plugin.around_init_kv_manager(lambda q, x: (current_context(), x), queue, 7)
    assert inside == (EngineContext("the pool", "reqs", 61, 128, 8), 7)
    assert current_context() is None


def test_pools_are_described_from_sglang_like_objects_and_from_kv_args():
    m = MHA(layers=2, heads=4, dim=16, slots=64, page=4, seed=3)
    pool = types.SimpleNamespace(k_buffer=m.k, v_buffer=m.v, page_size=4, start_layer=0, kv_cache_layout="nhd")
    from_object = describe_attention(pool).pool()
    args = types.SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in m.k + m.v],
                                 kv_data_lens=[t.numel() * 2 for t in m.k + m.v], kv_item_lens=[4 * 4 * 16 * 2] * 4,
                                 kv_cache_dtype_str="bfloat16", page_size=4, kv_head_num=4, kv_layer_ids=[],
                                 prefill_start_layer=0, num_draft_entries=0, state_types=[], gpu_id=None)
    from_args = describe(args, None, 1).kv.pool()
    slots = np.array([4, 9, 33])
    for p in (from_object, from_args):
        assert torch.equal(p.get_part(1, "v", slots).view(torch.uint8), m.v[1][slots].view(torch.uint8))
    with engine_context(EngineContext(kv_pool=pool)):
        assert describe(args, current_context(), 1).kv.layout == from_object.layout
    u = Unified(layers=2, heads=4, dim=16, slots=64, page=4, seed=4)
    upool = types.SimpleNamespace(k_buffer=[u.views_by[(i, "k")] for i in range(2)], page_size=4, start_layer=0,
                                  v_buffer=[u.views_by[(i, "v")] for i in range(2)], kv_cache_layout="page_major",
                                  requires_physical_write_loc=True,
                                  get_contiguous_buf_infos=lambda: ([u.buf.data_ptr()], [u.buf.numel()],
                                                                    [u.page_bytes]))
    up = describe_attention(upool).pool()
    assert up.regions()[0].data_ptr() == u.buf.data_ptr()
    assert torch.equal(up.get_part(1, "k", slots).view(torch.uint8), u.row(1, "k", slots).view(torch.uint8))


def test_what_cannot_be_described_is_refused_in_words():
    m = MHA(layers=1, heads=4, dim=16, slots=64, page=4, seed=5)
    args = types.SimpleNamespace(num_draft_entries=0, state_types=[types.SimpleNamespace(value="mamba")])
    with pytest.raises(LayoutError, match="needs the pool objects"):
        describe(args, None, 1)
    m_args = types.SimpleNamespace(kv_data_ptrs=[m.k[0].data_ptr(), m.v[0].data_ptr()], kv_data_lens=[4096] * 2,
                                   kv_item_lens=[512] * 2, kv_cache_dtype_str="auto", page_size=4, kv_layer_ids=[],
                                   num_draft_entries=0, state_types=[], gpu_id=None)
    with pytest.raises(LayoutError, match="KV heads per rank"):   # decode's KVArgs, without the hook
        describe(m_args, None, 1)
    with pytest.raises(LayoutError, match="draft KV"):
        describe(types.SimpleNamespace(num_draft_entries=2), None, 1)
    shuffled = types.SimpleNamespace(k_buffer=m.k, v_buffer=m.v, page_size=4, kv_cache_layout="vectorized_5d")
    with pytest.raises(LayoutError, match="no affine byte map"):
        describe_attention(shuffled)
    aliased = types.SimpleNamespace(full_kv_pool=types.SimpleNamespace(requires_physical_write_loc=True),
                                    swa_kv_pool=types.SimpleNamespace(), layers_mapping={})
    with pytest.raises(LayoutError, match="share one raw buffer"):
        describe(types.SimpleNamespace(num_draft_entries=0), EngineContext(kv_pool=aliased), 1)
    with pytest.raises(LayoutError, match="not an MHA or MLA pool"):
        describe_attention(types.SimpleNamespace(page_size=4))


def test_sglangs_metadata_buffers_become_aux_rows_that_read_not_landed_when_cleared():
    """Row ``i`` of every MetadataBuffers field is request ``i``'s; kvxfer clears a row at the grant
    to zeros, which is what SGLang's metadata gate reads as "not landed" (bootstrap_room 0)."""
    fields = [torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 64, dtype=torch.bfloat16),
              torch.zeros(8, 8, dtype=torch.uint64)]          # ..., hidden states, bootstrap_room
    for i, t in enumerate(fields):
        fill(t, 20 + i)
    args = types.SimpleNamespace(aux_data_ptrs=[t.data_ptr() for t in fields],
                                 aux_data_lens=[t.numel() * t.element_size() for t in fields],
                                 aux_item_lens=[t[0].numel() * t.element_size() for t in fields])
    rows = metadata_rows(args)
    assert rows.row_bytes == (64, 128, 64) and len(rows) == 8
    want = b"".join(t[3].contiguous().view(torch.uint8).numpy().tobytes() for t in fields)
    assert rows.read_bytes(3) == want                        # the engine's own bytes, nothing copied
    rows.clear(3)
    assert int(fields[2][3, 0]) == 0 and rows.cleared(3)     # the gate: room 0 = not landed
    rows.write(3, want)
    assert torch.equal(fields[1][3].view(torch.uint8), torch.frombuffer(bytearray(want[64:192]), dtype=torch.uint8))
    assert metadata_rows(types.SimpleNamespace(aux_data_ptrs=[])) is None


def test_metadata_buffers_in_gpu_memory_are_refused(monkeypatch):
    """SGLang puts MetadataBuffers on the GPU for Mooncake's NVLink pool; read as host memory they
    would crash the process, so the backend refuses that setting by name."""
    t = torch.zeros(4, 16, dtype=torch.int32)
    args = types.SimpleNamespace(aux_data_ptrs=[t.data_ptr()], aux_data_lens=[256], aux_item_lens=[64])
    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK")
    with pytest.raises(LayoutError, match="INTRA_NODE_NVLINK"):
        metadata_rows(args)
