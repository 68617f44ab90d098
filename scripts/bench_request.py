#!/usr/bin/env python
"""End-to-end cost of one request, next to a raw ZMQ round trip measured in the same run.

    python scripts/bench_request.py [--transport zmq] [--requests 300] [--inflight 64]

Two processes on 127.0.0.1: a prefill endpoint (child) and a decode endpoint (this process).
Measured:
  raw ZMQ RTT        DEALER -> ROUTER with the page's bytes, 1-byte reply (pyzmq, no kvxfer),
                     back to back (caches and cores hot), and paced: with the idle time that
                     precedes each sequential request (its grant round trip) before each trip
  thread floor       the hops a request makes with no protocol work: a main thread hands the
                     page to its I/O thread (queue + pipe wake), which sends it on a DEALER; the
                     peer's I/O thread receives and copies it, and wakes its main thread. Paced
                     like the requests. What any design with an I/O thread per side costs here
  1-page latency     sender.send() on prefill -> receiver.wait() returns Success on decode
                     (one clock: CLOCK_MONOTONIC is shared by processes of one host)
  requests/s         1-page requests with ``--inflight`` outstanding, for ``--requests`` requests
Goal (issue 39): 1-page latency <= 3x the raw round trip.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import numpy as np


def _pool(a, seed=None):
    import torch

    from kvxfer.pools import MHAPool
    p = MHAPool(layers=a["layers"], heads=a["heads"], head_dim=a["head_dim"], dtype="bfloat16",
                num_pages=a["pages"], page_size=a["page_size"])
    if seed is not None:
        for i, b in enumerate(p.buffers):
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed + i),
                                  dtype=torch.uint8))
    return p


def _spec(role, a):
    from kvxfer.ranks import RankSpec
    return RankSpec(role=role, num_kv_heads=a["heads"], num_layers=a["layers"])


# ------------------------------------------------------------------------------------
# Child processes
# ------------------------------------------------------------------------------------
def raw_server(endpoint_q, n: int) -> None:
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:*")
    endpoint_q.put(s.last_endpoint.decode())
    for _ in range(n):
        ident, payload = s.recv_multipart(copy=False)
        s.send_multipart([ident, b"k"])
    s.close(0)
    ctx.term()


def floor_receiver(conn, n: int, nbytes: int) -> None:
    """The thread floor's far side: an I/O thread polls a ROUTER, copies each message out and
    wakes the main thread, which stamps it."""
    import queue
    import threading

    import zmq
    ctx = zmq.Context(io_threads=1)
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    conn.send_bytes(router.last_endpoint)
    woken: queue.SimpleQueue = queue.SimpleQueue()
    region = np.zeros(nbytes, np.uint8)

    def io() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        for _ in range(n):
            while not poller.poll(50):
                pass
            parts = router.recv_multipart(copy=False)
            region[:] = np.frombuffer(parts[1].buffer, np.uint8)   # the one copy a receiver makes
            woken.put(None)

    thread = threading.Thread(target=io, daemon=True)
    thread.start()
    stamps = []
    for _ in range(n):
        woken.get()
        stamps.append(time.monotonic())
    thread.join()
    conn.send_bytes(json.dumps(stamps).encode())
    router.close(0)
    ctx.term()


def bare_sender(conn, a: dict) -> None:
    """The transport alone: plan (prepared Planner, as the endpoints do) and submit on each "go"."""
    from kvxfer.plan import Planner
    from kvxfer.transport.registry import get_transport
    pool = _pool(a, seed=1)
    t = get_transport(a["transport"])
    t.register(pool.regions())
    peer = t.connect(json.loads(conn.recv_bytes()))
    slots = np.arange(a["page_size"], 2 * a["page_size"])
    planner = Planner(pool.layout, pool.layout)
    stamps = []
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            break
        t0 = time.monotonic()
        plan = planner.plan(slots, slots)
        t.submit(peer, msg.decode(), plan, timeout=10)
        stamps.append((t0, time.monotonic()))
    conn.send_bytes(json.dumps(stamps).encode())
    t.close()


def transport_one_way(ctx, a: dict, n: int) -> dict:
    """submit() (with planning) on one process -> arrivals() returns on the other: the floor under a request."""
    from kvxfer.grant import ByteRanges
    from kvxfer.transport.registry import get_transport
    pool = _pool(a)
    t = get_transport(a["transport"])
    t.register(pool.regions())
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=bare_sender, args=(theirs, a))
    proc.start()
    mine.send_bytes(json.dumps(t.descriptor()).encode())
    ranges = ByteRanges.of_slots(pool.layout, np.arange(a["page_size"], 2 * a["page_size"]))
    got = []
    for i in range(n + 30):
        t.expect(f"{i}.1", ranges)
        mine.send_bytes(f"{i}.1".encode())
        arrived = []
        while not arrived:
            arrived = t.arrivals(timeout=5)
        got.append(time.monotonic())
        assert arrived[0].ok, arrived
        t.forget(f"{i}.1")
    mine.send_bytes(b"stop")
    stamps = json.loads(mine.recv_bytes())
    proc.join(10)
    t.close()
    return {"latency": [g - s[0] for g, s in zip(got[30:], stamps[30:])],
            "send": [s[1] - s[0] for s in stamps[30:]]}


def prefill(conn, a: dict) -> None:
    """Serve rooms 0..total-1 in order: one chunk each, as soon as decode's grant arrived."""
    from kvxfer.allocator import PageAllocator
    from kvxfer.endpoint.base import KVPoll
    from kvxfer.endpoint.prefill import PrefillEndpoint
    pool = _pool(a, seed=1)
    alloc = PageAllocator(a["pages"], a["page_size"])
    ep = PrefillEndpoint(_spec("prefill", a), pool, transport=a["transport"])
    ep.register(a["bootstrap"])
    conn.send_bytes(b"ready")
    total, window = a["total"], a["window"]
    senders, stamps, nxt, made = {}, {}, 0, 0
    while nxt < total:
        while made < min(total, nxt + window):      # senders for the next rooms, before decode asks
            slots = alloc.alloc(a["page_size"])
            senders[made] = (ep.sender(made, on_release=lambda s, sl=slots: alloc.free(sl)), slots)
            made += 1
        s, slots = senders[nxt]
        s.wait(30, until=KVPoll.WaitingForInput)   # block, do not spin: spinning starves the I/O threads
        t0 = time.monotonic()
        s.send(slots, last=True)
        stamps[nxt] = (t0, time.monotonic())
        nxt += 1
    for s, _ in senders.values():
        s.wait(30)
    conn.send_bytes(json.dumps({"stamps": stamps, "ok": sum(s.poll() == KVPoll.Success
                                                            for s, _ in senders.values())}).encode())
    conn.recv_bytes()
    ep.close()


# ------------------------------------------------------------------------------------
def raw_rtt(ctx, nbytes: int, n: int, gap: float = 0.0) -> list[float]:
    """Round trips of ``nbytes`` out and 1 byte back; ``gap`` seconds idle before each."""
    import zmq
    q = ctx.Queue()
    proc = ctx.Process(target=raw_server, args=(q, n + 50))
    proc.start()
    zc = zmq.Context()
    s = zc.socket(zmq.DEALER)
    s.connect(q.get(timeout=60))
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    out = []
    for i in range(n + 50):
        if gap:
            time.sleep(gap)
        t0 = time.monotonic()
        s.send(payload, copy=False)
        s.recv()
        if i >= 50:
            out.append(time.monotonic() - t0)
    s.close(0)
    zc.term()
    proc.join(10)
    return out


def thread_floor(ctx, nbytes: int, n: int, gap: float) -> list[float]:
    """One-way latency through main -> I/O thread -> DEALER -> ROUTER -> I/O thread -> main,
    with no protocol work (see the module docstring); ``gap`` seconds idle before each."""
    import os
    import queue
    import threading

    import zmq
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=floor_receiver, args=(theirs, n + 50, nbytes))
    proc.start()
    endpoint = mine.recv_bytes().decode()
    zc = zmq.Context(io_threads=1)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)

    def io() -> None:
        dealer = zc.socket(zmq.DEALER)
        dealer.connect(endpoint)
        poller, sent = zmq.Poller(), 0
        poller.register(wake_r, zmq.POLLIN)
        while sent < n + 50:
            if not poller.poll(50):
                continue
            os.read(wake_r, 4096)
            while not todo.empty():
                dealer.send(todo.get_nowait())
                sent += 1
        dealer.close(linger=-1)

    thread = threading.Thread(target=io, daemon=True)
    thread.start()
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    sent_at = []
    for _ in range(n + 50):
        time.sleep(gap)
        sent_at.append(time.monotonic())
        todo.put(payload)
        os.write(wake_w, b"\0")
    got = json.loads(mine.recv_bytes())
    thread.join(30)
    proc.join(10)
    zc.term()
    os.close(wake_r)
    os.close(wake_w)
    return [g - t for g, t in zip(got[50:], sent_at[50:])]


def run_requests(ctx, a: dict, inflight: int) -> dict:
    from kvxfer.allocator import PageAllocator
    from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
    from kvxfer.endpoint.base import KVPoll
    from kvxfer.endpoint.decode import DecodeEndpoint
    server = BootstrapServer(BootstrapConfig()).start()
    a = {**a, "bootstrap": server.url, "window": max(2 * inflight, 4)}
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(theirs, a))
    proc.start()
    assert mine.recv_bytes() == b"ready"
    pool = _pool(a)
    alloc = PageAllocator(a["pages"], a["page_size"])
    ep = DecodeEndpoint(_spec("decode", a), pool, transport=a["transport"])
    ep.connect(bootstrap=server.url)
    done_at, live, room, t_start = {}, {}, 0, time.monotonic()
    while room < a["total"] or live:
        while room < a["total"] and len(live) < inflight:
            slots = alloc.alloc(a["page_size"])
            r = ep.receiver(room, on_release=lambda r, sl=slots: alloc.free(sl))
            r.init(slots)
            live[room] = r
            room += 1
        oldest = min(live)
        state = live[oldest].wait(30)
        assert state == KVPoll.Success, live[oldest]
        done_at[oldest] = (live[oldest].ended_at, time.monotonic())
        del live[oldest]
    elapsed = time.monotonic() - t_start
    res = json.loads(mine.recv_bytes())
    mine.send_bytes(b"bye")
    proc.join(30)
    ep.close()
    server.stop()
    stamps = {int(k): v for k, v in res["stamps"].items()}
    keep = [r for r in sorted(done_at) if r >= a.get("warmup", 0)]
    idle = [stamps[r][0] - done_at[r - 1][1] for r in keep if r - 1 in done_at]   # one request's end -> next send
    return {"elapsed": elapsed, "n": a["total"], "prefill_ok": res["ok"], "idle": idle,
            "latency": [done_at[r][1] - stamps[r][0] for r in keep],      # send() called -> wait() returned
            "send": [stamps[r][1] - stamps[r][0] for r in keep],          # inside send()
            "to_end": [done_at[r][0] - stamps[r][0] for r in keep],       # send() called -> Success set
            "wake": [done_at[r][1] - done_at[r][0] for r in keep]}        # Success set -> wait() returned


def fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e6:7.0f} us   p90 {xs[int(0.9 * (len(xs) - 1))] * 1e6:7.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="zmq")
    ap.add_argument("--requests", type=int, default=300, help="sequential 1-page requests for the latency")
    ap.add_argument("--throughput-requests", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", type=Path, help="write the results here (rows for kvxfer bench)")
    args = ap.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvxfer.endpoint"])
    a = {"transport": args.transport, "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
         "page_size": args.page_size}
    page_bytes = args.page_size * args.layers * 2 * args.heads * args.head_dim * 2
    print(f"1 page = {args.page_size} tokens x {args.layers} layers x K,V x {args.heads} heads x {args.head_dim} "
          f"x bf16 = {page_bytes / 1024:.0f} KiB; transport {args.transport}")
    rtt = raw_rtt(ctx, page_bytes, args.requests)
    bare = transport_one_way(ctx, {**a, "pages": 8}, args.requests)
    one = run_requests(ctx, {**a, "total": args.requests + 30, "warmup": 30, "pages": args.requests + 64}, 1)
    gap = statistics.median(one["idle"]) if one["idle"] else 0.001
    paced = raw_rtt(ctx, page_bytes, args.requests, gap)
    floor = thread_floor(ctx, page_bytes, args.requests, gap)
    many = run_requests(ctx, {**a, "total": args.throughput_requests,
                              "pages": args.throughput_requests + 2 * args.inflight + 8}, args.inflight)
    rtt_med, lat_med = statistics.median(rtt), statistics.median(one["latency"])
    paced_med, floor_med = statistics.median(paced), statistics.median(floor)
    print(f"raw ZMQ round trip ({page_bytes / 1024:.0f} KiB out, 1 B back): {fmt(rtt)}")
    print(f"  paced like the requests ({gap * 1e6:.0f} us idle before each): {fmt(paced)}")
    print(f"thread floor, one way, paced (no protocol work): {fmt(floor)}   = {floor_med / rtt_med:.2f}x the raw "
          f"round trip, {floor_med / paced_med:.2f}x the paced one")
    print(f"transport alone, plan+submit -> arrival:    {fmt(bare['latency'])}   "
          f"= {statistics.median(bare['latency']) / rtt_med:.2f}x  (plan+submit() call {fmt(bare['send'])})")
    print(f"1-page request, send -> Success:            {fmt(one['latency'])}   "
          f"= {lat_med / rtt_med:.2f}x the raw round trip (goal <= 3x), {lat_med / paced_med:.2f}x the paced one")
    print(f"  of which: inside send() {fmt(one['send'])}; send -> Success set {fmt(one['to_end'])}; "
          f"Success set -> wait() returns {fmt(one['wake'])}")
    print(f"{args.inflight} in flight: {many['n'] / many['elapsed']:7.0f} requests/s "
          f"({many['n'] * page_bytes / many['elapsed'] / 1e6:.0f} MB/s); per-request latency {fmt(many['latency'])}")
    if args.json:
        bare_med, rps = statistics.median(bare["latency"]), many["n"] / many["elapsed"]
        rows = [{"name": f"request: 1-page latency, {args.transport} (median)", "value": lat_med * 1e6, "unit": "us",
                 "ceiling": rtt_med * 1e6, "ceiling_name": "raw ZMQ round trip", "ratio": lat_med / rtt_med,
                 "goal": "<= 3x", "ok": lat_med <= 3 * rtt_med},
                {"name": "request: thread floor, one way, paced (median)", "value": floor_med * 1e6, "unit": "us",
                 "ceiling": rtt_med * 1e6, "ceiling_name": "raw ZMQ round trip", "ratio": floor_med / rtt_med},
                {"name": "request: raw ZMQ round trip, paced like the requests (median)", "value": paced_med * 1e6,
                 "unit": "us", "ceiling": rtt_med * 1e6, "ceiling_name": "raw ZMQ round trip",
                 "ratio": paced_med / rtt_med},
                {"name": f"request: transport alone, plan+submit -> arrival, {args.transport} (median)",
                 "value": bare_med * 1e6, "unit": "us", "ceiling": rtt_med * 1e6,
                 "ceiling_name": "raw ZMQ round trip", "ratio": bare_med / rtt_med},
                {"name": f"request: 1-page requests/s, {args.inflight} in flight, {args.transport}", "value": rps,
                 "unit": "req/s"}]
        args.json.write_text(json.dumps({"bench": "request", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
