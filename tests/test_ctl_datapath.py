"""The data path at handshake: an unreachable one is refused at connect, naming the prefill rank
and the data address (#17); a decode rank that handshakes again (a restart) has its earlier
requests failed and its earlier data peer disconnected, so 50 restarts leave one data peer."""
from __future__ import annotations

import time

import pytest
import torch

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.handshake import DATA_PATH
from kvxfer.endpoint import AuxBuffer, DecodeEndpoint, KVPoll, Outcome, PrefillEndpoint, Timeouts
from kvxfer.errors import ConnectError
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec
from kvxfer_transports.local import LocalTransport

H, LAYERS, DIM, PAGE = 2, 2, 8, 4
QUICK = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10, handshake=5,
                 heartbeat=Heartbeat(interval=0.5, timeout=5.0))


def _pool() -> MHAPool:
    return MHAPool(layers=LAYERS, heads=H, head_dim=DIM, dtype="float32", num_pages=16, page_size=PAGE)


class Unreachable(LocalTransport):
    """A transport whose data path never reaches: connect does the round trip and fails."""

    def connect(self, descriptor: dict) -> str:
        raise ConnectError(f"cannot connect to local peer {descriptor.get('id')!r}: no answer within 1.0s")


class Garbled(LocalTransport):
    """A transport that finds the peer's descriptor unusable."""

    def connect(self, descriptor: dict) -> str:
        raise ValueError("descriptor field 'region_sizes' is not a list of sizes")


class Counting(LocalTransport):
    """The local transport, counting the data peers it holds (connected, not yet disconnected)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.live: set[str] = set()
        self.most = 0

    def connect(self, descriptor: dict) -> str:
        peer = super().connect(descriptor)
        self.live.add(peer)
        self.most = max(self.most, len(self.live))
        return peer

    def disconnect(self, peer: str) -> None:
        super().disconnect(peer)
        self.live.discard(peer)


@pytest.fixture
def server():
    s = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    yield s
    s.stop()


POOLS: dict[int, MHAPool] = {}   # id(endpoint) -> the pool the test made it with


def _prefill(server, transport) -> PrefillEndpoint:
    pool = _pool()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=H, num_layers=LAYERS), pool, transport=transport,
                         timeouts=QUICK)
    POOLS[id(pe)] = pool
    pe.register(server.url)
    return pe


def _decode() -> DecodeEndpoint:
    pool = _pool()
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=H, num_layers=LAYERS), pool, aux=AuxBuffer(2),
                        transport="local", timeouts=QUICK)
    POOLS[id(de)] = pool
    return de


@pytest.mark.parametrize("transport, why", [(Unreachable, "no answer within 1.0s"),
                                            (Garbled, "is not a list of sizes")])
def test_unreachable_data_path_fails_connect_at_once_naming_both(server, transport, why):
    pe = _prefill(server, transport())
    de = _decode()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as e:
            de.connect(bootstrap=server.url, timeout=20)
        took = time.monotonic() - t0
        msg = str(e.value)
        assert took < 4, f"connect failed after {took:.1f}s, not at once"
        assert DATA_PATH in msg and why in msg
        assert "prefill rank default/dp0/pp0/tp0" in msg                     # the prefill rank
        assert de.transport.descriptor()["id"] in msg                          # decode's data address
    finally:
        de.close()
        pe.close()


def _one_request(pe: PrefillEndpoint, de: DecodeEndpoint, room: int) -> None:
    """One request of 9 tokens; decode's slots must hold exactly prefill's bytes."""
    n = 9
    d_pool, p_pool = POOLS[id(de)], POOLS[id(pe)]
    d_slots, p_slots = d_pool.allocator().alloc(n), p_pool.allocator().alloc(n)
    g = torch.Generator().manual_seed(room)
    kv = [(torch.randn(n, H, DIM, generator=g), torch.randn(n, H, DIM, generator=g)) for _ in range(LAYERS)]
    for layer, (k, v) in enumerate(kv):
        p_pool.set_kv_buffer(layer, p_slots, k, v)
    rc = de.receiver(room)
    rc.init(d_slots)
    sd = pe.sender(room)
    sd.send(p_slots, last=True)
    assert rc.wait(10) == KVPoll.Success, rc.failure_exception()
    for layer, (k, v) in enumerate(kv):
        got_k, got_v = d_pool.get_kv_buffer(layer, d_slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), layer
    assert sd.wait(10) == KVPoll.Success


def test_a_restarted_decode_rank_leaves_one_data_peer(server):
    """50 restarts of one decode rank (each a new endpoint, a new data peer, a new HELLO): the
    prefill transport holds one data peer throughout, and the last decode rank moves bytes exactly."""
    tx = Counting()
    pe = _prefill(server, tx)
    de = None
    try:
        for i in range(50):
            de = _decode()
            de.connect(bootstrap=server.url, timeout=10)
            assert len(tx.live) == 1, f"restart {i}: {len(tx.live)} data peers"
            if i < 49:
                de.close()
        assert tx.most <= 2      # the new peer is connected after the old one is let go
        assert de is not None
        _one_request(pe, de, room=3)
    finally:
        if de is not None:
            de.close()
        pe.close()
        tx.close()


def test_requests_of_the_old_handshake_fail_when_the_rank_handshakes_again(server):
    pe = _prefill(server, Counting())
    old = _decode()
    new = None
    try:
        old.connect(bootstrap=server.url, timeout=10)
        rc = old.receiver(7)
        rc.init(POOLS[id(old)].allocator().alloc(5))
        sd = pe.sender(7)
        deadline = time.monotonic() + 5
        while sd.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sd.poll() == KVPoll.WaitingForInput    # bound to the old handshake
        new = _decode()                                # the same decode rank, restarted
        new.connect(bootstrap=server.url, timeout=10)
        assert sd.wait(5) == KVPoll.Failed and sd.outcome == Outcome.Failed
        assert "handshook again" in sd.reason and "default/dp0/pp0/tp0" in sd.reason
        _one_request(pe, new, room=8)
    finally:
        for ep in (new, old, pe):
            if ep is not None:
                ep.close()
