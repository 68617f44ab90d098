#!/usr/bin/env python
"""Throughput of the UCX transport between two processes on 127.0.0.1, next to its ceilings.

Cases, for each UCX_TLS asked for (``default``: the transport's default, shared memory here):
  run S        one contiguous run of S bytes per transfer, ``--inflight`` transfers in flight,
               offsets rotating over the pool so caches do not flatter anyone
  64K pages    one transfer of 1000 scattered 64 KiB pages of a 1 GiB pool -> scattered pages
  4K pages     one transfer of 16384 scattered 4 KiB pages (packed: gathered into one block,
               sent, scattered by the receiver)
Ceilings, measured in the same run and interleaved with the cases:
  perftest     raw ``ucx_perftest -t ucp_put_bw`` (the libucx wheel's) at the same size and TLS
  same pages   raw ``ucp_put_nbx`` through ctypes over the very runs of the case (same offsets,
               same pools, same receiver), all in flight, one flush, no protocol
               (bench_transport.UcxPutSamePages). Both are kept: perftest re-sends one
               cache-hot buffer, so it flatters UCX next to runs at random places of a 1 GiB
               pool; the same-pages put is what UCX itself does with the transport's bytes
  gather       one process, torch ``index_select`` of the same kind of pages
Each figure is the best of ``--rounds`` (other processes share this machine's 2 cores).

    .venv/bin/python scripts/bench_ucx.py [--quick] [--tls default --tls tcp] [--rounds 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transport_ceilings import die_with_parent  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE_CASES = (("1000 x 64K pages", 64 * KiB, 1000, False), ("16384 x 4K pages, packed", 4 * KiB, 16384, True))


def _plan(src_off, dst_off, nbytes, packed: bool):
    from kvxfer.plan import RunGroup, TransferPlan
    z = np.zeros(1, np.int64)
    n = np.broadcast_to(np.asarray(nbytes, np.int64), np.shape(src_off)).copy()
    return TransferPlan((RunGroup(z, z, z, z, np.asarray(src_off, np.int64), np.asarray(dst_off, np.int64),
                                  n, packed),))


def _receiver(tls: str | None, pool_bytes: int, conn) -> None:
    """Child process: register a pool, grant all of it, take arrivals until told to stop."""
    from kvxfer.grant import ByteRanges
    from kvxfer.transport.registry import get_transport
    t = get_transport("ucx", tls=tls)
    pool = torch.ones(pool_bytes, dtype=torch.uint8)  # touched: no page faults inside the timings
    t.register([pool])
    t.expect("bench", ByteRanges(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, pool_bytes)))
    conn.send(t.descriptor())
    bad = 0
    while not conn.poll(0):
        bad += sum(not a.ok for a in t.arrivals(0.05))
    conn.recv()
    conn.send(bad)
    t.close()


def _timed(t, peer: str, plans: list, inflight: int, timeout: float = 120.0) -> float:
    """Seconds to move every plan with at most ``inflight`` transfers outstanding."""
    start, live = time.perf_counter(), []
    for p in plans:
        if len(live) >= inflight:
            live.pop(0).result(timeout)
        live.append(t.submit(peer, "bench", p, timeout=timeout))
    for h in live:
        h.result(timeout)
    return time.perf_counter() - start


class Pair:
    """This process sends; a spawned child receives. Both hold a pool of ``pool_bytes``."""

    def __init__(self, tls: str | None, pool_bytes: int):
        from bench_transport import UcxPutSamePages

        from kvxfer.transport.registry import get_transport
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.child = ctx.Process(target=_receiver, args=(tls, pool_bytes, child_conn), daemon=True)
        self.child.start()
        self.t = get_transport("ucx", tls=tls)
        self.pool_bytes = pool_bytes
        pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8)
        self.t.register([pool])
        descriptor = self.conn.recv()
        self.peer = self.t.connect(descriptor)
        self.raw = UcxPutSamePages(pool, descriptor, tls)

    # Every timing follows an untimed pass over the same bytes: this VM pages out memory left
    # untouched for about a minute (DAMON), and a fault per 4 KiB would be measured, not UCX.
    def run(self, size: int, inflight: int) -> tuple[float, float]:
        """GB/s of (the transport, raw puts of the same runs)."""
        count = int(min(max(8, 256 * MiB // size), 2000))
        offs = (np.arange(count, dtype=np.int64) * size) % (self.pool_bytes - size + 1) // 4096 * 4096
        plans = [_plan([o], [o], size, False) for o in offs]
        _timed(self.t, self.peer, plans, inflight)
        kvx = count * size / _timed(self.t, self.peer, plans, inflight) / 1e9
        return kvx, self.raw({"so": offs, "do": offs, "n": np.full(count, size, np.int64)})

    def pages(self, page: int, npages: int, packed: bool, rng) -> tuple[float, float]:
        so, do = (np.stack([rng.choice(self.pool_bytes // page, npages, replace=False) * page for _ in range(3)])
                  for _ in range(2))
        plans = [_plan(s, d, page, packed) for s, d in zip(so, do)]
        _timed(self.t, self.peer, plans, 2)
        kvx = 3 * npages * page / _timed(self.t, self.peer, plans, 2) / 1e9
        return kvx, self.raw({"so": so.ravel(), "do": do.ravel(), "n": np.full(so.size, page, np.int64)})

    def close(self) -> None:
        self.conn.send("stop")
        bad = self.conn.recv() if self.conn.poll(30) else "?"
        self.raw.close()
        self.t.close()
        self.child.join(30)
        if bad:
            print(f"  WARNING: the receiver saw {bad} failed arrivals", file=sys.stderr)


def perftest(tls: str | None, size: int, port: int) -> float:
    """Raw UCX put bandwidth (GB/s) of the ucx_perftest shipped in the libucx wheel."""
    import libucx
    root = Path(libucx.__file__).parent
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"))
    if tls:
        env["UCX_TLS"] = tls
    exe = str(root / "bin" / "ucx_perftest")
    iters = int(min(max(100, GiB // size), 20000))
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=die_with_parent)
    try:
        time.sleep(0.5)
        res = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw", "-s", str(size), "-n",
                              str(iters)], env=env, capture_output=True, text=True, timeout=120)
    finally:
        try:
            server.wait(timeout=10)  # the server exits by itself after one client
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    m = re.search(r"Final:\s+(\S+\s+){5}(\S+)", res.stdout)  # bandwidth "overall", MB/s (2**20)
    return float(m.group(2)) * MiB / 1e9 if m else float("nan")


def gather(page: int, npages: int, pool: torch.Tensor, rng) -> float:
    """One process: torch index_select of ``npages`` random pages into one block (GB/s)."""
    rows = pool.view(-1, page)
    out = torch.ones(npages, page, dtype=torch.uint8)  # touched: no page faults inside the timing
    idx = torch.from_numpy(rng.choice(rows.shape[0], npages, replace=False))
    torch.index_select(rows, 0, idx, out=out)  # untimed pass: see Pair
    t0 = time.perf_counter()
    torch.index_select(rows, 0, idx, out=out)
    return npages * page / (time.perf_counter() - t0) / 1e9


def _h(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="no 256 MiB runs, two rounds")
    ap.add_argument("--tls", action="append", help="UCX_TLS to measure, repeatable; 'default' = the "
                    "transport's default (default: --tls default --tls tcp)")
    ap.add_argument("--rounds", type=int, help="best of this many (default 3, --quick 2)")
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=13337)
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    rng = np.random.default_rng(0)
    pool_bytes = int(args.pool_gib * GiB)
    sizes = [4 * KiB, 64 * KiB, MiB, 16 * MiB] + ([] if args.quick else [256 * MiB])
    local_pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8)
    for name in args.tls or ["default", "tcp"]:
        tls = None if name == "default" else name
        pair = Pair(tls, pool_bytes)
        best: dict[str, list[float]] = {}
        try:
            for _ in range(rounds):  # interleaved, so load from other processes hits both columns alike
                for size in sizes:
                    b = best.setdefault(f"run {_h(size)}", [0.0, 0.0, 0.0])
                    b[::2] = np.maximum(b[::2], pair.run(size, args.inflight)).tolist()
                    b[1] = max(b[1], perftest(tls, size, args.port))
                for label, page, npages, packed in PAGE_CASES:
                    b = best.setdefault(label, [0.0, 0.0, 0.0])
                    b[::2] = np.maximum(b[::2], pair.pages(page, npages, packed, rng)).tolist()
                    b[1] = max(b[1], gather(page, npages, local_pool, rng))
        finally:
            pair.close()
        one_mib = best["run 1 MiB"][0]
        print(f"UCX_TLS={name}  (best of {rounds}; GB/s = 1e9 bytes/s)")
        print(f"  {'case':26s} {'kvxfer':>7s} {'ceiling':>8s} {'ratio':>6s} {'same pages':>10s} {'ratio':>6s}"
              "  ceiling is")
        for label, (v, c, raw) in best.items():
            what = "ucx_perftest ucp_put_bw" if label.startswith("run") else "index_select gather, 1 process"
            print(f"  {label:26s} {v:7.3f} {c:8.3f} {v / c:6.2f} {raw:10.3f} {v / raw:6.2f}  {what}")
        v = best[PAGE_CASES[1][0]][0]
        print(f"  {'4K pages vs run 1 MiB':26s} {v:7.3f} {one_mib:8.3f} {v / one_mib:6.2f}  kvxfer run 1 MiB\n",
              flush=True)


if __name__ == "__main__":
    main()
