"""The background copy of offload records in batches: records queued together share a host
allocation yet keep whole pages of their own, what does not fit is carried over, ``close``
copies what is queued, ``reload`` maps a request's records in one pass.

Every round trip checks bytes (``offload_and_reload``: the request's bytes and the canary).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from offload_helpers import PAGE, POOLS, STYLES, Engine, offload_and_reload, wait_released

from kvxfer import LayoutError
from kvxfer.host import HostPool
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.offload.records import State


def shuffled(eng: Engine, n: int, rng) -> np.ndarray:
    """Slots of ``n`` tokens on whole pages taken in a shuffled order (an engine after churn)."""
    a = eng.alloc_of["token"]
    pages = a.take(a.pages_for(n))
    return a.slots_of(rng.permutation(pages), n)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", ["mha_token_major", "mha_hnd", "hybrid_swa"])
def test_records_copied_together_keep_their_own_whole_host_pages(kind, style):
    pool = POOLS[kind]()
    eng = Engine(pool)
    rng = np.random.default_rng(7)
    host = HostPool.for_pool(pool, layout=style, size=96)
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=2 * PAGE)) as mgr:
        reqs = {f"r{i}": (rng.integers(0, 32000, n), shuffled(eng, n, rng)) for i, n in enumerate((19, 24, 9))}
        if "swa" in eng.alloc_of:
            for toks, slots in reqs.values():
                pos = np.arange(max(0, len(toks) - pool.window), len(toks))
                pool.map_swa(slots[pos], eng.alloc_of["swa"].alloc(len(pos)))
        with mgr._cond:   # queued while the background thread waits for the lock: copied together
            for rid, (toks, slots) in reqs.items():
                mgr.release(rid, toks, slots)
        mgr.drain()
        owner: dict[tuple[str, int], int] = {}
        for rid in reqs:
            for rec in mgr._requests[rid].records:
                assert rec.state == State.HOST
                for space, hs in rec.host_slots.items():
                    ps = host.allocators[space].page_size
                    pages = hs[::ps] // ps
                    assert len(hs) == len(rec.positions[space]) and len(set(pages.tolist())) == len(pages)
                    assert np.array_equal(hs, (pages[:, None] * ps + np.arange(ps)).ravel()[:len(hs)])
                    for p in pages.tolist():   # a host page belongs to one record
                        assert owner.setdefault((space, p), id(rec)) == id(rec)
        assert sorted(mgr.poll().released) == sorted(reqs)
        want = {rid: eng.snapshot(slots, mgr.positions(rid)) for rid, (_, slots) in reqs.items()}
        for rid, (_, slots) in reqs.items():
            reload_into_fresh_slots(mgr, eng, rid, slots, want[rid])


def reload_into_fresh_slots(mgr, eng, rid, slots, want):
    """Reload ``rid`` (offloaded) into fresh slots; its bytes must be ``want`` again."""
    pos = mgr.positions(rid)
    new = eng.alloc(len(pos["token"]), swa_positions=pos.get("swa"))
    eng.free(slots)
    eng.randomize()
    mgr.reload(rid, new)
    got = eng.snapshot(new, pos)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    mgr.forget(rid)


def test_close_copies_what_is_still_queued():
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    mgr = DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=8))
    slots = {f"r{i}": eng.alloc(12) for i in range(3)}
    with mgr._cond:
        for i, (rid, s) in enumerate(slots.items()):
            mgr.release(rid, np.arange(12) + 100 * i, s)
    mgr.close()
    mgr.close()   # idempotent
    assert all(r.state == State.HOST for rid in slots for r in mgr._requests[rid].records)
    assert sorted(mgr.poll().released) == sorted(slots)
    assert mgr.drain(timeout=0)


def test_a_batch_larger_than_the_host_carries_over_and_drain_waits_for_it():
    """Records queued together that do not all fit are copied in turns (the carry, once room
    is made); drain() returns only when the last one is on host."""
    pool = POOLS["mha_token_major"]()
    eng = Engine(pool)
    host = HostPool.for_pool(pool, size=24)   # room for three records of 8 tokens
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=8)) as mgr:
        slots = {f"r{i}": eng.alloc(8) for i in range(7)}
        want = {rid: eng.snapshot(s, {"token": np.arange(8)}) for rid, s in slots.items()}
        toks = {rid: np.arange(8) + 100 * i for i, rid in enumerate(slots)}
        for rid in ("r0", "r1", "r2"):   # the host fills with them, then they become cache
            mgr.release(rid, toks[rid], slots[rid])
        mgr.drain()
        assert sorted(mgr.poll().released) == ["r0", "r1", "r2"]
        for rid in ("r0", "r1", "r2"):
            mgr.forget(rid)
        with mgr._cond:   # four records queued together: three fit (evicting the cache), one waits
            for rid in ("r3", "r4", "r5", "r6"):
                mgr.release(rid, toks[rid], slots[rid])
        wait_released(mgr, "r3")
        assert not mgr.drain(timeout=0.2)   # r6 waits for room
        mgr.forget("r3")                    # room: r6 is copied
        assert mgr.drain(timeout=10)
        wait_released(mgr, "r6")
        assert mgr.stats.records_dropped == 4
        for rid in ("r4", "r5", "r6"):
            eng.randomize()
            mgr.reload(rid, slots[rid])
            got = eng.snapshot(slots[rid], {"token": np.arange(8)})
            assert all(torch.equal(want[rid][k], got[k]) for k in got)


@pytest.mark.parametrize("kind", ["mha_token_major", "hybrid_swa", "state"])
def test_reload_maps_the_whole_request_at_once(kind):
    """reload() maps and checks all records of a request in one pass, then hands each record
    its share: the bytes land where they belong, and too few slots are refused."""
    pool = POOLS[kind]()
    eng = Engine(pool)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=64), OffloadConfig(stride=PAGE)) as mgr:
        toks = np.arange(3 * PAGE + 2)
        slots = eng.alloc(len(toks))
        for t in range(1, len(toks) + 1):
            mgr.step([("r", toks[:t], slots[:t] if eng.tokens else slots)])
        slots = offload_and_reload(mgr, eng, "r", toks, slots)
        if eng.tokens:   # too few slots: refused before a byte moves, naming the position
            mgr.release("r", toks, slots)
            wait_released(mgr, "r")
            with pytest.raises(LayoutError, match="slots given"):
                mgr.reload("r", slots[:-1])
            mgr.reload("r", slots)
