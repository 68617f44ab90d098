"""Prefill's table of decode peers: one ``DecodePeer`` per control peer that was welcomed, which
control peer speaks for each decode rank now, and which peers went silent since their HELLO.
Pure bookkeeping: ``PrefillEndpoint`` (``kvxfer.endpoint.prefill``) holds its lock around every
call.

A decode rank may handshake again: from the same control peer (a new epoch: the earlier
handshake is superseded at once), or from a new one (a restarted process). A new control peer
supersedes the earlier one only once that one is silent: a live peer is never cut off by
another's HELLO, which anyone could send with a rank's record. Superseded peers are retired by
the endpoint (requests failed, data peer disconnected), so the table stays one entry per decode
rank plus the restarts of one heartbeat timeout.
"""
from __future__ import annotations

from ..control.messages import Room
from ..control.records import RankInfo
from .chunks import DecodePeer, Target

MAX_QUEUED = 4096             # setting: REQs one decode peer may have waiting for their sender
MAX_QUEUED_BYTES = 64 << 20   # setting: bytes of slot arrays one decode peer may have waiting


class PeerTable:
    """Control peer -> ``DecodePeer``; decode rank key -> its control peer now; silent peers."""
    __slots__ = ("peers", "rank_peer", "silent")

    def __init__(self) -> None:
        self.peers: dict[str, DecodePeer] = {}
        self.rank_peer: dict[str, str] = {}
        self.silent: set[str] = set()

    def get(self, peer: str) -> DecodePeer | None:
        return self.peers.get(peer)

    def group_records(self, peer: str) -> list[RankInfo]:
        """The records another HELLO's head map is checked against: every live peer but ``peer``
        (a silent one, e.g. an earlier rank of a group restarted with a new map, holds nothing)."""
        return [dp.info for key, dp in self.peers.items() if key != peer and key not in self.silent]

    def stale(self, peer: str, rank: str) -> set[str]:
        """Peers a HELLO from ``peer`` for decode rank ``rank`` supersedes now: ``peer``'s own
        earlier handshake, and the rank's earlier peer if it is silent."""
        return {old for old in (peer, self.rank_peer.get(rank)) if old in self.peers and
                (old == peer or old in self.silent)}

    def add(self, peer: str, dp: DecodePeer) -> None:
        self.peers[peer] = dp
        self.rank_peer[dp.info.spec.key] = peer
        self.silent.discard(peer)

    def pop(self, peer: str) -> DecodePeer | None:
        """Forget ``peer``; its ``DecodePeer`` (None if unknown)."""
        dp = self.peers.pop(peer, None)
        self.silent.discard(peer)
        if dp is not None and self.rank_peer.get(dp.info.spec.key) == peer:
            del self.rank_peer[dp.info.spec.key]
        return dp

    def lost(self, peer: str) -> bool:
        """``peer`` went silent; True when its rank has handshaken again since (it is superseded)."""
        dp = self.peers.get(peer)
        if dp is None:
            return False
        self.silent.add(peer)
        return self.rank_peer.get(dp.info.spec.key) != peer

    def shares(self, xpeer: str) -> bool:
        """Another handshake uses data peer ``xpeer`` (the transport handed out the same key)."""
        return any(dp.xpeer == xpeer for dp in self.peers.values())

    def __len__(self) -> int:
        return len(self.peers)


class QueuedRequests:
    """REQs that came before their sender (``room -> {peer: (target, since)}``), each peer charged
    for its own: at most ``MAX_QUEUED`` of them and ``MAX_QUEUED_BYTES`` of slot arrays per peer, so
    one peer asking for rooms that never get a sender cannot grow the table for everyone."""
    __slots__ = ("rooms", "_count", "_bytes")

    def __init__(self) -> None:
        self.rooms: dict[Room, dict[str, tuple[Target, float]]] = {}
        self._count: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    @staticmethod
    def _cost(t: Target) -> int:
        return 8 * (len(t.kv) + len(t.state) + len(t.swa)) + 256

    def add(self, room: Room, peer: str, t: Target, now: float) -> str | None:
        """Queue ``t``; why not (the peer's share is spent), or None."""
        old = self.rooms.get(room, {}).get(peer)
        if old is not None:
            self.drop(room, peer)
        cost = self._cost(t)
        if self._count.get(peer, 0) >= MAX_QUEUED or self._bytes.get(peer, 0) + cost > MAX_QUEUED_BYTES:
            return (f"{self._count.get(peer, 0)} requests ({self._bytes.get(peer, 0)} bytes) of this peer already "
                    f"wait for their sender (at most {MAX_QUEUED}, {MAX_QUEUED_BYTES} bytes)")
        self.rooms.setdefault(room, {})[peer] = (t, now)
        self._count[peer] = self._count.get(peer, 0) + 1
        self._bytes[peer] = self._bytes.get(peer, 0) + cost
        return None

    def _uncharge(self, peer: str, t: Target) -> None:
        self._count[peer] -= 1
        self._bytes[peer] -= self._cost(t)
        if not self._count[peer]:
            del self._count[peer], self._bytes[peer]

    def get(self, room: Room) -> dict[str, tuple[Target, float]]:
        return self.rooms.get(room, {})

    def drop(self, room: Room, peer: str) -> Target | None:
        reqs = self.rooms.get(room)
        got = reqs.pop(peer, None) if reqs is not None else None
        if got is None:
            return None
        if not reqs:
            del self.rooms[room]
        self._uncharge(peer, got[0])
        return got[0]

    def take(self, room: Room) -> dict[str, tuple[Target, float]]:
        """Every REQ of ``room`` (its sender came, or ended)."""
        reqs = self.rooms.pop(room, {})
        for peer, (t, _) in reqs.items():
            self._uncharge(peer, t)
        return reqs

    def drop_peer(self, peer: str) -> None:
        for room in [r for r, reqs in self.rooms.items() if peer in reqs]:
            self.drop(room, peer)

    def __len__(self) -> int:
        return sum(len(reqs) for reqs in self.rooms.values())

    def expired(self, now: float, limit: float) -> list[tuple[Room, str, Target]]:
        """Remove and return the REQs that waited longer than ``limit``."""
        out = [(room, peer, t) for room, reqs in self.rooms.items() for peer, (t, since) in reqs.items()
               if now - since > limit]
        for room, peer, _ in out:
            self.drop(room, peer)
        return out


__all__ = ["PeerTable", "QueuedRequests", "MAX_QUEUED", "MAX_QUEUED_BYTES"]
