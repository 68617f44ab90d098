"""``kvxfer demo --model llama|qwen2``: the prefill -> decode run with a HuggingFace model.

The same P/D run as ``kvxfer demo``, with a model a user knows in place of kvxfer's own
tiny transformer: a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` built from a small config
with seeded random weights (``from_config``, no download; float32, eval mode). Needs the
``hf`` extra (``pip install 'kvxfer[hf]'``, transformers 4.45 to 5.x).

Processes: this one (bootstrap server, request feeder, reference, checker), a prefill
group (default TP 2, page-major pools) and a decode group (default TP 4, token-major
pools), each group a torch.distributed gloo world. HF models are not tensor-parallel, so
every rank holds the whole model; what TP changes is the KV each rank keeps and moves:
rank r of TP t holds the global KV heads ``kvxfer.topology.heads_held(kv_heads, t, r)``.

Prefill, per request: one forward over the prompt (``use_cache=True``); the rank writes
its heads of every layer's K/V (``[1, kv_heads, tokens, head_dim]`` in HF's cache, after
RoPE) into its kvxfer pool and sends them with ``KVSender``; the aux record carries the
first generated token (greedy). Decode, per batch: grants slots, waits until every rank of
its group has all its heads (``reduce_poll``), then all-gathers the group's heads over
gloo into one HF ``DynamicCache`` and continues ``generate(do_sample=False)`` from it
(rank 0 decodes; the other ranks hold the same cache). The checker compares every
request's tokens with the model's own uninterrupted ``generate(do_sample=False)`` on the
same prompt. Exit status 1 if any request differs or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict

import numpy as np

from .hf_model import (
    HF_MODELS,
    HFDemoConfig,
    agree_on_model,
    build_model,
    fingerprint,
    gather_cache,
    greedy,
    make_pool,
    make_requests,
    prefill,
    require_transformers,
    write_prefill_kv,
)
from .launch import DEMO_TIMEOUTS, collect, finish_prefill, init_group, start_ranks, stop_ranks, verdict, wait_batch

# -- prefill ------------------------------------------------------------------------------

def prefill_rank(cfg: HFDemoConfig, rank: int, port: int, bootstrap: str, inbox, outbox) -> None:
    """One prefill rank: prompts in, this rank's KV heads out, first token as aux."""
    try:
        import torch
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint.aux import AuxRecord
        from ..endpoint.prefill import PrefillEndpoint
        from ..ranks import RankSpec
        from ..topology import heads_held

        torch.set_num_threads(1)
        init_group(port, "prefill", rank, cfg.prefill_tp)
        model = build_model(cfg)
        fp = agree_on_model(model)
        heads = heads_held(cfg.kv_heads, cfg.prefill_tp, rank)
        requests = make_requests(cfg)
        pool = make_pool(cfg, cfg.prefill_tp, rank, cfg.prefill_layout, sum(len(p) for _, p in requests), len(requests))
        alloc, lock, freed = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size), threading.Lock(), []

        def release(slots: np.ndarray) -> None:    # on the endpoint's thread: decode has the KV
            with lock:
                freed.append(slots)
        spec = RankSpec(role="prefill", num_kv_heads=cfg.kv_heads, num_layers=cfg.layers, tp_rank=rank,
                        tp_size=cfg.prefill_tp)
        with PrefillEndpoint(spec, pool, transport=cfg.transport, timeouts=DEMO_TIMEOUTS()) as ep:
            ep.register(bootstrap)
            outbox.put(("ready", "prefill", rank, fp))
            senders = []
            for room, prompt in requests:
                slots = alloc.alloc(len(prompt))
                sender = ep.sender(room, on_release=lambda s, slots=slots: release(slots))
                cache, first = prefill(model, prompt)
                write_prefill_kv(cache, pool, slots, heads)
                sender.send(slots, start=0, last=True, aux=AuxRecord(first))
                senders.append(sender)
            finish_prefill(senders, lock, freed, alloc, rank, outbox, inbox)
        dist.destroy_process_group()
    except BaseException as e:   # report, never hang the demo
        import traceback
        outbox.put(("error", f"prefill rank {rank}", f"{e}\n{traceback.format_exc()}"))


# -- decode -------------------------------------------------------------------------------

def decode_rank(cfg: HFDemoConfig, rank: int, port: int, bootstrap: str, outbox) -> None:
    """One decode rank: grant slots, wait for the whole TP group, gather the heads, generate."""
    try:
        import torch
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint import KVPoll
        from ..endpoint.aux import AuxBuffer
        from ..endpoint.decode import DecodeEndpoint
        from ..grant import ByteRanges
        from ..ranks import RankSpec

        torch.set_num_threads(1)
        init_group(port, "decode", rank, cfg.decode_tp)
        group = dist.new_group(backend="gloo")
        model = build_model(cfg)
        fp = agree_on_model(model, group)
        requests = make_requests(cfg)
        pool = make_pool(cfg, cfg.decode_tp, rank, cfg.decode_layout, cfg.batch * cfg.max_prompt, cfg.batch)
        alloc = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size)
        spec = RankSpec(role="decode", num_kv_heads=cfg.kv_heads, num_layers=cfg.layers, tp_rank=rank,
                        tp_size=cfg.decode_tp)
        aux = AuxBuffer(cfg.batch)
        with DecodeEndpoint(spec, pool, aux=aux, transport=cfg.transport, timeouts=DEMO_TIMEOUTS()) as ep:
            ep.connect(bootstrap=bootstrap, timeout=120)
            outbox.put(("ready", "decode", rank, fp))
            for b in range(0, len(requests), cfg.batch):
                batch = requests[b:b + cfg.batch]
                recv, slots = [], []
                for i, (room, prompt) in enumerate(batch):
                    s = alloc.alloc(len(prompt))
                    r = ep.receiver(room)
                    r.init(s, aux_slot=i)
                    recv.append(r)
                    slots.append(s)
                nbytes = sum(ByteRanges.of_slots(pool.layout, s).nbytes for s in slots)
                states, _ = wait_batch(recv, group)
                for i, ((room, prompt), r, s, st) in enumerate(zip(batch, recv, slots, states)):
                    tokens = []
                    if st == KVPoll.Success:              # every rank takes part in the all-gather
                        cache = gather_cache(cfg, pool, s, group)
                        first = aux.read(i).first_token
                        tokens = [first] + (greedy(model, prompt + [first], cfg.gen_len - 1, cache)
                                            if rank == 0 else [])
                    if rank == 0:
                        outbox.put(("result", room, tokens, st == KVPoll.Success, r.reason))
                    r.clear()
                    alloc.free(s)
                if rank == 0:
                    outbox.put(("bytes", nbytes * cfg.decode_tp))
            outbox.put(("decode_done", rank, alloc.free_pages == alloc.capacity))
        dist.destroy_process_group()
    except BaseException as e:
        import traceback
        outbox.put(("error", f"decode rank {rank}", f"{e}\n{traceback.format_exc()}"))


# -- the run ------------------------------------------------------------------------------

def reference_tokens(cfg: HFDemoConfig, model) -> dict[int, list[int]]:
    """What every request must generate: the model's own uninterrupted greedy ``generate``."""
    return {room: greedy(model, prompt, cfg.gen_len) for room, prompt in make_requests(cfg)}


def run(cfg: HFDemoConfig, out=sys.stdout) -> dict:
    """Run the HF demo; returns the summary (also printed)."""
    import torch

    t0 = time.perf_counter()
    tf = require_transformers()
    torch.set_num_threads(1)
    model = build_model(cfg)
    fp = fingerprint(model)
    ranks = start_ranks(cfg, prefill_rank, decode_rank)
    print(f"kvxfer demo --model {cfg.model}: {type(model).__name__} (transformers {tf.__version__}, "
          f"{cfg.layers} layers, {cfg.heads} heads, {cfg.kv_heads} KV heads, head_dim {cfg.head_dim}, "
          f"float32, seed {cfg.seed}, weights {fp})", file=out)
    print(f"  prefill TP {cfg.prefill_tp} ({cfg.prefill_layout}) -> decode TP {cfg.decode_tp} "
          f"({cfg.decode_layout}) over {cfg.transport}, {cfg.requests} requests, {cfg.gen_len} tokens each",
          file=out, flush=True)
    ref_box: dict = {}
    ref_thread = threading.Thread(target=lambda: ref_box.update(reference_tokens(cfg, model)), daemon=True)
    ref_thread.start()
    results: dict[int, tuple] = {}
    fps: dict[str, str] = {}
    seen = {"bytes": 0, "t_ready": 0.0}

    def on_report(msg: tuple) -> None:
        if msg[0] == "ready":
            fps[f"{msg[1]} rank {msg[2]}"] = msg[3]
            if len(fps) == len(ranks.procs):
                seen["t_ready"] = time.perf_counter()
        elif msg[0] == "result":
            results[msg[1]] = msg[2:]
        elif msg[0] == "bytes":
            seen["bytes"] += msg[1]
    done, errors = collect(ranks, cfg, on_report)
    t_end = time.perf_counter()
    stop_ranks(ranks)
    ref_thread.join()

    errors += [f"{who} built weights {f}, this process {fp}" for who, f in sorted(fps.items()) if f != fp]
    ref, nbytes = ref_box, seen["bytes"]
    if len(ref) != cfg.requests:
        errors.append(f"the reference generate finished {len(ref)} of {cfg.requests} requests")
    for room, prompt in make_requests(cfg):
        if room in results:
            toks, ok, reason = results[room]
            mark = "ok" if ok and toks == ref.get(room) else \
                f"MISMATCH: want {ref.get(room)}" + (f" ({reason})" if reason else "")
            print(f"  room {room:3d}: prompt {len(prompt):3d} tokens -> {toks} {mark}", file=out)
    transfer_s = t_end - (seen["t_ready"] or t_end)
    summary = {"config": asdict(cfg), **verdict(cfg, results, ref, done, errors), "bytes_moved": nbytes,
               "weights": fp, "seconds": t_end - t0, "seconds_after_ready": transfer_s, "errors": errors}
    rows = [("requests", f"{cfg.requests}"),
            ("verified token for token", f"{summary['verified']}/{cfg.requests} (vs the model's own generate)"),
            ("bytes moved", f"{nbytes / 1e3:.1f} kB"),
            ("wall time", f"{t_end - t0:.1f} s ({transfer_s:.1f} s after every rank was ready)"),
            ("slots back to full", "no" if summary["slot_leak"] else "yes")]
    print("\n".join(f"  {k:26s} {v}" for k, v in rows), file=out)
    for e in errors:
        print(f"  ERROR {e}", file=out)
    print("  RESULT: " + ("every request verified" if summary["ok"] else "FAILED"), file=out)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Takes every option of ``kvxfer demo`` plus ``--model``, so the demo can hand its argv over."""
    d = HFDemoConfig()
    ap = argparse.ArgumentParser(prog="kvxfer demo --model llama|qwen2", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=d.model, choices=sorted(HF_MODELS))
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
    a = ap.parse_args(argv)
    try:
        cfg = HFDemoConfig(model=a.model, transport=a.transport, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                           prefill_layout=a.prefill_layout, decode_layout=a.decode_layout, requests=a.requests,
                           gen_len=a.gen_len, max_prompt=a.max_prompt, min_prompt=min(d.min_prompt, a.max_prompt),
                           seed=a.seed)
    except Exception as e:
        ap.error(str(e))
    require_transformers()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = run(cfg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
