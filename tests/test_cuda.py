"""CUDA tests: what only a GPU can show. Skipped, saying so, where there is no CUDA device.

The same ground, wider and with numbers, is covered by ``scripts/gpu_check.py`` (run it on a
GPU machine and put its output in the issue note). The CPU-side contracts (meta-device pools
and executor, the late stand-in event for offload) are in test_device_contract.py and
test_offload.py. The last two tests here run everywhere: the script must skip cleanly
without CUDA, and its dry run must pass on CPU.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer.copy import execute_plan
from kvxfer.host import HostPool
from kvxfer.layout import host_layout
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.plan import plan_transfer
from kvxfer.pools import KVPool, MHAPool

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (this torch: "
                                       f"{torch.__version__}, CUDA build {torch.version.cuda}); "
                                       "on a GPU machine run these and scripts/gpu_check.py")
PAGE = 16
SLEEP = 300_000_000   # torch.cuda._sleep cycles: ~0.15-0.3 s


def mha(layout: str, device) -> MHAPool:
    return MHAPool(layers=2, heads=4, head_dim=64, dtype="bfloat16", num_pages=64, page_size=PAGE,
                   layout=layout, device=device)


def fill(pool: KVPool, seed: int) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g).to(b.device))
    return pool


def slots(n: int, seed: int) -> np.ndarray:
    pages = np.random.default_rng(seed).permutation(np.arange(1, 64))[: -(-n // PAGE)]
    return (pages[:, None] * PAGE + np.arange(PAGE)).ravel()[:n]


def late_write(targets, finals) -> torch.cuda.Event:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        for t, f in zip(targets, finals):
            t.copy_(f)
        return side.record_event()


@needs_cuda
@pytest.mark.parametrize("layout", MHAPool.LAYOUTS)
@pytest.mark.parametrize("path", ["gpu->gpu", "gpu->pinned", "pinned->gpu"])
def test_executor_is_byte_exact_on_the_gpu(layout: str, path: str) -> None:
    dev = fill(mha(layout, "cuda"), 1)
    s = slots(300, 2)
    if path == "gpu->gpu":
        src, dst, s_in, d_in = dev, fill(mha(layout, "cuda"), 3), s, slots(300, 4)
    else:
        host = fill(HostPool(host_layout(dev.layout, "layer_first", 512), device_layout=dev.layout), 5)
        h = PAGE + np.arange(300)
        src, dst, s_in, d_in = (dev, host, s, h) if path == "gpu->pinned" else (host, dev, h, s)
        assert all(b.is_pinned() for b in host.buffers)
    plan = plan_transfer(src.layout, s_in, dst.layout, d_in)
    want = [b.cpu().clone() for b in dst.buffers]
    execute_plan(plan, [b.cpu() for b in src.buffers], want)
    execute_plan(plan, src.regions(), dst.regions())
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst.buffers, want))


@needs_cuda
def test_set_kv_buffer_is_captured_in_a_cuda_graph() -> None:
    pool, ref = fill(mha("page_major", "cuda"), 1), fill(mha("page_major", "cpu"), 1)
    s = slots(40, 2)
    d_slots = torch.from_numpy(s).cuda()
    k = torch.zeros(40, 4, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pool.set_kv_buffer(1, d_slots, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(1, d_slots, k, v)
    new_k, new_v = torch.randn(40, 4, 64).bfloat16(), torch.randn(40, 4, 64).bfloat16()
    k.copy_(new_k)
    v.copy_(new_v)
    graph.replay()
    ref.set_kv_buffer(1, s, new_k, new_v)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(pool.buffers, ref.buffers))


@needs_cuda
def test_offload_waits_for_the_ready_event_of_a_late_stream() -> None:
    pool, final = fill(mha("token_major", "cuda"), 1), fill(mha("token_major", "cuda"), 9)
    s = slots(64, 2)
    want = [final.get_part(0, k, s).cpu().view(torch.uint8) for k in "kv"]
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=256), OffloadConfig(stride=64)) as mgr:
        torch.cuda.synchronize()
        ready = late_write(pool.buffers, final.buffers)
        mgr.release("r", np.arange(64), s, ready=ready)
        deadline = time.monotonic() + 30
        while "r" not in mgr.poll().released:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        new = slots(64, 7)
        mgr.reload("r", new)
        torch.cuda.synchronize()
        got = [pool.get_part(0, k, new).cpu().view(torch.uint8) for k in "kv"]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_cuda
def test_a_blocking_reload_does_not_wait_for_queued_offloads() -> None:
    pool = fill(mha("token_major", "cuda"), 1)
    with DecodeOffloadManager(pool, HostPool.for_pool(pool, size=512), OffloadConfig(stride=64)) as mgr:
        a = slots(64, 2)
        mgr.release("a", np.arange(64), a)
        while "a" not in mgr.poll().released:
            time.sleep(0.01)
        b = np.setdiff1d(slots(128, 3), a)[:64]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP * 10)          # an offload whose KV is not ready for ~2 s
            late = side.record_event()
        mgr.release("b", np.arange(100, 164), b, ready=late)
        t0 = time.perf_counter()
        mgr.reload("a", np.setdiff1d(slots(256, 4), np.concatenate([a, b]))[:64])
        took = time.perf_counter() - t0
        assert not late.query(), "the test needs the offload still pending during the reload"
        assert took < 0.5, f"reload took {took:.2f} s: it waited for the queued offload"
        mgr.drain(30)


@pytest.mark.slow   # a subprocess
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the script runs for real (see scripts/gpu_check.py)")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SKIPPED: no CUDA device")


@pytest.mark.slow   # seconds
def test_gpu_check_dry_run_on_cpu_passes() -> None:
    """The script's own smoke test: its checks that need no GPU run on host memory."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "mha-hnd"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS executor/mha-hnd/gpu->gpu" in out.stdout and "FAIL" not in out.stdout
