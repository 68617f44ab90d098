"""Prefill endpoints bind one address and advertise another (issue 17), refuse at start-up to
advertise loopback to a bootstrap on another host (naming the setting), and tell the engine
about requests for rooms it has no sender for (``on_request``, issue 16: no engine reads raw
control messages). In-process, over the local transport.
"""
from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.client import BootstrapClient
from kvxfer.endpoint import KVPoll, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec

ELSEWHERE = "http://192.0.2.1:8998"    # TEST-NET-1: never this host; nothing is sent there
T = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10)


def pool(seed: int | None = None) -> MHAPool:
    p = MHAPool(layers=2, heads=2, head_dim=8, dtype="float16", num_pages=32, page_size=4)
    if seed is not None:
        for i, b in enumerate(p.buffers):
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed + i),
                                  dtype=torch.uint8))
    return p


def spec(role: str) -> RankSpec:
    return RankSpec(role=role, num_kv_heads=2, num_layers=2)


@pytest.fixture
def server():
    s = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
    yield s
    s.stop()


def test_bind_every_interface_advertise_an_interface_name_and_hear_requests(server):
    """The ROUTER binds 0.0.0.0; the record says the interface's address; decode reaches it there;
    the engine hears of each request through on_request and answers it with a sender."""
    asked: queue.Queue = queue.Queue()
    p_pool, d_pool = pool(seed=3), pool()
    p = PrefillEndpoint(spec("prefill"), p_pool, transport="local", timeouts=T, bind="tcp://0.0.0.0:0",
                        advertise="lo", on_request=lambda room, tokens: asked.put((room, tokens)))
    d = DecodeEndpoint(spec("decode"), d_pool, transport="local", timeouts=T)
    try:
        assert p.channel.bound.startswith("tcp://0.0.0.0:")
        port = p.channel.bound.rsplit(":", 1)[1]
        assert p.info.control == f"tcp://127.0.0.1:{port}"
        p.register(server.url, ttl=5.0)
        assert [r.control for r in BootstrapClient(server.url).topology()[1]] == [p.info.control]
        d.connect(bootstrap=server.url, timeout=10)
        r = d.receiver(5)
        r.init(np.arange(8, 18))
        assert asked.get(timeout=5) == (5, 10)          # the room, and how many tokens decode asks for
        s = p.sender(5)
        s.send(np.arange(4, 14), last=True)
        assert r.wait(10) == KVPoll.Success, r.reason
        assert s.wait(10) == KVPoll.Success, s.reason
        for layer in range(2):
            sent, got = p_pool.get_kv_buffer(layer, np.arange(4, 14)), d_pool.get_kv_buffer(layer, np.arange(8, 18))
            for a, b in zip(sent, got):   # as bytes: random bytes hold NaNs
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        assert asked.empty()                             # a room with a sender is not announced
    finally:
        d.close()
        p.close()


def test_on_request_failures_do_not_cost_the_channel(server):
    def bad(room, tokens):
        raise RuntimeError("engine bug")
    p = PrefillEndpoint(spec("prefill"), pool(1), transport="local", timeouts=T, on_request=bad)
    d = DecodeEndpoint(spec("decode"), pool(), transport="local", timeouts=T)
    try:
        p.register(server.url, ttl=5.0)
        d.connect(bootstrap=server.url, timeout=10)
        r = d.receiver(6)
        r.init(np.arange(4, 8))
        s = p.sender(6)
        s.send(np.arange(4, 8), last=True)
        assert r.wait(10) == KVPoll.Success, r.reason
        assert p.channel.alive and p.broken is None
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("kw, words", [
    ({}, r"advertise tcp://127\.0\.0\.1:\d+ to the bootstrap http://192\.0\.2\.1:8998 on another host.*"
         r"set PrefillEndpoint\(advertise=\)"),
    ({"advertise": "127.0.0.1"}, r"set PrefillEndpoint\(advertise=\) \(now '127\.0\.0\.1'"),
    ({"bind": "tcp://0.0.0.0:0", "advertise": "lo"}, r"set PrefillEndpoint\(advertise=\) \(now 'lo'"),
])
def test_loopback_is_refused_for_a_bootstrap_on_another_host(kw, words):
    p = PrefillEndpoint(spec("prefill"), pool(), transport="local", timeouts=T, **kw)
    try:
        with pytest.raises(ValueError, match=words):
            p.register(ELSEWHERE)
    finally:
        p.close()


def test_decode_refuses_a_loopback_data_endpoint_for_a_bootstrap_on_another_host():
    d = DecodeEndpoint(spec("decode"), pool(), transport="zmq", timeouts=T)
    try:
        with pytest.raises(ValueError, match=r"transport_options\['endpoint'\] of the zmq transport"):
            d.connect(bootstrap=ELSEWHERE, timeout=1)
    finally:
        d.close()


def test_a_wildcard_is_never_advertised():
    with pytest.raises(Exception, match="wildcard"):
        PrefillEndpoint(spec("prefill"), pool(), transport="local", timeouts=T, bind="tcp://0.0.0.0:0",
                        advertise="0.0.0.0")
