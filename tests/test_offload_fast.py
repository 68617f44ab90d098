"""The offload manager's fast paths: host allocation of a batch (``Tiers.alloc_many`` against
a model of the eviction rules), ``PageAllocator.alloc_many`` / ``free``, and ``check_slots``.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvxfer import HybridSWAPool, MHAPool, PageAllocator
from kvxfer.errors import LayoutError, RequestError
from kvxfer.host import HostPool
from kvxfer.offload.records import Record, State
from kvxfer.offload.tiers import Tiers

PAGE = 4


# ------------------------------------------------------------------------------------
# PageAllocator
# ------------------------------------------------------------------------------------
def test_alloc_many_whole_pages_back_to_back() -> None:
    a = PageAllocator(12, PAGE)
    got = a.alloc_many([5, 0, 4, 8])
    assert got is not None and [len(g) for g in got] == [5, 0, 4, 8]
    assert a.free_pages == 11 - 5
    pages = [np.unique(g // PAGE) for g in got]
    for g, p in zip(got, pages):
        if len(g):   # whole pages of its own, from the first slot of its first page
            assert g[0] % PAGE == 0 and np.array_equal(g, (p[:, None] * PAGE + np.arange(PAGE)).ravel()[:len(g)])
    flat = np.concatenate(pages)
    assert len(np.unique(flat)) == len(flat) == 5 and np.array_equal(flat, np.arange(flat[0], flat[0] + 5))
    assert a.alloc_many([4 * PAGE, PAGE + 1, 1]) is None and a.free_pages == 6   # not all fit: none taken
    assert a.alloc_many([]) == [] and a.free_pages == 6


def test_free_merges_pages_named_out_of_order() -> None:
    """Pages named in no increasing order (page 1, page 3, page 1 again) are each freed once:
    the increasing fast path must not count page 1 twice."""
    a = PageAllocator(10, PAGE)
    s = a.alloc(3 * PAGE)                       # pages 1, 2, 3
    assert a.free_pages == 6
    a.free(np.concatenate([s[0:2], s[8:10], s[2:4]]))
    assert a.free_pages == 8                    # pages 1 and 3, not three pages
    assert a.alloc(2 * PAGE) is not None and a.free_pages == 6
    a.free(s[4:8])                              # page 2, increasing
    with pytest.raises(LayoutError, match="double free"):
        a.free(s[4:6])
    assert a.free_pages == 7                    # the refused free took nothing back


def test_free_increasing_checks_range_and_double_free() -> None:
    a = PageAllocator(10, PAGE)
    s = a.alloc(4 * PAGE)
    a.free(s[: 2 * PAGE])
    with pytest.raises(LayoutError, match="double free"):
        a.free(s)                               # increasing, half of it already free
    assert a.free_pages == 7
    with pytest.raises(LayoutError, match="outside"):
        a.free(np.array([2 * PAGE, 10 * PAGE]))
    with pytest.raises(LayoutError, match="outside"):
        a.free(np.array([1, 2 * PAGE]))          # page 0 is padding
    a.free(s[2 * PAGE:])
    assert a.free_pages == 9


# ------------------------------------------------------------------------------------
# Tiers.alloc_many against a model of its rules
# ------------------------------------------------------------------------------------
def _hybrid_host() -> HostPool:
    pool = HybridSWAPool(full_layers=[0], swa_layers=[1], heads=1, head_dim=8, dtype="bfloat16", num_pages=40,
                         swa_num_pages=12, page_size=PAGE, window=6, device="meta")
    return HostPool.for_pool(pool, size={"token": 12 * PAGE, "swa": 6 * PAGE}, pin_memory=False)


def _record(i: int, tokens: dict[str, int]) -> Record:
    key = i.to_bytes(16, "little")
    return Record(key=key, first=key, kind="chunk", start=0, page_keys=(key,), state=State.QUEUED,
                  positions={s: np.arange(n, dtype=np.int64) for s, n in tokens.items()})


def _model(tiers: Tiers, sizes: list[dict[str, int]]) -> tuple[int, set[bytes]]:
    """What ``alloc_many(sizes, wait=False)`` must do (no file tier): evict least recently used
    unpinned, unreferenced host records that hold a space still short, until all fit or none is
    left; then the leading records that fit (-1: RequestError). Returns (count, keys dropped)."""
    ps = {s: a.page_size for s, a in tiers.host.allocators.items()}
    free = {s: a.free_pages for s, a in tiers.host.allocators.items()}
    need = [{s: -(-n // ps[s]) for s, n in t.items()} for t in sizes]
    total = {s: sum(n.get(s, 0) for n in need) for s in free}
    dropped: set[bytes] = set()
    for r in tiers.lru.values():
        short = {s for s in total if total[s] > free[s]}
        if not short:
            break
        if r.pins == 0 and r.state == State.HOST and r.refs == 0 and short & set(r.positions):
            dropped.add(r.key)
            for s, slots in r.host_slots.items():
                free[s] += -(-len(slots) // ps[s])
    fit = 0
    for n in need:
        if any(n.get(s, 0) > free[s] for s in free):
            break
        for s in free:
            free[s] -= n.get(s, 0)
        fit += 1
    return (fit if fit else -1), dropped


@pytest.mark.parametrize("seed", range(12))
def test_alloc_many_follows_the_eviction_rules(seed: int) -> None:
    """Random batches over two spaces, with referenced and pinned records in the LRU: the
    count allocated and the records dropped are the model's, and every slot handed out is a
    whole page of its own, distinct from every live record's."""
    rng = random.Random(seed)
    tiers = Tiers(_hybrid_host(), None)
    live: list[Record] = []
    k = 0
    for _ in range(40):
        sizes = []
        for _ in range(rng.randint(1, 5)):
            spaces = rng.choice([("token",), ("swa",), ("token", "swa")])
            sizes.append({s: rng.randint(1, 3 * PAGE) for s in spaces})
        want, drops = _model(tiers, sizes)
        before = {r.key for r in tiers.lru.values()}
        try:
            got = tiers.alloc_many(sizes, wait=False, closing=lambda: False)
        except RequestError:
            got = None
        assert (len(got) if got is not None else -1) == want
        assert before - {r.key for r in tiers.lru.values()} == drops
        live = [r for r in live if r.state == State.HOST]
        for t, slots in zip(sizes, got or []):
            assert set(slots) == set(t) and all(len(slots[s]) == n for s, n in t.items())
            k += 1
            rec = _record(k, t)
            rec.host_slots = slots
            with tiers.cond:
                tiers.add_locked(rec)
                tiers.hold_locked(rec, notify=False)
            rec.refs, rec.pins = rng.choice([0, 0, 0, 1]), rng.choice([0, 0, 0, 0, 1])
            live.append(rec)
        for s in ("token", "swa"):   # live records' pages are distinct, and the allocator agrees
            pages = np.concatenate([np.unique(r.host_slots[s] // PAGE) for r in live if s in r.host_slots] or [[]])
            assert len(np.unique(pages)) == len(pages)
            a = tiers.host.allocators[s]
            assert a.free_pages == a.capacity - len(pages)
        if rng.random() < 0.3:   # some become evictable
            for r in live:
                r.refs = r.pins = 0


def test_take_gives_back_a_space_when_another_is_short(monkeypatch) -> None:
    """A batch over two spaces takes one space, then finds the other short (taken by someone
    else meanwhile): what the first took is freed, and the next try allocates both."""
    tiers = Tiers(_hybrid_host(), None)
    swa = tiers.host.allocators["swa"]
    real, calls = swa.alloc_many, []

    def once_short(counts):
        calls.append(list(counts))
        return None if len(calls) == 1 else real(counts)
    monkeypatch.setattr(swa, "alloc_many", once_short)
    tok = tiers.host.allocators["token"].free_pages
    got = tiers.alloc_many([{"token": 2 * PAGE, "swa": PAGE}], wait=False, closing=lambda: False)
    assert len(calls) == 2 and len(got) == 1
    assert tiers.host.allocators["token"].free_pages == tok - 2   # the first try's pages came back


def test_alloc_many_refuses_a_record_bigger_than_the_host() -> None:
    pool = MHAPool(layers=1, heads=1, head_dim=8, dtype="bfloat16", num_pages=8, page_size=PAGE, device="meta")
    tiers = Tiers(HostPool.for_pool(pool, size=3 * PAGE, pin_memory=False), None)
    with pytest.raises(LayoutError, match="exceeds the host pool"):
        tiers.alloc_many([{"token": PAGE}, {"token": 3 * PAGE + 1}], wait=False, closing=lambda: False)
    assert tiers.host.allocators["token"].free_pages == 3


# ------------------------------------------------------------------------------------
# check_slots: int64 arrays skip the conversion, nothing else changes
# ------------------------------------------------------------------------------------
def test_check_slots_fast_path_keeps_every_refusal() -> None:
    lay = MHAPool(layers=1, heads=1, head_dim=8, dtype="bfloat16", num_pages=8, page_size=PAGE,
                  device="meta").layout
    a = np.array([4, 31], dtype=np.int64)
    assert lay.check_slots("token", a) is a                              # no copy
    for other in (np.array([4, 31], dtype=">i8"), np.array([4, 31], dtype=np.int32), [4, 31], (4, 31)):
        out = lay.check_slots("token", other)
        assert out.dtype == np.int64 and out.dtype.isnative and out.tolist() == [4, 31]
    with pytest.raises(LayoutError, match="must be integers"):
        lay.check_slots("token", np.array([4.0, 5.0]))
    with pytest.raises(LayoutError, match="padding page"):
        lay.check_slots("token", np.array([5, 3], dtype=np.int64))
    with pytest.raises(LayoutError, match="out of range"):
        lay.check_slots("token", np.array([5, 32], dtype=np.int64))
    with pytest.raises(LayoutError, match="out of range"):
        lay.check_slots("token", np.array([5, 2**63 + 1], dtype=np.uint64))   # wraps negative: refused
    with pytest.raises(LayoutError, match="1-D"):
        lay.check_slots("token", np.array([[5]], dtype=np.int64))
