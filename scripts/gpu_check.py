#!/usr/bin/env python
"""One GPU check for kvxfer: prints PASS / FAIL per check, with its numbers.

    python scripts/gpu_check.py                 every check on cuda:0 (under 8 minutes, one GPU)
    python scripts/gpu_check.py --only race     the checks whose name contains "race"
    python scripts/gpu_check.py --device cpu    a dry run of the checks that need no GPU (the
                                                script's own smoke test; host memory unpinned)

Without CUDA (and without ``--device cpu``) it prints that it skipped and exits 0. Exit
status 1 when any check failed.

Checks (each byte comparison is against the host executor applied to CPU copies of the
same buffers, so the reference never runs on the GPU):

executor/<pool>/<path>  every pool layout, plan GPU->GPU, GPU->pinned (layer-first and
                        page-first host layouts) and pinned->GPU: byte-exact; GPU->GPU
                        bandwidth against one device copy of the same bytes.
executor/device-threshold  one copy per run vs one gather + scatter, by run size: the
                        measured crossover for ``kvxfer.copy_device.DEVICE_COPY_ONE_BY_ONE``.
pools/<pool>            set_kv_buffer / get_kv_buffer / prefix-valid writes with device slot
                        tensors, byte-exact against a CPU pool; set_kv_buffer captured in a
                        CUDA graph and replayed with new data.
race/<what>             a side stream sleeps (torch.cuda._sleep) then writes the final pattern
                        and records an event; the executor, the offload manager
                        (``step(ready=)``) and each transport (``submit(ready=)``) must deliver
                        the final pattern. A control run without waiting shows the race is real.
zmq/device-arrival      an arrival into GPU memory is reported only once its bytes are there
                        (read on an unrelated stream right at the arrival).
ucx/gpu-gpu             two processes, GPU regions on both sides: memory types and cuda_ipc as
                        UCX reports them, byte-exact for whole, page and packed runs, bandwidth
                        against a device copy of the same bytes.
ucx/kill-receiver       the receiver is killed mid-transfer; the sender's CUDA context still works.
offload/vs-pinned       offload and reload of a request against plain pinned copies of the same
                        bytes (GB/s and ratio).
offload/batch           four requests offloaded, then back with one reload_many into new slots:
                        every layer byte-exact per request.

Who runs it: a person with a GPU machine, after a change to pools, the executor, offload or a
transport; its output goes in the issue note.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check_kit import (  # noqa: E402
    RESULTS,
    Ctx,
    cpu_clone,
    expect,
    fill,
    pool_factories,
    request,
    run,
    same,
    timed,
)
from gpu_check_offload import check_offload_batch, check_offload_vs_pinned  # noqa: E402
from gpu_check_ucx import check_ucx_gpu_gpu, check_ucx_kill_receiver  # noqa: E402

from kvxfer.copy import execute_plan  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.host import HostPool  # noqa: E402
from kvxfer.layout import host_layout  # noqa: E402
from kvxfer.plan import plan_transfer  # noqa: E402
from kvxfer.pools import KVPool, torch_dtype  # noqa: E402

SLEEP_CYCLES = 300_000_000          # torch.cuda._sleep: ~0.15-0.3 s on current GPUs


# ------------------------------------------------------------------------------------
# executor/<pool>/<path> and pools/<pool>
# ------------------------------------------------------------------------------------
def check_executor(ctx: Ctx, name: str, make, path: str) -> str:
    dev_pool = fill(make(ctx.device), 1)
    n = 1000
    slots, src_in = request(dev_pool, n, 2)
    if path == "gpu->gpu":
        other = fill(make(ctx.device), 3)
        _, dst_in = request(other, n, 4)
        src, dst = dev_pool, other
    else:
        style = "page_first" if path.endswith("page_first") else "layer_first"
        sizes = {s.name: (len(v) // s.page_size + 2) * s.page_size for s, v in
                 ((dev_pool.layout.space(k), v) for k, v in src_in.items())}
        host = fill(HostPool(host_layout(dev_pool.layout, style, sizes), device_layout=dev_pool.layout), 5)
        host_in = {k: dev_pool.layout.space(k).page_size + np.arange(len(v)) for k, v in src_in.items()}
        if path.startswith("gpu->"):
            src, dst, dst_in = dev_pool, host, host_in
        else:
            src, dst, dst_in, src_in = host, dev_pool, src_in, host_in
    plan = plan_transfer(src.layout, src_in, dst.layout, dst_in)
    want_src, want = cpu_clone(src), cpu_clone(dst)
    execute_plan(plan, want_src, want)                       # the host executor on CPU copies: the reference
    execute_plan(plan, src.regions(), dst.regions())
    ctx.sync()
    expect(same(dst.buffers, want), f"{name} {path}: destination bytes differ from the host executor")
    expect(same(src.buffers, want_src), f"{name} {path}: the source changed")
    msg = f"{plan.nbytes / 2**20:.1f} MiB in {plan.num_runs} runs byte-exact"
    if path == "gpu->gpu" and ctx.cuda:
        t = timed(ctx, lambda: execute_plan(plan, src.regions(), dst.regions()))
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=ctx.device)
        t_copy = timed(ctx, lambda: flat.copy_(src.buffers[0][: plan.nbytes]))
        msg += f", {plan.nbytes / t / 1e9:.1f} GB/s vs one device copy {plan.nbytes / t_copy / 1e9:.1f} GB/s"
    return msg


def _raw_parts(pool: KVPool, layer: int, kinds, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random bytes as typed ``[n, heads, head_dim]`` tensors for parts ``kinds`` of ``layer`` (CPU)."""
    out = {}
    for kind in kinds:
        p = pool.layout.part(layer, kind)
        raw = torch.randint(0, 256, (n, p.heads, p.head_bytes), dtype=torch.uint8, generator=g)
        out[kind] = raw.view(torch_dtype(p.dtype))
    return out


def check_pool_writes(ctx: Ctx, name: str, make) -> str:
    pool, ref = fill(make(ctx.device), 1), make("cpu")
    for r, b in zip(ref.buffers, pool.buffers):   # the reference starts from the same bytes
        r.copy_(b.cpu())
    n = 37
    slots, _ = request(pool, n, 2)
    request(ref, n, 2)
    g = torch.Generator().manual_seed(3)
    layer = pool.layout.layers[-1]
    extra_kinds = tuple(k for k in ("k_scale", "v_scale") if pool.layout.has_part((layer, k)))
    data = _raw_parts(pool, layer, pool.kv_kinds + extra_kinds, len(slots), g)
    kv = [data[k] for k in pool.kv_kinds]
    extra = {k: data[k] for k in extra_kinds}
    d_slots = torch.from_numpy(slots).to(ctx.device)
    pool.set_kv_buffer(layer, d_slots, *(t.to(ctx.device) for t in kv),
                       **{k: v.to(ctx.device) for k, v in extra.items()})
    ref.set_kv_buffer(layer, slots, *kv, **extra)
    ctx.sync()
    expect(same(pool.buffers, ref.buffers), "set_kv_buffer with device slots differs from the CPU pool")
    for a, b in zip(pool.get_kv_buffer(layer, d_slots), ref.get_kv_buffer(layer, slots)):
        expect(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), "get_kv_buffer differs")
    msg = "device-slot writes byte-exact"
    if ctx.cuda:   # capture the write in a CUDA graph, replay with new data in the static inputs
        static = [t.to(ctx.device).clone() for t in kv]
        static_x = {k: v.to(ctx.device).clone() for k, v in extra.items()}
        side = torch.cuda.Stream(ctx.device)
        side.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(side):   # warm-up outside capture, as torch requires
            pool.set_kv_buffer(layer, d_slots, *static, **static_x)
        torch.cuda.current_stream(ctx.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pool.set_kv_buffer(layer, d_slots, *static, **static_x)
        new = _raw_parts(pool, layer, pool.kv_kinds + extra_kinds, len(slots), g)
        for s, k in zip(static, pool.kv_kinds):
            s.copy_(new[k])
        for k, s in static_x.items():
            s.copy_(new[k])
        graph.replay()
        ref.set_kv_buffer(layer, slots, *(new[k] for k in pool.kv_kinds), **{k: new[k] for k in extra_kinds})
        ctx.sync()
        expect(same(pool.buffers, ref.buffers), "the CUDA-graph replay of set_kv_buffer differs from the CPU pool")
        msg += ", captured in a CUDA graph and replayed byte-exact"
    return msg


def check_device_threshold(ctx: Ctx) -> str:
    """Runs of one size scattered over 256 MiB: one copy per run vs rows of one gather +
    scatter, at 64 KiB .. 4 MiB per run; the crossover is copy_device.DEVICE_COPY_ONE_BY_ONE."""
    import kvxfer.copy_device as copy_module
    from kvxfer.plan import RunGroup, TransferPlan
    total = 256 << 20
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=ctx.device)
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(1)
    z = np.zeros(1, np.int64)
    rows, crossover = [], None
    saved = copy_module.DEVICE_COPY_ONE_BY_ONE
    try:
        for size in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
            count = total // size // 2
            s = rng.permutation(total // size)[:count].astype(np.int64) * size
            d = rng.permutation(total // size)[:count].astype(np.int64) * size
            times = {}
            for how, limit in (("one-by-one", size), ("gathered", size + 1)):
                copy_module.DEVICE_COPY_ONE_BY_ONE = limit
                plan = TransferPlan((RunGroup(z, z, z, z, s, d, np.full(count, size, np.int64), False),))
                times[how] = timed(ctx, lambda plan=plan: copy_module.execute_plan_batched(plan, [src], [dst]), 3)
            rows.append(f"{size >> 10} KiB: one-by-one {count * size / times['one-by-one'] / 1e9:.0f} GB/s, "
                        f"gathered {count * size / times['gathered'] / 1e9:.0f} GB/s")
            if crossover is None and times["one-by-one"] < times["gathered"]:
                crossover = size
    finally:
        copy_module.DEVICE_COPY_ONE_BY_ONE = saved
    return "; ".join(rows) + f"; one-by-one wins from {crossover} bytes (constant: {saved})"


# ------------------------------------------------------------------------------------
# race/*: a side stream writes the final KV late; readers must wait for its event
# ------------------------------------------------------------------------------------
def late_write(ctx: Ctx, targets: list[torch.Tensor], finals: list[torch.Tensor]):
    """Enqueue on a side stream: sleep, then ``targets[i].copy_(finals[i])``; returns the event
    recorded after the writes (the "KV is written" event of an engine's forward)."""
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t, f in zip(targets, finals):
            t.copy_(f)
        return side.record_event()


def check_race_executor(ctx: Ctx) -> str:
    make = pool_factories()["mha-page_major"]
    results = {}
    for wait in (False, True):   # the control (no wait) must show stale bytes: the race is real
        src, dst = fill(make(ctx.device), 1), fill(make(ctx.device), 2)
        final = fill(make(ctx.device), 9)
        _, s_in = request(src, 500, 3)
        _, d_in = request(dst, 500, 4)
        plan = plan_transfer(src.layout, s_in, dst.layout, d_in)
        want = cpu_clone(dst)
        execute_plan(plan, cpu_clone(final), want)
        ctx.sync()
        event = late_write(ctx, src.buffers, final.buffers)
        if wait:
            torch.cuda.current_stream(ctx.device).wait_event(event)
        execute_plan(plan, src.regions(), dst.regions())
        ctx.sync()
        results[wait] = same(dst.buffers, want)
    expect(results[True], "the executor read the source before the event completed")
    return f"final pattern delivered after the event; control without waiting saw stale bytes: {not results[False]}"


def check_race_offload(ctx: Ctx) -> str:
    from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
    make = pool_factories()["mha-token_major"]
    pool = fill(make(ctx.device), 1)
    final = fill(make(ctx.device), 9)
    host = HostPool.for_pool(pool, size=2048)
    slots, _ = request(pool, 256, 2)
    toks = np.arange(256)
    want = {(layer, k): final.get_part(layer, k, slots).cpu().view(torch.uint8)
            for layer in pool.layout.layers for k in pool.kv_kinds}
    with DecodeOffloadManager(pool, host, OffloadConfig(stride=256)) as mgr:
        ctx.sync()
        ready = late_write(ctx, pool.buffers, final.buffers)   # the current stream does not wait
        mgr.release("r", toks, slots, ready=ready)
        t0 = time.monotonic()
        while "r" not in mgr.poll().released:
            expect(time.monotonic() - t0 < 30, "offload did not finish in 30 s")
            time.sleep(0.01)
        new, _ = request(pool, 256, 5)
        mgr.reload("r", new)
        ctx.sync()
        for (layer, k), w in want.items():
            expect(torch.equal(pool.get_part(layer, k, new).cpu().view(torch.uint8), w),
                   f"layer {layer} {k}: offload read the KV before the ready event")
    return "offload waited for the ready event; reload byte-exact with the final pattern"


def _ready_kw(transport) -> bool:
    return "ready" in inspect.signature(transport.submit).parameters


def check_race_transport(ctx: Ctx, name: str) -> str:
    from kvxfer.transport.registry import get_transport
    make = pool_factories()["mha-hnd"]
    src, dst = fill(make(ctx.device), 1), fill(make(ctx.device), 2)
    final = fill(make(ctx.device), 9)
    _, s_in = request(src, 700, 3)
    _, d_in = request(dst, 700, 4)
    plan = plan_transfer(src.layout, s_in, dst.layout, d_in)
    want_src = [f.cpu() for f in final.buffers]
    want = cpu_clone(dst)
    execute_plan(plan, want_src, want)
    rx, tx = get_transport(name), get_transport(name)
    try:
        rx.register(dst.regions())
        tx.register(src.regions())
        peer = tx.connect(rx.descriptor())
        runs = plan.runs()
        rx.expect("r", ByteRanges(runs.dst_region, runs.dst_offset, runs.nbytes))
        ctx.sync()
        if not _ready_kw(tx):
            raise AssertionError(f"{name}: submit() takes no ready= event (the readiness contract is missing)")
        ready = late_write(ctx, src.buffers, final.buffers)
        handle = tx.submit(peer, "r", plan, timeout=60, ready=ready)
        expect(handle.wait(60), f"{name}: transfer did not complete")
        arrivals = []
        t0 = time.monotonic()
        while not arrivals and time.monotonic() - t0 < 30:
            arrivals = [a for a in rx.arrivals(0.1) if a.request_id == "r"]
        expect(bool(arrivals) and arrivals[0].ok, f"{name}: no ok arrival")
        ctx.sync()
        expect(same(dst.buffers, want), f"{name}: the destination does not hold the final pattern")
    finally:
        tx.close()
        rx.close()
    return f"{plan.nbytes / 2**20:.1f} MiB: the final pattern arrived"


# ------------------------------------------------------------------------------------
# zmq/device-arrival
# ------------------------------------------------------------------------------------
def check_zmq_device_arrival(ctx: Ctx) -> str:
    from kvxfer.transport.registry import get_transport
    src = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros(256 << 20, dtype=torch.uint8, device=ctx.device)
    n = 4096
    rng = np.random.default_rng(2)
    z = np.zeros(n, np.int64)
    offs = rng.permutation((256 << 20) // 65536)[:n].astype(np.int64) * 65536
    from kvxfer.plan import RunGroup, TransferPlan
    lens = np.full(n, 4096, np.int64)
    plan = TransferPlan((RunGroup(z[:1], z[:1], z[:1], z[:1], offs, offs[::-1].copy(), lens, True),))
    rx, tx = get_transport("zmq"), get_transport("zmq")
    try:
        rx.register([dst])
        tx.register([src])
        peer = tx.connect(rx.descriptor())
        runs = plan.runs()
        rx.expect("r", ByteRanges(runs.dst_region, runs.dst_offset, runs.nbytes))
        tx.submit(peer, "r", plan, timeout=60)
        arrivals = []
        t0 = time.monotonic()
        while not arrivals and time.monotonic() - t0 < 60:
            arrivals = [a for a in rx.arrivals(0.01) if a.request_id == "r"]
        expect(bool(arrivals) and arrivals[0].ok, "no ok arrival")
        other = torch.cuda.Stream(ctx.device) if ctx.cuda else None   # unrelated to the I/O thread's stream
        idx = torch.from_numpy(runs.dst_offset[:, None] + np.arange(4096)).to(ctx.device)
        if other is not None:
            with torch.cuda.stream(other):
                got = dst[idx].cpu()
        else:
            got = dst[idx].cpu()
        want = src[torch.from_numpy(runs.src_offset[:, None] + np.arange(4096))]
        expect(torch.equal(got, want), "the arrival was reported before its bytes were in device memory")
    finally:
        tx.close()
        rx.close()
    return f"{n} packed runs of 4 KiB: bytes in device memory at the arrival"


# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda:N (default cuda:0), or cpu for a dry run")
    ap.add_argument("--only", default=None, help="run the checks whose name contains this")
    args = ap.parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print(f"SKIPPED: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              f"nothing was checked. Run on a GPU machine, or --device cpu for a dry run.")
        return 0
    ctx = Ctx(args.device or "cuda:0", args.only)
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
        p = torch.cuda.get_device_properties(ctx.device)
        print(f"# {p.name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    t_start = time.monotonic()
    pools = pool_factories()
    for name, make in pools.items():
        for path in ("gpu->gpu", "gpu->pinned/layer_first", "gpu->pinned/page_first", "pinned->gpu"):
            run(ctx, f"executor/{name}/{path}", check_executor, name, make, path)
        run(ctx, f"pools/{name}", check_pool_writes, name, make)
    if ctx.cuda:
        run(ctx, "executor/device-threshold", check_device_threshold)
        run(ctx, "race/executor", check_race_executor)
        run(ctx, "race/offload", check_race_offload)
        for tname in ("local", "zmq", "ucx"):
            run(ctx, f"race/transport-{tname}", check_race_transport, tname)
    run(ctx, "zmq/device-arrival", check_zmq_device_arrival)
    run(ctx, "ucx/gpu-gpu", check_ucx_gpu_gpu)
    if ctx.cuda:
        run(ctx, "ucx/kill-receiver", check_ucx_kill_receiver)
    run(ctx, "offload/vs-pinned", check_offload_vs_pinned)
    run(ctx, "offload/batch", check_offload_batch)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"# {len(RESULTS) - len(failed)} passed, {len(failed)} failed in {time.monotonic() - t_start:.0f} s"
          + (f": {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
