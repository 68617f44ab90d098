"""One vLLM engine in a process of its own, driven line by line (run by the engine venv's python,
never imported by pytest): ``python tests/vllm_engine.py serve --model DIR --role plain|prefill|decode
[--extra JSON] [--block-size N] [--tp N]``, or ``python tests/vllm_engine.py model DIR`` to write the tiny
seeded Llama the e2e tests use.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the commands can
step it, abort a request, count free blocks, and reach the connector's worker (``KvxferConnector.
worker``) for the fault cases. Commands (one JSON object per line on stdin), replies (one JSON
object per line on stdout, after ``@@``; vLLM's own logs go to the same streams):
    {"op": "add", "id", "prompt": [ids], "max_tokens", "params": kv_transfer_params|null, "pause": bool}
        "pause": stop stepping once this request finished (a prefill whose send is then not started)
    {"op": "wait", "ids": [...], "timeout"}     -> {"outputs": {id: {tokens, logprobs, params, reason}}}
    {"op": "abort", "id"}  {"op": "resume"}  {"op": "free"} -> {"free": free blocks, "all": usable blocks}
    {"op": "loads"} -> {"loads": [[req_id, request_id, state, granted], ...]} (the worker's live receivers)
    {"op": "hold", "on": bool}: the faulty transport holds (or lets go) writes_pending of live loads
    {"op": "delay", "seconds"}: prefill's faulty transport starts each transfer that much later
    {"op": "flip"}: the next load that finishes gets bytes of its first block flipped (negative control)
    {"op": "errors"} -> {"errors": [block ids reported as load errors so far]}
    {"op": "digests"} -> {"digests": {request id: [hash of each block]}}: prefill, of the KV it sends (at
        request_finished); decode, of the KV that landed (when the load is reported, before any compute)
    {"op": "exit"}
"""
from __future__ import annotations

import faulthandler
import json
import os
import queue
import sys
import threading
import time

for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
             "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}.items():
    os.environ.setdefault(k, v)

DTYPE = "float32"


def make_model(path: str) -> None:
    """A tiny Llama with GQA (4 heads, 2 KV heads, head size 32), seeded, weights wide enough that
    greedy tokens vary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(getattr(torch, DTYPE))
    model.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)


def write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer over the model's vocabulary ("w0" .. "w511", ids 0..511, split on
    spaces), so a ``vllm serve`` of the model answers text prompts too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)


def reply(**kw) -> None:
    sys.stdout.write("@@" + json.dumps(kw) + "\n")
    sys.stdout.flush()


class Server:
    def __init__(self, args):
        from vllm import EngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine
        ktc = None
        if args.role != "plain":
            ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                                   kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
                                   kv_connector_extra_config=json.loads(args.extra),
                                   kv_load_failure_policy="recompute")
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=args.model, skip_tokenizer_init=True, enforce_eager=True, block_size=args.block_size,
            disable_hybrid_kv_cache_manager=True, max_model_len=512, max_num_seqs=8, dtype=DTYPE, seed=0,
            kv_transfer_config=ktc, tensor_parallel_size=args.tp,
            distributed_executor_backend="mp" if args.tp > 1 else None))
        self.core = self.engine.engine_core.engine_core     # in-process EngineCore
        self.outputs: dict[str, dict] = {}
        self.pause_after: set[str] = set()
        self.paused = False
        self.errors: list[int] = []
        self.flip_armed = False
        self.digests: dict[str, list[str]] = {}   # internal request id -> block hashes (sent / landed)
        self.worker = None
        if ktc is not None and args.tp == 1:   # TP > 1: the workers are processes of their own
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            conn = get_kv_transfer_group()
            self.worker = conn.worker
            self._wrap(conn)

    def _wrap(self, conn) -> None:
        """Count the load errors vLLM is told of, and flip bytes of an armed load (test instruments)."""
        real_finished, real_errors = conn.get_finished, conn.get_block_ids_with_load_errors
        sched = self.core.scheduler.connector
        real_request_finished = sched.request_finished

        def get_finished(ids):
            sent, received = real_finished(ids)
            for rid in received or ():   # decode: the KV that landed, before vLLM computes with it
                if rid in self.core.scheduler.requests:
                    self.digests[rid] = self.digest(self.core.scheduler.kv_cache_manager.get_block_ids(rid)[0])
            if self.flip_armed and received:   # after the bytes landed, before vLLM computes with them
                import torch
                rid = sorted(received)[0]
                first = self.core.scheduler.kv_cache_manager.get_block_ids(rid)[0][0]
                layer0 = self.worker.kv.memory[0]
                layer0[first].reshape(-1).view(torch.uint8)[:256] ^= 0x10
                self.flip_armed = False
            return sent, received

        def request_finished(request, block_ids):   # scheduler side (prefill): the KV it will send
            held, params = real_request_finished(request, block_ids)
            if held:
                self.digests[request.request_id] = self.digest(block_ids)
            return held, params

        def get_errors():
            got = real_errors()
            self.errors.extend(sorted(got))
            return got

        conn.get_finished, conn.get_block_ids_with_load_errors = get_finished, get_errors
        sched.request_finished = request_finished

    def digest(self, blocks) -> list[str]:
        """Per block, a hash of its bytes in every layer (whole tiles: the CPU layout moves whole blocks)."""
        import hashlib

        import torch
        out = []
        for b in blocks:
            h = hashlib.sha256()
            for t in self.worker.kv.memory:
                h.update(t[b].contiguous().view(torch.uint8).numpy().tobytes())
            out.append(h.hexdigest()[:16])
        return out

    def add(self, c) -> None:
        from vllm import SamplingParams
        extra = {"kv_transfer_params": c["params"]} if c.get("params") is not None else None
        sp = SamplingParams(max_tokens=c["max_tokens"], temperature=0.0, logprobs=1, extra_args=extra)
        if c.get("pause"):
            self.pause_after.add(c["id"])
        self.engine.add_request(c["id"], {"prompt_token_ids": c["prompt"]}, sp)

    def collect(self, outs) -> None:
        for o in outs:
            if not o.finished:
                continue
            c = o.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
            self.outputs[o.request_id] = {"tokens": list(c.token_ids), "logprobs": lps,
                                          "params": o.kv_transfer_params, "reason": c.finish_reason}
            if o.request_id in self.pause_after:
                self.paused = True

    def loads(self) -> list:
        return [[rid, r.request_id, r.state.name, r.granted] for rid, r in self.worker.receivers()]

    def handle(self, c, waits) -> bool:
        op = c["op"]
        if op == "add":
            self.add(c)
            reply(ok=True)
        elif op == "wait":
            waits.append((c, time.monotonic() + c.get("timeout", 120)))
        elif op == "abort":
            self.engine.abort_request([c["id"]])
            reply(ok=True)
        elif op == "resume":
            self.paused = False
            reply(ok=True)
        elif op == "free":
            pool = self.core.scheduler.kv_cache_manager.block_pool
            reply(free=pool.get_num_free_blocks(), all=pool.num_gpu_blocks - 1)   # block 0 is vLLM's null block
        elif op == "loads":
            reply(loads=self.loads())
        elif op == "hold":
            faults = self.worker.decode.transport.faults
            if c["on"]:
                faults.hold_pending.update(x[1] for x in self.loads())
            else:
                faults.hold_pending.clear()
            reply(held=sorted(faults.hold_pending))
        elif op == "delay":   # prefill: the faulty transport starts each transfer this many seconds late
            self.worker.prefill.transport.faults.submit_delay = float(c["seconds"])
            reply(ok=True)
        elif op == "flip":
            self.flip_armed = True
            reply(ok=True)
        elif op == "digests":
            reply(digests=self.digests)
        elif op == "errors":
            reply(errors=self.errors)
        elif op == "exit":
            reply(ok=True)
            return False
        return True

    def run(self) -> None:
        commands: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [commands.put(json.loads(line)) for line in sys.stdin], daemon=True).start()
        reply(ready=True)
        waits: list = []
        while True:
            try:
                c = commands.get(timeout=0.0 if (waits or not self.paused) else 0.05)
                if not self.handle(c, waits):
                    return
            except queue.Empty:
                pass
            if not self.paused and self.core.scheduler.has_requests():
                self.collect(self.engine.step())
            else:
                time.sleep(0.002)
            for w in list(waits):
                c, deadline = w
                if all(i in self.outputs for i in c["ids"]) or time.monotonic() > deadline:
                    waits.remove(w)
                    reply(outputs={i: self.outputs.get(i) for i in c["ids"]})


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["serve", "model"])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--model")
    ap.add_argument("--role", default="plain", choices=["plain", "prefill", "decode"])
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    faulthandler.enable()   # a crash in native code prints every thread's Python stack to the log
    # kvxfer's own record of each request's end and each prefill rank lost or back, stamped, in the
    # engine's log: what a failed case is read from
    import logging
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("kvxfer %(asctime)s %(name)s %(levelname)s %(message)s"))
    kv = logging.getLogger("kvxfer")
    kv.addHandler(h)
    kv.setLevel(logging.INFO)
    kv.propagate = False
    if args.what == "model":
        make_model(args.path)
        return
    Server(args).run()
    os._exit(0)   # the engine's threads need not be joined


if __name__ == "__main__":
    main()
