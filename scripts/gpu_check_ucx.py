"""The ``ucx/*`` checks of ``gpu_check.py``: two processes with GPU regions on both sides
(memory types, cuda_ipc, byte-exact runs, bandwidth), and a receiver killed mid-transfer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check_kit import Ctx, expect, timed  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402

# ------------------------------------------------------------------------------------
# ucx/*: two processes
# ------------------------------------------------------------------------------------
UCX_BYTES = 256 << 20


def _ucx_receiver(conn, device: str, nbytes: int) -> None:
    """Child: a UCX transport with one device region; checks what lands against the pattern."""
    from kvxfer.transport.registry import get_transport
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    t = get_transport("ucx")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    t.register([dst])
    conn.send(t.descriptor())
    while True:
        cmd, *a = conn.recv()
        if cmd == "expect":
            dst.zero_()
            t.expect(a[0], ByteRanges(*(np.asarray(x, np.int64) for x in a[1])))
            conn.send("ok")
        elif cmd == "check":   # (rid, dst offsets, src offsets, lengths): compare with the sender's pattern
            rid, d_off, s_off, lens = a
            got, t0 = [], time.monotonic()
            while not got and time.monotonic() - t0 < 60:
                got = [x for x in t.arrivals(0.05) if x.request_id == rid]
            src = _pattern(nbytes, device)
            ok = bool(got) and got[0].ok
            for d, s, n in zip(d_off, s_off, lens):
                ok = ok and torch.equal(dst[d: d + n], src[s: s + n])
            conn.send(ok)
        elif cmd == "close":
            t.close()
            conn.send("closed")
            return


def _pattern(nbytes: int, device) -> torch.Tensor:
    g = torch.Generator(device=torch.device(device)).manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def _ucx_plan(kind: str) -> tuple:
    rng = np.random.default_rng(5)
    if kind == "whole":
        s = d = np.zeros(1, np.int64)
        n = np.array([UCX_BYTES], np.int64)
    else:
        size = 65536 if kind == "pages" else 4096
        count = 2048 if kind == "pages" else 8192
        s = rng.permutation(UCX_BYTES // size)[:count].astype(np.int64) * size
        d = rng.permutation(UCX_BYTES // size)[:count].astype(np.int64) * size
        n = np.full(count, size, np.int64)
    from kvxfer.plan import RunGroup, TransferPlan
    z = np.zeros(1, np.int64)
    return TransferPlan((RunGroup(z, z, z, z, s, d, n, kind == "packed"),)), s, d, n


def _spawn_receiver(ctx: Ctx):
    mpc = mp.get_context("spawn")
    conn, child = mpc.Pipe()
    proc = mpc.Process(target=_ucx_receiver, args=(child, str(ctx.device), UCX_BYTES), daemon=True)
    proc.start()
    expect(conn.poll(120), "the UCX receiver process did not start")
    return proc, conn, conn.recv()


def check_ucx_gpu_gpu(ctx: Ctx) -> str:
    from kvxfer.cli.doctor import ucx_report
    from kvxfer.transport.registry import get_transport
    rep = ucx_report()
    tls = set(rep.get("transports", {}))
    proc, conn, desc = _spawn_receiver(ctx)
    tx = get_transport("ucx")
    src = _pattern(UCX_BYTES, ctx.device)
    tx.register([src])   # mapped with the device's memory type; refused if UCX made it another
    registered = tx.memory_types()
    expect(registered == ["cuda" if ctx.cuda else "host"], f"UCX registered the {ctx.device} region as {registered}")
    expect(tx.loop.callers == (not ctx.cuda), "a transport with a CUDA region must leave every turn to its I/O "
           "thread (no caller's turn: transports/ucx/loop.py)")
    out = [f"UCX transports {sorted(tls)}", f"cuda_ipc {'yes' if 'cuda_ipc' in tls else 'NO'}",
           f"registered as {registered[0]}"]
    try:
        peer = tx.connect(desc)
        for kind in ("whole", "pages", "packed"):
            plan, s, d, n = _ucx_plan(kind)
            conn.send(("expect", kind, (np.zeros(len(d), np.int64).tolist(), d.tolist(), n.tolist())))
            expect(conn.recv() == "ok", "expect failed")
            ctx.sync()
            t0 = time.perf_counter()
            h = tx.submit(peer, kind, plan, timeout=120)
            expect(h.wait(120), f"{kind}: transfer failed: {getattr(h, 'error', None)}")
            el = time.perf_counter() - t0
            conn.send(("check", kind, d.tolist(), s.tolist(), n.tolist()))
            expect(conn.recv(), f"{kind}: bytes differ at the receiver")
            flat = torch.empty(int(n.sum()), dtype=torch.uint8, device=ctx.device)
            t_copy = timed(ctx, lambda flat=flat, m=int(n.sum()): flat.copy_(src[:m]))
            out.append(f"{kind} {int(n.sum()) / el / 1e9:.1f} GB/s (device copy {int(n.sum()) / t_copy / 1e9:.0f})")
        expect(not ctx.cuda or "cuda_ipc" in tls or "cuda_copy" in tls, "UCX has no CUDA transport")
    finally:
        tx.close()
        conn.send(("close",))
        conn.poll(15)
        proc.join(15)
    return "; ".join(out)


def check_ucx_kill_receiver(ctx: Ctx) -> str:
    from kvxfer.transport.registry import get_transport
    proc, conn, desc = _spawn_receiver(ctx)
    tx = get_transport("ucx", peer_timeout=2.0)
    src = _pattern(UCX_BYTES, ctx.device)
    tx.register([src])
    try:
        peer = tx.connect(desc)
        plan, s, d, n = _ucx_plan("pages")
        conn.send(("expect", "k", (np.zeros(len(d), np.int64).tolist(), d.tolist(), n.tolist())))
        conn.recv()
        h = tx.submit(peer, "k", plan, timeout=30)
        time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        h.wait(30)
        x = torch.arange(1 << 20, device=ctx.device).float()
        y = float((x * 2).sum())
        ctx.sync()
        expect(y == float(x.sum()) * 2, "the sender's device gives wrong results after the kill")
    finally:
        tx.close()
    return f"transfer ended {h.poll().name} after the kill; sender's CUDA context works"
