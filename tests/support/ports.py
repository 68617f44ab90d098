"""Free TCP ports on 127.0.0.1 for the servers tests start (a registry, a metrics endpoint, a
bootstrap server, torch's rendezvous). Imported as ``from support.ports import free_port`` both
under pytest (``conftest.py`` puts ``tests/`` on the path) and by helper scripts that tests run
as ``python tests/<script>.py`` (their own directory is on the path)."""
from __future__ import annotations

import random
import socket

# below the kernel's ephemeral range (32768-60999 by default), where other processes' port-0 binds
# cannot take a port between our probe and its owner's bind
_LOW = (20000, 32000)


def free_port(taken: set[int] | None = None) -> int:
    """A port nobody had bound a moment ago, from below the ephemeral range (never one the kernel
    hands out: a server that binds it seconds later, a vLLM engine after its start-up, must not
    find it taken by some process's outgoing connection, as one did in stop 43); with ``taken``,
    one not in that set, which it joins (the ports of one test's servers, all different)."""
    taken = set() if taken is None else taken
    while True:
        port = random.randrange(*_LOW)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
