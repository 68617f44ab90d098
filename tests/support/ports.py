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
    """A port nobody had bound a moment ago. Without ``taken``: one the kernel hands out (port 0).
    With ``taken``: one from below the ephemeral range, not in ``taken``, which it joins: for
    servers that bind later, while the test's own workers bind port 0 (so the kernel cannot give
    one of them that port first)."""
    if taken is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
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
