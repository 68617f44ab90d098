"""Disconnect and shutdown of a UCX transport, on its I/O thread (start-up: ``regions``; connect: ``join``).

``disconnect`` and ``retire_closing`` end one peer; ``reopen`` takes back a disconnect still pending
when the peer is connected again; ``shutdown`` fails what is open, says BYE and frees every UCX
resource (close, or after a crash); the objects themselves go at the thread's exit (``Loop.free``).

Disconnect (one peer; the transport lives on). Its transfers fail at once, with a reason, and
the peer hears BYE. Its resources go only once the fencing rules allow: sources of ours that a
put of it may still read stay held until their flush completes (then ABORT; to a receiver that
pregranted us, FENCED-all once none is left: its eager writes of ours are over); memory of ours it
may still write (it was a sender to us) stays held until its DONE, ABORT, re-handshake or proven
death. Then our endpoint to it is flushed (bounded by ``peer_timeout``, so the ABORTs and BYE
leave), closed, its rkeys destroyed and the ``Peer`` dropped; only its channel secret and epoch
are kept (a bounded table), so a later connect() to the same transport re-handshakes with a
higher epoch, which the peer may still be waiting for.

Who calls what: ``UCXTransport.disconnect`` runs ``disconnect`` (a call on the I/O thread); the
loop calls ``retire_closing`` each turn while peers are closing; ``Join`` calls ``reopen``; the
``Close`` command and a crash run ``shutdown``.
"""
from __future__ import annotations

import time

from kvxfer.errors import PeerError
from kvxfer.transport.kit import CommandQueue

from . import bindings as ucp
from .eager import EagerSends
from .landing import Landing
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers, close_endpoint, close_retired, undrained
from .protocol import Abort, Bye, Fail
from .receiver import Receiver
from .regions import Regions
from .rehandshake import Rehandshake
from .sender import Sender
from .state import Peer
from .turn import Leftovers, Turn
from .workers import Workers


class Lifecycle:
    """Disconnects and shutdown (see the module docstring). ``closing``: disconnected peers, freed
    once nothing of them is held."""

    def __init__(self, options: UCXOptions, workers: Workers, regions: Regions, peers: Peers,
                 outbox: Outbox, sender: Sender, receiver: Receiver, landing: Landing, eager: EagerSends,
                 rehandshake: Rehandshake, commands: CommandQueue, leftovers: Leftovers, turn: Turn):
        self.options, self.workers, self.regions, self.peers = options, workers, regions, peers
        self.outbox, self.sender, self.receiver, self.landing, self.eager = outbox, sender, receiver, landing, eager
        self.rehandshake, self.commands, self.leftovers, self.turn = rehandshake, commands, leftovers, turn
        self.closing: list[Peer] = []

    def disconnect(self, peer_id: str) -> None:
        """Fail ``peer_id``'s transfers, say BYE, and free it once the fencing rules allow
        (``retire_closing``). Unknown or already disconnecting: nothing to do."""
        p = self.peers.get(peer_id)
        if p is None or p.closing:
            return
        if p.joining:   # never welcomed: nothing of it here, nothing of ours there
            self.peers.drop(p)
            close_endpoint(p)
            return
        p.closing, p.closing_since = True, time.monotonic()
        why = "the peer was disconnected"
        self.sender.fail_peer(p, why)   # ABORT once flushed
        for o in p.waiting:
            o.handle.finish(PeerError(f"request {o.handle.request_id}: {why}"), release=True)
        p.waiting = []
        self.receiver.fail_peer(p, why)
        self.outbox.send(p, Bye())
        self.closing.append(p)
        self.retire_closing()

    def reopen(self, p: Peer) -> None:
        """``p`` is connected again while its disconnect was pending: it stays, and re-handshakes
        (it heard BYE and fenced us: flush, then HELLO with a new epoch)."""
        p.closing = p.fenced_all_said = False
        self.closing.remove(p)
        if p.close_flush is not None:
            self.leftovers.keep(p.close_flush)
            p.close_flush = None
        self.rehandshake.begin(p, "connected again while its disconnect was pending")

    def retire_closing(self) -> None:
        """Free disconnected peers that hold nothing any more: flush the endpoint (bounded), close
        it, destroy the rkeys, keep only the channel secret and epoch."""
        now, left = time.monotonic(), []
        for p in self.closing:
            if self.peers.get(p.id) is not p:   # released meanwhile (proven dead)
                continue
            if p.failed_at is not None or not p.eph:   # its endpoint failed: ``Fencing.check_failed`` releases it
                left.append(p)
                continue
            if self.sender.uses(p) or p.rehello is not None or any(r.ep is not None for r in p.old) or p.outbox \
                    or self.receiver.opens(p) \
                    or any(k[0] == p.id for k in self.landing.puts) \
                    or any(e[0] == p.id for e in self.landing.draining):
                left.append(p)   # a put may still read our source, or one of its may still land here
                continue
            if p.close_flush is None and self.eager.say_fenced_all(p):   # eager: nothing of ours is on its way
                left.append(p)   # the close flush next turn, once the FENCED left with the outbox
                continue
            if p.close_flush is None:   # nothing of ours reads a source: flush so ABORTs and BYE leave
                p.close_flush = ucp.flush(p.eph, self.workers.flush_param)
            if p.close_flush.poll() is None and now - p.closing_since < self.options.peer_timeout:
                left.append(p)
                continue
            # Every put of ours to it settled before this close flush began (``Sender.uses``), which
            # covers control only: what of ours may still land is a failed put flush's epoch.
            below = undrained(p, ended=not p.flush_failed)
            if p.close_flush.ptr is not None:
                self.leftovers.keep(p.close_flush)
            self.peers.retire(p, below)   # first: whoever sees it gone from ``peers`` finds its record
            self.peers.drop(p)
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys, p.close_flush = ucp.EMPTY_TABLE, None
            close_endpoint(p)   # flushed, or the peer is silent: no put of ours is in flight to it
            close_retired(p)
        self.closing = left

    def shutdown(self, why: str) -> None:
        """Fail what is open, say BYE, free UCX state (I/O thread; close, or after a crash)."""
        sender, workers = self.sender, self.workers
        for o in list(sender.outgoing.values()):
            sender.fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"), tell=False)
        for i in list(self.receiver.incoming.values()):
            self.receiver.fail_in(i, f"{why} before the transfer finished", tell=False)
        self.commands.fail_all(why)
        # Give held transfers a bounded chance to flush, so their ABORTs (sent after the flush)
        # release the receiver's memory; a peer that cannot take it keeps it fenced.
        end = time.monotonic() + min(1.0, self.options.peer_timeout)
        while sender.holding and time.monotonic() < end:
            workers.settle()
            sender.settle_held()
        for p in self.peers.values():
            p.outbox = [m for m in p.outbox if isinstance(m, (Abort, Fail))]
        sender.fenced_all()   # eager: nothing of ours in flight any more, if so
        for p in self.peers.values():
            if not p.joining:   # a joining one's endpoint goes to its front worker, which takes HELLOs only
                self.outbox.send(p, Bye())
        self.outbox.flush(lazy=True)
        self.turn.run_later()   # the arrivals of what failed here
        end = time.monotonic() + 0.2  # let BYE leave; a dead peer never takes it
        while self.outbox.sends and time.monotonic() < end:
            workers.settle()
            self.outbox.sends = [s for s in self.outbox.sends if not s[0].completed]
        workers.cancel_inflight()
        for p in self.peers.values():
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys = ucp.EMPTY_TABLE
        self.regions.unmap()
        # Close endpoints now, without a flush: ucxx's destructor would flush-close them and
        # spin forever on a dead peer (error handling is off).
        for p in self.peers.values():
            close_endpoint(p)
            close_retired(p)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            workers.settle()
        self.landing.reap()   # cancelled receives: free their requests
        for o in sender.holding:   # endpoints closed: no put of theirs is in flight any more
            o.handle.release_source()
        self.turn.stopped = True
