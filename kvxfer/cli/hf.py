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
import hashlib
import inspect
import json
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from .launch import DEMO_TIMEOUT, DEMO_TIMEOUTS, free_port, init_group

# --model name -> (config class, model class) in transformers
HF_MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
HF_INSTALL = "pip install 'kvxfer[hf]'  (or: pip install 'transformers>=4.45,<6')"


@dataclass(frozen=True, slots=True, kw_only=True)
class HFDemoConfig:
    model: str = "llama"
    transport: str = "zmq"
    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_layout: str = "page_major"
    decode_layout: str = "token_major"
    requests: int = 8
    min_prompt: int = 8
    max_prompt: int = 96
    gen_len: int = 8
    page_size: int = 16
    batch: int = 4            # requests decode grants at once
    seed: int = 0
    # the model: small enough for a laptop, GQA so that heterogeneous TP splits KV heads
    layers: int = 2
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 128
    vocab: int = 256
    init_std: float = 0.1     # HF's initializer_range; its default 0.02 gives near-flat logits

    def __post_init__(self):
        if self.model not in HF_MODELS:
            raise ValueError(f"model {self.model!r} is not one of {sorted(HF_MODELS)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads}: "
                             "want hidden a multiple of heads and heads a multiple of kv_heads")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError(f"prompt lengths {self.min_prompt}..{self.max_prompt}: want 1 <= min <= max")
        if self.gen_len < 1:
            raise ValueError(f"gen_len {self.gen_len}: want at least 1 (the first token comes from prefill)")
        from ..topology import heads_held
        for tp in (self.prefill_tp, self.decode_tp):
            heads_held(self.kv_heads, tp, 0)    # raises, saying why, for a TP size the heads cannot split over

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# -- the model ---------------------------------------------------------------------------

def require_transformers():
    """The transformers module, or SystemExit saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"kvxfer demo --model llama|qwen2 needs transformers: {HF_INSTALL}") from None
    transformers.logging.set_verbosity_error()
    return transformers


def build_model(cfg: HFDemoConfig):
    """The HF model of ``cfg.model`` from a small config, random weights seeded by ``cfg.seed``."""
    import torch
    tf = require_transformers()
    config_cls, model_cls = (getattr(tf, name) for name in HF_MODELS[cfg.model])
    config = config_cls(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_prompt + cfg.gen_len,
                        initializer_range=cfg.init_std, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=0)   # no EOS: always gen_len tokens
    torch.manual_seed(cfg.seed)
    return model_cls(config).float().eval()


def fingerprint(model) -> str:
    """sha256 of every parameter, in order: the same seed must give the same model in each process."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def cache_kwarg(model) -> str:
    """transformers 5 names the cache argument (and output field) ``cache``; 4.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layer_kv(cache, layer: int):
    """K and V of ``layer`` from an HF cache, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):                           # transformers >= 4.54: one object per layer
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def greedy(model, prompt: list[int], max_new_tokens: int, cache=None) -> list[int]:
    """``generate(do_sample=False)``: from scratch, or continuing ``cache`` (which holds all of
    ``prompt`` but its last token)."""
    import torch
    if max_new_tokens == 0:
        return []
    ids = torch.tensor([prompt])
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, **extra)
    return out[0, len(prompt):].tolist()


def prefill(model, prompt: list[int]):
    """One forward over ``prompt``: its HF ``DynamicCache`` and the greedy first token. The cache
    is passed in: transformers 4.x returns a legacy tuple for a cache it made itself."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, **{cache_kwarg(model): cache})
    return cache, int(out.logits[0, -1].argmax())


def make_requests(cfg: HFDemoConfig) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(cfg.seed)
    return [(room, rng.integers(0, cfg.vocab, int(rng.integers(cfg.min_prompt, cfg.max_prompt + 1))).tolist())
            for room in range(1, cfg.requests + 1)]


def _pool(cfg: HFDemoConfig, tp: int, rank: int, layout: str, num_tokens: int, num_requests: int):
    from ..pools import MHAPool
    from ..topology import heads_held
    pages = -(-num_tokens // cfg.page_size) + num_requests + 2
    return MHAPool(layers=cfg.layers, heads=len(heads_held(cfg.kv_heads, tp, rank)), head_dim=cfg.head_dim,
                   dtype="float32", num_pages=pages, page_size=cfg.page_size, layout=layout)


def _agree_on_model(model, group=None) -> str:
    """Every rank of the group built the same weights (all-gather of the fingerprints over gloo)."""
    import torch.distributed as dist
    fp = fingerprint(model)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, fp, group=group)
    if len(set(every)) != 1:
        raise RuntimeError(f"ranks built different models from the same seed: {every}")
    return fp


# -- prefill ------------------------------------------------------------------------------

def write_prefill_kv(cache, pool, slots: np.ndarray, heads: range) -> None:
    """This rank's ``heads`` of every layer of an HF cache (batch 1) into ``pool`` at ``slots``."""
    for layer in range(_num_layers(cache)):
        k, v = layer_kv(cache, layer)                          # [1, kv_heads, tokens, head_dim]
        pool.set_kv_buffer(layer, slots, k[0, heads.start:heads.stop].transpose(0, 1).contiguous(),
                           v[0, heads.start:heads.stop].transpose(0, 1).contiguous())   # [tokens, heads, head_dim]


def _num_layers(cache) -> int:
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


def prefill_rank(cfg: HFDemoConfig, rank: int, port: int, bootstrap: str, inbox, outbox) -> None:
    """One prefill rank: prompts in, this rank's KV heads out, first token as aux."""
    try:
        import torch
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint.aux import AuxRecord
        from ..endpoint.base import KVPoll
        from ..endpoint.prefill import PrefillEndpoint
        from ..ranks import RankSpec
        from ..topology import heads_held

        torch.set_num_threads(1)
        init_group(port, rank, cfg.prefill_tp)
        model = build_model(cfg)
        fp = _agree_on_model(model)
        heads = heads_held(cfg.kv_heads, cfg.prefill_tp, rank)
        requests = make_requests(cfg)
        pool = _pool(cfg, cfg.prefill_tp, rank, cfg.prefill_layout, sum(len(p) for _, p in requests), len(requests))
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
            deadline = time.monotonic() + DEMO_TIMEOUT
            while not all(s.kv_releasable for s in senders) and time.monotonic() < deadline:
                time.sleep(0.01)
            with lock:
                for slots in freed:
                    alloc.free(slots)
            failed = [(s.room, s.reason) for s in senders if s.poll() != KVPoll.Success]
            outbox.put(("prefill_done", rank, failed, alloc.free_pages == alloc.capacity))
            inbox.get(timeout=DEMO_TIMEOUT)    # stay up until decode is done
        dist.destroy_process_group()
    except BaseException as e:   # report, never hang the demo
        import traceback
        outbox.put(("error", f"prefill rank {rank}", f"{e}\n{traceback.format_exc()}"))


# -- decode -------------------------------------------------------------------------------

def gather_cache(cfg: HFDemoConfig, pool, slots: np.ndarray, group):
    """The whole group's KV heads of ``slots`` as one HF cache, on every rank of ``group``:
    one all-gather over gloo per request of each rank's ``[layers, 2, tokens, heads, head_dim]``."""
    import torch
    import torch.distributed as dist
    mine = torch.stack([torch.stack(pool.get_kv_buffer(layer, slots)) for layer in range(cfg.layers)])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return cache_from_parts(cfg, parts)


def cache_from_parts(cfg: HFDemoConfig, parts: list):
    """An HF ``DynamicCache`` from the blocks ``[layers, 2, tokens, heads, head_dim]`` of every rank
    of a TP group, in rank order; rank r holds ``heads_held(kv_heads, len(parts), r)``."""
    import torch
    from transformers import DynamicCache

    from ..topology import heads_held
    n = parts[0].shape[2]
    full = torch.empty(cfg.layers, 2, n, cfg.kv_heads, cfg.head_dim, dtype=parts[0].dtype)
    for r, part in enumerate(parts):       # heads_held covers every head; replicas write the same values
        h = heads_held(cfg.kv_heads, len(parts), r)
        full[:, :, :, h.start:h.stop] = part
    cache = DynamicCache()
    for layer in range(cfg.layers):
        k, v = full[layer].permute(0, 2, 1, 3).unsqueeze(1)    # [1, kv_heads, tokens, head_dim] each
        cache.update(k.contiguous(), v.contiguous(), layer)
    return cache


def decode_rank(cfg: HFDemoConfig, rank: int, port: int, bootstrap: str, outbox) -> None:
    """One decode rank: grant slots, wait for the whole TP group, gather the heads, generate."""
    try:
        import torch
        import torch.distributed as dist

        from ..allocator import PageAllocator
        from ..endpoint import KVPoll, reduce_poll
        from ..endpoint.aux import AuxBuffer
        from ..endpoint.decode import DecodeEndpoint
        from ..grant import ByteRanges
        from ..ranks import RankSpec

        torch.set_num_threads(1)
        init_group(port, rank, cfg.decode_tp)
        group = dist.new_group(backend="gloo")
        model = build_model(cfg)
        fp = _agree_on_model(model, group)
        requests = make_requests(cfg)
        pool = _pool(cfg, cfg.decode_tp, rank, cfg.decode_layout, cfg.batch * cfg.max_prompt, cfg.batch)
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
                states = [KVPoll.Bootstrapping] * len(batch)
                deadline = time.monotonic() + DEMO_TIMEOUT
                while any(st not in (KVPoll.Success, KVPoll.Failed) for st in states):
                    if time.monotonic() > deadline:
                        for r in recv:
                            r.abort("demo deadline")
                    states = reduce_poll([r.poll() for r in recv], group)
                    time.sleep(0.002)
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
    import multiprocessing as mp

    import torch

    from ..control.bootstrap import BootstrapConfig, BootstrapServer

    t0 = time.perf_counter()
    tf = require_transformers()
    torch.set_num_threads(1)
    model = build_model(cfg)
    fp = fingerprint(model)
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    server = BootstrapServer(BootstrapConfig(expect=cfg.prefill_tp)).start()
    p_port, d_port = free_port(), free_port()
    inboxes = [ctx.Queue() for _ in range(cfg.prefill_tp)]
    procs = [ctx.Process(target=prefill_rank, args=(cfg, r, p_port, server.url, inboxes[r], outbox), daemon=True)
             for r in range(cfg.prefill_tp)]
    procs += [ctx.Process(target=decode_rank, args=(cfg, r, d_port, server.url, outbox), daemon=True)
              for r in range(cfg.decode_tp)]
    for p in procs:
        p.start()
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
    errors: list[str] = []
    fps: dict[str, str] = {}
    done: dict[str, list] = {"prefill": [], "decode": []}
    nbytes = 0
    t_ready = None
    deadline = time.monotonic() + DEMO_TIMEOUT
    while len(done["decode"]) < cfg.decode_tp and not errors and time.monotonic() < deadline:
        try:
            msg = outbox.get(timeout=1.0)
        except queue.Empty:
            if not all(p.is_alive() for p in procs) and outbox.empty():
                errors.append("a rank process died: " + ", ".join(str(p.exitcode) for p in procs))
            continue
        kind = msg[0]
        if kind == "ready":
            fps[f"{msg[1]} rank {msg[2]}"] = msg[3]
            if len(fps) == len(procs):
                t_ready = time.perf_counter()
        elif kind == "result":
            results[msg[1]] = msg[2:]
        elif kind == "bytes":
            nbytes += msg[1]
        elif kind == "decode_done":
            done["decode"].append(msg[2])
        elif kind == "prefill_done":
            done["prefill"].append(msg)
        elif kind == "error":
            errors.append(f"{msg[1]}: {msg[2]}")
    for q in inboxes:
        q.put("stop")
    while not errors and len(done["prefill"]) < cfg.prefill_tp and time.monotonic() < deadline:
        try:
            msg = outbox.get(timeout=5.0)
        except queue.Empty:
            errors.append("prefill ranks did not finish")
            break
        if msg[0] == "prefill_done":
            done["prefill"].append(msg)
        elif msg[0] == "error":
            errors.append(f"{msg[1]}: {msg[2]}")
    t_end = time.perf_counter()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    server.stop()
    ref_thread.join()

    errors += [f"{who} built weights {f}, this process {fp}" for who, f in sorted(fps.items()) if f != fp]
    ref = ref_box
    if len(ref) != cfg.requests:
        errors.append(f"the reference generate finished {len(ref)} of {cfg.requests} requests")
    for room, prompt in make_requests(cfg):
        if room in results:
            toks, ok, reason = results[room]
            mark = "ok" if ok and toks == ref.get(room) else \
                f"MISMATCH: want {ref.get(room)}" + (f" ({reason})" if reason else "")
            print(f"  room {room:3d}: prompt {len(prompt):3d} tokens -> {toks} {mark}", file=out)
    mismatched = [room for room, (toks, ok, _) in results.items() if not ok or toks != ref.get(room)]
    missing = cfg.requests - len(results)
    prefill_failed = [f for m in done["prefill"] for f in m[2]]
    leaks = not all(done["decode"]) or not all(m[3] for m in done["prefill"])
    transfer_s = t_end - (t_ready or t_end)
    summary = {"config": asdict(cfg), "requests": cfg.requests, "verified": len(results) - len(mismatched),
               "mismatched": mismatched, "missing": missing, "bytes_moved": nbytes, "weights": fp,
               "seconds": t_end - t0, "seconds_after_ready": transfer_s, "prefill_failed": prefill_failed,
               "slot_leak": leaks, "errors": errors}
    rows = [("requests", f"{cfg.requests}"),
            ("verified token for token", f"{summary['verified']}/{cfg.requests} (vs the model's own generate)"),
            ("bytes moved", f"{nbytes / 1e3:.1f} kB"),
            ("wall time", f"{t_end - t0:.1f} s ({transfer_s:.1f} s after every rank was ready)"),
            ("slots back to full", "no" if leaks else "yes")]
    print("\n".join(f"  {k:26s} {v}" for k, v in rows), file=out)
    for e in errors:
        print(f"  ERROR {e}", file=out)
    summary["ok"] = not (mismatched or missing or errors or prefill_failed or leaks)
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
