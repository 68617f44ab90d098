"""The control channel authenticated at the ZMTP handshake (``ControlChannel(zmtp_auth=True)`` with
a secret, issue 34): channels that share the secret talk; a channel with another secret, or
without zmtp_auth, fails its first handshake and its caller hears so at once (not at a timeout);
a raw peer without the secret gets nothing buffered and no answer.
"""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from support.channels import Quiet

from kvxfer.control.channel import ControlChannel, Heartbeat
from kvxfer.control.messages import Drop, Ping

pytestmark = pytest.mark.slow   # handshakes that fail, waited for (seconds)

SECRET = b"zmtp-secret"


def _router(**kw) -> tuple[ControlChannel, Quiet]:
    h = Quiet()
    return ControlChannel(h, secret=SECRET, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0", identity="p0",
                          **kw), h


def _until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_channels_with_the_same_secret_talk():
    server, _ = _router(zmtp_auth=True)
    client = ControlChannel(Quiet(), secret=SECRET, heartbeat=Heartbeat(interval=0.1, timeout=1.0),
                            identity="d0", zmtp_auth=True)
    try:
        client.connect("p0", server.address)
        assert _until(lambda: server.peers == 1), "the client's pings never reached the server"
        assert not client.dropped and not server.dropped, (client.dropped, server.dropped)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("secret, zmtp_auth", [(b"another", True), (SECRET, False), (None, False)],
                         ids=["another-secret", "no-zmtp-auth", "no-secret"])
def test_a_channel_that_cannot_authenticate_is_told_at_once(secret, zmtp_auth):
    server, handler = _router(zmtp_auth=True)
    client = ControlChannel(Quiet(), secret=secret, heartbeat=Heartbeat(interval=0.1, timeout=1.0),
                            identity="d1", zmtp_auth=zmtp_auth)
    try:
        client.connect("p0", server.address)   # it pings at once, and every heartbeat
        if zmtp_auth:   # a CURVE client learns of the failed handshake (its calls then fail at once)
            assert _until(lambda: client.dropped[Drop.AUTH] >= 1, 2.0), "the failed handshake was not reported"
        else:
            time.sleep(1.0)
        assert server.peers == 0 and not handler.got and not server.dropped, "something got past the handshake"
    finally:
        client.close()
        server.close()


def test_a_raw_peer_without_the_secret_is_never_answered():
    server, handler = _router(zmtp_auth=True)
    ctx = zmq.Context()
    try:
        for mechanism in ("null", "curve-random-keys"):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            if mechanism != "null":
                pub, sec = zmq.curve_keypair()
                d.curve_serverkey, d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()[0], pub, sec
            d.connect(server.address)
            try:
                d.send_multipart([b"", msgpack.packb([1, "x", server.address, bytes(16), 1]),
                                  msgpack.packb({"t": "ping"})], zmq.NOBLOCK)
            except zmq.Again:
                pass
            assert not d.poll(500), f"{mechanism}: a peer without the secret got an answer"
        assert server.peers == 0 and not handler.got and not server.dropped
    finally:
        ctx.destroy(linger=0)
        server.close()


def test_without_a_secret_zmtp_auth_changes_nothing():
    h = Quiet()
    server = ControlChannel(h, secret=None, heartbeat=Heartbeat(), bind="tcp://127.0.0.1:0", zmtp_auth=True)
    client = ControlChannel(Quiet(), secret=None, heartbeat=Heartbeat(interval=0.1, timeout=1.0), identity="d2")
    try:
        client.connect("p0", server.address)
        client.send("p0", Ping())
        assert _until(lambda: server.peers == 1)
    finally:
        client.close()
        server.close()
