"""Victims for the hostile-peer tests: real endpoints in this process, and what every test
checks after an attack (threads alive, an honest request lands byte-exact, the canary
outside grants untouched, fds/threads bounded).

Two kinds of victim: ``Pair``, a zmq prefill and decode rank found through a registry, whose
honest requests are checked byte for byte (``after_attack``); and ``local_prefill`` /
``local_decode``, endpoints on the local transport that start in milliseconds, for the
in-process tier (``still_serves`` checks them)."""
from __future__ import annotations

import itertools
import os
import threading

import request_peer as rp

# kvxfer names used by the hostile tests' victims (update here after a module move)
from kvxfer.control.channel import Heartbeat
from kvxfer.endpoint.base import KVPoll, Timeouts
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec

# bootstrap: a REQ waits that long for its sender (and decode for the ACK); 15 s keeps a loaded machine
# from ending the REQs an attack case queues before it checks them
TIMEOUTS = {"bootstrap": 15.0, "waiting": 4.0, "transfer": 4.0, "lease": 4.0, "handshake": 3.0}
_names = itertools.count(1)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def kvxfer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvxfer")}


def snapshot() -> tuple[int, int, int]:
    """(open fds, threads, RSS bytes)."""
    return fds(), threading.active_count(), rss()


def bounded(before: tuple[int, int, int], fd_slack: int = 16, thread_slack: int = 2) -> str:
    """'' when fds and threads grew by at most the slack since ``before``; else what grew."""
    now = snapshot()
    out = []
    if now[0] - before[0] > fd_slack:
        out.append(f"fds {before[0]} -> {now[0]}")
    if now[1] - before[1] > thread_slack:
        out.append(f"threads {before[1]} -> {now[1]}")
    return ", ".join(out)


class Pair:
    """A prefill and a decode endpoint in this process (decode connected to that prefill only),
    the decode pool's contents before, and the honest moves made since."""

    def __init__(self, registry_url: str, transport: str = "zmq", secret: str | None = None, **over):
        self.name = f"hostile{next(_names)}"
        self.cfg = rp.config(transport, spec={"instance": self.name}, timeouts=TIMEOUTS, **over)
        if secret is not None:
            self.cfg["secret"] = secret
        self.rooms = itertools.count(1000)
        self.moves: list = []
        before = kvxfer_threads()
        self.p = rp.Side("prefill", self.cfg, registry_url)
        try:
            self.d = rp.Side("decode", self.cfg, registry_url, peers=[self.p.ep.info])
        except BaseException:
            self.p.close()
            raise
        self.threads = kvxfer_threads() - before
        self.before = [b.clone() for b in self.d.kv.buffers]

    def alive(self) -> bool:
        """Every thread the two endpoints started is still running."""
        return all(t.is_alive() for t in self.threads)

    def dead(self) -> list[str]:
        return sorted(t.name for t in self.threads if not t.is_alive())

    def receiver(self, tokens: int = 8):
        """A decode request in flight (granted, its REQ sent): (receiver, decode slots)."""
        room = next(self.rooms)
        return self.d.receiver(room, tokens)

    def finish(self, r, d_slots, timeout: float = 8.0) -> bool:
        """Prefill sends the request of receiver ``r``; True when both sides end in Success."""
        s, p_slots = self.p.sender(r.room, len(d_slots))
        s.send(p_slots, last=True)
        ok = r.wait(timeout) == KVPoll.Success and s.wait(timeout) == KVPoll.Success
        if ok:
            self.moves.append((p_slots, d_slots))
        return ok

    def honest(self, tokens: int = 8, timeout: float = 8.0) -> bool:
        r, d_slots = self.receiver(tokens)
        return self.finish(r, d_slots, timeout)

    def intact(self) -> bool:
        """Decode's pool holds exactly the honest moves' bytes, and the canary everywhere else."""
        return rp.same_bytes(self.d.kv.buffers, rp.reference(self.cfg, self.before, self.moves))

    def close(self) -> None:
        for side in (self.d, self.p):
            try:
                side.close()
            except Exception:
                pass


def attacker_record(pair: "Pair", instance: str, made: list) -> dict:
    """A decode rank record of the attacker's own (``instance``), shaped like the victim decode rank's,
    whose data port is an open zmq receiver of the attacker's (``made`` keeps it, to be closed): the
    victim decode rank's own port admits only the prefill ranks it said HELLO to, so a copy of its
    descriptor gets no data path."""
    import copy

    import torch

    from kvxfer.transport.registry import get_transport
    rec = copy.deepcopy(pair.d.ep.info.to_dict())
    rec["instance"] = instance
    evil = get_transport("zmq", admission="open")
    evil.register([torch.zeros(n, dtype=torch.uint8) for n in rec["data"]["zmq"]["region_sizes"]])
    made.append(evil)
    rec["data"] = {"zmq": evil.descriptor()}
    return rec


def after_attack(pair: Pair, before, attacker=None) -> None:
    """What every test against a ``Pair`` checks once the attack is over; ``attacker`` (a
    ``hostile_wire.CtlClient``) probes that prefill's control thread still answers."""
    if attacker is not None:
        assert attacker.alive(), "the prefill control thread no longer answers"
    assert pair.alive(), f"victim threads died: {pair.dead()}"
    assert pair.honest(), "an honest request no longer completes"
    assert pair.intact(), "decode's pool differs from the honest moves (a byte outside a grant changed?)"
    assert not bounded(before), bounded(before)


# ------------------------------------------------------------------------------------
# Local-transport victims: the in-process tier
# ------------------------------------------------------------------------------------
FAST = Timeouts(handshake=3.0, heartbeat=Heartbeat(interval=0.2, timeout=2.0))


def _pool() -> MHAPool:
    return MHAPool(layers=4, heads=4, head_dim=8, dtype="float16", num_pages=16, page_size=4)


def local_prefill(secret: str | None = None) -> PrefillEndpoint:
    """A prefill endpoint on the local transport (the caller closes it)."""
    return PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=4, num_layers=4), _pool(), transport="local",
                           timeouts=FAST, secret=secret)


def local_decode(secret: str | None = None) -> DecodeEndpoint:
    """A decode endpoint that tests say HELLO for by hand: its data port admits anyone (no token)."""
    return DecodeEndpoint(RankSpec(role="decode", num_kv_heads=4, num_layers=4), _pool(), transport="local",
                          timeouts=FAST, secret=secret, transport_options={"admission": "open"})


def still_serves(p: PrefillEndpoint, secret: str | None = None) -> None:
    """The victim's channel thread lives and an honest decode rank handshakes with it."""
    assert p.channel.alive
    d = local_decode(secret)
    try:
        d.connect(peers=[p.info], timeout=5)
    finally:
        d.close()
    assert p.channel.alive
