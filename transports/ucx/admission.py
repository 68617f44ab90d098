"""Admission of a UCX transport's peers (``Transport.admit``; issue 34): who may join.

``Admission.admit`` runs in the caller's thread (decode's endpoint, before its HELLO to a prefill
rank); the rest on the I/O thread. ``Join.on_join`` asks ``required`` and checks a HELLO's token
against ``token_of`` before anything is made for the peer; it asks ``evict_silent`` when the
peer table is full and ``let_go`` for a channel its id's latest token replaces.

The contract (``kvxfer.transport.base``): ``admit(descriptor)`` allows the peer with that
descriptor's "id" to join and returns its token; a later call for the same id returns a fresh
token and voids the older. Option ``admission``: None (default) requires admission once this
transport admitted a peer or ``connect`` was given a token (it is then part of a deployment
whose control plane admits peers: decode ranks admit, prefill ranks connect with tokens and
never take a HELLO); True from the start; False never (bare transports paired by hand). At the
switch, peers that joined without a token and that we did not connect to are let go. Ids are
bound to the channel of the HELLO that carried the id's latest token, never to the first comer:
a HELLO with that token and another channel secret replaces an older channel of the id that
holds nothing here (one that still holds memory is kept, fenced as any, and the HELLO refused).
"""
from __future__ import annotations

import collections
import logging
import secrets
import threading

from kvxfer.errors import ConnectError

from . import bindings as ucp
from .fencing import Fencing
from .options import UCXOptions
from .peers import Peers, close_endpoint
from .protocol import MAX_SENDER
from .receiver import Receiver
from .sender import Sender
from .state import Peer
from .turn import Calls

log = logging.getLogger("kvxfer.transport.ucx")


class Admission:
    """Who may join (see the module docstring). ``mode``: the ``admission`` option; ``on``: admission
    became required (mode None); ``admitted``: peer id -> its latest token (bounded)."""

    def __init__(self, transport_id: str, options: UCXOptions, peers: Peers, fencing: Fencing, sender: Sender,
                 receiver: Receiver, calls: Calls):
        self.id, self.mode, self.max_peers, self.peers = transport_id, options.admission, options.max_peers, peers
        self.fencing, self.sender, self.receiver, self.calls = fencing, sender, receiver, calls
        self.on = False
        self.admitted: collections.OrderedDict[str, bytes] = collections.OrderedDict()   # id -> token
        self.lock = threading.Lock()

    def admit(self, descriptor: dict) -> bytes:
        """Receiver, any thread: the peer with ``descriptor["id"]`` may join (``Transport.admit``);
        returns its token (32 random bytes), which its ``connect`` must present; the id's older
        tokens stop working. From the first call on (``admission=None``) this transport requires
        admission: a HELLO without the id's latest token is refused, counted, nothing made."""
        try:
            peer_id = str(descriptor["id"])
        except (KeyError, TypeError) as e:
            raise ConnectError(f"not a transport descriptor ({type(e).__name__}: {e})") from e
        if not 1 <= len(peer_id) <= MAX_SENDER:
            raise ConnectError(f"a transport id of 1..{MAX_SENDER} characters, got {len(peer_id)}")
        token = secrets.token_bytes(32)
        with self.lock:
            self.admitted[peer_id] = token
            self.admitted.move_to_end(peer_id)
            while len(self.admitted) > 4 * self.max_peers:   # bounded: the oldest admission goes
                self.admitted.popitem(last=False)
        self.require()
        return token

    def require(self) -> None:
        """Any thread: admission becomes required (``admission=None``): peers that joined without it
        and that we did not connect to ourselves are let go (``drop_unadmitted``, on the I/O thread)."""
        if self.mode is None and not self.on:
            self.on = True
            self.calls.post(self.drop_unadmitted)

    def required(self) -> bool:
        """Does a HELLO need the latest token ``admit`` gave its id? (``admission`` option)"""
        return self.mode is True or (self.mode is None and self.on)

    def token_of(self, peer_id: str) -> bytes | None:
        """The latest token ``admit`` gave ``peer_id`` (None: not admitted)."""
        return self.admitted.get(peer_id)

    def holds_any(self, p: Peer) -> bool:
        """Anything of ``p`` open or held here (transfers either way, or memory it may write or read)."""
        return self.fencing.holds(p) or self.receiver.opens(p) or \
            any(o.peer is p for o in self.sender.outgoing.values())

    def drop_unadmitted(self) -> None:
        """Admission just became required: peers that joined without a token, which we did not
        connect to, are let go (their memory stays fenced if they hold any); to speak again they
        join with a token."""
        for p in [p for p in self.peers.values() if not p.admitted and p.sizes is None and not p.joining]:
            if self.holds_any(p):
                self.fencing.peer_gone(p, "admission became required and it joined without a token")
            else:
                self.let_go(p, "admission became required and it joined without a token")

    def let_go(self, p: Peer, why: str) -> None:
        """Forget ``p``, which holds nothing here and is open nowhere: its endpoint closed (no
        flush: nothing of ours is on its way to it), its rkeys and records gone."""
        try:
            close_endpoint(p)
        except Exception:
            log.exception("closing the endpoint of peer %s", p.id[:8])
        ucp.destroy_rkeys(p.rkeys)
        p.rkeys, p.outbox = ucp.EMPTY_TABLE, []
        self.peers.drop(p)
        log.info("UCX transport %s: peer %s let go: %s", self.id[:8], p.id[:8], why)

    def evict_silent(self) -> bool:
        """The peer table is full and a HELLO passed its checks: let go of the peer silent longest
        (past ``peer_timeout``: it is ``gone``) that joined us (we did not connect to it) and holds
        nothing here. False when there is none: the HELLO is refused. A peer let go that speaks
        again finds its batches dropped; it joins anew (its endpoint's next handshake)."""
        for p in sorted((q for q in self.peers.values() if q.gone and q.sizes is None and not q.joining),
                        key=lambda q: q.clock.heard):
            if not self.holds_any(p):
                self.let_go(p, "the peer table is full and it was silent longest, holding nothing")
                return True
        return False
