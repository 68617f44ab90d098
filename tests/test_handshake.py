"""Launch-time compatibility (in words), the HMAC-authenticated handshake, and the wire checks."""
from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.compat import check_pair, require_compatible
from kvxfer.control.handshake import hello
from kvxfer.control.messages import from_map
from kvxfer.control.records import RankInfo
from kvxfer.control.wire import ChunkMeta, decode, encode
from kvxfer.endpoint.base import Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.errors import CompatibilityError, ConnectError
from kvxfer.layout import (
    combine_layouts,
    hnd_layout,
    page_major_layout,
    state_layout,
    token_major_layout,
)
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec
from kvxfer.topology import (
    expected_decode_ranks,
    heads_held,
    peers_needed,
    stage_layers,
)

MAKERS = {"token_major": token_major_layout, "hnd": hnd_layout, "page_major": page_major_layout}


def layout(kind="token_major", *, layers=4, heads=4, head_dim=8, dtype="float16", page_size=4, state=False):
    size = ({"num_slots": 16 * page_size} if kind == "token_major" else {"num_pages": 16})
    lay = MAKERS[kind](layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, page_size=page_size, **size)
    if state:
        lay = combine_layouts(lay, state_layout(layers=layers, conv_blocks=[4, 4], conv_width=3, temporal_heads=heads,
                                                temporal_head_shape=[4], num_slots=8))
    return lay


def info(role, lay, *, kv_heads=4, num_layers=4, tp=1, tp_rank=0, pp=1, pp_rank=0, aux=64, transport="local"):
    return RankInfo(spec=RankSpec(role=role, num_kv_heads=kv_heads, num_layers=num_layers, tp_size=tp,
                                  tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank),
                    control="tcp://127.0.0.1:1", data={transport: {}}, layout=lay.to_dict(), aux_bytes=aux)


# ------------------------------------------------------------------------------------
# What the planner bridges is accepted
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("p_kind,d_kind", [("token_major", "hnd"), ("page_major", "token_major"),
                                           ("hnd", "page_major")])
@pytest.mark.parametrize("p_page,d_page", [(4, 4), (4, 8), (2, 16), (16, 4)])
def test_bridgeable_layouts_and_page_sizes_are_accepted(p_kind, d_kind, p_page, d_page):
    assert check_pair(info("prefill", layout(p_kind, page_size=p_page)),
                      info("decode", layout(d_kind, page_size=d_page))) == []


@pytest.mark.parametrize("heads,p_tp,p_pp,d_tp", [(8, 2, 1, 4), (8, 4, 1, 2), (2, 4, 1, 1), (8, 2, 2, 1), (1, 2, 1, 2)])
def test_heterogeneous_tp_and_pp_are_accepted(heads, p_tp, p_pp, d_tp):
    num_layers = 4
    for pp in range(p_pp):
        for tp in range(p_tp):
            p = info("prefill", layout(layers=list(stage_layers(num_layers, p_pp, pp)),
                                       heads=len(heads_held(heads, p_tp, tp))),
                     kv_heads=heads, tp=p_tp, tp_rank=tp, pp=p_pp, pp_rank=pp)
            for d in range(d_tp):
                dd = info("decode", layout(heads=len(heads_held(heads, d_tp, d))), kv_heads=heads, tp=d_tp, tp_rank=d)
                assert check_pair(p, dd) == [], (tp, pp, d)


def test_every_prefill_rank_is_contacted_and_counted():
    """Silent replicas get a dummy request from decode rank 0 and expect exactly that one."""
    p = RankSpec(role="prefill", num_kv_heads=1, num_layers=2, tp_size=4)
    d = RankSpec(role="decode", num_kv_heads=1, num_layers=2, tp_size=2)
    contacts = [peers_needed(p, RankSpec(role="decode", num_kv_heads=1, num_layers=2, tp_size=2, tp_rank=r))
                for r in range(2)]
    assert {k for c in contacts for k in c} == {(t, 0) for t in range(4)}
    assert [k for k, v in contacts[0].items() if not v] and not [k for k, v in contacts[1].items() if not v]
    for t in range(4):
        pr = RankSpec(role="prefill", num_kv_heads=1, num_layers=2, tp_size=4, tp_rank=t)
        senders = {r for r in range(2) if (t, 0) in contacts[r]}
        assert expected_decode_ranks(pr, d) == frozenset(senders), t


# ------------------------------------------------------------------------------------
# What it cannot bridge is refused, in words
# ------------------------------------------------------------------------------------
REFUSALS = {
    "page size not mappable": (dict(page_size=16), dict(page_size=24), {},
                               "P page_size 16 vs D page_size 24: one must be a multiple of the other"),
    "dtype mismatch": (dict(dtype="bfloat16"), dict(dtype="float16"), {},
                       "dtype of k, v: P bfloat16 vs D float16"),
    "head_dim mismatch": (dict(head_dim=16), dict(head_dim=8), {}, "head_dim of k, v: P 16 vs D 8"),
    "layer count mismatch": (dict(layers=4), dict(layers=3), dict(d_layers=3),
                             "layer count: P has 4 layers vs D 3"),
    "KV heads not divisible by TP": (dict(heads=6), dict(heads=2), dict(kv_heads=6, d_tp=4),
                                     "KV heads 6 not divisible by D TP size 4"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_names_the_mismatch(case):
    p_kw, d_kw, top, words = REFUSALS[case]
    p = info("prefill", layout(**p_kw), kv_heads=top.get("kv_heads", 4))
    d = info("decode", layout(**d_kw), kv_heads=top.get("kv_heads", 4), num_layers=top.get("d_layers", 4),
             tp=top.get("d_tp", 1))
    with pytest.raises(CompatibilityError) as e:
        require_compatible([(p, d)])
    assert any(words in m for m in e.value.mismatches), e.value.mismatches
    assert words in str(e.value)


def test_a_dtype_of_another_width_is_one_mismatch_not_two():
    """float32 vs float16: head_bytes differ too, but the head dims are the same: say only dtype."""
    p, d = info("prefill", layout(dtype="float32")), info("decode", layout(dtype="float16"))
    with pytest.raises(CompatibilityError) as e:
        require_compatible([(p, d)])
    assert e.value.mismatches == ["dtype of k, v: P float32 vs D float16: the bytes would be misread"], \
        e.value.mismatches


def test_every_mismatch_is_listed_once():
    p = info("prefill", layout(page_size=16, dtype="bfloat16", head_dim=16, state=True), aux=64)
    d = info("decode", layout(page_size=24, dtype="float16", head_dim=8), aux=32)
    with pytest.raises(CompatibilityError) as e:
        require_compatible([(p, d), (p, d)])
    ms = e.value.mismatches
    assert len(ms) == len(set(ms))
    for words in ("page_size 16 vs D page_size 24", "dtype of k, v", "head_dim of k, v",
                  "P sends conv0, conv1, temporal that D's layout lacks"):
        assert any(words in m for m in ms), (words, ms)
    # aux rows of another size are no refusal: only requests that ask for aux rows fail (test_aux_rows.py)
    assert not any("aux" in m for m in ms), ms


# ------------------------------------------------------------------------------------
# The handshake over the wire: refusals and the shared secret
# ------------------------------------------------------------------------------------
FAST = Timeouts(handshake=3.0, heartbeat=Heartbeat(interval=0.2, timeout=2.0))


def _pool(**kw):
    args = dict(layers=4, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4)
    args.update(kw)
    return MHAPool(**args)


@pytest.fixture
def prefill():
    made = []

    def make(secret=None, **pool):
        server = BootstrapServer(BootstrapConfig(ttl=5.0, secret=secret.encode() if secret else None)).start()
        ep = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=4), _pool(**pool), transport="local",
                             timeouts=FAST, secret=secret)
        ep.register(server.url)
        made.append((ep, server))
        return ep, server.url
    yield make
    for ep, server in made:
        ep.close()
        server.stop()


def _decode(secret=None, **pool):
    return DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=4), _pool(**pool), transport="local",
                          timeouts=FAST, secret=secret)


def test_connect_refuses_at_launch_with_words(prefill):
    _, url = prefill(page_size=16, dtype="bfloat16")
    d = _decode(page_size=24)
    try:
        with pytest.raises(CompatibilityError) as e:
            d.connect(bootstrap=url, timeout=5)
        assert any("page_size 16 vs D page_size 24" in m for m in e.value.mismatches)
        assert any("dtype of k, v: P bfloat16 vs D float16" in m for m in e.value.mismatches)
    finally:
        d.close()


def test_prefill_refuses_too(prefill):
    """The prefill rank checks with its own layout, whatever the decode rank believed."""
    p, _ = prefill(head_dim=16)
    d = _decode()
    try:
        d.channel.connect(p.spec.key, p.info.control)   # a prefill rank answers to its key only
        with pytest.raises(CompatibilityError, match="head_dim of k, v: P 16 vs D 8"):
            hello(d.channel, p.spec.key, d.info, 3.0)
    finally:
        d.close()


@pytest.mark.parametrize("d_secret", [None, "wrong"])
@pytest.mark.slow   # waits seconds for what never comes
def test_wrong_or_missing_secret_is_refused(prefill, d_secret):
    p, url = prefill(secret="s3cret")
    d = _decode(secret=d_secret)
    try:
        d.channel.connect(p.spec.key, p.info.control)
        with pytest.raises(ConnectError, match="authentication|secret"):
            hello(d.channel, p.spec.key, d.info, 3.0)
        # nothing of it reached the prefill rank: the ZMTP handshake (CURVE from the secret) refused it
        assert len(p.links.peers) == 0 and not any(p.channel.dropped.values()), p.channel.dropped
    finally:
        d.close()


def test_right_secret_connects(prefill):
    _, url = prefill(secret="s3cret")
    d = _decode(secret="s3cret")
    try:
        d.connect(bootstrap=url, timeout=5)
    finally:
        d.close()


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_unauthenticated_requests_are_dropped(prefill):
    """A peer without the secret gets nothing past the ZMTP handshake (CURVE keys from the secret):
    its message never reaches the channel, and nothing changes on the prefill side."""
    import zmq
    p, url = prefill(secret="s3cret")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(p.info.control)
    before = sum(p.channel.dropped.values())
    s.send_multipart(encode(from_map({"t": "req", "room": 1, "gen": 1, "kv": b"", "prefix": 0, "state": b"",
                                      "aux": False, "dummy": True}), b"not-the-secret"))
    time.sleep(1.0)
    assert sum(p.channel.dropped.values()) == before   # refused below the channel: nothing read
    assert not p.requests.pending and len(p.links.peers) == 0
    s.close()
    ctx.term()


# ------------------------------------------------------------------------------------
# Wire format: plain data, authenticated, checked field by field
# ------------------------------------------------------------------------------------
REQ = {"t": "req", "room": 5, "gen": 2, "kv": np.arange(8, 12, dtype="<i8").tobytes(), "prefix": 0, "state": b"",
       "aux": True, "dummy": False}


def test_round_trip_and_auth():
    req = from_map(REQ)
    assert decode(encode(req, b"k"), b"k").to_dict() == REQ
    assert decode(encode(req, None), None).to_dict() == REQ
    for frames, secret in ((encode(req, b"k"), b"other"), (encode(req, None), b"k")):
        with pytest.raises(ValueError, match="authentication"):
            decode(frames, secret)


@pytest.mark.parametrize("bad,why", [
    ({**REQ, "room": True}, "an int or a str"), ({**REQ, "room": -1}, r"in 0\.\.2\*\*63-1"),
    ({**REQ, "room": ""}, "1..256 printable"), ({**REQ, "room": "x" * 257}, "1..256 printable"),
    ({**REQ, "room": "a\nb"}, "unprintable"), ({**REQ, "gen": 1 << 40}, "outside"),
    ({**REQ, "kv": "text"}, "must be bytes"), ({k: v for k, v in REQ.items() if k != "prefix"}, "missing"),
    ({"t": "pickle"}, "unknown message type"), ([1, 2], "unknown message type"),
])
def test_bad_fields_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        decode([b"", msgpack.packb(bad, use_bin_type=True)], None)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_hostile_bytes_only_raise_value_error(raw):
    for fn in (lambda: decode([b"", raw], None), lambda: ChunkMeta.unpack(raw)):
        try:
            fn()
        except ValueError:
            pass


def test_chunk_meta_round_trip_and_bounds():
    m = ChunkMeta(7, 3, (1, 0), 2, 3, 4096, b"x" * 64)
    assert ChunkMeta.unpack(m.pack()) == m
    with pytest.raises(ValueError, match="outside"):
        ChunkMeta.unpack(msgpack.packb([7, 3, [1, 0], -5, 3, 4096, None]))
    for bad in ({"room": 7}, [7, 3, [1], 2, 3, 4, None], [7, 3, [1, 0], 2, 3, 4, "aux as text"]):
        with pytest.raises(ValueError, match="msgpack|shape|aux"):
            ChunkMeta.unpack(msgpack.packb(bad))
