"""Admission of a UCX transport's peers (``Transport.admit``; issue 34): who may join.

``UCXAdmission`` is a mixin of ``UCXTransport``. ``admit`` runs in the caller's thread (decode's
endpoint, before its HELLO to a prefill rank); the rest on the I/O thread. ``UCXJoin._on_join``
asks ``_admission_required`` and checks a HELLO's token against ``_admitted`` before anything is
made for the peer.

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
from collections.abc import Callable
from typing import Any

from kvxfer.errors import ConnectError
from kvxfer.transport.kit import Call

from . import bindings as ucp
from .join import MAX_SENDER
from .lifecycle import close_endpoint
from .state import Peer

log = logging.getLogger("kvxfer.transport.ucx")



class UCXAdmission:
    """Admission half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only (set in ``UCXTransport.__init__`` or by the other halves).
    id: str
    max_peers: int
    admission: bool | None
    io: Any                           # kit.IOThread
    commands: Any                     # kit.CommandQueue
    _admission_on: bool
    _admitted: collections.OrderedDict[str, bytes]
    _admit_lock: threading.Lock
    _stop: bool
    _peers: dict[str, Peer]
    _in: dict
    _out: dict
    _holds: Callable[[Peer], bool]                        # UCXFencing
    _peer_gone: Callable[[Peer, str], None]
    _drop_peer: Callable[[Peer], None]                    # UCXJoin

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
        with self._admit_lock:
            self._admitted[peer_id] = token
            self._admitted.move_to_end(peer_id)
            while len(self._admitted) > 4 * self.max_peers:   # bounded: the oldest admission goes
                self._admitted.popitem(last=False)
        self._require_admission()
        return token

    def _require_admission(self) -> None:
        """Admission becomes required (``admission=None``): peers that joined without it and that we
        did not connect to ourselves are let go (``_drop_unadmitted``, on the I/O thread)."""
        if self.admission is None and not self._admission_on:
            self._admission_on = True
            if not self._stop and not self.io.broken:
                self.commands.put(Call(self._drop_unadmitted, ()))

    def _admission_required(self) -> bool:
        """Does a HELLO need the latest token ``admit`` gave its id? (``admission`` option)"""
        return self.admission is True or (self.admission is None and self._admission_on)

    def _holds_any(self, p: Peer) -> bool:
        """Anything of ``p`` open or held here (transfers either way, or memory it may write or read)."""
        return self._holds(p) or any(k[0] == p.id for k in self._in) or any(o.peer is p for o in self._out.values())

    def _drop_unadmitted(self) -> None:
        """Admission just became required: peers that joined without a token, which we did not
        connect to, are let go (their memory stays fenced if they hold any); to speak again they
        join with a token."""
        for p in [p for p in self._peers.values() if not p.admitted and p.sizes is None and not p.joining]:
            if self._holds_any(p):
                self._peer_gone(p, "admission became required and it joined without a token")
            else:
                self._let_go(p, "admission became required and it joined without a token")

    def _let_go(self, p: Peer, why: str) -> None:
        """Forget ``p``, which holds nothing here and is open nowhere: its endpoint closed (no
        flush: nothing of ours is on its way to it), its rkeys and records gone."""
        try:
            close_endpoint(p)
        except Exception:
            log.exception("closing the endpoint of peer %s", p.id[:8])
        ucp.destroy_rkeys(p.rkeys)
        p.rkeys, p.outbox = ucp.EMPTY_TABLE, []
        self._drop_peer(p)
        log.info("UCX transport %s: peer %s let go: %s", self.id[:8], p.id[:8], why)

    def _evict_silent(self) -> bool:
        """The peer table is full and a HELLO passed its checks: let go of the peer silent longest
        (past ``peer_timeout``: it is ``gone``) that joined us (we did not connect to it) and holds
        nothing here. False when there is none: the HELLO is refused. A peer let go that speaks
        again finds its batches dropped; it joins anew (its endpoint's next handshake)."""
        for p in sorted((q for q in self._peers.values() if q.gone and q.sizes is None and not q.joining),
                        key=lambda q: q.clock.heard):
            if not self._holds_any(p):
                self._let_go(p, "the peer table is full and it was silent longest, holding nothing")
                return True
        return False
