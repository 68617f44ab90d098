"""KVSender / KVReceiver end to end: real processes on 127.0.0.1 over ZMQ (and UCX when it works),
plus in-process multi-source topologies over the local transport, plus reduce_poll on gloo.

Every transfer test compares the decode pool, byte for byte, with a reference built by the
reference executor from a rebuilt prefill pool; bytes outside the grant must keep the canary.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import request_peer as rp
import torch
from manual_clock import ManualClock
from support.deps import need
from waiting import until

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.copy import execute_plan
from kvxfer.endpoint import KVPoll, Outcome, Timeouts, reduce_poll
from kvxfer.endpoint.aux import AuxBuffer, AuxRecord
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.errors import RequestError
from kvxfer.plan import plan_transfer
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec
from kvxfer.topology import heads_held

SUCCESS = int(KVPoll.Success)


class Cluster:
    """Bootstrap server and decode endpoint here; the prefill endpoint in a peer process."""

    def __init__(self, transport: str, **over):
        self.cfg = rp.config(transport, **over)
        self.server = BootstrapServer(BootstrapConfig(ttl=3.0)).start()
        self.P = rp.Peer("prefill", {**self.cfg, "bootstrap": self.server.url})
        self.D = rp.Side("decode", self.cfg, self.server.url)
        self.before = [b.clone() for b in self.D.kv.buffers + (self.D.st.buffers if self.D.st else [])]

    def d_buffers(self):
        return self.D.kv.buffers + (self.D.st.buffers if self.D.st else [])

    def close(self):
        self.D.close()
        self.P.close()
        self.server.stop()


@pytest.fixture(scope="module")
def cluster(transport):
    c = Cluster(transport, state_slots=16)
    yield c
    c.close()


def _check(c: Cluster, moves):
    ref = rp.reference(c.cfg, c.before, moves)
    assert rp.same_bytes(c.d_buffers(), ref), "decode pool differs from the reference (or the canary was hit)"


def _finish(c: Cluster, rooms, p_rooms=None):
    """Decode frees its successful requests; both sides must be back to full with one release each.
    A release may come a tick after the end: with eager writes it waits for the sender's FENCED."""
    until(lambda: all(c.D.releases.get(room) for room in rooms), 10)
    for room in rooms:
        assert c.D.releases.get(room) == 1
        if room in c.D.slots:
            c.D.free(room)
    st = c.P.call("wait", rooms=p_rooms or rooms, timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = c.P.call("stats")
        if all(stats["releases"].get(str(r)) == 1 for r in p_rooms or rooms):
            break
        time.sleep(0.02)
    assert all(stats["releases"].get(str(r)) == 1 for r in p_rooms or rooms), stats
    assert stats["free_pages"] == stats["capacity"], stats
    assert c.D.full()
    return st


def test_one_chunk(cluster):
    ps = cluster.P.call("sender", room=1, tokens=10)["slots"]
    r, ds = cluster.D.receiver(1, 10)
    cluster.P.call("send", room=1, last=True)
    assert r.wait(10) == KVPoll.Success, r.reason
    _check(cluster, [(ps, ds)])
    cluster.before = [b.clone() for b in cluster.d_buffers()]
    assert _finish(cluster, [1])["1"]["state"] == SUCCESS


def test_many_chunks_sent_before_the_grant(cluster):
    ps = cluster.P.call("sender", room=2, tokens=30)["slots"]
    cluster.P.call("send", room=2, range=[0, 8])      # queued: decode has not granted yet
    assert cluster.P.call("poll", rooms=[2])["2"]["state"] == int(KVPoll.Bootstrapping)
    r, ds = cluster.D.receiver(2, 30)
    for a, b in ((8, 16), (16, 24)):
        cluster.P.call("send", room=2, range=[a, b])
    cluster.P.call("send", room=2, range=[24, 30], last=True)
    assert r.wait(10) == KVPoll.Success, r.reason
    _check(cluster, [(ps, ds)])
    cluster.before = [b.clone() for b in cluster.d_buffers()]
    assert _finish(cluster, [2])["2"]["state"] == SUCCESS


def test_prefix_is_skipped(cluster):
    ps = cluster.P.call("sender", room=3, tokens=20)["slots"]
    r, ds = cluster.D.receiver(3, 20, prefix=8)
    cluster.P.call("send", room=3, range=[0, 12])
    cluster.P.call("send", room=3, range=[12, 20], last=True)
    assert r.wait(10) == KVPoll.Success, r.reason
    _check(cluster, [(ps[8:], ds[8:])])    # the prefix slots keep the canary: nothing was written there
    cluster.before = [b.clone() for b in cluster.d_buffers()]
    _finish(cluster, [3])


def test_aux_and_state_arrive_with_the_kv(cluster):
    res = cluster.P.call("sender", room=4, tokens=9, state=True)
    r, ds = cluster.D.receiver(4, 9, state=True, aux_slot=5)
    cluster.P.call("send", room=4, range=[0, 8])
    assert r.poll() != KVPoll.Success
    cluster.P.call("send", room=4, range=[8, 9], last=True, aux=[1234, -0.25, [[7, -1.5], [9, -2.0]]])
    assert r.wait(10) == KVPoll.Success, r.reason
    assert AuxRecord.unpack(r.aux) == AuxRecord(1234, -0.25, ((7, -1.5), (9, -2.0)))
    assert cluster.D.aux.read(5) == AuxRecord.unpack(r.aux)
    _check(cluster, [(res["slots"], ds, res["state"], cluster.D.state[4])])
    cluster.before = [b.clone() for b in cluster.d_buffers()]
    _finish(cluster, [4])


def test_a_thousand_concurrent_requests(transport):
    c = Cluster(transport)
    try:
        rooms = list(range(1000, 2000))
        t0 = time.monotonic()
        c.P.post("serve", rooms=rooms, tokens=4, timeout=60)    # 1 page each
        recvs = {room: c.D.receiver(room, 4) for room in rooms}
        for room, (r, _) in recvs.items():
            assert r.wait(max(0.1, 60 - (time.monotonic() - t0))) == KVPoll.Success, (room, r.reason)
        served = c.P.reply(60)
        elapsed = time.monotonic() - t0
        assert all(s["state"] == SUCCESS for s in served["status"].values())
        _check(c, [(served["slots"][str(room)], recvs[room][1]) for room in rooms])
        _finish(c, rooms)
        print(f"1000 x 1-page requests over {transport}: {elapsed:.2f}s, {1000 / elapsed:.0f} req/s")
    finally:
        c.close()


@pytest.mark.slow   # seconds
def test_eager_writes_end_to_end():
    """Decode's UCX transport pregrants its requests (``eager_writes``), to the request's prefill
    rank only: it puts without the ANNOUNCE/GO round trip. Bytes, releases and the slots' return
    are as without: every slot comes back once the prefill rank said FENCED for it."""
    need("ucx")
    c = Cluster("ucx", eager=True)
    try:
        t, eager, told = c.D.ep.transport, [], []
        orig = t.receiver.on_announce
        t.receiver.on_announce = lambda p, m: (eager.append(m.eager), orig(p, m))[1]
        pregrant = t.pregrants.pregrant
        t.pregrants.pregrant = lambda rid, senders=None: (told.append(senders), pregrant(rid, senders))[1]
        rooms = list(range(3000, 3200))
        c.P.post("serve", rooms=rooms, tokens=4, timeout=60)
        recvs = {room: c.D.receiver(room, 4) for room in rooms}
        for room, (r, _) in recvs.items():
            assert r.wait(30) == KVPoll.Success, (room, r.reason)
        served = c.P.reply(60)
        assert all(s["state"] == SUCCESS for s in served["status"].values())
        _check(c, [(served["slots"][str(room)], recvs[room][1]) for room in rooms])
        went = sum(map(bool, eager))
        assert went >= len(rooms) // 2, f"only {went} of {len(eager)} transfers were eager"
        # decode named the request's prefill rank: only it was told (its transport id, a peer here)
        (prefill_id,) = {d["ucx"]["id"] for d in (i.data for i in c.D.ep.links.known_peers().values())}
        assert len(told) == len(rooms) and set(told) == {frozenset({prefill_id})}, set(told)
        assert prefill_id in t.peers
        _finish(c, rooms)
        assert t.fencing()["eager_fences"] == 0, t.fencing()
    finally:
        c.close()


def test_receiver_arguments_are_checked(cluster):
    r = cluster.D.ep.receiver(5)
    with pytest.raises(RequestError, match="prefix_len"):
        r.init(np.arange(8, 12), prefix_len=4)
    with pytest.raises(ValueError, match="padding page"):
        r.init(np.arange(0, 4))
    with pytest.raises(ValueError, match=r"kv_slots\[2\] = 8 is named twice"):
        r.init(np.array([8, 9, 8, 10]))
    assert not r.granted   # refused before anything was granted
    r.abort("test")
    assert r.poll() == KVPoll.Failed and r.outcome == Outcome.Aborted and "test" in r.reason
    assert isinstance(r.failure_exception(), RequestError)


# ------------------------------------------------------------------------------------
# Several sources per decode rank (in-process, local transport): heterogeneous TP, PP stages,
# a silent replica. The decode side reaches Success only when every source delivered.
# ------------------------------------------------------------------------------------
LENIENT = Timeouts(bootstrap=20, waiting=20, transfer=20, lease=20, heartbeat=Heartbeat(interval=0.5, timeout=5.0))


def _pool(rank_heads, layers, seed=None, layout="token_major", page_size=4):
    p = MHAPool(layers=layers, heads=rank_heads, head_dim=8, dtype="float16", num_pages=32, page_size=page_size,
                layout=layout)
    for i, b in enumerate(p.buffers):
        if seed is None:
            b.fill_(rp.CANARY)
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed + i),
                                  dtype=torch.uint8))
    return p


@pytest.mark.parametrize("heads,p_tp,p_pp,d_tp", [(4, 2, 2, 1), (4, 1, 1, 2), (1, 2, 1, 1), (4, 4, 1, 2)])
def test_multi_source_topologies(heads, p_tp, p_pp, d_tp):
    num_layers = 4
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    prefills, decodes = {}, {}
    try:
        from kvxfer.topology import stage_layers
        for pp in range(p_pp):
            for tp in range(p_tp):
                pool = _pool(len(heads_held(heads, p_tp, tp)), list(stage_layers(num_layers, p_pp, pp)),
                             seed=100 * pp + 10 * tp, layout="hnd")
                ep = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=heads, num_layers=num_layers,
                                              tp_rank=tp, tp_size=p_tp, pp_rank=pp, pp_size=p_pp),
                                     pool, transport="local", timeouts=LENIENT)
                ep.register(server.url, ttl=5.0)
                prefills[(tp, pp)] = (ep, pool)
        for d in range(d_tp):
            pool = _pool(len(heads_held(heads, d_tp, d)), num_layers, page_size=8)
            ep = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=heads, num_layers=num_layers, tp_rank=d,
                                         tp_size=d_tp), pool, transport="local", timeouts=LENIENT,
                                aux=AuxBuffer(4))
            ep.connect(bootstrap=server.url, timeout=10)
            decodes[d] = (ep, pool)
        p_slots, d_slots = np.arange(4, 4 + 14), np.arange(8, 8 + 14)
        before = {d: [b.clone() for b in pool.buffers] for d, (_, pool) in decodes.items()}
        recvs = [ep.receiver(77) for ep, _ in decodes.values()]
        senders = {k: ep.sender(77) for k, (ep, _) in prefills.items()}
        for r in recvs:
            r.init(d_slots, aux_slot=1)
        for (_tp, pp), s in senders.items():
            s.send(p_slots[:8])
            s.send(p_slots[8:], last=True, aux=AuxRecord(5) if pp == p_pp - 1 else None)
        for r in recvs:
            assert r.wait(10) == KVPoll.Success, r.reason
            assert AuxRecord.unpack(r.aux) == AuxRecord(5)
        for s in senders.values():
            assert s.wait(10) == KVPoll.Success, s.reason
        # reference: every source's planned bytes, applied locally
        from kvxfer.topology import decode_sources
        for d, (ep, pool) in decodes.items():
            ref = before[d]
            for src in decode_sources(prefills[(0, 0)][0].spec, ep.spec):
                p_pool = prefills[(src.p_tp_rank, src.p_pp_rank)][1]
                execute_plan(plan_transfer(p_pool.layout, p_slots, pool.layout, d_slots, src_heads=src.src_heads,
                                           dst_heads=src.dst_heads, layers=src.layers), p_pool.buffers, ref)
            assert rp.same_bytes(pool.buffers, ref)
        deadline = time.monotonic() + 5
        while not all(s.kv_releasable for s in senders.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s.kv_releasable for s in senders.values())
    finally:
        for ep, _ in list(decodes.values()) + list(prefills.values()):
            ep.close()
        server.stop()


def test_layer_group_chunks_and_an_empty_last_chunk():
    """Prefill streams per layer group as it computes (every token, layers 0-1, then 2-3); a final
    chunk with no bytes left still ends the request (a FIN on the control channel)."""
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    p_pool, d_pool = _pool(4, 4, seed=7), _pool(4, 4, layout="page_major")
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=4), p_pool, transport="local",
                         timeouts=LENIENT)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=4), d_pool, transport="local",
                        timeouts=LENIENT, aux=AuxBuffer(4))
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        ref = [b.clone() for b in d_pool.buffers]
        ps, ds = np.arange(4, 4 + 10), np.arange(8, 8 + 10)
        for room, layer_groups, empty_last in ((1, ([0, 1], [2, 3]), False), (2, ([0, 1, 2, 3],), True)):
            r, s = de.receiver(room), pe.sender(room)
            r.init(ds, aux_slot=room)
            for i, layers in enumerate(layer_groups):
                last = i == len(layer_groups) - 1 and not empty_last
                s.send(ps, start=0, layers=layers, last=last, aux=AuxRecord(room) if last else None)
                if not last:
                    assert r.poll() != KVPoll.Success
            if empty_last:
                assert r.wait(0.5, until=KVPoll.Transferring) == KVPoll.Transferring
                s.send(ps[:0], start=len(ps), last=True, aux=AuxRecord(room))
            assert r.wait(5) == KVPoll.Success, r.reason
            assert AuxRecord.unpack(r.aux) == AuxRecord(room) and s.wait(5) == KVPoll.Success
        execute_plan(plan_transfer(p_pool.layout, ps, d_pool.layout, ds), p_pool.buffers, ref)
        assert rp.same_bytes(d_pool.buffers, ref)
    finally:
        de.close()
        pe.close()
        server.stop()


def test_a_last_chunk_short_of_the_grant_fails_both_sides():
    """Prefill's chunks end before the tokens decode granted (a length mismatch between the
    engines): decode must not reach Success with KV it never got; both sides fail, saying so."""
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=2), _pool(4, 2, seed=3),
                         transport="local", timeouts=LENIENT)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=2), _pool(4, 2), transport="local",
                        timeouts=LENIENT)
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        r, s = de.receiver(9), pe.sender(9)
        r.init(np.arange(8, 24))                  # 16 tokens granted
        s.send(np.arange(4, 12))
        s.send(np.arange(12, 16), last=True)      # 12 sent
        assert s.wait(5) == KVPoll.Failed and "tokens 12..15 would never arrive" in s.reason, s.reason
        assert r.wait(5) == KVPoll.Failed and "tokens 12..15" in r.reason, r.reason
    finally:
        de.close()
        pe.close()
        server.stop()


def test_prefill_holds_the_kv_while_a_transport_still_reads_it():
    """A transfer fails while its transport may still read the KV (zero-copy frames queued for a
    stalled peer, puts in flight: ``holds_source``). Prefill must not release the KV, not even
    when the lease is over, until the transport lets go of the source; then it releases once.
    The lease runs on a manual clock: no waiting for it."""
    from kvxfer.errors import PeerError
    from kvxfer.transport.base import TransferHandle
    from kvxfer.transport.registry import get_transport
    held, released = [], []
    p_xport, clock = get_transport("local"), ManualClock()

    def failing_submit(peer, request_id, plan, *, timeout=30.0, notify=b"", capability=b""):   # fault injection
        h = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        h.finish(PeerError(f"request {request_id}: injected: the peer stopped answering"))
        held.append(h)
        return h

    p_xport.submit = failing_submit
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=2), _pool(4, 2, seed=3),
                         transport=p_xport, timeouts=LENIENT, clock=clock)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=2), _pool(4, 2), transport="local",
                        timeouts=LENIENT)
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        r, s = de.receiver(5), pe.sender(5, on_release=released.append)
        r.init(np.arange(8, 16))
        assert s.wait(5, until=KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        s.send(np.arange(4, 12), last=True)
        assert s.wait(5) == KVPoll.Failed and "injected" in s.reason
        assert r.wait(5) == KVPoll.Failed   # prefill told decode
        clock.advance(LENIENT.lease + 1)    # the lease is over: a scan sees it and still holds the KV
        assert until(lambda: s.overdue, 5)
        assert len(held) == 1 and not s.kv_releasable and not released
        held[0].release_source()
        assert until(lambda: released, 5)
        assert released == [Outcome.Failed] and s.kv_releasable
        time.sleep(0.1)                     # a few more ticks
        assert released == [Outcome.Failed]  # once
    finally:
        de.close()
        pe.close()
        p_xport.close()
        server.stop()


def test_decode_holds_the_slots_while_writes_may_still_land():
    """A request ends on decode while its transport says writes of it may still land (one-sided
    puts in flight: ``writes_pending``): the slots are released only once that ends, once."""
    from kvxfer.transport.registry import get_transport
    d_xport, pending, released = get_transport("local"), {"on": True}, []
    d_xport.writes_pending = lambda request_id: pending["on"]   # fault injection: puts in flight
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=2), _pool(4, 2, seed=3),
                         transport="local", timeouts=LENIENT)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=2), _pool(4, 2), transport=d_xport,
                        timeouts=LENIENT)
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        r = de.receiver(6, on_release=released.append)
        r.init(np.arange(8, 16))
        r.abort("the scheduler dropped it")
        assert r.poll() == KVPoll.Failed
        time.sleep(0.3)   # several ticks
        assert not released
        pending["on"] = False
        deadline = time.monotonic() + 2
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert released == [Outcome.Aborted]
    finally:
        de.close()
        pe.close()
        d_xport.close()
        server.stop()


# ------------------------------------------------------------------------------------
# reduce_poll: all-reduce MIN over a gloo group of 2 ranks
# ------------------------------------------------------------------------------------
def test_reduce_poll_over_gloo(tmp_path):
    ctx = rp.context()
    init = f"file://{tmp_path}/rendezvous"
    q = ctx.Queue()
    procs = [ctx.Process(target=_reduce_rank, args=(rank, init, q)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    # rank 0: [Success, Success, Transferring, Failed]; rank 1: [Success, WaitingForInput, Success, Success]
    want = [KVPoll.Success, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed]
    assert got == {0: [int(x) for x in want], 1: [int(x) for x in want]}


def _reduce_rank(rank: int, init: str, q) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    mine = [[KVPoll.Success, KVPoll.Success, KVPoll.Transferring, KVPoll.Failed],
            [KVPoll.Success, KVPoll.WaitingForInput, KVPoll.Success, KVPoll.Success]][rank]
    out = reduce_poll(mine, dist.group.WORLD)
    q.put((rank, [int(x) for x in out]))
    dist.destroy_process_group()
