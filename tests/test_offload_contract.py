"""Decode-side offload, the contracts with the rest of the system: direct-to-host receive
with heterogeneous TP (prefill writes into the decode rank's ``HostPool``), the readiness
contract (no source byte read before ``ready`` completes), and the TP group's backend.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from offload_helpers import PAGE, POOLS, Engine, decode, wait_released

import kvxfer.offload.group as group_mod
from kvxfer import (
    ByteRanges,
    LayoutError,
    MHAPool,
    PageAllocator,
    get_transport,
    plan_transfer,
)
from kvxfer.errors import RequestError
from kvxfer.host import HostPool
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.topology import heads_held, sources_for_decode_rank

# ------------------------------------------------------------------------------------
# Direct-to-host receive: prefill writes into the decode rank's HostPool, then reload.
# ------------------------------------------------------------------------------------
H, LAYERS, HD = 8, 3, 8


def global_kv(n: int, seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {(layer, k): torch.randint(0, 256, (n, H, HD * 2), dtype=torch.uint8, generator=g)
            for layer in range(LAYERS) for k in "kv"}


@pytest.mark.parametrize("p_tp,d_tp,d_layout,host_style", [(2, 4, "token_major", "page_first"),
                                                            (4, 2, "hnd", "layer_first")])
def test_direct_to_host_receive_hetero_tp_local(p_tp, d_tp, d_layout, host_style):
    n, rid = 22, "req-1"
    kv = global_kv(n)
    toks = np.arange(n) + 40
    p_pools, p_tr, p_slots = [], [], []
    for p in range(p_tp):
        pool = MHAPool(layers=LAYERS, heads=H // p_tp, head_dim=HD, dtype="bfloat16", num_pages=16, page_size=PAGE,
                       layout="page_major")
        slots = PageAllocator(16, PAGE).alloc(n + 4)[4:]       # prefill's own page table
        held = heads_held(H, p_tp, p)
        for layer in range(LAYERS):
            pool.set_kv_buffer(layer, slots, *(kv[(layer, k)][:, held.start:held.stop].contiguous()
                                               .view(torch.bfloat16) for k in "kv"))
        tr = get_transport("local")
        tr.register(pool.regions())
        p_pools.append(pool), p_tr.append(tr), p_slots.append(slots)
    for d in range(d_tp):
        dpool = MHAPool(layers=LAYERS, heads=H // d_tp, head_dim=HD, dtype="bfloat16", num_pages=16, page_size=PAGE,
                        layout=d_layout)
        host = HostPool.for_pool(dpool, layout=host_style, size=32)
        tr = get_transport("local")
        tr.register(host.regions())                          # the host pool is the destination
        with DecodeOffloadManager(dpool, host, OffloadConfig(stride=8)) as mgr:
            grant = mgr.receive_to_host(rid, toks)
            tr.expect(rid, ByteRanges.of_slots(host.layout, grant.slots))
            for src in sources_for_decode_rank(num_kv_heads=H, p_tp=p_tp, d_tp=d_tp, d_rank=d, num_layers=LAYERS):
                p = src.p_tp_rank
                plan = plan_transfer(p_pools[p].layout, {"token": p_slots[p][grant.positions["token"]]}, host.layout,
                                     grant.slots, src_heads=src.src_heads, dst_heads=src.dst_heads, layers=src.layers)
                p_tr[p].submit(p_tr[p].connect(tr.descriptor()), rid, plan, timeout=10).result(10)
            assert tr.forget(rid) and not tr.rejected
            mgr.commit_received(rid)
            assert (dpool.regions()[0] == 0).all()           # no device slot was used to receive
            slots = PageAllocator(16, PAGE).alloc(n + 8)[8:]
            mgr.reload(rid, slots)
            held = heads_held(H, d_tp, d)
            for layer in range(LAYERS):
                for k, got in zip("kv", dpool.get_kv_buffer(layer, slots)):
                    assert torch.equal(got.contiguous().view(torch.uint8).reshape(n, -1),
                                       kv[(layer, k)][:, held.start:held.stop].reshape(n, -1)), (d, layer, k)


# ------------------------------------------------------------------------------------
# The readiness contract and the group kind
# ------------------------------------------------------------------------------------
class LateEvent:
    """A stand-in for a CUDA event that completes when the test says so (a forward still running)."""

    def __init__(self):
        import threading
        self._done = threading.Event()
        self.synchronized = 0

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._done.wait(30)

    def complete(self) -> None:
        self._done.set()


@pytest.mark.parametrize("call", ["step", "release"])
def test_offload_reads_no_source_byte_before_ready_completes(call):
    """The step's KV is still being written when step()/release() is called: the final pattern
    lands after the call, then the event completes. The host copy must hold the final pattern.
    Without the guard the background thread copies the stale bytes at once (drain() below
    returns True early and the reload finds the stale pattern)."""
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=8)) as mgr:
        toks, slots = np.arange(8), eng.alloc(8)
        ready = LateEvent()
        if call == "step":
            decode(mgr, eng, "r", toks[:7], slots[:7], start=1)
            assert mgr.step([("r", toks, slots)], ready=ready) == 1
        else:
            decode(mgr, eng, "r", toks[:7], slots[:7], start=1)
            mgr.release("r", toks, slots, ready=ready)
        assert not mgr.drain(timeout=0.3), "the copy ran before the KV was ready"
        eng.randomize()                                   # the forward writes the final pattern ...
        final = eng.snapshot(slots, {"token": np.arange(8)})
        ready.complete()                                  # ... and then its event completes
        assert mgr.drain(timeout=10) and ready.synchronized >= 1
        if call == "step":
            mgr.release("r", toks, slots)
        wait_released(mgr, "r")
        new = eng.alloc(8)
        eng.free(slots)
        mgr.reload("r", new)
        got = eng.snapshot(new, {"token": np.arange(8)})
        assert all(torch.equal(final[k], got[k]) for k in final), "offload read the KV before it was ready"


def test_ready_must_be_an_event_like_object():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=8)) as mgr:
        toks, slots = np.arange(8), eng.alloc(8)
        with pytest.raises(RequestError, match="query\\(\\) and synchronize\\(\\)"):
            mgr.step([("r", toks[:3], slots[:3])], ready=object())   # refused even with nothing to copy
        with pytest.raises(RequestError, match="query\\(\\) and synchronize\\(\\)"):
            mgr.release("r", toks, slots, ready=object())


def test_group_must_be_cpu_capable(monkeypatch):
    """An NCCL TP group cannot all-reduce the CPU votes: refused at construction, saying what to pass."""
    pool = POOLS["mha_token_major"]()
    host = HostPool.for_pool(pool, size=64)
    nccl = object()
    monkeypatch.setattr(group_mod.dist, "get_backend", lambda g=None: "nccl" if g is nccl else "gloo")
    with pytest.raises(LayoutError, match=r"backend is 'nccl'.*new_group\(tp_ranks, backend='gloo'\)"):
        DecodeOffloadManager(pool, host, OffloadConfig(stride=8), group=nccl)
    with pytest.raises(LayoutError, match="not a torch.distributed process group"):
        monkeypatch.undo()
        DecodeOffloadManager(pool, host, OffloadConfig(stride=8), group="tp0")
