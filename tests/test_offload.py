"""Decode-side offload on one rank: every pool kind and host layout, the file tier and
launch-time validation (direct-to-host receive and the readiness contract:
``test_offload_contract.py``; shared helpers: ``offload_helpers.py``).

Device pools are filled with random bytes (the KV) before anything happens. After a
reload, the request's bytes must equal what was there before the offload, and every
other byte of the pool must equal what it held just before the reload (the canary).
Comparisons are on raw bytes: random bf16 holds NaNs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offload_helpers import PAGE, POOLS, STYLES, Engine, decode, offload_and_reload, wait_released

import kvxfer.offload.copier as copier_mod
from kvxfer import (
    LayoutError,
    Planner,
)
from kvxfer.errors import RequestError, StorageError
from kvxfer.host import HostPool
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.offload.records import page_keys


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


def _offload_batch(mgr, eng, lengths: dict[str, int], seed: int) -> dict:
    """Decode and release requests of ``lengths`` tokens, one after another (freeing each one's
    slots once released); returns rid -> (positions, the bytes to get back)."""
    rng, out = np.random.default_rng(seed), {}
    for rid, n in lengths.items():
        toks = rng.integers(0, 32000, n)
        slots = eng.alloc(n)
        decode(mgr, eng, rid, toks, slots, start=1)
        mgr.release(rid, toks, slots)
        wait_released(mgr, rid)
        pos = mgr.positions(rid)
        out[rid] = (pos, eng.snapshot(slots, pos))
        eng.free(slots)
    return out


def _count_copies(monkeypatch) -> list:
    calls: list = []
    real = copier_mod.Copier._copy

    def counted(self, plan, *a, **k):
        calls.append(plan.nbytes)
        return real(self, plan, *a, **k)
    monkeypatch.setattr(copier_mod.Copier, "_copy", counted)
    return calls


@pytest.mark.parametrize("kind,tier", [("mha_token_major", "host"), ("hybrid_swa", "host"), ("mla", "host"),
                                       ("state", "host"), ("mha_hnd", "file")])
def test_reload_many_resumes_a_batch_with_one_copy(kind, tier, tmp_path, monkeypatch):
    """Three requests back in one call, byte-exact, nothing written outside their slots. From
    host memory that is one plan and one copy (the engine's batch, as the bench's ceiling copies
    it); records in the file tier come back one by one in the same call."""
    pool = POOLS[kind]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, size=16 if tier == "file" else 64)
    cfg = OffloadConfig(stride=8, storage_dir=str(tmp_path) if tier == "file" else None)
    with DecodeOffloadManager(pool, host, cfg) as mgr:
        held = _offload_batch(mgr, eng, {"a": 13, "b": 9, "c": 17}, seed=7)
        assert (mgr.stats.records_evicted > 0) == (tier == "file")
        new = {rid: eng.alloc(len(pos["token"]) if "token" in pos else 1, swa_positions=pos.get("swa"))
               for rid, (pos, _) in held.items()}
        eng.randomize()
        before = [b.numpy().copy() for b in pool.regions()]
        masks = [np.zeros(len(b), bool) for b in before]
        for rid, (pos, _) in held.items():
            for m, c in zip(masks, eng.covered_mask(new[rid], pos)):
                m |= c
        copies = _count_copies(monkeypatch)
        mgr.reload_many(new)
        for rid, (pos, want) in held.items():
            got = eng.snapshot(new[rid], pos)
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), rid
        for b, after, m in zip(before, pool.regions(), masks):
            assert np.array_equal(b[~m], after.numpy()[~m]), "reload_many wrote outside the requests' slots"
        if tier == "host":
            assert len(copies) == 1 and mgr.stats.records_reloaded == sum(
                len(mgr._requests[r].records) for r in held)
        else:
            assert len(copies) > 1
        assert all(mgr._requests[r].phase == "running" for r in held)   # they decode on


def test_reload_many_checks_every_request_before_it_copies_anything():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, size=64)
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=8)) as mgr:
        held = _offload_batch(mgr, eng, {"a": 10, "b": 12}, seed=3)
        mgr.step([("run", np.arange(5), eng.alloc(5))])   # a running request: nothing to reload
        new = {rid: eng.alloc(len(pos["token"])) for rid, (pos, _) in held.items()}
        before = [b.numpy().copy() for b in pool.regions()]
        bad = [([("a", new["a"]), ("zz", new["b"])], RequestError, "zz is not known"),
               ([("a", new["a"]), ("run", new["b"])], RequestError, "run is running, not offloaded"),
               ([("a", new["a"]), ("b", new["b"]), ("a", new["a"])], RequestError, "a is listed twice"),
               ([("a", new["a"]), ("b", new["b"][:5])], LayoutError, "reload b: 5 slots given"),
               ([("a", new["a"]), "b"], RequestError, "pairs, got 'b'")]
        for batch, err, why in bad:
            with pytest.raises(err, match=why):
                mgr.reload_many(batch)
            assert all(np.array_equal(x, y.numpy()) for x, y in zip(before, pool.regions())), why
            assert mgr._requests["a"].phase == mgr._requests["b"].phase == "offloaded"
        mgr.reload_many([(rid, new[rid]) for rid in ("b", "a")])   # pairs, in any order
        for rid, (pos, want) in held.items():
            got = eng.snapshot(new[rid], pos)
            assert all(torch.equal(want[k], got[k]) for k in want), rid


def _python_chain(prev: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """The key chain as ``kvxfer.offload.tiers`` documents it, one hashlib call per page: what
    record files written by any kvxfer are named by."""
    out, raw = [], np.asarray(tokens, np.int64).tobytes()
    for a in range(0, len(tokens) // page_size * page_size * 8, page_size * 8):
        prev = hashlib.blake2b(prev + raw[a:a + page_size * 8], digest_size=16).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("page_size", [1, 3, 15, 16, 17, 64, 256])
def test_page_keys_are_the_documented_blake2b_chain(page_size):
    """The compiled chain gives hashlib's keys (files on disk stay found) for every length: whole
    pages, a partial last page (no key), none at all; prev of 0, 16 and 64 bytes."""
    rng = np.random.default_rng(page_size)
    for n in (0, page_size - 1, page_size, 5 * page_size + 2):
        tok = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
        for prev in (b"", rng.bytes(16), rng.bytes(64)):
            got = page_keys(prev, tok, page_size)
            assert got == _python_chain(prev, tok, page_size)
            assert len(got) == n // page_size
    # the manager hands token ids as lists and narrower arrays too: the same keys
    assert page_keys(b"s" * 16, list(range(40)), 8) == _python_chain(b"s" * 16, np.arange(40), 8)
    assert page_keys(b"s" * 16, np.arange(40, dtype=np.int32), 8) == _python_chain(b"s" * 16, np.arange(40), 8)
    for prev, size, why in ((b"x" * 65, 8, "at most 64"), (b"x", 0, "page_size > 0")):
        with pytest.raises(ValueError, match=why):
            page_keys(prev, np.arange(16), size)
    # a page larger than the tokens: no key, and nothing sized from the page (its 8-byte ids and the
    # key before would wrap a size_t: to 56 bytes for 2**61 - 1 tokens, to 0 for 2**62)
    for size in (2**61 - 1, 2**62, 2**63 - 1):
        assert page_keys(b"x" * 64, np.arange(16), size) == []


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
    """The executor keeps nothing of the regions it copies between: a pool that goes away
    takes its memory with it."""
    import gc
    import weakref

    pool = POOLS["mha_token_major"]()
    host = HostPool.for_pool(pool, size=16)
    slots = host.alloc({"token": 8})
    plan = Planner(pool.layout, host.layout).plan({"token": np.arange(8, 16)}, slots)
    copier_mod.execute_plan(plan, pool.regions(), host.regions())
    alive = [weakref.ref(t) for t in host.regions()]
    del host
    gc.collect()
    assert not any(r() is not None for r in alive)


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
from offload_helpers import POOLS, Engine
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


@pytest.mark.slow   # a restarted process reads the file tier (the full tier)
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
