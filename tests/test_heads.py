"""Head placement by head id (issue #19): ``RankSpec.head_map`` (which global KV heads each TP
rank of a group holds, in the order of its pool's local heads), checked on the way in, carried in
``RankInfo`` over the wire, used by the topology, and refused at the handshake when two ranks of
one group disagree. Every transfer test checks the bytes that landed against the ones sent."""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.compat import check_group, head_map_mismatch
from kvxfer.control.records import RankInfo
from kvxfer.endpoint import AuxBuffer, DecodeEndpoint, KVPoll, PrefillEndpoint, Timeouts
from kvxfer.errors import CompatibilityError, PlanError
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec
from kvxfer.topology import expected_decode_ranks, heads_held, peer_sources, peers_needed, sources_for_decode_rank

H, LAYERS, DIM, PAGE = 4, 2, 8, 4
QUICK = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10, handshake=5,
                 heartbeat=Heartbeat(interval=0.5, timeout=5.0))


def spec(role: str, tp: int, rank: int, head_map=None, **kw) -> RankSpec:
    return RankSpec(role=role, num_kv_heads=kw.pop("heads", H), num_layers=LAYERS, tp_size=tp, tp_rank=rank,
                    head_map=head_map, **kw)


# ------------------------------------------------------------------------------------
# The record: checked, normalised, carried
# ------------------------------------------------------------------------------------
def test_default_record_is_unchanged_on_the_wire():
    s = spec("decode", 2, 1)
    assert s.head_map is None and list(s.heads) == [2, 3]
    d = RankInfo(spec=s).to_dict()
    assert "head_map" not in d                       # an old peer reads it as before
    assert RankInfo.from_dict(d).spec == s           # and a record without one means the default
    assert spec("decode", 2, 1, [[0, 1], [2, 3]]).head_map is None   # explicit default == default


def test_explicit_map_round_trips():
    s = spec("decode", 2, 0, [[3, 1], [0, 2]])
    assert s.head_map == ((3, 1), (0, 2)) and list(s.heads) == [3, 1] and list(s.heads_of(1)) == [0, 2]
    d = RankInfo(spec=s).to_dict()
    assert d["head_map"] == [[3, 1], [0, 2]]
    assert RankInfo.from_dict(d).spec == s


@pytest.mark.parametrize("bad, why", [
    ([[0, 1]], "list of 2 lists"),                            # one row per TP rank
    ("0123", "list of 2 lists"),
    ([[0, 1, 2], [3]], "must list 2"),                         # count per rank
    ([[0, 4], [1, 2]], "integers in 0..3"),                   # range
    ([[0, -1], [1, 2]], "integers in 0..3"),
    ([[0, True], [2, 3]], "integers in 0..3"),                # bool is not a head id
    ([[0, 1.0], [2, 3]], "integers in 0..3"),
    ([[1, 1], [2, 3]], "names a head twice"),                 # unique per rank
    ([[0, 1], [1, 2]], "held by 2 TP rank"),                  # every head once (3 by nobody)
])
def test_bad_maps_are_refused_naming_the_field(bad, why):
    with pytest.raises(ValueError, match="head_map") as e:
        spec("decode", 2, 0, bad)
    assert why in str(e.value)
    with pytest.raises(ValueError, match=why):                # the same from a peer's record
        RankInfo.from_dict({**RankInfo(spec=spec("decode", 2, 0)).to_dict(), "head_map": bad})


_ANY = st.recursive(st.none() | st.booleans() | st.integers(-5, 1 << 40) | st.floats() | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=6), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(raw=_ANY, tp=st.integers(1, 8), heads=st.integers(1, 8))
def test_any_map_from_a_peer_only_raises_value_error(raw, tp, heads):
    d = {**RankInfo(spec=RankSpec(role="decode", num_kv_heads=8, num_layers=LAYERS)).to_dict(), "head_map": raw,
         "tp_size": tp, "num_kv_heads": heads}
    try:
        info = RankInfo.from_dict(d)
    except ValueError:
        return
    s = info.spec                                   # accepted: an explicit map is a valid placement
    for r in range(s.tp_size if s.head_map is not None else 0):
        assert len(s.heads_of(r)) == len(heads_held(s.num_kv_heads, s.tp_size, 0))


def test_a_map_has_a_size_bound():
    big = 1 << 17                                            # over MAX_HEAD_IDS: refused before any row is read
    with pytest.raises(ValueError, match="more than 65536 head ids"):
        spec("decode", 1, 0, [range(big)], heads=big)


def test_replicated_heads_and_mla_maps():
    # TP 8 over 4 heads: each head on 2 ranks, any placement that keeps that
    s = spec("prefill", 8, 0, [[3], [3], [2], [2], [1], [1], [0], [0]])
    assert list(s.heads) == [3]
    with pytest.raises(ValueError, match="head 2 is held by 1 TP rank"):
        spec("prefill", 8, 0, [[3], [3], [3], [2], [1], [1], [0], [0]])
    with pytest.raises(ValueError, match="replicated KV"):
        spec("prefill", 2, 0, [[0], [0]], heads=1, replicated=True)
    with pytest.raises(ValueError, match="not divisible"):
        spec("prefill", 3, 0, [[0], [1], [2, 3]])


# ------------------------------------------------------------------------------------
# The topology: sources by head id
# ------------------------------------------------------------------------------------
def _heads_landing(p_tp, d_tp, p_map, d_map, heads=H):
    """(decode rank, decode local head) -> the global head written there, over every source;
    asserts nothing is written twice."""
    got = {}
    for d in range(d_tp):
        srcs = sources_for_decode_rank(num_kv_heads=heads, p_tp=p_tp, d_tp=d_tp, d_rank=d, num_layers=LAYERS,
                                       p_heads=p_map, d_heads=d_map)
        for s in srcs:
            n_src = len(heads_held(heads, p_tp, 0))
            n_dst = len(heads_held(heads, d_tp, 0))
            ps, pn = _span(s.src_heads, n_src)
            ds, dn = _span(s.dst_heads, n_dst)
            assert pn == dn
            p_row = p_map[s.p_tp_rank] if p_map else list(heads_held(heads, p_tp, s.p_tp_rank))
            for k in range(dn):
                key = (d, ds + k)
                assert key not in got, f"{key} written twice"
                got[key] = p_row[ps + k]
    return got


def _span(sl, n):
    m = n // sl.count
    return sl.index * m, m


@pytest.mark.parametrize("p_tp, d_tp, p_map, d_map", [
    (1, 2, None, [[3, 1], [0, 2]]),
    (2, 2, None, [[3, 1], [0, 2]]),
    (2, 2, [[2, 3], [0, 1]], None),
    (2, 4, [[1, 0], [3, 2]], [[2], [0], [3], [1]]),
    (4, 2, [[3], [2], [1], [0]], [[0, 2], [1, 3]]),
    (8, 2, [[3], [3], [2], [2], [1], [1], [0], [0]], [[1, 0], [3, 2]]),
    (2, 8, [[0, 3], [1, 2]], [[3], [3], [2], [2], [1], [1], [0], [0]]),
])
def test_every_decode_head_gets_the_head_it_names(p_tp, d_tp, p_map, d_map):
    got = _heads_landing(p_tp, d_tp, p_map, d_map)
    want = {(d, j): h for d in range(d_tp)
            for j, h in enumerate(d_map[d] if d_map else heads_held(H, d_tp, d))}
    assert got == want
    # the prefill side sees the same sources from its own record and the decode rank's, and waits
    # for the decode ranks it feeds (a silent replica: for rank 0's dummy request)
    for p in range(p_tp):
        ps, fed = spec("prefill", p_tp, p, p_map), set()
        for d in range(d_tp):
            ds = spec("decode", d_tp, d, d_map)
            mine = peer_sources(ps, ds)
            assert mine == peers_needed(ps, ds).get((p, 0), [])
            fed |= {d} if mine else set()
        assert expected_decode_ranks(ps, spec("decode", d_tp, 0, d_map)) == frozenset(fed or {0})


def test_default_sources_are_the_old_blocks():
    """No map: one aligned slice per (prefill rank, stage), as before head ids."""
    s = sources_for_decode_rank(num_kv_heads=8, p_tp=2, d_tp=4, d_rank=3, num_layers=LAYERS, p_pp=2)
    assert [(x.p_tp_rank, x.p_pp_rank, x.src_heads.to_list(), x.dst_heads.to_list()) for x in s] == \
        [(1, 0, [1, 2], [0, 1]), (1, 1, [1, 2], [0, 1])]


def test_a_head_no_prefill_rank_holds_is_a_plan_error():
    with pytest.raises(PlanError, match="holds head 3, which no prefill TP rank holds"):
        sources_for_decode_rank(num_kv_heads=H, p_tp=2, d_tp=2, d_rank=1, num_layers=LAYERS,
                                p_heads=[[0, 1], [2, 2]])


# ------------------------------------------------------------------------------------
# Disagreement: refused, naming both ranks and both assignments
# ------------------------------------------------------------------------------------
def test_group_members_that_disagree_are_named():
    a = spec("prefill", 2, 0, [[2, 3], [0, 1]])
    b = spec("prefill", 2, 1)
    why = head_map_mismatch(a, b)
    assert why and a.key in why and b.key in why and "[2, 3]" in why and "[0, 1]" in why
    assert check_group([RankInfo(spec=a), RankInfo(spec=b)]) == [why]
    assert check_group([RankInfo(spec=a), RankInfo(spec=spec("prefill", 2, 1, [[2, 3], [0, 1]]))]) == []
    assert head_map_mismatch(a, spec("prefill", 2, 1, instance="other")) is None   # another group


# ------------------------------------------------------------------------------------
# End to end: bytes by head id
# ------------------------------------------------------------------------------------
class _Ready:
    def query(self):
        return True


def _value(n, layer, kind):
    """K/V of every global head: value encodes (layer, kind, token, head, dim)."""
    t = torch.arange(n).view(n, 1, 1)
    h = torch.arange(H).view(1, H, 1)
    d = torch.arange(DIM).view(1, 1, DIM)
    return ((layer * 2 + kind) * 100 + t) * 100.0 + h * 10 + d * 0.01


def _run(p_tp, d_tp, p_map, d_map, server_url=None, tokens=10):
    """P TP ``p_tp`` -> D TP ``d_tp`` in this process over the local transport, one request;
    each decode rank must hold exactly the heads its map names, each prefill rank sends the heads
    its map names. Returns nothing; asserts."""
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    pes, des = [], []
    try:
        p_pools = []
        for r in range(p_tp):
            s = spec("prefill", p_tp, r, p_map)
            pool = MHAPool(layers=LAYERS, heads=len(s.heads), head_dim=DIM, dtype="float32", num_pages=16,
                           page_size=PAGE, layout="page_major")
            pe = PrefillEndpoint(s, pool, transport="local", timeouts=QUICK)
            pe.register(server.url)
            pes.append(pe), p_pools.append(pool)
        d_pools, auxes = [], []
        for r in range(d_tp):
            s = spec("decode", d_tp, r, d_map)
            pool = MHAPool(layers=LAYERS, heads=len(s.heads), head_dim=DIM, dtype="float32", num_pages=16,
                           page_size=PAGE)
            for b in pool.buffers:
                b.fill_(0xCD)
            aux = AuxBuffer(2)
            de = DecodeEndpoint(s, pool, aux=aux, transport="local", timeouts=QUICK)
            des.append(de), d_pools.append(pool), auxes.append(aux)
            de.connect(bootstrap=server.url, timeout=10)
        room, n = 5, tokens
        d_slots = [p.allocator().alloc(n) for p in d_pools]
        recvs = [de.receiver(room) for de in des]
        for r, rc in enumerate(recvs):
            rc.init(d_slots[r], aux_slot=0)
        senders = []
        for pe, pool in zip(pes, p_pools):
            slots = pool.allocator().alloc(n)
            held = torch.tensor(list(pe.spec.heads))
            for layer in range(LAYERS):
                pool.set_kv_buffer(layer, slots, _value(n, layer, 0)[:, held], _value(n, layer, 1)[:, held])
            sd = pe.sender(room)
            sd.send(slots, last=True, ready=_Ready(), aux=b"\x00" * pe.aux_bytes)
            senders.append(sd)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(rc.poll() not in (KVPoll.Success, KVPoll.Failed) for rc in recvs):
            time.sleep(0.01)
        assert [rc.poll() for rc in recvs] == [KVPoll.Success] * d_tp, [rc.failure_exception() for rc in recvs]
        for r, pool in enumerate(d_pools):
            mine = torch.tensor(list(des[r].spec.heads))
            for layer in range(LAYERS):
                k, v = pool.get_kv_buffer(layer, d_slots[r])
                assert torch.equal(k, _value(n, layer, 0)[:, mine]), (r, layer)
                assert torch.equal(v, _value(n, layer, 1)[:, mine]), (r, layer)
        for sd in senders:
            assert sd.wait(5) == KVPoll.Success
    finally:
        for ep in des + pes:
            ep.close()
        server.stop()


def test_default_placement_moves_byte_exact():
    _run(1, 2, None, None)


def test_permuted_decode_placement_moves_the_right_heads():
    _run(2, 2, None, [[3, 1], [0, 2]])


def test_permuted_prefill_placement_moves_the_right_heads():
    _run(2, 4, [[2, 3], [1, 0]], [[1], [0], [3], [2]])


def test_prefill_ranks_that_disagree_are_refused_at_connect():
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    eps = []
    try:
        for r, m in ((0, [[2, 3], [0, 1]]), (1, None)):       # rank 1 thinks it holds 2, 3 (the default)
            s = spec("prefill", 2, r, m)
            pool = MHAPool(layers=LAYERS, heads=2, head_dim=DIM, dtype="float32", num_pages=16, page_size=PAGE)
            pe = PrefillEndpoint(s, pool, transport="local", timeouts=QUICK)
            pe.register(server.url)
            eps.append(pe)
        pool = MHAPool(layers=LAYERS, heads=4, head_dim=DIM, dtype="float32", num_pages=16, page_size=PAGE)
        de = DecodeEndpoint(spec("decode", 1, 0), pool, transport="local", timeouts=QUICK)
        eps.append(de)
        with pytest.raises(CompatibilityError) as e:
            de.connect(bootstrap=server.url, timeout=10)
        msg = str(e.value)
        assert "default/dp0/pp0/tp0" in msg and "default/dp0/pp0/tp1" in msg and "[2, 3]" in msg and "[0, 1]" in msg
    finally:
        for ep in eps:
            ep.close()
        server.stop()


def test_prefill_refuses_a_decode_rank_that_disagrees_with_its_group():
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    eps = []
    try:
        pool = MHAPool(layers=LAYERS, heads=4, head_dim=DIM, dtype="float32", num_pages=16, page_size=PAGE)
        pe = PrefillEndpoint(spec("prefill", 1, 0), pool, transport="local", timeouts=QUICK)
        pe.register(server.url)
        eps.append(pe)
        first = DecodeEndpoint(spec("decode", 2, 0, [[3, 1], [0, 2]]),
                               MHAPool(layers=LAYERS, heads=2, head_dim=DIM, dtype="float32", num_pages=16,
                                       page_size=PAGE), transport="local", timeouts=QUICK)
        eps.append(first)
        first.connect(bootstrap=server.url, timeout=10)
        other = DecodeEndpoint(spec("decode", 2, 1),          # the default: it holds 2, 3, not 0, 2
                               MHAPool(layers=LAYERS, heads=2, head_dim=DIM, dtype="float32", num_pages=16,
                                       page_size=PAGE), transport="local", timeouts=QUICK)
        eps.append(other)
        with pytest.raises(CompatibilityError) as e:
            other.connect(bootstrap=server.url, timeout=10)
        msg = str(e.value)
        assert "head placement" in msg and "[3, 1]" in msg and "[2, 3]" in msg and "tp0" in msg and "tp1" in msg
    finally:
        for ep in eps:
            ep.close()
        server.stop()



def test_a_restarted_decode_group_may_change_its_map_once_the_old_ranks_are_silent():
    """A decode group restarted with another head map: refused while an earlier rank of it still
    answers heartbeats, accepted once the prefill rank found it silent."""
    fast = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10, handshake=5,
                    heartbeat=Heartbeat(interval=0.1, timeout=0.6))
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()

    def decode(r, m):
        return DecodeEndpoint(spec("decode", 2, r, m), MHAPool(layers=LAYERS, heads=2, head_dim=DIM, dtype="float32",
                                                               num_pages=16, page_size=PAGE),
                              transport="local", timeouts=fast)
    eps = []
    try:
        pe = PrefillEndpoint(spec("prefill", 1, 0), MHAPool(layers=LAYERS, heads=4, head_dim=DIM, dtype="float32",
                                                             num_pages=16, page_size=PAGE),
                             transport="local", timeouts=fast)
        pe.register(server.url)
        eps.append(pe)
        first = [decode(r, None) for r in range(2)]
        eps += first
        for de in first:
            de.connect(bootstrap=server.url, timeout=10)
        first[0].close()                              # rank 0 restarts with the new map ...
        again = decode(0, [[3, 1], [0, 2]])
        eps.append(again)
        with pytest.raises(CompatibilityError, match="head placement"):
            again.connect(bootstrap=server.url, timeout=10)   # ... while rank 1 of the old map lives
        first[1].close()                              # the whole group restarted: rank 1 goes silent
        deadline = time.monotonic() + 10
        while True:
            renewed = decode(0, [[3, 1], [0, 2]])
            eps.append(renewed)
            try:
                renewed.connect(bootstrap=server.url, timeout=10)
                break
            except CompatibilityError:
                assert time.monotonic() < deadline, "the silent rank still holds the group's head map"
                time.sleep(0.2)
    finally:
        for ep in eps:
            ep.close()
        server.stop()
