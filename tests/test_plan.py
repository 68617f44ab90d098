"""Property tests of the planner against a naive reference copy.

The reference (``plan_reference.py``) walks every (part, token, head) with a plain Python
loop and computes byte offsets straight from the ``Part`` fields. It shares no code with
``kvxfer.plan``, so a planner bug (a wrong stride, a bad merge, a fused run that crosses a
gap) shows up as a byte difference. Destinations are filled with random
"canary" bytes first: comparing whole regions then also proves that no byte outside
the request was written.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_reference import (
    HUGE,
    SLOT_STYLES,
    Case,
    assert_disjoint,
    cases,
    execute_packed,
    make_slots,
    min_runs_reference,
    random_regions,
    reference_copy,
)

from kvxfer.copy import execute_plan
from kvxfer.layout import (
    page_major_layout,
    token_major_layout,
)
from kvxfer.plan import (
    PACK_BELOW,
    HeadSlice,
    Planner,
    plan_transfer,
)


# ------------------------------------------------------------------------------------
# The property
# ------------------------------------------------------------------------------------
@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_plan_matches_reference_copy(case: Case) -> None:
    rng = np.random.default_rng(case.seed)
    src = random_regions(case.src, rng)
    canary = random_regions(case.dst, rng)
    expected = [t.numpy().copy() for t in canary]
    want_bytes = reference_copy(case.src, [t.numpy() for t in src], case.src_slots, case.src_heads,
                                case.dst, expected, case.dst_slots, case.dst_heads,
                                None if case.layers is None else set(case.layers))
    src_before = [t.clone() for t in src]
    for pack_below in (0, PACK_BELOW, HUGE):
        plan = plan_transfer(case.src, case.src_slots, case.dst, case.dst_slots, src_heads=case.src_heads,
                             dst_heads=case.dst_heads, layers=case.layers, pack_below=pack_below)
        assert plan.nbytes == want_bytes
        runs = plan.runs()
        assert int(runs.nbytes.sum()) == want_bytes and (runs.nbytes > 0).all()
        assert_disjoint(runs.dst_region, runs.dst_offset, runs.nbytes)
        if pack_below == 0:
            assert plan.num_packed_runs == 0
        if pack_below == HUGE:
            assert plan.num_packed_runs == plan.num_runs
        for executor in (execute_plan, execute_packed):
            dst = [t.clone() for t in canary]
            executor(plan, src, dst)
            for i, (got, want) in enumerate(zip(dst, expected)):
                if not np.array_equal(got.numpy(), want):
                    bad = np.flatnonzero(got.numpy() != want)
                    pytest.fail(f"{executor.__name__} pack_below={pack_below}: region {i} "
                                f"({case.dst.regions[i].name}) differs at {len(bad)} bytes, first {bad[:8]}")
    assert all(torch.equal(a, b) for a, b in zip(src, src_before)), "the source was modified"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_never_beats_the_minimum_and_prepared_equals_one_shot(case: Case) -> None:
    """No plan can have fewer runs than the unit-chain minimum; a smaller count would
    mean a run that is not contiguous on one side. The prepared Planner and the
    one-shot call must agree run for run."""
    kw = dict(src_heads=case.src_heads, dst_heads=case.dst_heads)
    one_shot = plan_transfer(case.src, case.src_slots, case.dst, case.dst_slots, **kw).runs()
    prepared = Planner(case.src, case.dst, **kw).plan(case.src_slots, case.dst_slots).runs()
    for a, b in zip(one_shot, prepared):
        np.testing.assert_array_equal(a, b)
    floor = min_runs_reference(case.src, case.src_slots, case.src_heads, case.dst, case.dst_slots, case.dst_heads)
    assert len(one_shot.nbytes) >= floor


# ------------------------------------------------------------------------------------
# Run counts: the planner reaches the minimum where the design promises it.
# ------------------------------------------------------------------------------------
def joint_runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> int:
    """Maximal runs of (src, dst) pairs that step by +1 on both sides, taken in source
    order (the order of runs is free, so pages 5, 4 -> 13, 12 are one run of two)."""
    if len(src_idx) == 0:
        return 0
    order = np.argsort(src_idx)
    s, d = src_idx[order], dst_idx[order]
    step = (np.diff(s) == 1) & (np.diff(d) == 1)
    return int(len(s) - step.sum())


def page_runs_case(rng: np.random.Generator, num_pages: int, n_pages: int, scatter: bool) -> np.ndarray:
    pages = np.arange(1, num_pages)
    pages = rng.permutation(pages)[:n_pages] if scatter else pages[:n_pages]
    if scatter and rng.random() < 0.5:  # sorted but gappy: some pages adjacent, some not
        pages = np.sort(pages)
    return pages


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from((1, 2, 16, 64)), layers=st.integers(1, 4),
       heads=st.integers(1, 4), v_dim=st.sampled_from((8, 4, 16)), n_pages=st.integers(1, 12),
       scatter=st.booleans())
def test_page_major_runs_are_one_per_page_run(seed: int, page_size: int, layers: int, heads: int, v_dim: int,
                                              n_pages: int, scatter: bool) -> None:
    """Every layer's K and V of a page sit back to back, also when K and V head dims
    differ, so a run of pages adjacent on both sides is one run."""
    rng = np.random.default_rng(seed)
    num_pages = 16
    lay = page_major_layout(layers=layers, heads=heads, head_dim=8, v_head_dim=v_dim, dtype="bfloat16",
                            num_pages=num_pages, page_size=page_size)
    sp = page_runs_case(rng, num_pages, n_pages, scatter)
    dp = page_runs_case(rng, num_pages, n_pages, scatter)
    slots = lambda pages: (pages[:, None] * page_size + np.arange(page_size)).ravel()  # noqa: E731
    plan = plan_transfer(lay, slots(sp), lay, slots(dp))
    want = joint_runs(sp, dp)
    assert plan.num_runs == want
    assert want == min_runs_reference(lay, slots(sp), HeadSlice(), lay, slots(dp), HeadSlice())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from((1, 4, 16)), layers=st.integers(1, 4),
       heads=st.integers(1, 4), v_dim=st.sampled_from((8, 16)), n=st.integers(1, 60),
       style=st.sampled_from(SLOT_STYLES))
def test_token_major_runs_are_one_per_layer_kv_and_slot_run(seed: int, page_size: int, layers: int, heads: int,
                                                            v_dim: int, n: int, style: str) -> None:
    rng = np.random.default_rng(seed)
    num_pages = -(-n // page_size) + 4
    lay = token_major_layout(layers=layers, heads=heads, head_dim=8, v_head_dim=v_dim, dtype="float16",
                             num_slots=num_pages * page_size, page_size=page_size)
    s = make_slots(rng, style, n, page_size, num_pages)
    d = make_slots(rng, style, n, page_size, num_pages)
    plan = plan_transfer(lay, s, lay, d)
    want = layers * 2 * joint_runs(s, d)
    assert plan.num_runs == want
    assert want == min_runs_reference(lay, s, HeadSlice(), lay, d, HeadSlice())
