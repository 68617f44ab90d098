"""``UCXTransport.connect`` proves the data path (issue 17): a round trip over the new endpoint
(our HELLO, the peer's answer) within ``connect_timeout``, so an address that does not reach
fails at connect with a ``ConnectError`` that names it, not at the first request.

The receiver is a child process (``tests/xfer_peer.py``): stopped (SIGSTOP: alive, silent) or
killed before the sender connects. A live one connects and a transfer lands byte-exact.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow   # stalls or stops a peer and waits (the full tier)

from xfer_peer import PeerProcess, enc, raw_plan  # noqa: E402

from kvxfer.errors import ConnectError  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402

SIZE = 1 << 20
OPTS = {"tls": "tcp", "heartbeat": 0.2, "peer_timeout": 2.0}


@pytest.fixture
def rx(tmp_path):
    rx = PeerProcess(tmp_path / "rx.err")
    rx.desc = rx.call("init", transport="ucx", sizes=[SIZE], fill="canary", options=OPTS)["descriptor"]
    try:
        yield rx
    finally:
        if rx.proc.poll() is None:
            rx.signal(signal.SIGCONT)
        rx.close()


@pytest.fixture
def tx():
    t = get_transport("ucx", **OPTS, connect_timeout=2.0)
    t.register([torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))])
    try:
        yield t
    finally:
        t.close()


def refused(tx, desc) -> str:
    start = time.monotonic()
    with pytest.raises(ConnectError) as e:
        tx.connect(desc)
    assert time.monotonic() - start < 8.0, "connect took far longer than connect_timeout"
    msg = str(e.value)
    assert desc["address"][:16] in msg and desc["id"][:8] in msg, f"the error does not name the address: {msg}"
    return msg


def test_a_stopped_peer_fails_at_connect(rx, tx):
    rx.signal(signal.SIGSTOP)
    assert "did not answer" in refused(tx, rx.desc)
    assert tx.fencing()["sources"] == 0


def test_a_gone_peer_fails_at_connect(rx, tx):
    rx.signal(signal.SIGKILL)
    rx.proc.wait(10)
    refused(tx, rx.desc)


def test_a_live_peer_connects_and_a_transfer_lands(rx, tx):
    import hashlib
    rx.call("expect", request_id="c.1", ranges={"region": enc(np.array([0])), "start": enc(np.array([0])),
                                                 "nbytes": enc(np.array([SIZE]))})
    peer = tx.connect(rx.desc)
    assert tx.peers[peer].answered
    z = np.zeros(1, np.int64)
    h = tx.submit(peer, "c.1", raw_plan(z, z, z, z, np.array([SIZE], np.int64)), timeout=10)
    assert h.wait(10), h.error
    assert rx.call("digest", regions=[0])["digests"]["0"] == hashlib.sha256(tx.regions.tensors[0].numpy()).hexdigest()


def test_admission_binds_an_id_to_the_latest_token(rx, tx):
    """``Transport.admit`` on the receiver, the token to ``connect``: without it, with another id's
    or an older one, the receiver refuses the HELLO and connect fails naming it; with the latest
    it connects. ``admission=True`` requires it from the start."""
    other = rx.call("admit", descriptor={"id": "someone-else"})["token"]
    assert "refused our HELLO" in refused(tx, rx.desc)               # admission is on now: no token
    import base64
    with pytest.raises(ConnectError, match="refused our HELLO"):
        tx.connect(rx.desc, base64.b64decode(other))                 # another id's token
    old = base64.b64decode(rx.call("admit", descriptor=tx.descriptor())["token"])
    new = base64.b64decode(rx.call("admit", descriptor=tx.descriptor())["token"])
    with pytest.raises(ConnectError, match="refused our HELLO"):
        tx.connect(rx.desc, old)                                     # voided by the second admit
    assert tx.connect(rx.desc, new) == rx.desc["id"]
    assert rx.call("rejected")["rejected"]["unknown peer"] >= 3
    strict = get_transport("ucx", **OPTS, admission=True)
    try:
        strict.register([torch.zeros(4096, dtype=torch.uint8)])
        with pytest.raises(ConnectError, match="refused our HELLO"):
            tx.connect(strict.descriptor())
        assert tx.connect(strict.descriptor(), strict.admit(tx.descriptor())) == strict.id
    finally:
        strict.close()
