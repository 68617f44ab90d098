"""Decode-side offload on one rank: every pool kind and host layout, the file tier,
direct-to-host receive with heterogeneous TP, and launch-time validation.

Device pools are filled with random bytes (the KV) before anything happens. After a
reload, the request's bytes must equal what was there before the offload, and every
other byte of the pool must equal what it held just before the reload (the canary).
Comparisons are on raw bytes: random bf16 holds NaNs.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer.offload.copier as copier_mod
import kvxfer.offload.group as group_mod
from kvxfer import (
    ByteRanges,
    HybridSWAPool,
    LayoutError,
    MHAPool,
    MLAPool,
    PageAllocator,
    Planner,
    StatePool,
    get_transport,
    plan_transfer,
)
from kvxfer.errors import RequestError, StorageError
from kvxfer.host import HostPool
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.topology import heads_held, sources_for_decode_rank

PAGE = 4
POOLS = {
    "mha_token_major": lambda: MHAPool(layers=3, heads=2, head_dim=8, dtype="bfloat16", num_pages=40, page_size=PAGE),
    "mha_hnd": lambda: MHAPool(layers=3, heads=2, head_dim=8, dtype="float16", num_pages=40, page_size=PAGE,
                               layout="hnd"),
    "mha_page_major_fp8": lambda: MHAPool(layers=3, heads=2, head_dim=16, dtype="fp8_e4m3", num_pages=40,
                                          page_size=PAGE, layout="page_major", scale_block=8),
    "mla": lambda: MLAPool(layers=3, kv_lora_rank=16, rope_dim=4, dtype="bfloat16", num_pages=40, page_size=PAGE),
    "hybrid_swa": lambda: HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=8,
                                        dtype="bfloat16", num_pages=40, swa_num_pages=12, page_size=PAGE, window=6),
    "hybrid_swa_page_major": lambda: HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=8,
                                                   dtype="bfloat16", num_pages=40, swa_num_pages=12,
                                                   page_size=PAGE, window=6, layout="page_major"),
    "state": lambda: StatePool(layers=2, conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                               temporal_head_shape=[4, 4], num_slots=8),
}
STYLES = ("layer_first", "page_first")


# ------------------------------------------------------------------------------------
# The engine's side, as a test needs it: allocators, slot mapping, byte snapshots.
# ------------------------------------------------------------------------------------
class Engine:
    def __init__(self, pool, seed: int = 0):
        self.pool, self.gen = pool, torch.Generator().manual_seed(seed)
        self.alloc_of = {s.name: PageAllocator(s.num_pages, s.page_size) for s in pool.layout.spaces}
        self.tokens = "token" in self.alloc_of
        for a in self.alloc_of.values():   # fragment: every other page taken, so slots are not contiguous
            taken = a.alloc(a.page_size * (a.capacity // 3))
            if taken is not None:
                a.free(taken[(taken // a.page_size) % 2 == 0])
        self.randomize()

    def randomize(self):
        for b in self.pool.regions():
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=self.gen))

    def alloc(self, n: int, swa_positions=None) -> np.ndarray:
        """Engine slots of a request of ``n`` tokens (a state pool: its one state slot)."""
        if not self.tokens:
            return self.alloc_of["state"].alloc(1)
        slots = self.alloc_of["token"].alloc(n)
        if "swa" in self.alloc_of:
            pos = np.arange(max(0, n - self.pool.window), n) if swa_positions is None else swa_positions
            self.pool.map_swa(slots[pos], self.alloc_of["swa"].alloc(len(pos)))
        return slots

    def free(self, slots):
        if not self.tokens:
            return self.alloc_of["state"].free(slots)
        if "swa" in self.alloc_of:
            self.alloc_of["swa"].free(self.pool.unmap_swa(slots))
        self.alloc_of["token"].free(slots)

    def snapshot(self, slots, positions) -> dict:
        """Raw bytes of every part at the request's positions (per the part's space)."""
        out = {}
        for p in self.pool.layout.parts:
            pos = positions.get(p.space)
            if pos is not None and len(pos):
                out[p.key] = self.pool.get_part(p.layer, p.kind, slots[pos]).contiguous().view(torch.uint8).clone()
        return out

    def covered_mask(self, slots, positions) -> list[np.ndarray]:
        """Per region: True on the bytes the request owns at ``slots``."""
        lay = self.pool.layout
        dev = {s: np.asarray(self.pool.space_slots(s, slots[p]), np.int64) for s, p in positions.items() if len(p)}
        masks = [np.zeros(r.nbytes, bool) for r in lay.regions]
        r = Planner(lay, lay, kinds=[p.kind for p in lay.parts if p.space in dev], pack_below=0).plan(dev, dev).runs()
        for reg, off, n in zip(r.dst_region.tolist(), r.dst_offset.tolist(), r.nbytes.tolist()):
            masks[reg][off:off + n] = True
        return masks


def wait_released(mgr, rid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = mgr.poll()
        assert not res.failed, res.failed
        if rid in res.released:
            return
        time.sleep(0.005)
    raise AssertionError(f"{rid} not released within {timeout}s")


def decode(mgr, eng, rid, toks, slots, start: int):
    """Run the decode loop from ``start`` tokens to ``len(toks)``, one step() per token."""
    for t in range(start, len(toks) + 1):
        mgr.step([(rid, toks[:t], slots[:t] if eng.tokens else slots)])


def offload_and_reload(mgr, eng, rid, toks, slots):
    """release -> poll -> free -> reuse -> reload into other slots; check bytes and canary."""
    mgr.release(rid, toks, slots)
    wait_released(mgr, rid)
    pos = mgr.positions(rid)
    want = eng.snapshot(slots, pos)
    new = eng.alloc(len(toks), swa_positions=pos.get("swa"))   # taken while the old ones are held:
    assert not set(new.tolist()) & set(slots.tolist())           # other slots for sure
    eng.free(slots)
    eng.randomize()   # the freed slots are reused by someone else
    before = [b.numpy().copy() for b in eng.pool.regions()]
    mgr.reload(rid, new)
    got = eng.snapshot(new, pos)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"part {k} differs after reload"
    for b, after, m in zip(before, eng.pool.regions(), eng.covered_mask(new, pos)):
        assert np.array_equal(b[~m], after.numpy()[~m]), "reload wrote outside the request's slots"
    return new


# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", list(POOLS))
def test_roundtrip_every_pool_and_host_layout(kind, style):
    pool = POOLS[kind]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, layout=style, size=64)
    assert host.layout.kind == f"host_{style}" and len(host.regions()) == len(host.layout.regions)
    rng = np.random.default_rng(1)
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=8)) as mgr:
        toks = rng.integers(0, 32000, 23)
        slots = eng.alloc(len(toks))
        decode(mgr, eng, "r", toks, slots, start=5)
        slots = offload_and_reload(mgr, eng, "r", toks, slots)
        # the request decodes on after the reload and is offloaded a second time
        toks = np.concatenate([toks, rng.integers(0, 32000, 10)])
        if eng.tokens:
            more = eng.alloc_of["token"].alloc(10)
            if "swa" in eng.alloc_of:   # the window slides: the engine maps the newest positions
                eng.alloc_of["swa"].free(pool.unmap_swa(slots))
                slots = np.concatenate([slots, more])
                pos = np.arange(len(toks) - pool.window, len(toks))
                pool.map_swa(slots[pos], eng.alloc_of["swa"].alloc(len(pos)))
            else:
                slots = np.concatenate([slots, more])
        decode(mgr, eng, "r", toks, slots, start=24)
        offload_and_reload(mgr, eng, "r", toks, slots)
        if kind != "state":
            assert mgr.stats.records_offloaded >= 5
        mgr.forget("r")


def test_shared_prefix_is_stored_once_and_restored():
    pool = POOLS["mha_page_major_fp8"]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, layout="page_first", size=96)
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=8)) as mgr:
        toks = np.arange(1000, 1020)
        a = eng.alloc(20)
        decode(mgr, eng, "a", toks, a, start=1)
        mgr.release("a", toks, a)
        wait_released(mgr, "a")
        # b shares a's first 16 tokens and holds the same KV there (a deterministic model)
        btoks = np.concatenate([toks[:16], [7, 7, 7, 7, 7, 7]])
        b = eng.alloc(22)
        for p in pool.layout.parts:
            pool.set_parts(p.layer, b[:16], [(p.kind, pool.get_part(p.layer, p.kind, a[:16]))])
        decode(mgr, eng, "b", btoks, b, start=1)
        assert mgr.stats.records_deduped == 2
        want = eng.snapshot(a, {"token": np.arange(16)})
        offload_and_reload(mgr, eng, "b", btoks, b)
        # a third request with the prefix only: restore finds 16 tokens without any copy
        assert mgr.restore("c", np.concatenate([toks[:17], [5]])) == 16
        c = eng.alloc(18)
        mgr.reload("c", c)
        got = eng.snapshot(c, {"token": np.arange(16)})
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert mgr.restore("d", np.arange(5000, 5020)) == 0


def test_step_does_not_block_on_the_copy(monkeypatch):
    slow = copier_mod.execute_plan

    def slow_copy(*args):
        time.sleep(1.0)
        return slow(*args)

    monkeypatch.setattr(copier_mod, "execute_plan", slow_copy)
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=8)) as mgr:
        toks, slots = np.arange(16), eng.alloc(16)
        t0 = time.perf_counter()
        decode(mgr, eng, "r", toks, slots, start=1)
        mgr.release("r", toks, slots)
        assert time.perf_counter() - t0 < 0.5   # the copy takes 1 s
        assert mgr.poll().released == []       # copies still running: the slots stay the engine's
        wait_released(mgr, "r")


def test_launch_validation_names_fields_and_values(tmp_path):
    pool = POOLS["mha_token_major"]()
    host = HostPool.for_pool(pool, size=64)
    with pytest.raises(LayoutError, match=r"stride 6 is not a multiple of page_size 4 of space 'token': use 8"):
        DecodeOffloadManager(pool, host, OffloadConfig(stride=6))
    small = HostPool.for_pool(pool, size=4)
    with pytest.raises(LayoutError, match=r"holds 4 slots, less than one OffloadConfig.stride \(8 tokens\)"):
        DecodeOffloadManager(pool, small, OffloadConfig(stride=8))
    with pytest.raises(LayoutError, match="stride must be a positive int"):
        OffloadConfig(stride=0)
    with pytest.raises(LayoutError, match="host pool was built for layout"):
        DecodeOffloadManager(pool, HostPool.for_pool(POOLS["mla"](), size=64), OffloadConfig(stride=8))
    with pytest.raises(LayoutError, match="HostPool layout 'nope'"):
        HostPool.for_pool(pool, layout="nope", size=64)
    with pytest.raises(LayoutError, match="size for space 'swa'"):
        HostPool.for_pool(POOLS["hybrid_swa"](), size={"token": 64})
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadConfig(stride=8).stride = 16   # frozen


def test_host_pool_batch_allocation_is_back_to_back_whole_pages():
    host = HostPool.for_pool(POOLS["mha_token_major"](), size=10 * PAGE)
    got = host.alloc_many([{"token": 2 * PAGE}, {"token": PAGE + 1}, {"token": PAGE}])
    pages = [np.unique(g["token"] // PAGE) for g in got]
    assert [len(p) for p in pages] == [2, 2, 1] and [len(g["token"]) for g in got] == [2 * PAGE, PAGE + 1, PAGE]
    assert np.array_equal(np.concatenate(pages), np.arange(pages[0][0], pages[0][0] + 5))   # one block
    assert host.free_slots("token") == 5 * PAGE
    assert host.alloc_many([{"token": 3 * PAGE}, {"token": 3 * PAGE}]) is None      # not all fit: none taken
    assert host.free_slots("token") == 5 * PAGE
    host.free(got[1])
    with pytest.raises(LayoutError, match="already free"):
        host.free(got[1])
    assert host.free_slots("token") == 7 * PAGE


def test_a_burst_of_copies_evicts_the_cache_it_needs_in_one_go():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=32), OffloadConfig(stride=8)) as mgr:
        first = {f"a{i}": eng.alloc(8) for i in range(4)}
        for i, (rid, s) in enumerate(first.items()):
            mgr.release(rid, np.arange(8) + 100 * i, s)
        mgr.drain()
        assert sorted(mgr.poll().released) == sorted(first)
        for rid in first:            # cache now: droppable
            mgr.forget(rid)
        second = {f"b{i}": eng.alloc(8) for i in range(4)}
        want = {rid: eng.snapshot(s, {"token": np.arange(8)}) for rid, s in second.items()}
        for i, (rid, s) in enumerate(second.items()):
            mgr.release(rid, np.arange(8) + 1000 + 100 * i, s)
        mgr.drain()
        assert sorted(mgr.poll().released) == sorted(second) and mgr.stats.records_dropped == 4
        eng.randomize()
        for rid, s in second.items():
            mgr.reload(rid, s)
            got = eng.snapshot(s, {"token": np.arange(8)})
            assert all(torch.equal(want[rid][k], got[k]) for k in got)


def test_copies_keep_no_pool_alive():
    """The executor caches row views of the regions it copies between; a pool that goes away
    takes its entries (and its memory) with it."""
    import gc
    import weakref

    from kvxfer import copy_host as plan_mod
    pool = POOLS["mha_token_major"]()
    host = HostPool.for_pool(pool, size=16)
    slots = host.alloc({"token": 8})
    plan = Planner(pool.layout, host.layout).plan({"token": np.arange(8, 16)}, slots)
    copier_mod.execute_plan(plan, pool.regions(), host.regions())
    alive = [weakref.ref(t) for t in host.regions()]
    before = len(plan_mod._REGION_VIEWS)
    del host
    gc.collect()
    assert not any(r() is not None for r in alive)
    assert len(plan_mod._REGION_VIEWS) == before - len(alive)


def test_full_host_without_file_tier_waits_then_proceeds():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=8), OffloadConfig(stride=8)) as mgr:
        a, c = eng.alloc(8), eng.alloc(8)
        mgr.release("a", np.arange(8), a)
        wait_released(mgr, "a")
        mgr.release("c", np.arange(100, 108), c)   # the host is full of a, which is still in use
        time.sleep(0.3)
        assert mgr.poll().released == []
        want = eng.snapshot(c, {"token": np.arange(8)})
        mgr.forget("a")                          # a is done: its records become droppable cache
        wait_released(mgr, "c")
        eng.randomize()
        mgr.reload("c", c)
        got = eng.snapshot(c, {"token": np.arange(8)})
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert mgr.stats.records_dropped == 1 and mgr.restore("a2", np.arange(8)) == 0


@pytest.mark.parametrize("kind", ["mha_hnd", "hybrid_swa"])
def test_full_host_evicts_to_file_tier_and_nothing_is_lost(tmp_path, kind):
    pool = POOLS[kind]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, size={"token": 16, "swa": 8})
    cfg = OffloadConfig(stride=8, storage_dir=str(tmp_path))
    rng = np.random.default_rng(3)
    with DecodeOffloadManager(pool, host, cfg) as mgr:
        reqs = {}
        for i in range(4):
            toks = rng.integers(0, 1000, 19)
            slots = eng.alloc(19)
            decode(mgr, eng, f"r{i}", toks, slots, start=1)
            mgr.release(f"r{i}", toks, slots)
            wait_released(mgr, f"r{i}")
            pos = mgr.positions(f"r{i}")
            reqs[f"r{i}"] = (toks, pos, eng.snapshot(slots, pos))
            eng.free(slots)
        assert mgr.stats.records_evicted > 0
        for rid, (_toks, pos, want) in reqs.items():
            new = eng.alloc(19, swa_positions=pos.get("swa"))
            mgr.reload(rid, new)
            got = eng.snapshot(new, pos)
            assert all(torch.equal(want[k], got[k]) for k in want), rid
            eng.free(new)
        assert mgr.stats.file_reads > 0


RESTART = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_offload import POOLS, Engine
from kvxfer.offload import DecodeOffloadManager, HostPool, OffloadConfig
out = {{}}
for kind in {kinds!r}:
    pool = POOLS[kind]()
    eng = Engine(pool, seed=99)
    want = np.load({d!r} + f"/{{kind}}.npz")
    toks = want["toks"]
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64),
                              OffloadConfig(stride=8, storage_dir={d!r})) as mgr:
        n = mgr.restore("again", toks)
        pos = mgr.positions("again")
        slots = eng.alloc(len(toks), swa_positions=pos.get("swa"))
        mgr.reload("again", slots)
        got = eng.snapshot(slots, pos)
        out[kind] = dict(n=int(n), reads=mgr.stats.file_reads,
                         ok=all(np.array_equal(got[p.key].numpy(), want[f"{{p.layer}}_{{p.kind}}"])
                                for p in pool.layout.parts if p.key in got), parts=len(got))
print(json.dumps(out))
"""


def test_reload_after_restart_from_the_file_tier(tmp_path):
    kinds = ["mha_page_major_fp8", "hybrid_swa", "state", "mla"]
    for kind in kinds:
        pool = POOLS[kind]()
        eng = Engine(pool)
        toks = np.arange(300, 321)
        with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64),
                                  OffloadConfig(stride=8, storage_dir=str(tmp_path))) as mgr:
            slots = eng.alloc(len(toks))
            decode(mgr, eng, "r", toks, slots, start=3)
            mgr.release("r", toks, slots)
            wait_released(mgr, "r")
            want = eng.snapshot(slots, mgr.positions("r"))
            assert mgr.flush() >= 1
        np.savez(tmp_path / f"{kind}.npz", toks=toks, **{f"{k[0]}_{k[1]}": v.numpy() for k, v in want.items()})
    code = RESTART.format(tests=str(__import__("pathlib").Path(__file__).parent), kinds=kinds, d=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for kind in kinds:
        assert out[kind]["ok"] and out[kind]["n"] == 21 and out[kind]["reads"] > 0 and out[kind]["parts"], out


def test_file_tier_refuses_corrupt_or_truncated_records(tmp_path):
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    cfg = OffloadConfig(stride=8, storage_dir=str(tmp_path))
    toks = np.arange(16)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), cfg) as mgr:
        slots = eng.alloc(16)
        mgr.release("r", toks, slots)
        wait_released(mgr, "r")
        assert mgr.flush() == 2
    bins = sorted(tmp_path.rglob("*.bin"))
    data = bytearray(bins[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    bins[0].write_bytes(bytes(data))
    bins[1].write_bytes(bins[1].read_bytes()[:-3])
    for meta in tmp_path.rglob("*.meta"):
        assert b"\x80\x03" not in meta.read_bytes()[:2]   # not a pickle
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), cfg) as mgr:
        assert mgr.restore("r", toks) == 16
        with pytest.raises(StorageError, match="digest|bytes"):
            mgr.reload("r", eng.alloc(16))
    for meta in tmp_path.rglob("*.meta"):
        meta.write_bytes(b"garbage")
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), cfg) as mgr:
        assert mgr.restore("r", toks) == 0   # unreadable records are skipped, not trusted


def test_forget_and_misuse():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=4)) as mgr:
        slots = eng.alloc(20)
        decode(mgr, eng, "r", np.arange(20), slots, start=1)
        mgr.forget("r")                  # abort mid-offload: waits for copies reading the slots
        assert mgr.drain(5)
        with pytest.raises(RequestError):
            mgr.reload("r", slots)
        mgr.release("s", np.arange(20), slots)
        with pytest.raises(RequestError, match="being released"):
            mgr.forget("s")
        with pytest.raises(RequestError, match="not running"):
            mgr.step([("s", np.arange(21), slots)])
        wait_released(mgr, "s")
        with pytest.raises(LayoutError, match="slots given"):
            mgr.reload("s", slots[:10])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), start=st.integers(1, 40), stride=st.sampled_from([4, 8, 12]),
       style=st.sampled_from(STYLES))
def test_any_length_and_stride_roundtrips(n, start, stride, style):
    pool = POOLS["mha_hnd"]()
    eng = Engine(pool, seed=n)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, layout=style, size=48),
                              OffloadConfig(stride=stride)) as mgr:
        toks, slots = np.arange(n) * 7, eng.alloc(n)
        decode(mgr, eng, "r", toks, slots, start=min(start, n))
        offload_and_reload(mgr, eng, "r", toks, slots)


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
