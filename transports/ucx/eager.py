"""Eager writes: a sender puts into a request's grant without waiting for GO (no control round
trip), and its handle succeeds once those puts are flushed (remote completion), as NIXL's and
Mooncake's do. Its ANNOUNCE (``EAGER_STARTED``) leaves ahead of the puts, or, below
``sender.ANNOUNCE_AHEAD`` bytes, with the turn's batch after them: the receiver checks it as any
other, tracks the transfer (deadline, the sender's death) and completes it at DONE.

The default; the receiving side decides (``UCXOptions.eager_writes``). Two parts, one per side,
each owning its state; every method here runs on the I/O thread: ``Pregrants`` (receiver: what it
told whom, and the FENCEs it waits for) and ``EagerSends`` (sender: what receivers pregranted us,
transfers waiting for a PREGRANT, FENCEs waiting for their flush). ``Sender`` asks ``EagerSends`` whether a
transfer goes eager (``eager_ok``) or waits (``park``), and restarts the transfers it hands back.

Who calls what, when:

receiver
  ``pregrant(rid)``   after ``expect`` (a command): PREGRANT(rid, its granted ranges) to every
                      connected peer whose HELLO said ``eager`` (it answers FENCEs), and that
                      ``expect``'s ``senders`` names, when given;
                      ``Pregrants.granted[rid]`` remembers them. A grant of more than
                      ``MAX_PREGRANT_BYTES // 16`` intervals is not pregranted: its PREGRANT
                      carries no ranges (announced, GO), so the sender does not wait for one.
                      Nor is one that would take a peer beyond its window
                      (``pregrant_window_bytes`` / ``_requests``: what is pregranted to it and
                      not yet FENCED): that peer gets a PREGRANT without ranges, so a stalled
                      peer holds at most its window (``held``, ``window_snapshot``).
  ``fence(rid)``      after ``forget`` (``Receiver.drop_request``): FENCE(rid) to each of them,
                      lazily: with the next batch to that peer (the next request's PREGRANT, in
                      a stream of them) or at the loop's next tick (``Outbox``; FENCEs that
                      leave together are one message: ``Outbox.send``).
                      ``writes_pending(rid)`` stays True from ``forget`` until each answered
                      FENCED (sent after its endpoint flush: nothing of the request is on its way
                      and nothing more will be), or was proven dead (``unfence_peer``), or
                      ``quarantine_timeout`` passed. A silent one is asked again when it
                      re-handshakes (``refence``): silence is not death.
sender
  ``on_pregrant``     remembers the ids and their ranges (bounded: ``MAX_PREGRANTED`` ids and
                      ``MAX_PREGRANTED_BYTES``; one it forgot only costs the round trip).
  ``eager_ok(o)``     at ``Sender.start_out``: the request is pregranted, every run of the transfer lies
                      in its pregranted ranges, it has puts and inline bytes only (no frames: they
                      need GO's data tag), no re-handshake runs. A transfer with a run outside is
                      announced and waits for GO, as without: the receiver refuses it before a
                      byte is put.
  ``park(o)``         at ``Sender.start_out``, when only the PREGRANT is missing and the receiver
                      pregranted us before: ``o`` waits for it (``wait_pregrant``), at most
                      ``pregrant_wait`` s, then is announced. The submit raced its PREGRANT (the
                      request reached the prefill side by another path before our I/O thread had
                      it): without the wait it would pay the ANNOUNCE/GO round trip. The PREGRANT
                      (``on_pregrant``) or a FENCE of the request ends the wait at once; a
                      parked transfer was never announced, so failing it sends no ABORT.
  ``Sender.on_fence`` forgets the ids (``forget``), fails their eager transfers still flushing,
                      flushes the endpoint (``flush_fence``), then FENCED (``check_flushes``),
                      lazily as the FENCE: with our next batch to it (the next transfer's), or
                      at the tick.

Why the receiver's answer is not waited for: the put's flush is remote completion (the bytes
are in the receiver's memory); the sender put only inside the grant the receiver sent it, and
the receiver still refuses an announce outside the grant or of an ended request (counted); its
own arrival is what the decode side acts on. So an honest sender with a wrong plan never writes
outside a grant here either. A peer holding rkeys can write any registered byte anyway: the
checks catch an honest sender's bug, they never stopped a hostile one.
"""
from __future__ import annotations

import collections
import struct
import time
from collections.abc import Callable, Iterable

from kvxfer.grant import ByteRanges, GrantTable
from kvxfer.metrics import record_pregrant

from . import bindings as ucp
from .outbox import Outbox
from .peers import Peers
from .protocol import MAX_PREGRANT_BYTES, Fence, Fenced, Pregrant
from .state import Outgoing, Peer, oldest_undrained
from .workers import Workers

MAX_PREGRANTED = 1 << 16   # request ids a sender remembers per receiver (the oldest is forgotten first)
MAX_PREGRANTED_BYTES = 64 << 20   # and the memory their ranges may take, per receiver
INTERVAL_COST = 96   # bytes an interval of a remembered grant may take (arrays, and Python ints once checked)
# Seconds a transfer waits for its PREGRANT (``park``). The PREGRANT is one control message, sent
# when the receiver's ``expect`` ran: ~0.1-0.5 ms here, 2-core box, loaded. A wait that ends with
# no PREGRANT costs this much, and happens only when a receiver that pregranted us before
# pregrants no longer (a FENCE or a re-handshake ended it, or we dropped it: ``MAX_PREGRANTED``),
# or did not name us among the request's senders (``expect(senders=)``: a misrouted transfer).
PREGRANT_WAIT = 0.002

Restart = Callable[[Outgoing], None]   # ``Sender.restart``: start a transfer that waited again


class Pregrants:
    """Receiver side (see the module docstring). ``granted``: request id -> ids of the peers
    pregranted; ``fences``: forgotten request id -> (peers yet to say FENCED, since); ``queued``:
    forgotten, not yet fenced by the I/O thread (``queue``, any thread); ``expired``: fences
    given up by ``quarantine_timeout``; ``held``: peer id -> {request id: granted bytes} of what
    is pregranted to it and not yet FENCED (in ``granted`` or ``fences``), ``held_bytes`` their
    sums: each peer's use of its window (``window_bytes``, ``window_requests``)."""

    def __init__(self, grants: GrantTable, peers: Peers, outbox: Outbox, window_bytes: int, window_requests: int):
        self.grants, self.peers, self.outbox = grants, peers, outbox
        self.window_bytes, self.window_requests = window_bytes, window_requests
        self.granted: dict[str, set[str]] = {}
        self.fences: dict[str, tuple[set[str], float]] = {}
        self.queued: set[str] = set()
        self.expired = 0
        self.held: dict[str, dict[str, int]] = {}
        self.held_bytes: dict[str, int] = {}

    def pregrant(self, rid: str, senders: frozenset[str] | None = None) -> None:
        ids = {p.id for p in self.peers.values() if p.sends_eager and p.bye_at is None
               and not (p.closing or p.fenced or p.gone) and (senders is None or p.id in senders)}
        ranges = self.grants.ranges_of(rid)
        if not ids or ranges is None:
            return   # forgotten meanwhile
        nbytes = ranges.nbytes
        within = {pid for pid in ids if rid in self.held.get(pid, ()) or (
            len(self.held.get(pid, ())) < self.window_requests
            and self.held_bytes.get(pid, 0) + nbytes <= self.window_bytes)}
        for pid in within:
            if rid not in (h := self.held.setdefault(pid, {})):
                h[rid] = nbytes
                self.held_bytes[pid] = self.held_bytes.get(pid, 0) + nbytes
                record_pregrant(nbytes, 1)
        if within:
            self.granted.setdefault(rid, set()).update(within)
        # too large a grant to send: no ranges (its sender announces at once, GO), fenced as any
        msg = Pregrant((rid,), (ranges.packed() if len(ranges) * 16 <= MAX_PREGRANT_BYTES else b"",))
        for pid in within:
            self.outbox.send(self.peers[pid], msg)
        if beyond := ids - within:   # beyond its window: no ranges (announced, GO), nothing held for it
            empty = Pregrant((rid,), (b"",))
            for pid in beyond:
                self.outbox.send(self.peers[pid], empty)

    def _release(self, pid: str, rid: str) -> None:
        """``pid`` no longer holds ``rid`` of its window, unless still pregranted or unfenced."""
        if pid in self.granted.get(rid, ()) or pid in self.fences.get(rid, ((), 0.0))[0]:
            return
        if (h := self.held.get(pid)) is not None and (n := h.pop(rid, None)) is not None:
            self.held_bytes[pid] -= n
            record_pregrant(-n, -1)
            if not h:
                del self.held[pid], self.held_bytes[pid]

    def clear(self) -> None:
        """The transport is gone (``Loop.free``): nothing it pregranted is held any more."""
        record_pregrant(-sum(self.held_bytes.values()), -sum(len(h) for h in self.held.values()))
        self.held.clear()
        self.held_bytes.clear()
        self.granted.clear()

    def window_snapshot(self) -> dict:
        """Any thread: the window and the most any peer holds of it (a snapshot)."""
        held = list(self.held_bytes.items())
        counts = [len(h) for h in list(self.held.values())]
        return {"pregrant_window_bytes": self.window_bytes, "pregrant_window_requests": self.window_requests,
                "pregranted_bytes": sum(n for _, n in held), "pregranted_requests": sum(counts),
                "pregranted_peer_max_bytes": max((n for _, n in held), default=0),
                "pregranted_peer_max_requests": max(counts, default=0)}

    def pregranted(self, rid: str, peer_id: str) -> bool:
        """Was ``rid`` pregranted to ``peer_id`` (an eager announce needs it)?"""
        return peer_id in self.granted.get(rid, ())

    def queue(self, rid: str) -> None:
        """Any thread, at ``forget``: ``writes_pending(rid)`` until the I/O thread fenced it (``fence``)."""
        self.queued.add(rid)

    def pending(self, rid: str) -> bool:
        """Any thread: may an eager write of forgotten ``rid`` still land (no FENCED from every peer yet)?"""
        return rid in self.queued or rid in self.fences

    def fence(self, rid: str) -> None:
        """``rid`` was forgotten: each peer it was pregranted to must say FENCED before its memory goes."""
        ids = self.granted.pop(rid, None)
        if ids:
            old = self.fences.get(rid)
            self.fences[rid] = (ids | old[0] if old else ids, old[1] if old else time.monotonic())
            for pid in ids:
                if (p := self.peers.get(pid)) is not None:
                    self.outbox.send(p, Fence((rid,)), lazy=True)   # with the next batch to it, or at the tick
        self.queued.discard(rid)   # after the entry is made: writes_pending sees no gap

    def on_fenced(self, p: Peer, m: Fenced) -> None:
        rids = list(self.fences) if m.all else m.rids
        for rid in rids:
            if (entry := self.fences.get(rid)) is not None:
                entry[0].discard(p.id)
                if not entry[0]:
                    del self.fences[rid]
                self._release(p.id, rid)
        if m.all:   # its transport is closing: no more pregrants to it
            p.sends_eager = False
            for ids in self.granted.values():
                ids.discard(p.id)
            for rid in list(self.held.get(p.id, ())):
                self._release(p.id, rid)

    def refence(self, p: Peer) -> None:
        """``p`` re-handshook: a FENCE it may not have had goes again (it answers each once flushed)."""
        rids = tuple(rid for rid, (ids, _) in self.fences.items() if p.id in ids)
        for k in range(0, len(rids), 4096):
            self.outbox.send(p, Fence(rids[k:k + 4096]))

    def unfence_peer(self, p: Peer) -> None:
        """``p`` is proven dead: nothing more of it lands, whatever it was pregranted."""
        self.on_fenced(p, Fenced((), True))

    def holds(self, p: Peer) -> bool:
        """Does a forgotten request wait for ``p``'s FENCED?"""
        return any(p.id in e[0] for e in self.fences.values())

    def expire(self, now: float, limit: float) -> None:
        for rid in [rid for rid, (_, since) in self.fences.items() if now - since > limit]:
            ids = self.fences.pop(rid)[0]
            self.expired += 1
            for pid in ids:
                self._release(pid, rid)


class EagerSends:
    """Sender side (see the module docstring). ``parked``: (peer id, request id) -> transfers
    waiting for its PREGRANT; ``park_order``: (until, transfer) in the order they were parked;
    ``flushing``: peers with FENCEs waiting for their flush. ``pregrant_wait``: seconds a
    transfer waits (``PREGRANT_WAIT``; tests set it on the instance)."""
    pregrant_wait: float = PREGRANT_WAIT

    def __init__(self, few_runs: int, grants: GrantTable, peers: Peers, outbox: Outbox, workers: Workers):
        self.few_runs, self.grants, self.peers, self.outbox, self.workers = few_runs, grants, peers, outbox, workers
        self.parked: dict[tuple[str, str], list[Outgoing]] = {}
        self.park_order: collections.deque = collections.deque()
        self.flushing: list[Peer] = []

    def on_pregrant(self, p: Peer, m: Pregrant, restart: Restart) -> None:
        for rid, packed in zip(m.rids, m.grants):
            try:
                ranges = ByteRanges.from_packed(packed)
            except ValueError as e:
                self.grants.reject(rid, f"malformed message: a PREGRANT's grant: {e}")
                continue
            if (old := p.pregranted.pop(rid, None)) is not None:
                p.pregranted_bytes -= len(old) * INTERVAL_COST
            p.pregranted[rid] = ranges
            p.pregranted_bytes += len(ranges) * INTERVAL_COST
        while p.pregranted and (len(p.pregranted) > MAX_PREGRANTED or p.pregranted_bytes > MAX_PREGRANTED_BYTES):
            p.pregranted_bytes -= len(p.pregranted.pop(next(iter(p.pregranted)))) * INTERVAL_COST
        p.fence_answers = True
        if self.parked:
            for rid in m.rids:
                self.unpark((p.id, rid), restart)

    def park(self, o: Outgoing) -> bool:
        """``o`` was not put eagerly: wait for its PREGRANT instead of announcing now? (see the docstring)"""
        p, rid = o.peer, o.handle.request_id
        if o.parked or not p.fence_answers or rid in p.pregranted or not self.eager_shape(o):
            return False
        o.parked, o.state = True, "wait_pregrant"
        self.parked.setdefault((p.id, rid), []).append(o)
        self.park_order.append((time.monotonic() + self.pregrant_wait, o))
        return True

    def unpark(self, key: tuple[str, str], restart: Restart) -> None:
        """Hand the transfers parked under ``key`` to ``restart`` (it starts those still waiting:
        eager if their PREGRANT allows, else announced)."""
        for o in self.parked.pop(key, ()):
            restart(o)

    def unpark_due(self, now: float, restart: Restart) -> None:
        """Each loop turn while transfers are parked: announce those whose wait ran out."""
        q = self.park_order
        while q and (q[0][0] <= now or q[0][1].state != "wait_pregrant"):
            o = q.popleft()[1]
            key = (o.peer.id, o.handle.request_id)
            if o.state == "wait_pregrant":
                self.unpark(key, restart)
            elif (parked := self.parked.get(key)) is not None and o in parked:   # failed while parked
                parked.remove(o)
                if not parked:
                    del self.parked[key]

    @staticmethod
    def eager_shape(o: Outgoing) -> bool:
        """Could ``o`` go eager once pregranted: puts and inline bytes only (frames need GO's data
        tag), its peer neither re-handshaking nor silent."""
        p = o.peer
        return bool(o.puts) and o.iov is None and o.staging is None and p.rehello is None and not p.gone

    def eager_ok(self, o: Outgoing) -> bool:
        """Put ``o`` at once? Only inside the grant its receiver pregranted (see the docstring)."""
        p = o.peer
        if not self.eager_shape(o):
            return False
        if (ranges := p.pregranted.get(o.handle.request_id)) is None:
            return False
        a = o.announce
        n = len(a.runs) // 24
        if n <= self.few_runs:   # Python ints: a compiled check per run, no arrays to set up
            rows = struct.unpack(f"<{3 * n}q", a.runs)
            return all(ranges.covers_run(rows[i], rows[n + i], rows[2 * n + i]) for i in range(n))
        region, offset, nbytes = a.run_array()
        return bool(ranges.covers(region, offset, nbytes).all())

    def forget(self, p: Peer, rids: Iterable[str], restart: Restart) -> None:
        """A FENCE from ``p``: its pregrants of ``rids`` end, and transfers parked for one of them are
        announced now (the receiver refuses them: the request ended)."""
        for rid in rids:
            if (old := p.pregranted.pop(rid, None)) is not None:
                p.pregranted_bytes -= len(old) * INTERVAL_COST
            if self.parked:
                self.unpark((p.id, rid), restart)

    def flush_fence(self, p: Peer, rids: tuple[str, ...]) -> None:
        """Flush our endpoint to ``p``; FENCED(rids) follows once it completed (``check_flushes``)."""
        p.fence_flushes.append((ucp.flush(p.eph, self.workers.flush_param), rids))
        if p not in self.flushing:
            self.flushing.append(p)

    def check_flushes(self) -> None:
        """Every turn while FENCEs wait for their flush: answer FENCED for each one completed, once
        no endpoint a re-handshake replaced may still carry a put of ours (``Rehandshake.renew``),
        nor one we had before this connect (``Peer.undrained``: that one never drains)."""
        for p in self.flushing:
            left = []
            for f, rids in p.fence_flushes:
                if (st := f.poll()) is None or oldest_undrained(p) is not None:
                    left.append((f, rids))
                elif st == 0:
                    self.outbox.send(p, Fenced(rids), lazy=True)   # with the next batch to it, or at the tick
                # failed: so did the endpoint; the receiver holds the memory until it knows more
            p.fence_flushes = left
        self.flushing = [p for p in self.flushing if p.fence_flushes]

    def say_fenced_all(self, p: Peer) -> bool:
        """Nothing of ours is on its way to ``p`` any more (we close, or ``disconnect`` it): tell it
        FENCED-all, once, so the memory of the requests it forgot can go. Whether or not it
        pregranted us yet: a PREGRANT still on its way here would otherwise hold that memory until
        ``quarantine_timeout`` (our FENCED-all clears it there in any order). Not after a failed
        flush to it: what that flush covered may still land (the memory stays held until it knows
        more). True when it was told."""
        if p.fenced_all_said or p.flush_failed or oldest_undrained(p) is not None:
            return False
        self.outbox.send(p, Fenced((), True))
        p.fence_answers, p.fenced_all_said = False, True
        return True
