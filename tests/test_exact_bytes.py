"""Decode completes a source only when exactly the bytes it granted that source have landed
(issue 16): the expected count comes from decode's own grant at ``init``, never from what
prefill declares. A prefill (hostile or buggy) that declares too few bytes, in a forged FIN or
in a last chunk's metadata, fails the request with a reason naming the source, the declared
and the expected numbers; honest requests still land byte-exact.

In-process prefill/decode endpoints over the local transport (the forged messages travel the
real control channel, MAC'd with the pair's secret, from the handshaked prefill rank).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import request_peer as rp
import torch

# kvxfer names used here (update here after a module move)
from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.messages import Fin
from kvxfer.control.wire import ChunkMeta
from kvxfer.copy import execute_plan
from kvxfer.endpoint import KVPoll, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.plan import plan_transfer
from kvxfer.pools import MHAPool, StatePool
from kvxfer.ranks import RankSpec
from kvxfer.topology import decode_sources, heads_held

LENIENT = Timeouts(bootstrap=20, waiting=20, transfer=20, lease=20, heartbeat=Heartbeat(interval=0.5, timeout=5.0))
HEADS, LAYERS, SECRET = 4, 2, "exact-bytes-secret"


def _fill(pool, seed):
    for i, b in enumerate(pool.buffers):
        if seed is None:
            b.fill_(rp.CANARY)
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed + i),
                                  dtype=torch.uint8))
    return pool


def _kv(heads, seed=None, layout="token_major", page_size=4):
    return _fill(MHAPool(layers=LAYERS, heads=heads, head_dim=8, dtype="float16", num_pages=32, page_size=page_size,
                         layout=layout), seed)


def _state(heads, seed=None):
    return _fill(StatePool(layers=LAYERS, conv_blocks=[heads, heads], conv_width=3, temporal_heads=heads,
                           temporal_head_shape=[4], num_slots=8), seed)


class Topo:
    """p_tp prefill ranks and d_tp decode ranks in this process, connected over the local transport."""

    def __init__(self, p_tp=1, d_tp=1, *, d_layout="token_major", state=False):
        self.server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
        self.prefills, self.decodes = {}, {}
        try:
            for tp in range(p_tp):
                kv = _kv(len(heads_held(HEADS, p_tp, tp)), seed=10 * tp + 1, layout="hnd")
                st = _state(len(heads_held(HEADS, p_tp, tp)), seed=500 + tp) if state else None
                ep = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=HEADS, num_layers=LAYERS, tp_rank=tp,
                                              tp_size=p_tp), kv, state=st, transport="local", timeouts=LENIENT,
                                     secret=SECRET)
                ep.register(self.server.url, ttl=5.0)
                self.prefills[tp] = (ep, kv, st)
            for d in range(d_tp):
                kv = _kv(len(heads_held(HEADS, d_tp, d)), layout=d_layout, page_size=8)
                st = _state(len(heads_held(HEADS, d_tp, d))) if state else None
                ep = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=HEADS, num_layers=LAYERS, tp_rank=d,
                                             tp_size=d_tp), kv, state=st, transport="local", timeouts=LENIENT,
                                    secret=SECRET)
                ep.connect(bootstrap=self.server.url, timeout=10)
                self.decodes[d] = (ep, kv, st)
        except BaseException:
            self.close()
            raise
        self.before = {d: [b.clone() for b in kv.buffers + (st.buffers if st else [])]
                       for d, (_, kv, st) in self.decodes.items()}

    def pool_bytes(self, d):
        _, kv, st = self.decodes[d]
        return kv.buffers + (st.buffers if st else [])

    def reference(self, d, ps, ds, prefix, p_st=None, d_st=None):
        """Decode rank d's pool as it must be: before, plus every source's planned bytes."""
        ep, kv, st = self.decodes[d]
        ref = [b.clone() for b in self.before[d]]
        n = len(kv.buffers)
        for src in decode_sources(self.prefills[0][0].spec, ep.spec):
            _, p_kv, p_st_pool = self.prefills[src.p_tp_rank]
            execute_plan(plan_transfer(p_kv.layout, ps[prefix:], kv.layout, ds[prefix:], src_heads=src.src_heads,
                                       dst_heads=src.dst_heads, layers=src.layers), p_kv.buffers, ref[:n])
            if p_st is not None:
                execute_plan(plan_transfer(p_st_pool.layout, p_st, st.layout, d_st, src_heads=src.src_heads,
                                           dst_heads=src.dst_heads, layers=src.layers), p_st_pool.buffers, ref[n:])
        return ref

    def close(self):
        for ep, _, _ in list(self.decodes.values()) + list(self.prefills.values()):
            try:
                ep.close()
            except Exception:
                pass
        self.server.stop()


@pytest.fixture
def topo():
    made = []

    def make(*a, **kw):
        made.append(Topo(*a, **kw))
        return made[-1]
    yield make
    for t in made:
        t.close()


def _granted_target(s, timeout=5.0):
    """The decode target of sender ``s`` once decode's grant (its REQ) reached prefill."""
    deadline = time.monotonic() + timeout
    while not s.targets and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.targets, "decode's request never reached prefill"
    return next(iter(s.targets.values()))


def _per_token_bytes(d_kv) -> int:
    return int(sum(b.numel() * b.element_size() for b in d_kv.buffers) // (32 * 8))   # num_pages x page_size


# -- a prefill that declares too few bytes ------------------------------------------------------
def test_a_forged_fin_with_zero_bytes_does_not_complete_the_request(topo):
    t = topo()
    (de, d_kv, _), (pe, _, _) = t.decodes[0], t.prefills[0]
    r, s = de.receiver(5), pe.sender(5)
    ds = np.arange(8, 24)
    r.init(ds)
    target = _granted_target(s)
    expected = 16 * _per_token_bytes(d_kv)
    # "the last chunk moved no bytes: 0 chunks, 0 bytes", from the right peer, with the right secret
    pe.channel.send(target.peer, Fin(meta=ChunkMeta(5, target.gen, pe.source, 0, 0, 0).pack()))
    assert r.wait(5) == KVPoll.Failed, f"{r.poll()!r} {r.reason}"
    assert "declared 0 bytes" in r.reason and f"expected {expected}" in r.reason and "tp0/pp0" in r.reason, r.reason
    assert all(torch.equal(a, b) for a, b in zip(d_kv.buffers, t.before[0])), "no byte was sent, none may change"


def test_a_forged_fin_after_part_of_the_kv_does_not_complete_the_request(topo):
    """Prefill sends half the tokens, then a FIN whose totals match what it sent so far."""
    t = topo()
    (de, d_kv, _), (pe, _, _) = t.decodes[0], t.prefills[0]
    r, s = de.receiver(6), pe.sender(6)
    r.init(np.arange(8, 24))
    s.send(np.arange(4, 12))                     # tokens 0..7 of 16
    target = _granted_target(s)
    deadline = time.monotonic() + 5
    while target.chunks < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    half, full = 8 * _per_token_bytes(d_kv), 16 * _per_token_bytes(d_kv)
    assert target.nbytes == half
    pe.channel.send(target.peer, Fin(meta=ChunkMeta(6, target.gen, pe.source, 1, 1, half).pack()))
    assert r.wait(5) == KVPoll.Failed, f"{r.poll()!r} {r.reason}"
    assert f"declared {half} bytes" in r.reason and f"expected {full}" in r.reason, r.reason


def test_a_last_chunk_declaring_only_what_was_sent_does_not_complete_the_request(topo, monkeypatch):
    """The sender's ChunkMeta is forged: its first (not last) chunk says "last, 1 chunk, these bytes"."""
    t = topo()
    (de, d_kv, _), (pe, _, _) = t.decodes[0], t.prefills[0]
    real_submit = pe.transport.submit

    def forged(peer, request_id, plan, *, notify, **kw):
        m = ChunkMeta.unpack(notify)
        notify = ChunkMeta(m.room, m.gen, m.source, m.chunk, m.chunk + 1, plan.nbytes, m.aux).pack()
        return real_submit(peer, request_id, plan, notify=notify, **kw)
    monkeypatch.setattr(pe.transport, "submit", forged)
    r, s = de.receiver(7), pe.sender(7)
    r.init(np.arange(8, 24))
    s.send(np.arange(4, 12))                     # 8 of 16 tokens, declared as all of them
    half, full = 8 * _per_token_bytes(d_kv), 16 * _per_token_bytes(d_kv)
    assert r.wait(5) == KVPoll.Failed, f"{r.poll()!r} {r.reason}"
    assert f"declared {half} bytes" in r.reason and f"expected {full}" in r.reason, r.reason


# -- honest requests still succeed byte-exact ---------------------------------------------------
@pytest.mark.parametrize("p_tp,d_tp,d_layout,prefix,state", [
    (1, 1, "token_major", 0, False),
    (1, 1, "page_major", 0, False),
    (1, 2, "token_major", 0, False),
    (2, 1, "page_major", 0, False),
    (1, 2, "page_major", 5, False),
    (2, 1, "token_major", 6, False),
    (1, 1, "token_major", 3, True),
    (1, 1, "page_major", 0, True),
    (2, 1, "token_major", 4, True),
    (1, 2, "page_major", 0, True),
])
def test_honest_requests_land_byte_exact(topo, p_tp, d_tp, d_layout, prefix, state):
    t = topo(p_tp, d_tp, d_layout=d_layout, state=state)
    ps, ds = np.arange(4, 4 + 14), np.arange(8, 8 + 14)
    p_st, d_st = (np.array([2]), np.array([5])) if state else (None, None)
    recvs = {d: ep.receiver(11) for d, (ep, _, _) in t.decodes.items()}
    senders = {tp: ep.sender(11) for tp, (ep, _, _) in t.prefills.items()}
    for r in recvs.values():
        r.init(ds, prefix_len=prefix, state_slots=d_st)
    for s in senders.values():
        s.send(ps[:9])
        s.send(ps[9:], last=True, state_slots=p_st)
    for r in recvs.values():
        assert r.wait(10) == KVPoll.Success, r.reason
    for s in senders.values():
        assert s.wait(10) == KVPoll.Success, s.reason
    for d in t.decodes:
        assert rp.same_bytes(t.pool_bytes(d), t.reference(d, ps, ds, prefix, p_st, d_st))
