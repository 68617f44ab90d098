"""Where the zmq data socket binds: a fixed port, any free one, or the first free one of a range.

What peers are told (``advertise``) is ``kvxfer.addresses.advertise_address`` of the
bound address, as for the control channel: never a wildcard, never loopback for ``remote`` peers.
"""
from __future__ import annotations

import errno
from typing import cast

import zmq

from kvxfer.addresses import split_address
from kvxfer.errors import ConfigError


def check_ports(endpoint: str, ports: tuple[int, int] | None) -> tuple[int, int] | None:
    """The ``ports`` option checked against the ``endpoint`` it applies to (ValueError says why)."""
    kind, _, port = split_address(endpoint)   # ValueError names a malformed endpoint
    if ports is None:
        return None
    if not (isinstance(ports, (tuple, list)) and len(ports) == 2 and all(type(p) is int for p in ports)
            and 1 <= ports[0] <= ports[1] <= 65535):
        raise ConfigError(f"ports={ports!r}: give (first, last) with 1 <= first <= last <= 65535")
    if kind != "tcp" or port != 0:
        raise ConfigError(f"ports={ports!r} needs a tcp:// endpoint with port 0 (the range picks it), not {endpoint!r}")
    return int(ports[0]), int(ports[1])


def bind(sock: zmq.Socket, endpoint: str, ports: tuple[int, int] | None) -> str:
    """Bind ``sock`` and return the bound endpoint (``tcp://0.0.0.0:41234``). ``ports``: the first
    free port of the range (zmq.ZMQError EADDRINUSE when every one is taken)."""
    if ports is None:
        sock.bind(endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint)
    else:
        base = endpoint.rpartition(":")[0]
        for port in range(ports[0], ports[1] + 1):
            try:
                sock.bind(f"{base}:{port}")
                break
            except zmq.ZMQError as e:
                if e.errno != errno.EADDRINUSE or port == ports[1]:
                    raise zmq.ZMQError(e.errno, f"{e} (ports {ports[0]}-{ports[1]} tried)") from None
    return cast(bytes, sock.last_endpoint).decode()   # pyzmq types sockopts loosely
