"""Eager writes: a sender puts into a request's grant without the ANNOUNCE/GO round trip, and its
handle succeeds once those puts are flushed (remote completion), as NIXL's and Mooncake's do; the
receiver checks what landed when the announce arrives, which then doubles as DONE.

Opt-in on the receiving side (``UCXTransport(eager_writes=True)``); ``UCXEager`` is a mixin of
``UCXTransport`` and every method here runs on the I/O thread.

Who calls what, when:

receiver
  ``_pregrant(rid)``  after ``expect`` (a command): PREGRANT(rid, its granted ranges) to every
                      connected peer whose HELLO said ``eager`` (it answers FENCEs), and that
                      ``expect``'s ``senders`` names, when given;
                      ``_pregrants[rid]`` remembers them. A grant of more than
                      ``MAX_PREGRANT_BYTES // 16`` intervals is not pregranted: its PREGRANT
                      carries no ranges (announced, GO), so the sender does not wait for one.
  ``_fence(rid)``     after ``forget`` (``_drop_request``): FENCE(rid) to each of them (the
                      FENCEs of one turn leave as one message: ``UCXControl._send``).
                      ``writes_pending(rid)`` stays True from ``forget`` until each answered
                      FENCED (sent after its endpoint flush: nothing of the request is on its way
                      and nothing more will be), or was proven dead (``_unfence_peer``), or
                      ``quarantine_timeout`` passed. A silent one is asked again when it
                      re-handshakes (``_refence``): silence is not death.
sender
  ``_on_pregrant``    remembers the ids and their ranges (bounded: ``MAX_PREGRANTED`` ids and
                      ``MAX_PREGRANTED_BYTES``; one it forgot only costs the round trip).
  ``_eager_ok(o)``    at ``_start_out``: the request is pregranted, every run of the transfer lies
                      in its pregranted ranges, it has puts and inline bytes only (no frames: they
                      need GO's data tag), no re-handshake runs. A transfer with a run outside is
                      announced and waits for GO, as without: the receiver refuses it before a
                      byte is put.
  ``_park(o)``        at ``_start_out``, when only the PREGRANT is missing and the receiver
                      pregranted us before: ``o`` waits for it (``wait_pregrant``), at most
                      ``pregrant_wait`` s, then is announced. The submit raced its PREGRANT (the
                      request reached the prefill side by another path before our I/O thread had
                      it): without the wait it would pay the ANNOUNCE/GO round trip. The PREGRANT
                      (``_on_pregrant``) or a FENCE of the request ends the wait at once; a
                      parked transfer was never announced, so failing it sends no ABORT.
  ``_on_fence``       forgets the ids, fails their eager transfers still flushing, flushes the
                      endpoint, then FENCED (``_check_fence_flushes``).

Why the receiver's answer is not waited for: the put's flush is remote completion (the bytes
are in the receiver's memory); the sender put only inside the grant the receiver sent it, and
the receiver still refuses an announce outside the grant or of an ended request (counted); its
own arrival is what the decode side acts on. So an honest sender with a wrong plan never writes
outside a grant here either. A peer holding rkeys can write any registered byte anyway: the
checks catch an honest sender's bug, they never stopped a hostile one.
"""
from __future__ import annotations

import collections
import ctypes
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxfer.errors import RejectedWrite
from kvxfer.grant import ByteRanges, GrantTable

from . import bindings as ucp
from .protocol import MAX_PREGRANT_BYTES, Fence, Fenced, Pregrant
from .state import Outgoing, Peer

if TYPE_CHECKING:
    from .protocol import Message

MAX_PREGRANTED = 1 << 16   # request ids a sender remembers per receiver (the oldest is forgotten first)
MAX_PREGRANTED_BYTES = 64 << 20   # and the memory their ranges may take, per receiver
INTERVAL_COST = 96   # bytes an interval of a remembered grant may take (arrays, and Python ints once checked)
# Seconds a transfer waits for its PREGRANT (``_park``). The PREGRANT is one control message, sent
# when the receiver's ``expect`` ran: ~0.1-0.5 ms here, 2-core box, loaded. A wait that ends with
# no PREGRANT costs this much, and happens only when a receiver that pregranted us before
# pregrants no longer (a FENCE or a re-handshake ended it, or we dropped it: ``MAX_PREGRANTED``),
# or did not name us among the request's senders (``expect(senders=)``: a misrouted transfer).
PREGRANT_WAIT = 0.002


class UCXEager:
    """Eager-writes half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only (set in ``UCXTransport.__init__`` or by the other halves).
    eager_writes: bool
    grants: GrantTable
    few_runs: int
    _peers: dict[str, Peer]
    _out: dict[int, Outgoing]
    _holding: list
    _pregrants: dict[str, set[str]]
    _fences: dict[str, tuple[set[str], float]]
    _fence_queued: set[str]
    _fence_expired: int
    _fence_flushing: list[Peer]     # sender: peers with FENCEs waiting for their flush
    _flush_param: ucp.RequestParam
    _send: Callable[[Peer, Message], None]
    _fail_out: Callable[..., None]
    _start_puts: Callable[[Outgoing, int], None]   # UCXSender's
    _start_out: Callable[[Outgoing], None]
    pregrant_wait: float = PREGRANT_WAIT
    _parked: dict[tuple[str, str], list[Outgoing]]   # (peer id, request id) -> transfers waiting for its PREGRANT
    _park_order: collections.deque                   # (until, transfer), in the order they were parked

    # ---- receiver ------------------------------------------------------------------------
    def _pregrant(self, rid: str, senders: frozenset[str] | None = None) -> None:
        ids = {p.id for p in self._peers.values() if p.sends_eager and p.bye_at is None
               and not (p.closing or p.fenced or p.gone) and (senders is None or p.id in senders)}
        ranges = self.grants.ranges_of(rid)
        if not ids or ranges is None:
            return   # forgotten meanwhile
        self._pregrants.setdefault(rid, set()).update(ids)
        # too large a grant to send: no ranges (its sender announces at once, GO), fenced as any
        msg = Pregrant((rid,), (ranges.packed() if len(ranges) * 16 <= MAX_PREGRANT_BYTES else b"",))
        for pid in ids:
            self._send(self._peers[pid], msg)

    def _fence(self, rid: str) -> None:
        """``rid`` was forgotten: each peer it was pregranted to must say FENCED before its memory goes."""
        ids = self._pregrants.pop(rid, None)
        if ids:
            old = self._fences.get(rid)
            self._fences[rid] = (ids | old[0] if old else ids, old[1] if old else time.monotonic())
            for pid in ids:
                if (p := self._peers.get(pid)) is not None:
                    self._send(p, Fence((rid,)))
        self._fence_queued.discard(rid)   # after the entry is made: writes_pending sees no gap

    def _on_fenced(self, p: Peer, m: Fenced) -> None:
        rids = list(self._fences) if m.all else m.rids
        for rid in rids:
            if (entry := self._fences.get(rid)) is not None:
                entry[0].discard(p.id)
                if not entry[0]:
                    del self._fences[rid]
        if m.all:   # its transport is closing: no more pregrants to it
            p.sends_eager = False
            for ids in self._pregrants.values():
                ids.discard(p.id)

    def _refence(self, p: Peer) -> None:
        """``p`` re-handshook: a FENCE it may not have had goes again (it answers each once flushed)."""
        rids = tuple(rid for rid, (ids, _) in self._fences.items() if p.id in ids)
        for k in range(0, len(rids), 4096):
            self._send(p, Fence(rids[k:k + 4096]))

    def _unfence_peer(self, p: Peer) -> None:
        """``p`` is proven dead: nothing more of it lands, whatever it was pregranted."""
        self._on_fenced(p, Fenced((), True))

    def _expire_fences(self, now: float, limit: float) -> None:
        for rid in [rid for rid, (_, since) in self._fences.items() if now - since > limit]:
            del self._fences[rid]
            self._fence_expired += 1

    # ---- sender --------------------------------------------------------------------------
    def _on_pregrant(self, p: Peer, m: Pregrant) -> None:
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
        if self._parked:
            for rid in m.rids:
                self._unpark((p.id, rid))

    def _park(self, o: Outgoing) -> bool:
        """``o`` was not put eagerly: wait for its PREGRANT instead of announcing now? (see the docstring)"""
        p, rid = o.peer, o.handle.request_id
        if o.parked or not p.fence_answers or rid in p.pregranted or not self._eager_shape(o):
            return False
        o.parked, o.state = True, "wait_pregrant"
        self._parked.setdefault((p.id, rid), []).append(o)
        self._park_order.append((time.monotonic() + self.pregrant_wait, o))
        return True

    def _unpark(self, key: tuple[str, str]) -> None:
        """Start the transfers parked under ``key`` again: eager if their PREGRANT allows, else announced."""
        for o in self._parked.pop(key, ()):
            if o.state == "wait_pregrant":   # not failed meanwhile
                del self._out[o.xid]
                o.state = "queued"
                self._start_out(o)

    def _unpark_due(self, now: float) -> None:
        """Each loop turn while transfers are parked: announce those whose wait ran out."""
        q = self._park_order
        while q and (q[0][0] <= now or q[0][1].state != "wait_pregrant"):
            o = q.popleft()[1]
            key = (o.peer.id, o.handle.request_id)
            if o.state == "wait_pregrant":
                self._unpark(key)
            elif (parked := self._parked.get(key)) is not None and o in parked:   # failed while parked
                parked.remove(o)
                if not parked:
                    del self._parked[key]

    @staticmethod
    def _eager_shape(o: Outgoing) -> bool:
        """Could ``o`` go eager once pregranted: puts and inline bytes only (frames need GO's data
        tag), its peer neither re-handshaking nor silent."""
        p = o.peer
        return bool(o.puts) and o.iov is None and o.staging is None and p.rehello is None and not p.gone

    def _eager_ok(self, o: Outgoing) -> bool:
        """Put ``o`` at once? Only inside the grant its receiver pregranted (see the docstring)."""
        p = o.peer
        if not self._eager_shape(o):
            return False
        if (ranges := p.pregranted.get(o.handle.request_id)) is None:
            return False
        a = o.announce
        n = len(a.runs) // 24
        if n <= self.few_runs:   # Python ints: a few bisects instead of ~20 numpy calls
            rows = struct.unpack(f"<{3 * n}q", a.runs)
            return all(ranges.covers_run(rows[i], rows[n + i], rows[2 * n + i]) for i in range(n))
        region, offset, nbytes = a.run_array()
        return bool(ranges.covers(region, offset, nbytes).all())

    def _start_eager(self, o: Outgoing) -> None:
        """Put at once (``o.announce`` says eager); ``_advance`` sends it (as DONE) once the flush completed."""
        o.eager = True
        self._start_puts(o, 0)

    def _on_fence(self, p: Peer, m: Fence) -> None:
        rids = set(m.rids)
        for rid in rids:
            if (old := p.pregranted.pop(rid, None)) is not None:
                p.pregranted_bytes -= len(old) * INTERVAL_COST
            if self._parked:   # announced now: the receiver refuses it (the request ended)
                self._unpark((p.id, rid))
        for o in [o for o in self._out.values() if o.peer is p and o.eager and o.state == "flushing"
                  and o.handle.request_id in rids]:
            self._fail_out(o, RejectedWrite(f"request {o.handle.request_id}: the receiver ended the request"))
        p.fence_flushes.append((ucp.Flush(ucp.ep_flush(p.eph, ctypes.byref(self._flush_param))), m.rids))
        if p not in self._fence_flushing:
            self._fence_flushing.append(p)

    def _check_fence_flushes(self) -> None:
        """Every turn while FENCEs wait for their flush: answer FENCED for each one completed."""
        for p in self._fence_flushing:
            left = []
            for f, rids in p.fence_flushes:
                if (st := f.poll()) is None:
                    left.append((f, rids))
                elif st == 0:
                    self._send(p, Fenced(rids))
                # failed: so did the endpoint; the receiver holds the memory until it knows more
            p.fence_flushes = left
        self._fence_flushing = [p for p in self._fence_flushing if p.fence_flushes]

    def _say_fenced_all(self, p: Peer) -> bool:
        """Nothing of ours is on its way to ``p`` any more (we close, or ``disconnect`` it): tell it
        FENCED-all, once, so the memory of the requests it forgot can go. Whether or not it
        pregranted us yet: a PREGRANT still on its way here would otherwise hold that memory until
        ``quarantine_timeout`` (our FENCED-all clears it there in any order). Not after a failed
        flush to it: what that flush covered may still land (the memory stays held until it knows
        more). True when it was told."""
        if p.fenced_all_said or p.flush_failed:
            return False
        self._send(p, Fenced((), True))
        p.fence_answers, p.fenced_all_said = False, True
        return True

    def _fenced_all(self) -> None:
        """Closing, with no put of ours in flight: tell each receiver that pregranted us."""
        if not self._holding:
            for p in self._peers.values():
                self._say_fenced_all(p)
