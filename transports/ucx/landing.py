"""What may still land here of ended incoming transfers (receiver side; silence is not death).

``Landing`` is the receiver's ledger behind ``writes_pending`` and ``fencing()``:

* ``puts``: ended transfers whose sender had GO, so puts of theirs may still land, until its
  DONE or ABORT (sent once its puts are flushed: ``end``), a HELLO that says their epoch drained
  (``drained``: after a flush of the endpoint they went over), proof that it is dead
  (``writes_impossible``), or ``quarantine_timeout`` (``expire``); never its silence:
  ``(peer id, xid) -> (request id, nbytes, since, the sender's epoch when it was announced)``.
* ``draining``: ended transfers whose posted frame receives may still land (into the grant, or
  into receive-ring slots the ``Receiver`` holds): ``(peer id, key, requests, nbytes, since)``,
  ended when the receives completed (``reap``).
* ``rids``: request id -> entries of either kind (``writes_pending`` while any); ``open``:
  request id -> incoming transfers still open (``Receiver`` counts them).

Who calls what: ``Receiver`` adds entries (I/O thread); ``Control`` ends them (DONE, ABORT, a
re-handshaking HELLO); ``Fencing`` for dead peers and quarantines; the loop's tick and
``Lifecycle`` ask who holds what. ``pending`` and ``snapshot`` run in any thread.
"""
from __future__ import annotations

import collections
import time

from kvxfer.grant import GrantTable

from .state import Incoming, Peer
from .turn import Leftovers


class Landing:
    """The receiver's ledger of writes that may still land (see the module docstring)."""

    def __init__(self, grants: GrantTable, leftovers: Leftovers):
        self.grants, self.leftovers = grants, leftovers
        self.puts: dict[tuple[str, int], tuple[str, int, float, int]] = {}
        self.draining: list = []
        self.rids: collections.Counter = collections.Counter()
        self.open: collections.Counter = collections.Counter()
        self.expired = 0   # entries given up by ``quarantine_timeout``

    def pending(self, rid: str) -> bool:
        """Any thread: may a write of ``rid`` still land here (eager fences aside: ``Pregrants``)?
        Transfers of the request still open count too once it is no longer live: ``forget`` fails
        them on the I/O thread a moment later."""
        return rid in self.rids or (rid in self.open and not self.grants.is_live(rid))

    def landed(self, rid) -> None:
        self.rids[rid] -= 1
        if self.rids[rid] <= 0:
            del self.rids[rid]

    def hold_puts(self, i: Incoming) -> None:
        """``i`` ended after its GO: its sender's puts may still land until it proves otherwise."""
        self.puts[(i.peer.id, i.xid)] = (i.rid, i.nbytes, time.monotonic(), i.epoch)
        self.rids[i.rid] += 1

    def drain(self, peer_id: str, key, reqs, nbytes: int) -> None:
        """Receives posted for an ended transfer (``reqs``: ``poll()`` True once all completed) may
        still write ``nbytes``; ``key``: the request id, or ("ring slots", request id)."""
        self.draining.append((peer_id, key, reqs, nbytes, time.monotonic()))
        self.rids[key] += 1   # writes_pending until they are all done

    def end(self, p: Peer, xid: int) -> bool:
        """``p`` said DONE or ABORT for ended transfer ``xid`` (after its flush): nothing more of it
        lands. False when no entry waited for it."""
        e = self.puts.pop((p.id, xid), None)
        if e is None:
            return False
        self.landed(e[0])
        return True

    def drained(self, p: Peer, below: int) -> None:
        """``p``'s HELLO says every put it issued in an epoch below ``below`` landed (it flushed the
        endpoints that carried them): those entries end. An entry records the epoch ``p`` had here
        when its transfer was announced: a late announce from an older endpoint only counts as
        newer, so it is released later, never sooner."""
        for key in [k for k, e in self.puts.items() if k[0] == p.id and e[3] < below]:
            self.landed(self.puts.pop(key)[0])

    def writes_impossible(self, p: Peer) -> None:
        """``p`` is proven dead: none of its puts or posted receives can land any more."""
        for key in [k for k in self.puts if k[0] == p.id]:
            self.landed(self.puts.pop(key)[0])
        for entry in [e for e in self.draining if e[0] == p.id]:
            self.draining.remove(entry)
            self.leftovers.keep(entry[2])
            self.landed(entry[1])

    def reap(self) -> None:
        """Ended transfers whose posted receives are all done: nothing more of them lands."""
        left = []
        for entry in self.draining:
            if entry[2].poll():
                self.landed(entry[1])
            else:
                left.append(entry)
        self.draining = left

    def expire(self, now: float, limit: float) -> list[str]:
        """``quarantine_timeout``: give up entries older than ``limit`` s (counted in ``expired``);
        returns the request ids of the expired puts (the caller logs them)."""
        rids = []
        for key, (rid, _n, since, _e) in list(self.puts.items()):
            if now - since > limit:
                del self.puts[key]
                self.landed(rid)
                self.expired += 1
                rids.append(rid)
        return rids

    def expire_draining(self, now: float, limit: float) -> None:
        for entry in [e for e in self.draining if now - e[4] > limit]:
            self.draining.remove(entry)
            self.leftovers.keep(entry[2])
            self.landed(entry[1])
            self.expired += 1

    def holds(self, p: Peer) -> bool:
        return any(k[0] == p.id for k in self.puts) or any(e[0] == p.id for e in self.draining)

    def waited(self) -> set[str]:
        """Ids of the peers memory here waits for."""
        return {k[0] for k in self.puts} | {e[0] for e in self.draining} if self.puts or self.draining else set()

    def busy(self) -> set[str]:
        return {k[0] for k in self.puts} | {e[0] for e in self.draining}

    def snapshot(self) -> dict:
        """Any thread (a snapshot): requests, bytes and transfers that may still be written."""
        landing, draining = list(self.puts.values()), list(self.draining)
        rids = {e[0] for e in landing} | {e[1] for e in draining}
        return {"requests": len(rids), "bytes": sum(e[1] for e in landing) + sum(e[3] for e in draining),
                "transfers": len(landing) + len(draining)}

    def clear(self) -> None:
        """At the I/O thread's exit: nothing lands after close (the endpoints are closed)."""
        self.draining = []
        self.open.clear()
