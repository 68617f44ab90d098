"""The data path at handshake: an unreachable one is refused at connect, naming the prefill rank
and the data address (#17); a decode rank that handshakes again (a restart) has its earlier
requests failed and its earlier data peer disconnected (a new epoch of the same peer at once, an
earlier process once it is silent), so 50 restarts leave one data peer; a live rank is never cut
off by another's HELLO."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.control.handshake import DATA_PATH, Busy, hello
from kvxfer.endpoint import AuxBuffer, DecodeEndpoint, KVPoll, Outcome, PrefillEndpoint, Timeouts
from kvxfer.errors import ConnectError
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec
from kvxfer.transport.base import Transport
from kvxfer_transports.local import LocalTransport
from kvxfer_transports.zmq import ZMQTransport

H, LAYERS, DIM, PAGE = 2, 2, 8, 4
QUICK = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10, handshake=5,
                 heartbeat=Heartbeat(interval=0.5, timeout=5.0))
FAST = Timeouts(bootstrap=10, waiting=10, transfer=10, lease=10, handshake=5,
                heartbeat=Heartbeat(interval=0.1, timeout=0.5))   # a closed decode rank is silent in 0.5 s


def _pool() -> MHAPool:
    return MHAPool(layers=LAYERS, heads=H, head_dim=DIM, dtype="float32", num_pages=16, page_size=PAGE)


class Unreachable(LocalTransport):
    """A transport whose data path never reaches: connect does the round trip and fails."""

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        raise ConnectError(f"cannot connect to local peer {descriptor.get('id')!r}: no answer within 1.0s")


class Garbled(LocalTransport):
    """A transport that finds the peer's descriptor unusable."""

    def connect(self, descriptor: dict, token: bytes = b"") -> str:
        raise ValueError("descriptor field 'region_sizes' is not a list of sizes")


def counting(base: type[Transport]) -> type[Transport]:
    """``base``, counting the data peers it holds (connected, not yet disconnected)."""

    class Counting(base):   # type: ignore[misc, valid-type]
        def __init__(self, **options):
            super().__init__(**options)
            self.live: set[str] = set()
            self.most = 0

        def connect(self, descriptor: dict, token: bytes = b"") -> str:
            peer = super().connect(descriptor, token)
            self.live.add(peer)
            self.most = max(self.most, len(self.live))
            return peer

        def disconnect(self, peer: str) -> None:
            super().disconnect(peer)
            self.live.discard(peer)
    return Counting


Counting = counting(LocalTransport)
TRANSPORTS = {"local": LocalTransport, "zmq": ZMQTransport}


@pytest.fixture
def server():
    s = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0)).start()
    yield s
    s.stop()


POOLS: dict[int, MHAPool] = {}   # id(endpoint) -> the pool the test made it with


def _prefill(server, transport, timeouts: Timeouts = QUICK) -> PrefillEndpoint:
    pool = _pool()
    pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=H, num_layers=LAYERS), pool, transport=transport,
                         timeouts=timeouts)
    POOLS[id(pe)] = pool
    pe.register(server.url)
    return pe


def _decode(timeouts: Timeouts = QUICK, transport: str = "local", **options) -> DecodeEndpoint:
    """``options``: transport options (``admission="open"`` for a test that says HELLO by hand, with no
    admission token for the prefill rank)."""
    pool = _pool()
    de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=H, num_layers=LAYERS), pool, aux=AuxBuffer(2),
                        transport=transport, timeouts=timeouts, transport_options=options)
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


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("name", ["local", "zmq"])
@pytest.mark.slow   # seconds
def test_a_restarted_decode_rank_leaves_one_data_peer(server, name):
    """50 restarts of one decode rank (each a new endpoint, a new data peer, a new HELLO): each
    earlier data peer is disconnected once its process is silent, so the prefill transport ends
    with one data peer, and the last decode rank moves bytes exactly."""
    tx = counting(TRANSPORTS[name])()
    pe = _prefill(server, tx, FAST)
    de = None
    try:
        for _ in range(50):
            if de is not None:
                de.close()                    # the process ends; a new one starts, same rank
            de = _decode(FAST, name)
            de.connect(bootstrap=server.url, timeout=10)
        assert _until(lambda: len(tx.live) == 1, 5), f"{len(tx.live)} data peers after 50 restarts"
        assert tx.most <= 25, f"{tx.most} data peers at once: earlier ones are not let go"
        assert de is not None
        _one_request(pe, de, room=3)
        assert len(tx.live) == 1
    finally:
        if de is not None:
            de.close()
        pe.close()
        tx.close()


def _bound_sender(pe: PrefillEndpoint, de: DecodeEndpoint, room: int):
    rc = de.receiver(room)
    rc.init(POOLS[id(de)].allocator().alloc(5))
    sd = pe.sender(room)
    assert _until(lambda: sd.poll() != KVPoll.Bootstrapping, 5)
    assert sd.poll() == KVPoll.WaitingForInput
    return rc, sd


def test_a_new_epoch_of_a_decode_peer_ends_its_earlier_requests(server):
    """The same decode endpoint says HELLO again (as after it lost the prefill rank): what ran on
    its earlier handshake fails at once, naming why; the new handshake moves bytes exactly."""
    tx = Counting()
    pe = _prefill(server, tx)
    de = _decode(admission="open")
    try:
        de.connect(bootstrap=server.url, timeout=10)
        rc, sd = _bound_sender(pe, de, 7)
        hello(de.channel, "default/dp0/pp0/tp0", de.info, 5)
        assert sd.wait(5) == KVPoll.Failed and sd.outcome == Outcome.Failed
        assert "handshook again" in sd.reason and "default/dp0/pp0/tp0" in sd.reason
        assert rc.wait(5) == KVPoll.Failed
        assert len(tx.live) == 1
        _one_request(pe, de, room=8)
    finally:
        de.close()
        pe.close()
        tx.close()


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_another_hello_with_a_live_ranks_record_does_not_cut_it_off(server):
    """A second process says HELLO with the record of a decode rank that still lives (heartbeats):
    it is refused for now, naming the live process (a rank is one process at a time: identity before
    resources); the live rank keeps its handshake, its request completes byte-exact. Once the live
    one closed (BYE), the other is welcomed."""
    pe = _prefill(server, Counting())
    de, other = _decode(), _decode()
    try:
        de.connect(bootstrap=server.url, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(Busy, match="is live here as another process"):
            other.connect(bootstrap=server.url, timeout=1.5)   # the same rank key, another process
        assert time.monotonic() - t0 < 3
        assert pe.links.refused_busy == 0 and len(pe.links.peers) == 1
        _one_request(pe, de, room=9)
        de.close()                                             # BYE: the rank is free at once
        other.connect(bootstrap=server.url, timeout=5)
        _one_request(pe, other, room=10)
    finally:
        for ep in (other, de, pe):
            ep.close()


@pytest.mark.slow   # waits ~1 s for a timeout: the full tier (keeps the fast tier under 90 s)
def test_a_retired_peer_does_not_take_a_shared_data_peer_with_it(server):
    """Two handshakes with one data peer (another rank's HELLO that carried a live rank's data
    descriptor, then the rank's own): when the impostor goes silent and is retired, the shared data
    peer stays."""
    tx = Counting()
    pe = _prefill(server, tx, FAST)
    de = _decode(FAST, admission="open")
    imp = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=H, num_layers=LAYERS, instance="impostor"), _pool(),
                         aux=AuxBuffer(2), transport="local", timeouts=FAST)
    try:
        de.connect(bootstrap=server.url, timeout=10)
        fake = dataclasses.replace(imp.info, data=de.info.data)  # imp's rank, de's data descriptor
        imp.channel.connect("default/dp0/pp0/tp0", pe.info.control)
        hello(imp.channel, "default/dp0/pp0/tp0", fake, 5)
        shared = de.transport.descriptor()["id"]
        assert shared in tx.live and len(pe.links.peers) == 2
        imp.close()                                              # BYE: retired
        assert _until(lambda: len(pe.links.peers) == 1, 5), pe.links.peers
        time.sleep(0.5)
        assert shared in tx.live, "retiring imp disconnected de's data peer"
        _one_request(pe, de, room=4)
    finally:
        for ep in (imp, de, pe):
            ep.close()
        tx.close()


def test_two_records_of_one_registry_read_that_share_a_transport_id_are_refused_before_the_second_admit(server):
    """A record that carries another rank's data descriptor, read in the same connect as that rank's
    own: decode refuses it before admitting that id again (which would void the first rank's token),
    naming both ranks; the first rank's admission stays the only one made."""
    pes = [PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=H, num_layers=LAYERS, tp_size=2, tp_rank=r),
                           MHAPool(layers=LAYERS, heads=H // 2, head_dim=DIM, dtype="float32", num_pages=16,
                                   page_size=PAGE), transport="zmq", timeouts=QUICK) for r in range(2)]
    de = _decode(transport="zmq")
    admits: list[str] = []
    admit = de.transport.admit
    de.transport.admit = lambda d: (admits.append(d["id"]), admit(d))[1]   # type: ignore[method-assign]
    try:
        rogue = dataclasses.replace(pes[1].info, data=pes[0].info.data)   # rank 1's control, rank 0's data
        with pytest.raises(ConnectError, match="reuses another rank's transport") as e:
            de.connect(peers=[pes[0].info, rogue], timeout=10)
        assert "default/dp0/pp0/tp1" in str(e.value) and "default/dp0/pp0/tp0" in str(e.value)
        assert admits == [pes[0].transport.descriptor()["id"]], admits
        de.connect(peers=[pes[0].info, pes[1].info], timeout=10)   # the true records: both ranks answer
        assert sorted(de.links.known_peers()) == ["default/dp0/pp0/tp0", "default/dp0/pp0/tp1"]
    finally:
        de.close()
        for pe in pes:
            pe.close()


def test_a_record_whose_transport_id_is_not_a_string_is_refused_by_name(server):
    """A peer's record may hold any value as its transport id: an unhashable one is refused with a
    ConnectError naming it, never a TypeError out of decode's id index."""
    pe = _prefill(server, "zmq")
    de = _decode(transport="zmq")
    try:
        odd = dataclasses.replace(pe.info, data={"zmq": dict(pe.info.data["zmq"], id=[1, 2])})
        with pytest.raises(ConnectError, match=r"cannot admit .*\[1, 2\]"):
            de.connect(peers=[odd], timeout=5)
    finally:
        de.close()
        pe.close()
