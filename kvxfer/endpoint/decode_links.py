"""Prefill's links to decode ranks: ``DecodeLinks``, the part of a ``PrefillEndpoint`` that answers
HELLOs and keeps the table of decode peers (``kvxfer.endpoint.peers.PeerTable``).

HELLOs are answered off the control channel's thread, by a few handshake threads: checking a
peer's record and connecting its data path (``Transport.connect``, a round trip that may take
the transport's ``connect_timeout`` when the address does not answer) never hold up the channel,
which keeps answering the other peers' heartbeats and requests. A slow or dead data address fails
that HELLO alone. At most ``MAX_HANDSHAKES`` HELLOs wait at once and one per peer; more are refused
at once, in words. At most ``max_peers`` decode peers are kept (each costs sockets: the default
fits the process's file limit); a decode peer that goes silent is retired (its requests fail, its
data peer and channel state are freed), so a peer that said HELLO and nothing after costs one
heartbeat timeout.

Who calls what: the endpoint's channel thread calls ``on_hello`` and ``lost``; the handshake
threads call the endpoint's ``retire_requests(peer, why, later)`` (under the endpoint lock) when a
peer is superseded; the endpoint reads ``peers`` under its lock and calls ``close`` once.
"""
from __future__ import annotations

import concurrent.futures
import logging
import resource
import threading

from ..control.handshake import BUSY, DATA_PATH, answer_hello, describe
from ..control.messages import Hello, Refuse, cut
from ..errors import ConnectError, LayoutError, PlanError
from ..layout import Layout
from ..topology import expected_decode_ranks, peer_sources
from .chunks import DecodePeer
from .peers import PeerTable
from .sender import SenderHost

log = logging.getLogger("kvxfer.request")

MAX_HANDSHAKES = 64     # setting: HELLOs queued or in progress at once
HANDSHAKE_THREADS = 4   # HELLOs answered at once (each may wait a data-path round trip)
FDS_PER_PEER = 4        # sockets a decode peer may cost (control, data) with room to spare


def default_max_peers() -> int:
    """Decode peers a prefill rank keeps: what its file limit affords, keeping 256 descriptors spare."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(4096, (soft - 256) // FDS_PER_PEER)) if soft > 0 else 4096


class DecodeLinks:
    """The decode peers of one prefill endpoint and the threads that answer their HELLOs."""

    def __init__(self, ep: SenderHost, max_peers: int | None = None):
        self.ep = ep
        self.peers = PeerTable()
        self.max_peers = default_max_peers() if max_peers is None else int(max_peers)
        self._busy: set[str] = set()            # peers whose HELLO is queued or being answered
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=HANDSHAKE_THREADS,
                                                           thread_name_prefix="kvxfer-prefill-hello")
        self.refused_busy = 0                   # HELLOs refused because too many waited

    def on_hello(self, peer: str, msg: Hello) -> None:
        """Channel thread, never blocks: queue the HELLO for a handshake thread, or refuse it now."""
        with self._lock:
            if peer in self._busy or len(self._busy) >= MAX_HANDSHAKES:
                self.refused_busy += 1
                why = f"{BUSY} a handshake of this peer is in progress" if peer in self._busy else \
                    f"{BUSY} prefill {self.ep.spec.key} is answering {MAX_HANDSHAKES} handshakes: try again"
                self.ep.channel.send(peer, Refuse(re=msg.i, why=[why]))
                return
            self._busy.add(peer)
        try:
            self._pool.submit(self._answer, peer, msg)
        except RuntimeError:   # closing
            with self._lock:
                self._busy.discard(peer)

    def _answer(self, peer: str, msg: Hello) -> None:
        """Handshake thread: check the record, connect the data path, keep the peer, reply."""
        try:
            reply = self._welcome(peer, msg)
        except Exception as e:   # a bug: refuse this HELLO, keep the thread
            log.exception("answering the HELLO of %r failed", peer[:128])
            reply = Refuse(re=msg.i, why=[cut(f"prefill {self.ep.spec.key}: internal error: {e!r}")])
        finally:
            with self._lock:
                self._busy.discard(peer)
        self.ep.channel.send(peer, reply)

    def _welcome(self, peer: str, msg: Hello):
        ep = self.ep
        with ep.guard():   # a silent peer (a restarted group's earlier rank) does not hold the group's map
            others = self.peers.group_records(peer)
            full = peer not in self.peers.peers and len(self.peers) >= self.max_peers
        if full:
            return Refuse(re=msg.i, why=[f"prefill {ep.spec.key} keeps {self.max_peers} decode peers: no more"])
        d_info, reply = answer_hello(ep.info, msg, ep.transport.name, others)
        if d_info is None:
            return reply
        rank = d_info.spec.key
        with ep.guard():   # a new epoch of this peer, or a silent earlier one of its rank: gone
            live = self.peers.rank_peer.get(rank)
            stale = self.peers.stale(peer, rank)
        if live is not None and live != peer and live not in stale:   # identity: one live process per rank
            return Refuse(re=msg.i, why=[cut(f"{BUSY} decode rank {rank} is live here as another process ({live}): "
                                             f"a restart of it is welcomed once that one said BYE or was silent for "
                                             f"the heartbeat timeout ({ep.timeouts.heartbeat.timeout}s)")])
        for old in stale:
            self.retire(old, f"decode rank {rank} handshook again (as {peer})", forget=old != peer)
        try:
            dl = Layout.from_dict(d_info.layout)
            sources = peer_sources(ep.spec, d_info.spec)
            desc = d_info.data[ep.transport.name]
        except KeyError:
            offered = sorted(d_info.data)
            return Refuse(re=msg.i, why=[cut(f"transport: P uses {ep.transport.name!r}, D offers {offered}")])
        except (LayoutError, PlanError) as e:
            return Refuse(re=msg.i, why=[cut(f"prefill {ep.spec.key}: {e}")])
        token = (msg.tokens or {}).get(ep.transport.name, b"")
        try:   # thread-safe in every transport: no endpoint lock held while the data path answers
            xpeer = ep.transport.connect(dict(desc), token)
        except (ConnectError, ValueError) as e:   # the data path: refused now, with the reason
            return Refuse(re=msg.i, why=[cut(f"{DATA_PATH}: prefill {ep.spec.key} cannot reach decode "
                                             f"{d_info.spec.key} at its {ep.transport.name} data address "
                                             f"{describe(desc)}: {e}")])
        with ep.guard():
            self.peers.add(peer, DecodePeer(d_info, dl, xpeer, sources, expected_decode_ranks(ep.spec, d_info.spec)))
        ep.channel.watch(peer)
        log.info("decode rank %s connected (%d source(s) from here)", peer, len(sources))
        return reply

    def retire(self, old: str, why: str, forget: bool = True) -> None:
        """Any thread but the I/O threads: decode peer ``old`` is gone (superseded by a new handshake
        of its rank, or silent): its requests fail (``retire_requests``), then its data peer is
        disconnected unless another handshake shares it (before a new connect, which may hand out the
        same key), and its control state is forgotten. A live peer is never retired for another's
        HELLO (that would let anyone who says HELLO with a rank's record cut that rank off)."""
        ep = self.ep
        with ep.guard() as later:
            dp = self.peers.pop(old)
            if dp is None:
                return
            failed = ep.retire_requests(old, why, later)
            # a warning when it costs requests (a peer that finished and closed is news to no one)
            log.log(logging.WARNING if failed else logging.INFO, "decode peer %s retired: %s (%d request(s) it had "
                    "not confirmed fail)", old, why, failed)
            shared = self.peers.shares(dp.xpeer)
        if not shared:
            ep.transport.disconnect(dp.xpeer)
        if forget:
            ep.channel.forget(old)

    def handshaking(self) -> int:
        """Any thread: HELLOs queued for a handshake thread or being answered now."""
        with self._lock:
            return len(self._busy)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["DecodeLinks", "MAX_HANDSHAKES", "default_max_peers"]
