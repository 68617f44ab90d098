#!/usr/bin/env python3
"""Where packing pays: moving N scattered runs one by one vs gathered into one block.

For each run size (256 B ... 256 KiB) it moves the same total bytes between two large
byte buffers at random, non-overlapping offsets, in three ways:

  one-by-one   ``dst[o:o+n].copy_(src[o:o+n])`` per run (what an unpacked run costs)
  packed       ``gather_runs`` into one staging block + ``scatter_runs`` out of it
               (what a packed group costs: sender gathers, receiver scatters)
  copy_runs    the local executor (index copy below BIG_RUN, per run above), for reference

and prints the crossover: the smallest run size from which one-by-one is at least as fast
as packed for every larger size. ``kvxfer.plan.PACK_BELOW`` should sit near it.

    .venv/bin/python scripts/bench_pack.py [--total-mib 16] [--reps 7] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvxfer.copy import copy_runs, gather_runs, scatter_runs
from kvxfer.plan import BIG_RUN, PACK_BELOW, Runs

SIZES = [256 << i for i in range(11)]  # 256 B .. 256 KiB


def best_of(fns: dict, reps: int, sync) -> dict[str, float]:
    """Fastest of ``reps`` timed calls per function (seconds), after one warm-up each.
    The functions take turns within each rep, so a burst of load from other processes
    on a shared machine hits all of them alike; the minimum is the least disturbed."""
    best = {}
    for name, fn in fns.items():
        fn()
        sync()
        best[name] = float("inf")
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def scattered_offsets(rng: np.random.Generator, size: int, n: int, capacity: int) -> np.ndarray:
    """``n`` distinct run-aligned offsets spread over a buffer of ``capacity`` bytes."""
    return np.sort(rng.choice(capacity // size, n, replace=False)).astype(np.int64)[rng.permutation(n)] * size


def fmt(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=16, help="bytes moved per run size")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    total = args.total_mib << 20
    capacity = 4 * total                      # runs occupy a quarter of the buffer: scattered
    src = torch.randint(0, 256, (capacity,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(capacity, dtype=torch.uint8, device=dev)
    rng = np.random.default_rng(0)
    print(f"{args.total_mib} MiB per size, {dev}, {torch.get_num_threads()} torch threads, best of {args.reps}")
    print(f"{'run size':>9s} {'runs':>7s} {'one-by-one':>12s} {'packed':>12s} {'copy_runs':>12s}  faster")
    results = []
    for size in SIZES:
        n = total // size
        so, do = scattered_offsets(rng, size, n, capacity), scattered_offsets(rng, size, n, capacity)
        nb = np.full(n, size, np.int64)
        reg = np.zeros(n, np.int64)
        pairs = list(zip(so.tolist(), do.tolist()))

        def one_by_one(pairs: list[tuple[int, int]] = pairs, size: int = size) -> None:
            for s, d in pairs:
                dst[d: d + size].copy_(src[s: s + size])

        def packed(reg: np.ndarray = reg, so: np.ndarray = so, do: np.ndarray = do, nb: np.ndarray = nb) -> None:
            block = gather_runs([src], reg, so, nb)
            scatter_runs([dst], reg, do, nb, block)

        runs = Runs(reg, so, reg, do, nb, np.zeros(n, bool))
        t = best_of({"one": one_by_one, "packed": packed, "copy_runs": lambda runs=runs: copy_runs([src], [dst], runs)},
                    args.reps, sync)
        t1, t2, t3 = t["one"], t["packed"], t["copy_runs"]
        # correctness of the packed path, so the timing is of a real move
        dst.zero_()
        packed()
        i = int(rng.integers(n))
        assert torch.equal(dst[do[i]: do[i] + size], src[so[i]: so[i] + size])
        results.append((size, t1, t2))
        gbps = lambda t: f"{total / t / 1e9:7.2f} GB/s"  # noqa: E731
        print(f"{fmt(size):>9s} {n:7d} {gbps(t1):>12s} {gbps(t2):>12s} {gbps(t3):>12s}  "
              f"{'packed' if t2 < t1 else 'one-by-one'} x{max(t1, t2) / min(t1, t2):.1f}")
    crossover = next((size for k, (size, _, _) in enumerate(results)
                      if all(t1 <= t2 for _, t1, t2 in results[k:])), None)
    print(f"crossover: one-by-one wins from {fmt(crossover) if crossover else 'never (up to 256 KiB)'}; "
          f"kvxfer.plan.PACK_BELOW = {fmt(PACK_BELOW)}, BIG_RUN = {fmt(BIG_RUN)}")


if __name__ == "__main__":
    main()
