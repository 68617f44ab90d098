"""Sender side of a re-handshake: flush our endpoint to a peer, then HELLO with a new epoch.

When a silent peer speaks again, or fences us (its FAIL "peer fenced"), or is connected again
while its disconnect was pending, whatever we sent it may be lost or belong to an epoch it
fenced. ``begin`` flushes our endpoint to it; ``check`` (each tick) sends HELLO(epoch + 1) once the
flush completed, then the announces that waited for it (``Peer.waiting``). Transfers waiting for
GO are marked stale: each gets one answer (control is ordered): a GO fails it without a put
(``Sender.on_answer``: ABORT), a FENCED refusal announces it again after the HELLO (``requeue``).
New announces wait for the HELLO, so no put issued after the flush began belongs to the old
epoch. The receiver's side is ``Control.on_hello``.

Who calls what (I/O thread): ``Control`` (``begin``, ``requeue``), ``Join`` (``begin``), the
loop's tick (``check``).
"""
from __future__ import annotations

import ctypes

from . import bindings as ucp
from .outbox import Outbox
from .sender import Sender
from .state import Outgoing, Peer
from .workers import Workers


class Rehandshake:
    """Re-handshakes of our peers (see the module docstring)."""

    def __init__(self, sender: Sender, outbox: Outbox, workers: Workers):
        self.sender, self.outbox, self.workers = sender, outbox, workers

    def begin(self, p: Peer) -> None:
        """Flush our endpoint to ``p``, then (``check``) HELLO with a new epoch."""
        if p.rehello is not None or p.sizes is None or p.closing:   # flushing already, or we never write to it
            return
        for o in self.sender.outgoing.values():
            if o.peer is p and o.state == "wait_go":
                o.stale = True
        p.pregranted.clear()   # maybe stale after silence: announced (GO) until pregranted again
        p.pregranted_bytes = 0
        p.rehello = ucp.Flush(ucp.ep_flush(p.eph, ctypes.byref(self.workers.flush_param)))

    def requeue(self, o: Outgoing) -> None:
        """``o``'s announce was refused because the receiver fenced us. Nothing of it was issued
        (no GO): it is announced again, same transfer id, after our new HELLO."""
        del self.sender.outgoing[o.xid]
        o.state, o.stale = "queued", False
        self.sender.start_out(o)   # waits in p.waiting while the re-handshake flush runs

    def check(self, p: Peer) -> None:
        """Each tick while ``p.rehello``: the flush completed? Then HELLO, then the waiting announces."""
        st = p.rehello.poll()
        if st is None:
            for o in [o for o in p.waiting if o.handle.poll() != 0]:   # timed out waiting: never read
                o.handle.release_source()
                p.waiting.remove(o)
            return
        p.rehello = None
        if st != 0:   # not flushed: try again (a dead peer never completes one)
            self.begin(p)
            return
        p.my_epoch += 1
        self.outbox.send(p, self.workers.hello(p))
        waiting, p.waiting = p.waiting, []
        for o in waiting:
            self.sender.start_out(o)
