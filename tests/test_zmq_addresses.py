"""The zmq data socket: bind apart from advertise, fixed or ranged ports, and no advertised
address a peer cannot reach (a wildcard never; loopback never to a peer on another host)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from support.ports import free_port
from xfer_peer import raw_plan

from kvxfer.addresses import split_address
from kvxfer.errors import ConnectError
from kvxfer.grant import ByteRanges
from kvxfer.plan import TransferPlan
from kvxfer.transport.registry import get_transport


def _plan(n: int) -> TransferPlan:
    return raw_plan([0], [3], [0], [100], [n])


def _move(tx, rx, rid: str, n: int = 300_000) -> None:
    """A byte-exact transfer from tx to rx through rx's advertised descriptor."""
    src, dst = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    tx.register([src]), rx.register([dst])
    rx.expect(rid, ByteRanges(np.array([0]), np.array([100]), np.array([n])))
    tx.submit(tx.connect(rx.descriptor()), rid, _plan(n), timeout=20).result(20)
    assert torch.equal(dst[100: 100 + n], src[3: 3 + n]) and not dst[:100].any() and not dst[100 + n:].any()


def test_wildcard_bind_advertises_a_reachable_address():
    with get_transport("zmq", endpoint="tcp://0.0.0.0:0") as rx, get_transport("zmq") as tx:
        _, host, port = split_address(rx.descriptor()["endpoint"])
        assert rx.bound.startswith("tcp://0.0.0.0:") and host not in ("0.0.0.0", "*", "")
        assert port == split_address(rx.bound)[2] != 0
        _move(tx, rx, "wild")


def test_advertise_apart_from_bind():
    """Bound on every interface, advertised by interface name: peers get that interface's address."""
    with get_transport("zmq", endpoint="tcp://0.0.0.0:0", advertise="lo") as rx, get_transport("zmq") as tx:
        assert rx.descriptor()["endpoint"] == f"tcp://127.0.0.1:{split_address(rx.bound)[2]}"
        _move(tx, rx, "adv")


@pytest.mark.parametrize("options, words", [
    ({"endpoint": "tcp://0.0.0.0:0", "advertise": "0.0.0.0"}, "wildcard"),
    ({"endpoint": "tcp://127.0.0.1:0", "remote": True}, "loopback"),
    ({"endpoint": "tcp://0.0.0.0:0", "advertise": "localhost", "remote": True}, "loopback"),
])
def test_unreachable_advertise_is_refused_loudly(options, words):
    with pytest.raises(ConnectError, match=words) as e:
        get_transport("zmq", **options)
    assert "advertise=" in str(e.value)


def test_port_range_takes_the_first_free_port():
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.ROUTER)
    first = taken.bind_to_random_port("tcp://127.0.0.1", 30000, 60000)
    try:
        with get_transport("zmq", ports=(first, first + 20)) as rx, get_transport("zmq") as tx:
            port = split_address(rx.descriptor()["endpoint"])[2]
            assert first < port <= first + 20
            _move(tx, rx, "ranged")
        with pytest.raises(ConnectError, match=f"ports {first}-{first}"):
            get_transport("zmq", ports=(first, first))
    finally:
        taken.close(linger=0)


def test_fixed_port():
    """The endpoint given is the one bound. The port comes from ``free_port`` (a plain socket's
    probe, freed at once; a zmq socket's close is done later by its context's I/O thread, and the
    transport's bind could find the port still taken); another process may still take it between
    probe and bind, so a few ports are tried."""
    for _ in range(5):
        port = free_port()
        try:
            rx = get_transport("zmq", endpoint=f"tcp://127.0.0.1:{port}")
        except ConnectError as e:
            if "Address already in use" in str(e):
                continue
            raise
        with rx:
            assert rx.descriptor()["endpoint"] == f"tcp://127.0.0.1:{port}"
        return
    pytest.fail("5 free ports in a row were taken before the transport could bind them")


@pytest.mark.parametrize("ports", [(5000, 4000), (0, 10), (1, 70000), "5000-5010"])
def test_bad_port_ranges_are_refused(ports):
    with pytest.raises(ValueError, match="ports="):
        get_transport("zmq", ports=ports)


def test_port_range_needs_port_zero():
    with pytest.raises(ValueError, match="port 0"):
        get_transport("zmq", endpoint="tcp://127.0.0.1:5555", ports=(6000, 6010))
