"""Hybrid sliding-window (SWA) pools through the request endpoints, in-process, over the local and
ZMQ transports: full-attention layers move for every token decode lacks, sliding-window layers only
for the window decode keeps (``KVReceiver.init(swa_slots=...)``).

Every transfer test compares every byte of every decode pool with a reference: the decode pool
before (canary bytes) plus the expected moves, planned and executed locally from the prefill pools.
So a byte written outside the grant, a sliding-window slot outside the window, or a prefix slot,
shows up as a canary that changed. The one-to-one cases also compare the typed K/V values.
"""
from __future__ import annotations

import re
import time

import msgpack
import numpy as np
import pytest
import torch

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.compat import check_pair, layout_record
from kvxfer.control.messages import from_map
from kvxfer.control.records import RankInfo
from kvxfer.control.wire import decode, encode
from kvxfer.copy import execute_plan
from kvxfer.endpoint.aux import AuxBuffer, AuxRecord
from kvxfer.endpoint.base import KVPoll, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.errors import CompatibilityError, RequestError
from kvxfer.layout import SWA, TOKEN, token_major_layout
from kvxfer.plan import plan_transfer
from kvxfer.pools import HybridSWAPool, MHAPool
from kvxfer.ranks import RankSpec
from kvxfer.topology import decode_sources, heads_held, stage_layers

CANARY = 0xCD
LAYERS, FULL, SLIDING = 4, [0, 2], [1, 3]
WINDOW = 10
LENIENT = Timeouts(bootstrap=20, waiting=20, transfer=20, lease=20, heartbeat=Heartbeat(interval=0.5, timeout=5.0))
TRANSPORTS = ["local", "zmq"]


def _options(transport: str) -> dict:
    return {"heartbeat_ivl": 0.5, "heartbeat_timeout": 5.0} if transport == "zmq" else {}


def hybrid(heads: int, layers=range(LAYERS), *, seed: int | None = None, layout: str = "token_major",
           page_size: int = 4, window: int = WINDOW) -> HybridSWAPool:
    """A hybrid pool of ``layers`` (SWA layers per ``SLIDING``): seeded random bytes, or the canary."""
    pool = HybridSWAPool(full_layers=[x for x in layers if x in FULL], swa_layers=[x for x in layers if x in SLIDING],
                         heads=heads, head_dim=8, dtype="float16", num_pages=64 // page_size,
                         swa_num_pages=32 // page_size, page_size=page_size, window=window, layout=layout)
    for i, b in enumerate(pool.buffers):
        if seed is None:
            b.fill_(CANARY)
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed * 100 + i),
                                  dtype=torch.uint8))
    return pool


def usable(pool, space: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct usable slots of ``space`` in random order (scattered runs)."""
    sp = pool.layout.space(space)
    return rng.permutation(np.arange(sp.page_size, sp.num_slots))[:n]


class Cluster:
    """Prefill ranks and decode ranks of one model, in this process, with a bootstrap server."""

    def __init__(self, transport: str, *, heads: int = 4, p_tp: int = 1, p_pp: int = 1, d_tp: int = 1,
                 p_layout: str = "token_major", d_layout: str = "token_major", p_page: int = 4, d_page: int = 4):
        self.server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
        self.prefills: dict[tuple[int, int], tuple[PrefillEndpoint, HybridSWAPool]] = {}
        self.decodes: dict[int, tuple[DecodeEndpoint, HybridSWAPool]] = {}
        try:
            for pp in range(p_pp):
                for tp in range(p_tp):
                    pool = hybrid(len(heads_held(heads, p_tp, tp)), stage_layers(LAYERS, p_pp, pp),
                                  seed=10 * pp + tp + 1, layout=p_layout, page_size=p_page)
                    ep = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=heads, num_layers=LAYERS, tp_rank=tp,
                                                  tp_size=p_tp, pp_rank=pp, pp_size=p_pp), pool,
                                         transport=transport, transport_options=_options(transport),
                                         timeouts=LENIENT)
                    ep.register(self.server.url, ttl=5.0)
                    self.prefills[(tp, pp)] = (ep, pool)
            for d in range(d_tp):
                pool = hybrid(len(heads_held(heads, d_tp, d)), layout=d_layout, page_size=d_page)
                ep = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=heads, num_layers=LAYERS, tp_rank=d,
                                             tp_size=d_tp), pool, transport=transport,
                                    transport_options=_options(transport), timeouts=LENIENT, aux=AuxBuffer(4))
                ep.connect(bootstrap=self.server.url, timeout=20)
                self.decodes[d] = (ep, pool)
        except BaseException:
            self.close()
            raise

    def close(self):
        for ep, _ in list(self.decodes.values()) + list(self.prefills.values()):
            ep.close()
        self.server.stop()


@pytest.fixture
def cluster_of():
    made = []

    def make(*args, **kw) -> Cluster:
        made.append(Cluster(*args, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def run_request(c: Cluster, room: int, *, tokens: int, prefix: int, window: int, chunks, p_maps: str = "window",
                seed: int = 0):
    """One request through every rank of ``c``; returns (prefill slots, decode slots, decode window
    slots, decode buffers before) after checking both sides reached Success."""
    rng = np.random.default_rng(seed)
    ps = usable(c.prefills[(0, 0)][1], TOKEN, tokens, rng)
    # prefill maps its request positions to window slots as the engine would: all of them, or only the
    # last pool window (older ones evicted). The same ids on every prefill rank (one scheduler).
    mapped = ps if p_maps == "all" else ps[-WINDOW:]
    p_swa = usable(c.prefills[(0, 0)][1], SWA, len(mapped), rng)
    for _, pool in c.prefills.values():
        pool.map_swa(mapped, p_swa)
    ds, d_swa = usable(c.decodes[0][1], TOKEN, tokens, rng), usable(c.decodes[0][1], SWA, window, rng)
    before = {d: [b.clone() for b in pool.buffers] for d, (_, pool) in c.decodes.items()}
    recvs = [ep.receiver(room) for ep, _ in c.decodes.values()]
    senders = {k: ep.sender(room) for k, (ep, _) in c.prefills.items()}
    for r in recvs:
        r.init(ds, prefix_len=prefix, swa_slots=d_swa, aux_slot=1)
    last_stage = max(pp for _, pp in c.prefills)
    for (_tp, pp), s in senders.items():
        for i, (a, b) in enumerate(chunks):
            last = i == len(chunks) - 1
            s.send(ps[a:b], last=last, aux=AuxRecord(room) if last and pp == last_stage else None)
    for r in recvs:
        assert r.wait(20) == KVPoll.Success, r.reason
        assert AuxRecord.unpack(r.aux) == AuxRecord(room)
    for s in senders.values():
        assert s.wait(20) == KVPoll.Success, s.reason
    deadline = time.monotonic() + 10
    while not all(s.kv_releasable for s in senders.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(s.kv_releasable for s in senders.values())
    return ps, ds, d_swa, before


def expected(c: Cluster, ps, ds, d_swa, before, prefix: int) -> dict[int, list[torch.Tensor]]:
    """Each decode pool as it must be: ``before`` plus full layers of tokens ``prefix..`` and the
    sliding-window layers of the window tokens at or after ``prefix``, from every source."""
    tokens, window = len(ds), len(d_swa)
    first = max(prefix, tokens - window)            # first window token that moves
    out = {}
    for d, (ep, pool) in c.decodes.items():
        ref = [b.clone() for b in before[d]]
        for src in decode_sources(c.prefills[(0, 0)][0].spec, ep.spec):
            p_pool = c.prefills[(src.p_tp_rank, src.p_pp_rank)][1]
            src_slots = {TOKEN: ps[prefix:], SWA: p_pool.full_to_swa[ps[first:]]}
            dst_slots = {TOKEN: ds[prefix:], SWA: d_swa[first - (tokens - window):]}
            assert (src_slots[SWA] != 0).all()
            execute_plan(plan_transfer(p_pool.layout, src_slots, pool.layout, dst_slots, src_heads=src.src_heads,
                                       dst_heads=src.dst_heads, layers=src.layers), p_pool.buffers, ref)
        out[d] = ref
    return out


def check_bytes(c: Cluster, ps, ds, d_swa, before, prefix: int) -> None:
    for d, ref in expected(c, ps, ds, d_swa, before, prefix).items():
        got = c.decodes[d][1].buffers
        assert len(got) == len(ref)
        for i, (x, y) in enumerate(zip(got, ref)):
            assert torch.equal(x, y), f"decode rank {d}, region {c.decodes[d][1].layout.regions[i].name}: " \
                                      f"{int((x != y).sum())} byte(s) differ from the reference"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (random bytes include NaNs, which never compare equal as floats)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_typed(c: Cluster, ps, ds, d_swa, prefix: int) -> None:
    """Independent of the planner (one prefill rank, one decode rank): every K/V value that should
    have moved did, and every window slot that should not have keeps the canary."""
    (_, p), (_, d) = c.prefills[(0, 0)], c.decodes[0]
    tokens, window = len(ds), len(d_swa)
    first = max(prefix, tokens - window)
    for layer in FULL:
        for kind in ("k", "v"):
            assert same(d.get_part(layer, kind, ds[prefix:]), p.get_part(layer, kind, ps[prefix:]))
    d.map_swa(ds[tokens - window:], d_swa)      # lets get_part address decode's window by full slots
    try:
        for layer in SLIDING:
            for kind in ("k", "v"):
                assert same(d.get_part(layer, kind, ds[first:]), p.get_part(layer, kind, ps[first:]))
                held = d.get_part(layer, kind, ds[tokens - window:first]).view(torch.uint8)
                assert (held == CANARY).all(), "a window slot inside the prefix was written"
    finally:
        d.unmap_swa(ds[tokens - window:])
    used = d.layout.space(SWA)
    others = np.setdiff1d(np.arange(used.page_size, used.num_slots), d_swa[first - (tokens - window):])
    for layer in SLIDING:
        for kind in ("k", "v"):
            raw = d._part_view(d.layout.part(layer, kind))      # [pages, page_size, heads, bytes]
            cells = raw.reshape(-1, *raw.shape[2:])[torch.from_numpy(others)]
            assert (cells == CANARY).all(), "a sliding-window slot outside the window was written"


# ------------------------------------------------------------------------------------
# One prefill rank, one decode rank: one chunk, several chunks, prefix skip
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("tokens,prefix,window,chunks,p_maps", [
    (14, 0, WINDOW, [(0, 14)], "all"),                         # one chunk; prefill maps every token
    (22, 8, WINDOW, [(0, 8), (8, 16), (16, 22)], "window"),    # window straddles chunks; prefix before it
    (22, 17, 7, [(0, 12), (12, 20), (20, 22)], "all"),         # prefix inside the window; shorter window
    (5, 0, 5, [(0, 4), (4, 5)], "window"),                     # request shorter than the pool window
])
def test_hybrid_request_moves_full_layers_and_the_window(cluster_of, transport, tokens, prefix, window, chunks,
                                                         p_maps):
    c = cluster_of(transport)
    ps, ds, d_swa, before = run_request(c, 7, tokens=tokens, prefix=prefix, window=window, chunks=chunks,
                                        p_maps=p_maps)
    check_bytes(c, ps, ds, d_swa, before, prefix)
    check_typed(c, ps, ds, d_swa, prefix)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layouts_and_page_sizes_bridge(cluster_of, transport):
    c = cluster_of(transport, p_layout="page_major", d_layout="hnd", p_page=4, d_page=8)
    ps, ds, d_swa, before = run_request(c, 8, tokens=20, prefix=4, window=WINDOW, chunks=[(0, 8), (8, 20)])
    check_bytes(c, ps, ds, d_swa, before, 4)
    check_typed(c, ps, ds, d_swa, 4)


# ------------------------------------------------------------------------------------
# Heterogeneous TP and PP: head slices and stages apply to the window layers as to the full ones
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("p_tp,p_pp,d_tp", [(1, 1, 2), (2, 1, 1), (2, 2, 1)])
def test_hybrid_heterogeneous_tp_and_pp(cluster_of, transport, p_tp, p_pp, d_tp):
    c = cluster_of(transport, p_tp=p_tp, p_pp=p_pp, d_tp=d_tp, p_layout="hnd")
    ps, ds, d_swa, before = run_request(c, 9, tokens=18, prefix=3, window=WINDOW, chunks=[(0, 8), (8, 18)])
    check_bytes(c, ps, ds, d_swa, before, 3)


# ------------------------------------------------------------------------------------
# Failures: an unmapped window token, bad window slots, a hybrid / non-hybrid pair
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_unmapped_window_token_fails_the_request_and_sends_nothing(cluster_of, transport):
    c = cluster_of(transport)
    (pe, p), (de, d) = c.prefills[(0, 0)], c.decodes[0]
    rng = np.random.default_rng(3)
    ps, ds = usable(p, TOKEN, 12, rng), usable(d, TOKEN, 12, rng)
    p.map_swa(ps[-WINDOW:-1], usable(p, SWA, WINDOW - 1, rng))     # the last token was never mapped
    before = [b.clone() for b in d.buffers]
    r, s = de.receiver(11), pe.sender(11)
    r.init(ds, swa_slots=usable(d, SWA, WINDOW, rng))
    s.send(ps, last=True)
    assert s.wait(10) == KVPoll.Failed and "no sliding-window slot" in s.reason and "token 11" in s.reason
    assert r.wait(10) == KVPoll.Failed and "no sliding-window slot" in r.reason
    time.sleep(0.2)   # a stray write would land within this
    assert all(torch.equal(x, y) for x, y in zip(d.buffers, before)), "bytes were sent for a failed request"


def test_bad_window_slots_are_refused_at_init(cluster_of):
    c = cluster_of("local")
    de, d = c.decodes[0]
    ds = np.arange(4, 16)
    cases = [(None, "pass swa_slots"), (np.arange(4, 4 + WINDOW + 1), r"must cover the last 1\.\.10 tokens"),
             (np.arange(4, 4), "must cover the last"),
             (np.arange(0, 3), "padding page"), (np.arange(30, 34), "out of range")]
    for i, (swa, why) in enumerate(cases):
        r = de.receiver(20 + i)
        with pytest.raises((RequestError, ValueError), match=why):
            r.init(ds, swa_slots=swa)
        r.abort("test")
    r = de.receiver(30)
    with pytest.raises(RequestError, match=r"1\.\.3 tokens"):      # a 3-token request has a 3-token window
        r.init(ds[:3], swa_slots=np.arange(4, 8))
    r.abort("test")


def test_swa_slots_on_a_pool_without_a_window_are_refused():
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    pool = MHAPool(layers=LAYERS, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4)
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=LAYERS), pool, transport="local",
                         timeouts=LENIENT)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=LAYERS),
                        MHAPool(layers=LAYERS, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4),
                        transport="local", timeouts=LENIENT)
    try:
        pe.register(server.url, ttl=5.0)
        de.connect(bootstrap=server.url, timeout=10)
        with pytest.raises(RequestError, match="no sliding-window layers"):
            de.receiver(1).init(np.arange(4, 8), swa_slots=np.arange(4, 6))
    finally:
        de.close()
        pe.close()
        server.stop()


@pytest.mark.parametrize("hybrid_side", ["prefill", "decode"])
def test_hybrid_and_plain_pools_refuse_to_pair(hybrid_side):
    server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    plain = MHAPool(layers=LAYERS, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4)
    pools = {"prefill": plain, "decode": plain}
    pools[hybrid_side] = hybrid(4)
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=LAYERS), pools["prefill"],
                         transport="local", timeouts=LENIENT)
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=LAYERS), pools["decode"],
                        transport="local", timeouts=LENIENT)
    try:
        pe.register(server.url, ttl=5.0)
        with pytest.raises(CompatibilityError, match="hybrid SWA: .* on both sides or on neither"):
            de.connect(bootstrap=server.url, timeout=10)
    finally:
        de.close()
        pe.close()
        server.stop()


def _info(role: str, pool, window: int | None = None) -> RankInfo:
    w = pool.window if window is None else window
    return RankInfo(spec=RankSpec(role=role, num_kv_heads=4, num_layers=LAYERS), control="tcp://127.0.0.1:1",
                    data={"local": {}}, layout=layout_record(pool.layout, w), aux_bytes=64)


def test_check_pair_names_window_and_layer_mismatches():
    assert check_pair(_info("prefill", hybrid(4)), _info("decode", hybrid(4, layout="hnd", page_size=8))) == []
    why = check_pair(_info("prefill", hybrid(4)), _info("decode", hybrid(4, window=12)))
    assert any("sliding window: P 10 tokens vs D 12 tokens" in w for w in why), why
    why = check_pair(_info("prefill", hybrid(4)), _info("decode", hybrid(4), window=0))
    assert any("sliding window" in w for w in why), why
    why = check_pair(_info("prefill", hybrid(4)), _info("decode", hybrid(4), window=-1))
    assert any("swa_window" in w for w in why), why
    other = HybridSWAPool(full_layers=[0, 1], swa_layers=[2, 3], heads=4, head_dim=8, dtype="float16", num_pages=16,
                          swa_num_pages=8, page_size=4, window=WINDOW)
    why = check_pair(_info("prefill", hybrid(4)), _info("decode", other))
    assert any("sliding-window on P but full-attention on D" in w for w in why), why
    plain = token_major_layout(layers=LAYERS, heads=4, head_dim=8, dtype="float16", num_slots=64, page_size=4)
    why = check_pair(_info("prefill", hybrid(4)),
                     RankInfo(spec=RankSpec(role="decode", num_kv_heads=4, num_layers=LAYERS),
                              control="tcp://127.0.0.1:1", data={"local": {}}, layout=plain.to_dict(), aux_bytes=64))
    assert any("on both sides or on neither" in w for w in why), why


def test_window_fields_are_type_checked_on_the_wire():
    req = {"t": "req", "room": 1, "gen": 1, "kv": b"", "prefix": 0, "state": b"", "aux": False, "dummy": False}
    assert decode(encode(from_map(req), None), None).to_dict() == req       # a plain request: no window fields
    ok = {**req, "swa": np.arange(4, 6, dtype="<i8").tobytes(), "swa_n": 2}
    assert decode(encode(from_map(ok), None), None).to_dict() == ok
    for bad in ({**req, "swa_n": "2"}, {**req, "swa_n": -1}, {**req, "swa": 5}):
        with pytest.raises(ValueError, match="swa"):     # as a peer would send it: msgpack, no MAC
            decode([b"", msgpack.packb(bad, use_bin_type=True)], None)


@pytest.mark.parametrize("swa,count,why", [
    (np.arange(4, 8), 3, "their count"),                        # count disagrees with the slots
    (np.arange(4, 8), None, "their count"),                     # no count at all
    (np.array([4, 5, 99]), 3, "out of range"),                  # a slot outside decode's swa space
    (np.arange(4, 4 + WINDOW + 1), WINDOW + 1, r"must be 1\.\.10"),   # more than the window
    (np.arange(4, 4), 0, r"must be 1\.\.10"),                   # no window at all
])
def test_prefill_checks_the_window_slots_it_is_sent(cluster_of, swa, count, why):
    """A decode peer that bypasses init()'s checks gets a NACK naming the problem; nothing is bound."""
    c = cluster_of("local")
    (pe, _), (de, _) = c.prefills[(0, 0)], c.decodes[0]
    r = de.receiver(40)
    msg = {"t": "req", "room": r.room, "gen": r.gen, "kv": np.arange(4, 20, dtype="<i8").tobytes(), "prefix": 0,
           "state": b"", "aux": False, "dummy": False, "swa": swa.astype("<i8").tobytes()}
    if count is not None:
        msg["swa_n"] = count
    pe.on_message(de.channel.identity, from_map(msg))
    assert r.wait(10) == KVPoll.Failed
    assert "bad request" in r.reason and re.search(why, r.reason), r.reason
    assert pe.sender(40).poll() == KVPoll.Bootstrapping        # the request was not queued for a sender
