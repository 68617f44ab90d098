"""``kvxfer demo``: a real prefill -> decode run on 127.0.0.1, verified token for token.

Processes: this one (bootstrap server, request feeder, checker), a prefill group
(default TP 2, page-major pool) and a decode group (default TP 4, token-major pool),
each group a torch.distributed gloo world running the tiny TP transformer of
``kvxfer.model``. Prefill computes each prompt chunk by chunk and streams every chunk
as soon as its KV is in the pool; the last chunk carries the first output token as
the aux record. Decode grants slots, waits until every rank of its TP group has all
its heads (``reduce_poll``), then continues generation from the transferred KV. The
checker compares every request's tokens with a single-process run of the same model.
Exit status 1 if any request differs or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from .launch import DEMO_TIMEOUTS, collect, finish_prefill, init_group, start_ranks, stop_ranks, verdict, wait_batch


@dataclass(frozen=True, slots=True)
class DemoConfig:
    transport: str = "zmq"
    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_layout: str = "page_major"
    decode_layout: str = "token_major"
    requests: int = 24
    min_prompt: int = 8
    max_prompt: int = 160
    gen_len: int = 8
    page_size: int = 16
    chunk_pages: int = 2
    batch: int = 8            # requests decode grants at once
    seed: int = 0


def make_requests(cfg: DemoConfig) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(cfg.seed)
    from .model import ModelConfig
    vocab = ModelConfig().vocab
    return [(room, rng.integers(0, vocab, int(rng.integers(cfg.min_prompt, cfg.max_prompt + 1))).tolist())
            for room in range(1, cfg.requests + 1)]


def _pool(cfg: DemoConfig, tp: int, layout: str, num_tokens: int):
    from ..pools import MHAPool
    from .model import ModelConfig, kv_heads_per_rank
    m = ModelConfig()
    pages = -(-num_tokens // cfg.page_size) + cfg.requests + 2
    return MHAPool(layers=m.layers, heads=kv_heads_per_rank(m, tp), head_dim=m.head_dim, dtype="float32",
                   num_pages=pages, page_size=cfg.page_size, layout=layout)


def prefill_rank(cfg: DemoConfig, rank: int, port: int, bootstrap: str, inbox, outbox) -> None:
    """One prefill rank: prompts in, KV streamed out chunk by chunk."""
    try:
        import torch
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint.aux import AuxRecord
        from ..endpoint.prefill import PrefillEndpoint
        from ..ranks import RankSpec
        from .model import ModelConfig, TPModel, init_weights, shard_weights

        m = ModelConfig()
        init_group(port, "prefill", rank, cfg.prefill_tp)
        model = TPModel(m, shard_weights(init_weights(m), m, cfg.prefill_tp, rank), cfg.prefill_tp)
        requests = make_requests(cfg)
        pool = _pool(cfg, cfg.prefill_tp, cfg.prefill_layout, sum(len(p) for _, p in requests))
        alloc, lock, freed = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size), threading.Lock(), []
        spec = RankSpec(role="prefill", num_kv_heads=m.kv_heads, num_layers=m.layers, tp_rank=rank,
                        tp_size=cfg.prefill_tp)
        with PrefillEndpoint(spec, pool, transport=cfg.transport, timeouts=DEMO_TIMEOUTS()) as ep:
            ep.register(bootstrap)
            outbox.put(("ready", "prefill", rank))
            senders = []
            chunk = cfg.chunk_pages * cfg.page_size
            for room, prompt in requests:
                slots = alloc.alloc(len(prompt))

                def on_release(outcome, slots=slots) -> None:
                    with lock:
                        freed.append(slots)
                sender = ep.sender(room, on_release=on_release)
                for start in range(0, len(prompt), chunk):
                    end = min(start + chunk, len(prompt))
                    x = model.forward_layer_range(model.embed(prompt[start:end]), torch.arange(start, end),
                                                  pool, slots[start:end], slots[:end], range(m.layers))
                    last = end == len(prompt)
                    aux = AuxRecord(model.next_token(x)) if last else None
                    sender.send(slots[start:end], start=start, last=last, aux=aux)
                senders.append(sender)
            finish_prefill(senders, lock, freed, alloc, rank, outbox, inbox)
        dist.destroy_process_group()
    except Exception as e:   # report, never hang the demo
        import traceback
        outbox.put(("error", f"prefill rank {rank}", f"{e}\n{traceback.format_exc()}"))


def decode_rank(cfg: DemoConfig, rank: int, port: int, bootstrap: str, outbox) -> None:
    """One decode rank: grant slots, wait for the whole TP group, continue generation."""
    try:
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint import KVPoll
        from ..endpoint.aux import AuxBuffer
        from ..endpoint.decode import DecodeEndpoint
        from ..grant import ByteRanges
        from ..ranks import RankSpec
        from .model import ModelConfig, TPModel, init_weights, shard_weights

        m = ModelConfig()
        init_group(port, "decode", rank, cfg.decode_tp)
        group = dist.new_group(backend="gloo")
        model = TPModel(m, shard_weights(init_weights(m), m, cfg.decode_tp, rank), cfg.decode_tp)
        requests = make_requests(cfg)
        pool = _pool(cfg, cfg.decode_tp, cfg.decode_layout,
                     sum(len(p) + cfg.gen_len for _, p in requests[:cfg.batch]) + cfg.batch * cfg.page_size)
        alloc = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size)
        spec = RankSpec(role="decode", num_kv_heads=m.kv_heads, num_layers=m.layers, tp_rank=rank,
                        tp_size=cfg.decode_tp)
        aux = AuxBuffer(cfg.batch)
        with DecodeEndpoint(spec, pool, aux=aux, transport=cfg.transport, timeouts=DEMO_TIMEOUTS()) as ep:
            ep.connect(bootstrap=bootstrap, timeout=120)
            outbox.put(("ready", "decode", rank))
            for b in range(0, len(requests), cfg.batch):
                batch = requests[b:b + cfg.batch]
                recv, slots, started = [], [], {}
                for i, (room, prompt) in enumerate(batch):
                    s = alloc.alloc(len(prompt) + cfg.gen_len)
                    r = ep.receiver(room)
                    started[room] = time.perf_counter()
                    r.init(s[:len(prompt)], aux_slot=i)
                    recv.append(r)
                    slots.append(s)
                nbytes = sum(ByteRanges.of_slots(pool.layout, s[:len(p)]).nbytes for s, (_, p) in zip(slots, batch))
                states, ended = wait_batch(recv, group)
                latency = {room: t - started[room] for (room, _), t in zip(batch, ended)}
                for i, ((room, prompt), r, s, st) in enumerate(zip(batch, recv, slots, states)):
                    tokens = []
                    if st == KVPoll.Success:
                        tok = aux.read(i).first_token
                        tokens.append(tok)
                        for j in range(cfg.gen_len - 1):
                            tok = model.forward([tok], len(prompt) + j, pool, s)
                            tokens.append(tok)
                    if rank == 0:
                        outbox.put(("result", room, tokens, st == KVPoll.Success, r.reason, latency[room]))
                    r.clear()
                    alloc.free(s)
                if rank == 0:
                    outbox.put(("bytes", nbytes * cfg.decode_tp))
            outbox.put(("decode_done", rank, alloc.free_pages == alloc.capacity))
        dist.destroy_process_group()
    except Exception as e:
        import traceback
        outbox.put(("error", f"decode rank {rank}", f"{e}\n{traceback.format_exc()}"))


def reference_tokens(cfg: DemoConfig) -> dict[int, list[int]]:
    """The same model in one process, TP 1: what every request must generate."""
    from ..allocator import PageAllocator
    from ..pools import MHAPool
    from .model import ModelConfig, TPModel, init_weights
    m = ModelConfig()
    model = TPModel(m, init_weights(m))
    out = {}
    for room, prompt in make_requests(cfg):
        pool = MHAPool(layers=m.layers, heads=m.kv_heads, head_dim=m.head_dim, dtype="float32",
                       num_pages=-(-(len(prompt) + cfg.gen_len) // cfg.page_size) + 1, page_size=cfg.page_size)
        slots = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size).alloc(len(prompt) + cfg.gen_len)
        tok = model.forward(prompt, 0, pool, slots)
        toks = [tok]
        for j in range(cfg.gen_len - 1):
            tok = model.forward([tok], len(prompt) + j, pool, slots)
            toks.append(tok)
        out[room] = toks
    return out


def _bar(done: int, total: int, width: int = 30) -> str:
    fill = width * done // max(total, 1)
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


def run(cfg: DemoConfig, out=sys.stdout) -> dict:
    """Run the demo; returns the summary (also printed)."""
    t0 = time.perf_counter()
    ranks = start_ranks(cfg, prefill_rank, decode_rank)
    print(f"kvxfer demo: prefill TP {cfg.prefill_tp} ({cfg.prefill_layout}) -> decode TP {cfg.decode_tp} "
          f"({cfg.decode_layout}) over {cfg.transport}, {cfg.requests} requests", file=out)
    ref_box: dict = {}
    ref_thread = threading.Thread(target=lambda: ref_box.update(reference_tokens(cfg)), daemon=True)
    ref_thread.start()
    results: dict = {}
    seen = {"ready": 0, "bytes": 0, "t_first": 0.0}

    def on_report(msg: tuple) -> None:
        if msg[0] == "ready":
            seen["ready"] += 1
            if seen["ready"] == len(ranks.procs):
                seen["t_first"] = time.perf_counter()
        elif msg[0] == "result":
            results[msg[1]] = msg[2:]
            print(f"\r  transferring and decoding {_bar(len(results), cfg.requests)}", end="", file=out, flush=True)
        elif msg[0] == "bytes":
            seen["bytes"] += msg[1]
    done, errors = collect(ranks, cfg, on_report)
    print(file=out)
    wall = time.perf_counter() - (seen["t_first"] or t0)
    stop_ranks(ranks)
    ref_thread.join()

    nbytes = seen["bytes"]
    lat = sorted(r[3] for r in results.values())
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: float("nan"))
    summary = {"config": asdict(cfg), **verdict(cfg, results, ref_box, done, errors), "bytes_moved": nbytes,
               "seconds": wall, "throughput_mb_s": nbytes / wall / 1e6 if wall else 0.0, "p50_ms": pct(0.50),
               "p99_ms": pct(0.99), "errors": errors}
    rows = [("requests", f"{cfg.requests}"), ("verified token for token", f"{summary['verified']}/{cfg.requests}"),
            ("bytes moved", f"{nbytes / 1e6:.2f} MB"), ("wall time", f"{wall:.1f} s"),
            ("bytes / wall time", f"{summary['throughput_mb_s']:.2f} MB/s (bound by the model's compute)"),
            ("grant -> KV landed p50", f"{summary['p50_ms']:.1f} ms (includes waiting for prefill)"),
            ("grant -> KV landed p99", f"{summary['p99_ms']:.1f} ms"),
            ("slots back to full", "no" if summary["slot_leak"] else "yes")]
    print("\n".join(f"  {k:26s} {v}" for k, v in rows), file=out)
    for e in errors:
        print(f"  ERROR {e}", file=out)
    for room in summary["mismatched"]:
        got = results[room]
        print(f"  MISMATCH room {room}: got {got[0]} (ok={got[1]}, {got[2]}), want {ref_box.get(room)}", file=out)
    print("  RESULT: " + ("every request verified" if summary["ok"] else "FAILED"), file=out)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer demo", description=__doc__.split("\n\n")[0])
    d = DemoConfig()
    ap.add_argument("--transport", default=d.transport, help="zmq or ucx")
    ap.add_argument("--prefill-tp", type=int, default=d.prefill_tp)
    ap.add_argument("--decode-tp", type=int, default=d.decode_tp)
    ap.add_argument("--prefill-layout", default=d.prefill_layout, choices=["token_major", "hnd", "page_major"])
    ap.add_argument("--decode-layout", default=d.decode_layout, choices=["token_major", "hnd", "page_major"])
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--gen-len", type=int, default=d.gen_len)
    ap.add_argument("--max-prompt", type=int, default=d.max_prompt)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--model", default="tiny", choices=["tiny", "llama", "qwen2"],
                    help="tiny: kvxfer's own TP transformer; llama, qwen2: a HuggingFace model with seeded "
                         "random weights (pip install 'kvxfer[hf]')")
    a = ap.parse_args(argv)
    if a.model != "tiny":
        from .hf import main as hf_main
        return hf_main(argv)
    cfg = DemoConfig(transport=a.transport, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                     prefill_layout=a.prefill_layout, decode_layout=a.decode_layout, requests=a.requests,
                     gen_len=a.gen_len, max_prompt=a.max_prompt, seed=a.seed)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = run(cfg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["ok"] else 1
