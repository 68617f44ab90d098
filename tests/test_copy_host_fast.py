"""The host executor's shortcuts keep its guarantees (issue 20: fixed costs per request).

- ``check_plan_bounds`` is skipped only for a plan ``Planner.plan`` made (``TransferPlan.fits``)
  and only when every region given is at least the size the planner planned for; a plan built
  by hand, or a planner's plan run against smaller regions, is still refused before a byte
  moves. A planner's arrays are read-only, so the plan cannot change after it was vouched for.
- a region is read where its tensor's storage is now (``set_`` to new memory).
- a zero-length row (a plan from outside) copies nothing.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from plan_reference import Case, cases

from kvxfer.copy import execute_plan
from kvxfer.errors import LayoutError, PlanError
from kvxfer.host import HostPool
from kvxfer.plan import PACK_BELOW, Planner, RunGroup, TransferPlan, check_plan_bounds
from kvxfer.pools import MHAPool


def _pool():
    pool = MHAPool(layers=2, heads=2, head_dim=16, dtype="bfloat16", num_pages=8, page_size=4, device="cpu")
    for i, b in enumerate(pool.regions()):
        b.copy_(torch.arange(b.numel(), dtype=torch.int64).add_(i * 7).remainder_(251).to(torch.uint8))
    return pool


def _planned():
    pool = _pool()
    host = HostPool.for_pool(pool, layout="layer_first", size=16)
    hs = host.alloc({"token": 8})
    plan = Planner(pool.layout, host.layout).plan({"token": np.arange(12, 20)}, hs)
    return pool, host, plan


def test_planner_plan_vouches_for_its_layouts():
    pool, host, plan = _planned()
    assert plan.fits == (tuple(r.nbytes for r in pool.layout.regions), tuple(r.nbytes for r in host.layout.regions))
    assert plan.fits_regions([r.numel() for r in pool.regions()], [r.numel() for r in host.regions()])
    with pytest.raises(TypeError):   # the constructor cannot vouch: only the planner sets it
        TransferPlan(plan.groups, fits=plan.fits)  # type: ignore[call-arg]
    assert dataclasses.replace(plan).fits is None
    assert TransferPlan(plan.groups).fits is None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_what_the_planner_vouches_for_holds(case: Case) -> None:
    """The skipped check is redundant: on random layouts, slots, head slices and layer subsets,
    every plan the planner vouches for passes ``check_plan_bounds`` on regions of exactly the
    sizes in ``fits`` (the executor's byte-exactness against the reference is test_plan's)."""
    for pack_below in (0, PACK_BELOW, 1 << 40):
        plan = Planner(case.src, case.dst, src_heads=case.src_heads, dst_heads=case.dst_heads, layers=case.layers,
                       pack_below=pack_below).plan(case.src_slots, case.dst_slots)
        assert plan.fits == (tuple(r.nbytes for r in case.src.regions), tuple(r.nbytes for r in case.dst.regions))
        check_plan_bounds(plan, list(plan.fits[0]), list(plan.fits[1]))
        assert plan.fits_regions(list(plan.fits[0]), list(plan.fits[1]))
        smaller = [n - 1 for n in plan.fits[1]]
        assert not plan.fits_regions(list(plan.fits[0]), smaller)


def test_planner_plan_on_smaller_regions_is_still_checked():
    """Regions smaller than the layouts the plan was made for: the full check runs and refuses
    the plan before any byte moves."""
    pool, host, plan = _planned()
    small = [torch.zeros(r.numel() // 2, dtype=torch.uint8) for r in host.regions()]
    with pytest.raises(PlanError, match="reaches byte"):
        execute_plan(plan, pool.regions(), small)
    assert all(int(t.count_nonzero()) == 0 for t in small)
    fewer = pool.regions()[:1]   # fewer regions than the layout has
    assert not plan.fits_regions([r.numel() for r in fewer], [r.numel() for r in host.regions()])
    with pytest.raises(PlanError, match="region id"):
        execute_plan(plan, fewer, host.regions())


def test_hand_built_plan_is_checked():
    """A plan from outside (a peer, a file, a test) is checked run by run, even when its groups
    came from a planner's plan."""
    pool, host, plan = _planned()
    g = plan.groups[0]
    far = RunGroup(g.src_region, g.src_base, g.dst_region, g.dst_base, g.row_src,
                   g.row_dst + host.regions()[0].numel(), g.row_len, g.packed)
    before = [t.clone() for t in host.regions()]
    with pytest.raises(PlanError, match="reaches byte"):
        execute_plan(TransferPlan((far,)), pool.regions(), host.regions())
    with pytest.raises(PlanError, match="reaches byte"):   # concat with a vouched plan: not vouched
        execute_plan(TransferPlan.concat([plan, TransferPlan((far,))]), pool.regions(), host.regions())
    assert all(torch.equal(a, b) for a, b in zip(before, host.regions()))


def test_planner_arrays_are_read_only():
    _, _, plan = _planned()
    g = plan.groups[0]
    for a in (g.src_region, g.src_base, g.dst_region, g.dst_base, g.row_src, g.row_dst, g.row_len):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1 << 40


def test_concat_keeps_fits_of_one_planner():
    pool, host, plan = _planned()
    again = Planner(pool.layout, host.layout).plan({"token": np.arange(4, 8)}, host.alloc({"token": 4}))
    assert TransferPlan.concat([plan, again]).fits == plan.fits
    back = Planner(host.layout, pool.layout).plan(host.alloc({"token": 4}), {"token": np.arange(4, 8)})
    assert TransferPlan.concat([plan, back]).fits is None   # other layouts: not vouched


def test_region_with_new_storage_gets_new_views():
    """The same tensor object moved to new storage (``set_``): the cached views of the old
    storage are not used, the bytes land in the new one."""
    pool, host, plan = _planned()
    execute_plan(plan, pool.regions(), host.regions())
    region = host.regions()[0]
    old = region.clone()
    fresh = torch.zeros(region.numel(), dtype=torch.uint8)
    region.set_(fresh.untyped_storage(), 0, region.shape)   # same object, new data_ptr
    execute_plan(plan, pool.regions(), host.regions())
    assert torch.equal(region, old)   # landed in the new storage


def test_zero_length_row_copies_nothing():
    """Rows of one unit skip the index expansion; a zero-length row (never made by the planner,
    possible from outside) must still move no byte."""
    z = np.zeros(1, np.int64)
    src = torch.arange(256, dtype=torch.int64).remainder_(251).to(torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    g = RunGroup(z, z, z, z, np.array([0, 64, 128]), np.array([0, 64, 128]), np.array([64, 0, 64]), False)
    execute_plan(TransferPlan((g,)), [src], [dst])
    want = torch.zeros(256, dtype=torch.uint8)
    want[:64], want[128:192] = src[:64], src[128:192]
    assert torch.equal(dst, want)


def test_page_allocator_matches_a_plain_model():
    """``take`` (first free block that fits, else the lowest free pages) and ``free`` (pages of
    the slots, each once) against a model over a Python set, on random churn that reaches the
    last page (the sentinel past it) and frees slots in any order, pages named several times."""
    from kvxfer.allocator import PageAllocator
    rng = np.random.default_rng(7)
    for num_pages in (2, 3, 17, 64):
        a, free, held = PageAllocator(num_pages, 4), set(range(1, num_pages)), []
        for _ in range(300):
            if held and rng.random() < 0.45:
                slots = held.pop(int(rng.integers(len(held))))
                a.free(rng.permutation(slots))
                free |= set((slots // 4).tolist())
            else:
                need = int(rng.integers(0, 6))
                got = a.take(need)
                if need > len(free):
                    assert got is None
                    continue
                order = sorted(free)
                blocks = [b for b in np.split(np.array(order), np.flatnonzero(np.diff(order) != 1) + 1)
                          if len(b) >= need] if need else []
                want = blocks[0][:need].tolist() if blocks else order[:need]
                assert got.tolist() == want
                free -= set(want)
                held.append(a.slots_of(got, need * 4))
            assert a.free_pages == len(free)
        nonempty = [h for h in held if len(h)]
        if nonempty:
            a.free(nonempty[0])
            with pytest.raises(LayoutError, match="double free"):
                a.free(nonempty[0])
