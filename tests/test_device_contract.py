"""Device safety, proven without a GPU.

Pools and the executor are driven with ``device="meta"`` tensors: they have a shape and a
dtype but no data, and refuse ``.numpy()``, ``.item()``, ``.tolist()`` and ``bool()``. A hot
path that read a device value on the host (a range check, a mask count, ``np.asarray`` on
slots) raises here. A dispatch mode counts every host -> device copy, so "index tensors are
uploaded once per plan" is checked by counting, not by trusting a counter in the code.

The device execution path (``execute_plan_batched``) is also run on CPU tensors against the
tuned host path, byte for byte, for every layout.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvxfer.copy import copy_runs, execute_plan, execute_plan_batched, gather_runs, scatter_runs
from kvxfer.layout import host_layout
from kvxfer.plan import HeadSlice, plan_transfer
from kvxfer.pools import HybridSWAPool, KVPool, MHAPool, MLAPool, StatePool

PAGE = 4
META = torch.device("meta")


class HostToDevice(TorchDispatchMode):
    """Counts copies from a CPU tensor onto another device, and reads of device data."""

    def __init__(self):
        super().__init__()
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_to_copy") and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" \
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            self.uploads += 1
        if name.startswith("copy_") and args[0].device.type != "cpu" and args[1].device.type == "cpu":
            self.uploads += 1
        return func(*args, **kwargs)


def pools(device) -> dict[str, KVPool]:
    mha = {f"mha-{lay}": MHAPool(layers=[0, 3], heads=2, head_dim=8, v_head_dim=4, dtype="bfloat16", num_pages=10,
                                 page_size=PAGE, layout=lay, scale_block=4, device=device)
           for lay in MHAPool.LAYOUTS}
    return {**mha,
            "mla-page-major": MLAPool(layers=3, kv_lora_rank=8, rope_dim=4, dtype="bfloat16", num_pages=10,
                                      page_size=PAGE, layout="page_major", device=device),
            "state": StatePool(layers=[0, 2], conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                               temporal_head_shape=[2, 4], num_slots=12, device=device),
            "fp8": MHAPool(layers=2, heads=2, head_dim=8, dtype="fp8_e5m2", num_pages=10, page_size=PAGE,
                           device=device)}


def kv_on(pool: KVPool, layer: int, n: int, device) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    def t(kind):
        p = pool.layout.part(layer, kind)
        return torch.empty((n, p.heads, p.head_dim), dtype=torch.uint8 if p.dtype == "uint8" else
                           {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8_e5m2": torch.float8_e5m2}
                           [p.dtype], device=device)
    extra = {k: t(k) for k in ("k_scale", "v_scale") if pool.layout.has_part((layer, k))}
    return [t(k) for k in pool.kv_kinds], extra


# ------------------------------------------------------------------------------------
# Pools: writes with device slots never touch the host
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(pools("cpu")))
def test_pool_writes_and_reads_with_device_slots_stay_on_the_device(name: str) -> None:
    pool = pools(META)[name]
    layer = pool.layout.layers[-1]
    slots = torch.empty(6, dtype=torch.int64, device=META)        # the engine's out_cache_loc
    tensors, extra = kv_on(pool, layer, 6, META)
    with HostToDevice() as mode:
        for _ in range(3):                                        # three decode steps
            pool.set_kv_buffer(layer, slots, *tensors, **extra)
            got = pool.get_kv_buffer(layer, slots)
    assert mode.uploads == 0, "a write with device slots copied something from the host"
    assert all(g.device == META and g.shape == t.shape for g, t in zip(got, tensors))


@pytest.mark.parametrize("name", sorted(pools("cpu")))
def test_prefix_valid_write_with_device_input_has_no_mask_and_no_sync(name: str) -> None:
    pool = pools(META)[name]
    layer = pool.layout.layers[0]
    slots_2d = torch.empty((3, 4), dtype=torch.int64, device=META)
    lens = torch.empty(3, dtype=torch.int64, device=META)
    flat, extra = kv_on(pool, layer, 12, META)
    with HostToDevice() as mode:
        pool.set_kv_buffer_prefix_valid(layer, slots_2d, lens, *(t.reshape(3, 4, *t.shape[1:]) for t in flat),
                                        **{k: t.reshape(3, 4, *t.shape[1:]) for k, t in extra.items()})
    assert mode.uploads == 0


def test_hybrid_swa_maps_device_slots_on_the_device() -> None:
    pool = HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=4, dtype="bfloat16",
                         num_pages=16, swa_num_pages=6, page_size=PAGE, window=6, device=META)
    pool.map_swa(np.arange(4, 10), np.arange(4, 10))             # host bookkeeping, once per request
    slots = torch.empty(5, dtype=torch.int64, device=META)
    k = v = torch.empty((5, 2, 4), dtype=torch.bfloat16, device=META)
    with HostToDevice() as mode:
        for layer in range(4):
            pool.set_kv_buffer(layer, slots, k, v)
    assert mode.uploads == 0


def test_device_slots_on_a_cpu_pool_are_still_checked() -> None:
    """A CPU tensor of slots costs no sync to check: a CPU pool keeps refusing bad slots."""
    pool = pools("cpu")["mha-hnd"]
    k, v = torch.zeros(2, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="padding page"):
        pool.set_kv_buffer(0, torch.tensor([4, 1]), k, v)


# ------------------------------------------------------------------------------------
# The executor: device plans never read on the host, and upload their indices once
# ------------------------------------------------------------------------------------
def plan_between(src: KVPool, dst: KVPool, n: int, seed: int, heads: HeadSlice | None = None):
    rng = np.random.default_rng(seed)
    sp, dp = src.layout.spaces[0], dst.layout.spaces[0]
    s = rng.permutation(np.arange(sp.page_size, sp.num_slots))[:n]
    d = rng.permutation(np.arange(dp.page_size, dp.num_slots))[:n]
    return plan_transfer(src.layout, s, dst.layout, d)


@pytest.mark.parametrize("name", sorted(pools("cpu")))
def test_execute_plan_on_device_regions_uploads_indices_once_per_plan(name: str) -> None:
    src, dst = pools(META)[name], pools(META)[name]
    n = 4 if name == "state" else 30
    plan = plan_between(src, dst, n, 1)
    with HostToDevice() as first:
        execute_plan(plan, src.regions(), dst.regions())
    with HostToDevice() as again:
        for _ in range(5):                                        # every layer, every step: no upload
            execute_plan(plan, src.regions(), dst.regions())
    assert again.uploads == 0, f"{again.uploads} host -> device copies re-executing a cached plan"
    assert first.uploads > 0 or name == "mla-page-major"   # the mode sees uploads (page runs need none)
    assert first.uploads <= 2 * len(src.regions()) * len(dst.regions())   # at most one per region pair side


def test_host_to_device_plan_and_back_on_meta() -> None:
    """Offload-shaped plans: device pool <-> host layout, both executed with no host reads."""
    dev = pools(META)["mha-page_major"]
    host = KVPool(host_layout(dev.layout, "layer_first", 64), device=META)
    s = np.arange(8, 30)
    d2h = plan_transfer(dev.layout, s, host.layout, np.arange(4, 26))
    h2d = plan_transfer(host.layout, np.arange(4, 26), dev.layout, s[::-1].copy())
    execute_plan(d2h, dev.regions(), host.regions())
    with HostToDevice() as mode:
        execute_plan(d2h, dev.regions(), host.regions())
        execute_plan(h2d, host.regions(), dev.regions())
        execute_plan(h2d, host.regions(), dev.regions())
    assert mode.uploads <= 2 * len(host.regions()) * len(dev.regions())   # h2d's first run only


def test_gather_scatter_and_copy_runs_on_device_with_a_key_upload_once() -> None:
    src, dst = pools(META)["mha-hnd"], pools(META)["mha-hnd"]
    plan = plan_between(src, dst, 40, 2)
    runs = plan.runs()
    assert len(runs.nbytes) > 32
    staging = torch.empty(int(runs.nbytes.sum()), dtype=torch.uint8, device=META)
    for _ in range(2):
        with HostToDevice() as mode:
            gather_runs(src.regions(), runs.src_region, runs.src_offset, runs.nbytes, out=staging, key=plan)
            scatter_runs(dst.regions(), runs.dst_region, runs.dst_offset, runs.nbytes, staging, key=plan)
            copy_runs(src.regions(), dst.regions(), runs, key=plan)
    assert mode.uploads == 0


# ------------------------------------------------------------------------------------
# The device path, run on CPU tensors, equals the host path byte for byte
# ------------------------------------------------------------------------------------
def fill(pool: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("name", sorted(pools("cpu")))
@pytest.mark.parametrize("target", ["same", "host_layer_first", "host_page_first"])
def test_batched_execution_equals_the_host_path(name: str, target: str) -> None:
    src = pools("cpu")[name]
    fill(src, 1)
    dst_a = pools("cpu")[name] if target == "same" else KVPool(host_layout(src.layout, target[5:], 48))
    dst_b = pools("cpu")[name] if target == "same" else KVPool(host_layout(src.layout, target[5:], 48))
    fill(dst_a, 2)
    fill(dst_b, 2)
    plan = plan_between(src, dst_a, 4 if name == "state" else 30, 3)
    execute_plan(plan, src.regions(), dst_a.regions())
    execute_plan_batched(plan, src.regions(), dst_b.regions())
    execute_plan_batched(plan, src.regions(), dst_b.regions())   # cached: the same bytes again
    for a, b in zip(dst_a.buffers, dst_b.buffers):
        assert torch.equal(a, b)


def test_host_slots_are_uploaded_once_per_write_not_once_per_part() -> None:
    """K, V and their scales share one index upload per call (one per slot space)."""
    pool = pools(META)["mha-page_major"]
    tensors, extra = kv_on(pool, 3, 5, META)
    with HostToDevice() as mode:
        pool.set_kv_buffer(3, np.array([4, 5, 6, 9, 17]), *tensors, **extra)   # k, v, k_scale, v_scale
    assert mode.uploads == 1


def test_hybrid_swa_map_reaches_device_slots_however_it_is_changed() -> None:
    """Tensor slots map through the device mirror: map_swa, unmap_swa and load_swa_map keep it
    equal to the host map (on the CPU they are the same memory)."""
    for device in ("cpu", META):
        pool = HybridSWAPool(full_layers=[0], swa_layers=[1], heads=2, head_dim=4, dtype="bfloat16",
                             num_pages=16, swa_num_pages=6, page_size=PAGE, window=6, device=device)
        pool.map_swa(np.arange(4, 10), np.arange(8, 14))
        pool.unmap_swa(np.arange(4, 6))
        other = HybridSWAPool(full_layers=[0], swa_layers=[1], heads=2, head_dim=4, dtype="bfloat16",
                              num_pages=16, swa_num_pages=6, page_size=PAGE, window=6, device=device)
        other.load_swa_map(pool.full_to_swa)
        if device == "cpu":
            for p in (pool, other):
                assert np.array_equal(p.full_to_swa_device.numpy(), p.full_to_swa)
                assert p.space_slots("swa", torch.arange(4, 10)).tolist() == [0, 0, 10, 11, 12, 13]
        with pytest.raises(Exception, match="full_to_swa"):
            other.load_swa_map(np.full_like(pool.full_to_swa, 99))
