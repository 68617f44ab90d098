"""The ``offload/*`` checks of ``gpu_check.py``: offload and reload of a request against plain pinned
copies of the same bytes, and a batch of requests taken back with one ``reload_many``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check_kit import PAGE, Ctx, expect, fill, request, timed  # noqa: E402

from kvxfer.host import HostPool  # noqa: E402
from kvxfer.pools import MHAPool  # noqa: E402


# ------------------------------------------------------------------------------------
# offload/vs-pinned
# ------------------------------------------------------------------------------------
def check_offload_vs_pinned(ctx: Ctx) -> str:
    from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
    tokens, stride = 8192, 1024
    pool = fill(MHAPool(layers=32, heads=8, head_dim=128, dtype="bfloat16", num_pages=tokens // PAGE + 64,
                        page_size=PAGE, layout="page_major", device=ctx.device), 1)
    host = HostPool.for_pool(pool, size=tokens + stride)
    slots, _ = request(pool, tokens, 2)
    toks = np.arange(tokens)
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=stride)) as mgr:
        ctx.sync()
        t0 = time.perf_counter()
        mgr.release("r", toks, slots)
        while "r" not in mgr.poll().released:
            time.sleep(0.001)
        t_off = time.perf_counter() - t0
        nbytes = mgr.stats.bytes_offloaded
        new, _ = request(pool, tokens, 3)
        want = pool.get_kv_buffer(5, slots)[0].cpu()
        t0 = time.perf_counter()
        mgr.reload("r", new)
        ctx.sync()
        t_re = time.perf_counter() - t0
        expect(torch.equal(pool.get_kv_buffer(5, new)[0].cpu().view(torch.uint8), want.view(torch.uint8)),
               "reload differs")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    d2h = timed(ctx, lambda: pinned.copy_(pool.buffers[0][:nbytes], non_blocking=True), repeat=3)
    h2d = timed(ctx, lambda: pool.buffers[0][:nbytes].copy_(pinned, non_blocking=True), repeat=3)
    gb = nbytes / 1e9
    return (f"{nbytes / 2**20:.0f} MiB: offload {gb / t_off:.1f} GB/s vs pinned copy {gb / d2h:.1f} "
            f"({d2h / t_off:.2f}x); reload {gb / t_re:.1f} GB/s vs {gb / h2d:.1f} ({h2d / t_re:.2f}x)")


def check_offload_batch(ctx: Ctx) -> str:
    """Four requests offloaded together, then taken back with one ``reload_many`` into new slots
    (one plan, one copy on the reload stream): every layer's K and V byte-exact per request."""
    from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
    tokens, stride, n = 1024, 256, 4
    pool = fill(MHAPool(layers=8, heads=8, head_dim=128, dtype="bfloat16", num_pages=n * tokens * 2 // PAGE + 8,
                        page_size=PAGE, layout="page_major", device=ctx.device), 4)
    host = HostPool.for_pool(pool, size=n * tokens)
    pages = np.random.default_rng(9).permutation(np.arange(1, pool.layout.spaces[0].num_pages))
    cut = [(pages[i * tokens // PAGE:(i + 1) * tokens // PAGE, None] * PAGE + np.arange(PAGE)).ravel()
           for i in range(2 * n)]
    old, new = {f"r{i}": cut[i] for i in range(n)}, {f"r{i}": cut[n + i] for i in range(n)}

    def kv(slots):
        return [t.cpu().view(torch.uint8) for layer in range(8) for t in pool.get_kv_buffer(layer, slots)]

    want = {rid: kv(slots) for rid, slots in old.items()}
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=stride)) as mgr:
        ctx.sync()
        for i, (rid, slots) in enumerate(old.items()):
            mgr.release(rid, np.arange(tokens) + 100_000 * i, slots)
        left = set(old)
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            left -= set(mgr.poll().released)
            time.sleep(0.001)
        expect(not left, f"offload of {sorted(left)} did not finish in 30 s")
        nbytes = mgr.stats.bytes_offloaded
        t0 = time.perf_counter()
        mgr.reload_many(new)
        ctx.sync()
        t_re = time.perf_counter() - t0
    for rid, slots in new.items():
        got = kv(slots)
        expect(all(torch.equal(a, b) for a, b in zip(got, want[rid])), f"reload_many: {rid} differs")
    return f"{n} requests, {nbytes / 2**20:.0f} MiB: reload_many {nbytes / 1e9 / t_re:.1f} GB/s, byte-exact"
