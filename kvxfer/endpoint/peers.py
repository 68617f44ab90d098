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

from ..control.records import RankInfo
from .chunks import DecodePeer


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


__all__ = ["PeerTable"]
