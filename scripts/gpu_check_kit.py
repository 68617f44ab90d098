"""What the checks of ``gpu_check.py`` share: the run context and budget, running one check
(PASS / FAIL with its reason), and pools of every kind with scattered requests.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvxfer.pools import HybridSWAPool, KVPool, MHAPool, MLAPool, StatePool  # noqa: E402

BUDGET_S = 7.5 * 60
RESULTS: list[tuple[str, bool, str]] = []


# ------------------------------------------------------------------------------------
# Running checks
# ------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, device: str, only: str | None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.only = only
        self.deadline = time.monotonic() + BUDGET_S

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def run(ctx: Ctx, name: str, fn, *args) -> None:
    if ctx.only and ctx.only not in name:
        return
    if time.monotonic() > ctx.deadline:
        print(f"SKIP {name}: the {BUDGET_S:.0f} s budget is spent", flush=True)
        return
    t0 = time.perf_counter()
    try:
        msg = fn(ctx, *args) or ""
        ok = True
    except Exception as e:   # a check that raises fails with its reason; the others still run
        ok, msg = False, f"{type(e).__name__}: {e}"
        if os.environ.get("GPU_CHECK_TRACE"):
            traceback.print_exc()
    RESULTS.append((name, ok, msg))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {msg} ({time.perf_counter() - t0:.1f} s)", flush=True)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# ------------------------------------------------------------------------------------
# Pools and requests
# ------------------------------------------------------------------------------------
PAGE = 16


def pool_factories() -> dict:
    mha = dict(layers=4, heads=8, head_dim=128, num_pages=128, page_size=PAGE)
    out = {f"mha-{lay}": (lambda dev, lay=lay: MHAPool(**mha, dtype="bfloat16", layout=lay, device=dev))
           for lay in MHAPool.LAYOUTS}
    out["mha-page_major-fp8_e4m3-scales"] = lambda dev: MHAPool(**mha, dtype="fp8_e4m3", layout="page_major",
                                                                scale_block=32, device=dev)
    out["mha-hnd-fp8_e5m2"] = lambda dev: MHAPool(**mha, dtype="fp8_e5m2", layout="hnd", device=dev)
    out["mla"] = lambda dev: MLAPool(layers=4, kv_lora_rank=512, rope_dim=64, dtype="bfloat16", num_pages=128,
                                     page_size=PAGE, device=dev)
    out["mla-page_major"] = lambda dev: MLAPool(layers=4, kv_lora_rank=512, rope_dim=64, dtype="bfloat16",
                                                num_pages=128, page_size=PAGE, layout="page_major", device=dev)
    out["state"] = lambda dev: StatePool(layers=4, conv_blocks=[256, 64, 64], conv_width=4, temporal_heads=8,
                                         temporal_head_shape=[64, 16], num_slots=64, device=dev)
    for lay in ("token_major", "page_major"):
        out[f"hybrid_swa-{lay}"] = (lambda dev, lay=lay: HybridSWAPool(
            full_layers=[0, 2], swa_layers=[1, 3], heads=8, head_dim=128, dtype="bfloat16", num_pages=128,
            swa_num_pages=32, page_size=PAGE, window=64, layout=lay, device=dev))
    return out


def fill(pool: KVPool, seed: int) -> KVPool:
    for i, b in enumerate(pool.buffers):
        g = torch.Generator(device=b.device).manual_seed(seed * 1000 + i)
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, device=b.device, generator=g))
    return pool


def request(pool: KVPool, n: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Engine slots of an ``n``-token request (scattered pages) and the plan input per space."""
    rng = np.random.default_rng(seed)
    sp = pool.layout.spaces[0]
    if sp.name == "state":
        n = min(n, 8)
    pages = rng.permutation(np.arange(1, sp.num_pages))[: -(-n // sp.page_size)]
    slots = (pages[:, None] * sp.page_size + np.arange(sp.page_size)).ravel()[:n]
    if isinstance(pool, HybridSWAPool):
        w = min(pool.window, n)
        swa = pool.layout.space("swa")
        pool.map_swa(slots[n - w:], rng.permutation(np.arange(swa.page_size, swa.num_slots))[:w])
    by_space = {}
    for s in pool.layout.spaces:
        mapped = np.asarray(pool.space_slots(s.name, slots))
        by_space[s.name] = mapped[mapped != 0]
    return slots, by_space


def cpu_clone(pool: KVPool) -> list[torch.Tensor]:
    return [b.detach().cpu().clone() for b in pool.buffers]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def timed(ctx: Ctx, fn, repeat: int = 5) -> float:
    """Seconds per call of ``fn`` (device time when on CUDA)."""
    fn()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    ctx.sync()
    return (time.perf_counter() - t0) / repeat
