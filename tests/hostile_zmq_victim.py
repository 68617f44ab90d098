"""A victim process for the hostile ZMQ tests: kvxfer's sockets in a process of their own, so a test
can measure what an attacker makes it hold (RSS, fds, threads) without the attacker's own memory.

Run as ``python hostile_zmq_victim.py KIND OPTIONS_JSON``; it prints one JSON line when ready
(``{"ports": {...}}``: the ZMQ addresses an attacker can reach), then answers one JSON line per
command line on stdin:

    stats     {"rss": bytes, "fds": n, "threads": n, "alive": bool}
    honest    an honest request now: {"ok": bool, "why": str} (bytes checked, canary checked)
    trim      nothing; answers with stats after a second (memory a closed attacker left behind)

KINDS
    data      two zmq transports: a receiver (decode's data port) and the honest sender (prefill;
              its own ROUTER is reachable too), built with OPTIONS_JSON["transport"] (e.g.
              {"admission": "required"}); the sender is admitted when the receiver requires it.
              An honest request: a 4 MiB transfer to a fresh granted range, checked byte for
              byte, and every byte outside the honest moves still the canary.
    control   a prefill and a decode endpoint (zmq) with a shared secret and a registry; the
              control ROUTER is prefill's. OPTIONS_JSON["channel"]: keyword arguments every
              ``ControlChannel`` of the endpoints gets (e.g. {"zmtp_auth": true}, what the endpoints
              are to pass). An honest request: a KV request end to end (``hostile_victims.Pair``).
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

REGION = 64 << 20
MOVE = 4 << 20
CANARY = 0xA5


def stats(alive: bool) -> dict:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(), "alive": alive}


class DataVictim:
    def __init__(self, options: dict):
        import numpy as np
        import torch

        from kvxfer.grant import ByteRanges
        from kvxfer.plan import RunGroup, TransferPlan
        from kvxfer.transport.registry import get_transport
        self.np, self.torch, self.ByteRanges, self.RunGroup, self.TransferPlan = np, torch, ByteRanges, RunGroup, \
            TransferPlan
        opts = options.get("transport", {})
        self.rx = get_transport("zmq", **opts)
        self.tx = get_transport("zmq", **opts)
        self.src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        self.dst = torch.full((REGION,), CANARY, dtype=torch.uint8)
        self.expected = self.dst.clone()
        self.tx.register([self.src])
        self.rx.register([self.dst])
        token = self.rx.admit(self.tx.descriptor())
        self.peer = self.tx.connect(self.rx.descriptor(), token)
        self.n = 0
        self.ports = {"receiver": self.rx.endpoint, "sender": self.tx.endpoint}

    def alive(self) -> bool:
        return self.rx.broken is None and self.tx.broken is None and self.rx.io.alive and self.tx.io.alive

    def honest(self) -> dict:
        np = self.np
        k = self.n % (REGION // MOVE)
        self.n += 1
        rid, cap, off = f"honest.{self.n}", secrets.token_bytes(16), k * MOVE
        self.rx.expect(rid, self.ByteRanges(np.zeros(1), np.array([off]), np.array([MOVE])), cap)
        z = np.zeros(1, np.int64)
        plan = self.TransferPlan((self.RunGroup(z, np.array([off]), z, np.array([off]), z, z, np.array([MOVE]),
                                                False),))
        h = self.tx.submit(self.peer, rid, plan, timeout=20, capability=cap)
        if not h.wait(20):
            return {"ok": False, "why": f"transfer failed: {h.error}"}
        arrivals = self.rx.arrivals(5.0)
        self.rx.forget(rid)
        self.expected[off: off + MOVE] = self.src[off: off + MOVE]
        if not any(a.request_id == rid and a.ok and a.nbytes == MOVE for a in arrivals):
            return {"ok": False, "why": f"no arrival: {arrivals}"}
        if not self.torch.equal(self.dst, self.expected):
            return {"ok": False, "why": "the receiver's region differs from the honest moves (canary or bytes)"}
        return {"ok": True, "why": ""}


class ControlVictim:
    def __init__(self, options: dict):
        import hostile_victims

        import kvxfer.endpoint.decode as decode
        import kvxfer.endpoint.prefill as prefill
        from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
        from kvxfer.control.channel import ControlChannel
        extra = options.get("channel", {})
        if extra:   # what the endpoints are to pass to their channels (see the report of issue 34)
            for module in (prefill, decode):
                module.ControlChannel = functools.partial(ControlChannel, **extra)   # type: ignore[misc]
        secret = options.get("secret", "flood-secret") or None   # "": an open deployment (no secret)
        self.registry = BootstrapServer(BootstrapConfig(ttl=30.0, secret=secret.encode() if secret else None)).start()
        self.pair = hostile_victims.Pair(self.registry.url, secret=secret)
        self.ports = {"control": self.pair.p.ep.info.control}

    def alive(self) -> bool:
        return self.pair.alive()

    def honest(self) -> dict:
        if not self.pair.honest():
            return {"ok": False, "why": "an honest request did not complete"}
        if not self.pair.intact():
            return {"ok": False, "why": "decode's pool differs from the honest moves"}
        return {"ok": True, "why": ""}


def main() -> None:
    kind, options = sys.argv[1], json.loads(sys.argv[2])
    victim = {"data": DataVictim, "control": ControlVictim}[kind](options)
    first = victim.honest()   # warm: buffers and pools in use before the baseline
    print(json.dumps({"ports": victim.ports, "warm": first}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "honest":
            out = victim.honest()
        elif cmd == "trim":
            time.sleep(1.0)
            out = stats(victim.alive())
        else:
            out = stats(victim.alive())
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
