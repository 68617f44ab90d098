"""One side of ``test_vllm_workers.py``: a process holding the vLLM connector's worker object
(``KvxferWorker``; no vLLM needed) over tensors shaped as vLLM hands them, driven through a pipe.

    prefill(conn, port, layers, heads, head, block, blocks)   scheduler + worker, TP 1, NHD paged views
    decode(conn, tp_rank, tp_size, layers, heads, head, block, blocks)   worker of one TP rank, HND

Messages (plain tuples over a multiprocessing pipe, test-only): prefill gets ("finish", req_id,
prompt_len, block_ids) and answers with the kv_transfer_params; decode gets ("plan", StepPlan) and
answers ("done", received, errors) once its worker reports the load, then ("read", block_ids, n)
-> the K and V bytes of tokens 0..n (numpy, [n, heads, head] per layer).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from kvxfer.integrations.vllm.scheduler import KvxferScheduler
from kvxfer.integrations.vllm.settings import ModelShape, parse
from kvxfer.integrations.vllm.worker import KvxferWorker

NAMES = "model.layers.{}.self_attn.attn"


def paged(blocks: int, block: int, heads: int, head: int, layers: int, nhd: bool, seed: int | None):
    """vLLM's per-layer views [B, H, N, K|V] (NHD: memory [B, N, H, K|V]), a pattern or zeros."""
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for i in range(layers):
        shape = (blocks, block, heads, 2 * head) if nhd else (blocks, heads, block, 2 * head)
        t = torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)
        out[NAMES.format(i)] = t.permute(0, 2, 1, 3) if nhd else t
    return out


def read(kv: dict, block_ids, n: int, block: int, head: int) -> list[np.ndarray]:
    """K and V of tokens 0..n, ``[n, heads, head]`` per layer, by vLLM's own indexing."""
    pos = np.arange(n)
    b, o = np.asarray(block_ids)[pos // block], pos % block
    return [t[b, :, o].numpy().copy() for t in kv.values()]   # [n, heads, 2 * head]


def prefill(conn, port: int, layers: int, heads: int, head: int, block: int, blocks: int) -> None:
    settings = parse({"bootstrap_port": port}, "kv_producer")
    sched = KvxferScheduler(settings, block)
    kv = paged(blocks, block, heads, head, layers, nhd=True, seed=1)
    worker = KvxferWorker(settings, ModelShape(num_kv_heads=heads, num_layers=layers, head_size=head,
                                               block_size=block, tp_rank=0, tp_size=1))
    worker.register(kv)
    conn.send(("ready",))
    sent: set[str] = set()
    while True:
        if conn.poll(0.01):
            msg = conn.recv()
            if msg[0] == "finish":
                _, rid, n, block_ids = msg
                req = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)),
                                      kv_transfer_params={"do_remote_decode": True},
                                      status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
                held, params = sched.finished(req, block_ids)
                worker.run_plan(sched.build_plan())
                conn.send((held, params, read(kv, block_ids, n, block, head)))
            elif msg[0] == "sent":
                conn.send(sorted(sent))
            elif msg[0] == "exit":
                worker.close()
                sched.close()
                conn.send(("bye",))
                return
        got, _, _ = worker.take()
        sent |= got


def decode(conn, tp_rank: int, tp_size: int, layers: int, heads: int, head: int, block: int, blocks: int) -> None:
    settings = parse({}, "kv_consumer", engine_id="decode-engine-1")   # one engine: its ranks share the id
    kv = paged(blocks, block, heads // tp_size, head, layers, nhd=False, seed=None)
    worker = KvxferWorker(settings, ModelShape(num_kv_heads=heads, num_layers=layers, head_size=head,
                                               block_size=block, tp_rank=tp_rank, tp_size=tp_size))
    worker.register(kv)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "plan":
            worker.run_plan(msg[1])
            want = {r.req_id for r in msg[1].recv}
            received, errors, end = set(), set(), time.monotonic() + 60
            while not want <= received and time.monotonic() < end:
                worker.idle_wait(0.05)
                _, got, bad = worker.take()
                received |= got
                errors |= bad
            conn.send(("done", sorted(received), sorted(errors)))
        elif msg[0] == "read":
            conn.send(read(kv, msg[1], msg[2], block, head))
        elif msg[0] == "exit":
            worker.close()
            conn.send(("bye",))
            return
