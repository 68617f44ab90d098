"""TP-group agreement: ``reduce_poll`` over a ``LocalGroup`` (ranks in one process) has the
semantics of the gloo all-reduce (MIN), and ``reduce_poll`` refuses groups it cannot use
(None, NCCL) with a message that says what to pass. The gloo path itself is covered by
``test_request.py::test_reduce_poll_over_gloo``."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import request_peer as rp
import torch.distributed as dist
from request_pair import LENIENT, pool

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.copy import execute_plan
from kvxfer.endpoint import DecodeEndpoint, KVPoll, LocalGroup, PrefillEndpoint, reduce_poll
from kvxfer.plan import plan_transfer
from kvxfer.ranks import RankSpec
from kvxfer.topology import decode_sources

S, W, T, F = KVPoll.Success, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed


def _in_threads(group, per_rank):
    out, errors = [None] * len(per_rank), []

    def member(i):
        try:
            out[i] = reduce_poll(per_rank[i], group)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out, errors


def test_local_group_reduces_with_min_like_the_gloo_group():
    per_rank = [[S, S, T, F], [S, W, S, S], [S, S, S, S]]
    group = LocalGroup(3)
    for _ in range(3):   # rounds follow one another
        out, errors = _in_threads(group, per_rank)
        assert not errors and out == [[S, W, T, F]] * 3
    assert group.reduce_all(per_rank) == [S, W, T, F]
    assert LocalGroup(1).reduce([T]) == [T]


def test_local_group_errors_say_what_went_wrong():
    out, errors = _in_threads(LocalGroup(2), [[S, S], [S]])
    assert len(errors) == 2 and all("same requests in the same order" in str(e) for e in errors)
    lonely = LocalGroup(2, timeout=0.2)
    with pytest.raises(RuntimeError, match="not all 2 members called reduce_poll"):
        reduce_poll([S], lonely)
    with pytest.raises(ValueError, match="n >= 1"):
        LocalGroup(0)
    with pytest.raises(ValueError, match="states of 1"):
        LocalGroup(2).reduce_all([[S]])


def test_reduce_poll_refuses_groups_it_cannot_use(monkeypatch):
    with pytest.raises(ValueError, match=r"explicit group.*backend='gloo'.*LocalGroup"):
        reduce_poll([S], None)
    nccl = object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is nccl else "gloo")
    with pytest.raises(ValueError, match=r"backend is 'nccl'.*backend='gloo'"):
        reduce_poll([S], nccl)


def test_a_tp_group_in_one_process_agrees_through_a_local_group():
    """Decode TP 2 in this process (one thread per rank), prefill TP 1: each rank waits for the
    group, not only for its own heads; every byte of every rank checked."""
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    p_pool = pool(5)
    d_pools = [pool(None, heads=1), pool(None, heads=1)]
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=2, num_layers=2), p_pool, transport="local",
                         timeouts=LENIENT)
    des = [DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2, tp_rank=i, tp_size=2), d_pools[i],
                          transport="local", timeouts=LENIENT) for i in range(2)]
    try:
        pe.register(server.url, ttl=5.0)
        for de in des:
            de.connect(bootstrap=server.url, timeout=10)
        before = [[b.clone() for b in p.buffers] for p in d_pools]
        ps, ds = np.arange(4, 14), np.arange(8, 18)
        recvs = [de.receiver(9) for de in des]
        recvs[0].init(ds)                  # rank 1 grants later: the group must wait for it
        s = pe.sender(9)
        group, seen = LocalGroup(2), [[], []]

        def rank(i):
            while True:
                st = reduce_poll([recvs[i].poll()], group)[0]
                seen[i].append(st)
                if st in (S, F):
                    return
                if i == 1 and not recvs[1].granted:
                    recvs[1].init(ds)
                    s.send(ps, last=True)

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert seen[0][-1] == seen[1][-1] == S and seen[0] == seen[1]   # both saw the same agreed states
        assert seen[0][0] == KVPoll.Bootstrapping                     # rank 0 alone was not enough
        for i, de in enumerate(des):
            ref = before[i]
            for src in decode_sources(pe.spec, de.spec):
                execute_plan(plan_transfer(p_pool.layout, ps, d_pools[i].layout, ds, src_heads=src.src_heads,
                                           dst_heads=src.dst_heads, layers=src.layers), p_pool.buffers, ref)
            assert rp.same_bytes(d_pools[i].buffers, ref)
    finally:
        for de in des:
            de.close()
        pe.close()
        server.stop()
