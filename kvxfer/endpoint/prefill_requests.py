"""Prefill's request table: ``RequestTable``, the part of a ``PrefillEndpoint`` that matches decode
ranks' REQs to the engine's senders and keeps who may end what.

A decode rank asks for a room (REQ: room, generation, its slots); the engine makes the room's
sender (``PrefillEndpoint.sender``) before or after the REQs arrive. The table keeps:
    ``senders``: room -> its live sender;
    ``grants``: (decode peer, "room.gen") -> the sender that REQ is bound to, until the sender's KV
        is released (a DONE or ABORT names its request this way);
    ``pending``: REQs that came before their room's sender (each waits ``Timeouts.bootstrap``);
    ``withdrawn``: rooms whose only REQ its own peer aborted before the sender existed.
A sender is bound (``WaitingForInput``) once every decode rank its group expects has asked.
A decode peer ends only what it asked for itself: a third party's ABORT changes nothing.

Who calls what: the endpoint calls everything here under its lock (``guard``), from the channel
thread (``on_req``, ``on_done``, ``on_abort``, ``retire_peer``, ``expire``) and the scheduler's
(``add``); it tells the table when a sender ends (``forget``) and when its KV goes (``release``).
The table calls back the endpoint's ``pump`` (submit what a bound sender queued) and
``end_request``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from ..control.compat import aux_format, aux_mismatch
from ..control.messages import Abort, Ack, Done, Nack, Req, Room, cut
from ..errors import LayoutError, RequestError
from .base import KVPoll, Outcome
from .chunks import DecodePeer, Target, request_slots
from .decode_links import DecodeLinks
from .peers import QueuedRequests
from .sender import KVSender, SenderHost, call_on_request


class RequestTable:
    """Which decode REQ is bound to which sender, on one prefill rank (see the module docstring)."""

    def __init__(self, ep: SenderHost, links: DecodeLinks, on_request: Callable[[Room, int], None] | None):
        self.ep, self.links, self.on_request = ep, links, on_request
        self.senders: dict[Room, KVSender] = {}              # room -> live sender
        self.grants: dict[tuple[str, str], KVSender] = {}    # (peer, request_id) -> sender, until released
        self.pending = QueuedRequests()                      # REQs that came before the sender
        self.withdrawn: dict[Room, tuple[str, float]] = {}   # rooms whose only REQ its peer aborted, no sender yet

    def add(self, s: KVSender, later) -> None:
        """The engine made ``s`` for its room: bind the REQs that waited for it (or end it, when its
        only REQ was withdrawn)."""
        old = self.senders.get(s.room)
        if old is not None:
            raise RequestError(f"room {s.room} already has a live sender ({old.state.name})")
        self.senders[s.room] = s
        withdrawn = self.withdrawn.pop(s.room, None)
        if withdrawn is not None and not self.pending.get(s.room):
            self.ep.end_request(s, Outcome.Aborted, withdrawn[0], later)
        for target, _ in self.pending.take(s.room).values():
            self.bind(s, target, later)

    def on_req(self, peer: str, msg: Req, later) -> None:
        ep = self.ep
        nack = lambda why: ep.channel.send(peer, Nack(room=msg.room, gen=msg.gen, why=cut(why)))  # noqa: E731
        dp = self.links.peers.get(peer)
        if dp is None:
            nack(f"prefill {ep.spec.key} has no handshake with {peer}")
            return
        try:
            kv, st, swa = request_slots(dp, msg, ep.token_space, ep.swa_window, ep.spec.key)
        except LayoutError as e:
            nack(f"bad request: {e}")
            return
        target = Target(peer, dp.info.spec.tp_rank, msg, kv, st, swa)
        s = self.senders.get(msg.room)
        if s is None or self.claimed(s, target, dp):   # a live room claimed by another: as for no sender
            full = self.pending.add(msg.room, peer, target, ep.clock())
            if full:
                nack(full)
                return
            if s is None and self.on_request is not None:
                tokens = 0 if target.dummy else len(kv)
                later.append(functools.partial(call_on_request, self.on_request, msg.room, tokens))
        else:
            self.bind(s, target, later)

    def bind(self, s: KVSender, t: Target, later) -> None:
        """Bind REQ ``t`` to sender ``s`` and ACK it, or NACK it with the reason; once every expected
        decode rank asked, ``s`` waits for input and its queued chunks go."""
        ep = self.ep
        dp = self.links.peers.get(t.peer)
        why = None
        if dp is None:
            why = "decode rank is gone"
        elif self.claimed(s, t, dp):   # answered as a room with no sender: nothing tells a live room apart
            why = f"no prefill request for room {s.room} on {ep.spec.key}"
        elif t.d_rank not in dp.expected:
            why = f"decode rank {t.d_rank} does not pull from prefill {ep.spec.key}"
        elif t.aux:
            why = aux_mismatch(ep.spec.key, ep.aux_format, dp.info.spec.key, aux_format(dp.info))
            if why:   # the request cannot complete: both sides fail it now, with the reason
                ep.channel.send(t.peer, Nack(room=s.room, gen=t.gen, why=cut(why)))
                ep.end_request(s, Outcome.Failed, why, later)
                return
        if why or dp is None:
            ep.channel.send(t.peer, Nack(room=s.room, gen=t.gen, why=cut(why or "")))
            return
        if t.d_rank not in s.targets:
            s.group, s.expected = dp.group, dp.expected
            s.targets[t.d_rank] = t
            self.grants[(t.peer, t.request_id)] = s
        ep.channel.send(t.peer, Ack(room=s.room, gen=t.gen))
        if s.state == KVPoll.Bootstrapping and set(s.targets) >= s.expected:
            s.advance(KVPoll.WaitingForInput, ep.clock() + ep.timeouts.waiting)
            ep.pump(s, later)

    @staticmethod
    def claimed(s: KVSender, t: Target, dp: DecodePeer) -> bool:
        """``s`` is bound to another decode group, or has another grant from ``t``'s decode rank."""
        old = s.targets.get(t.d_rank)
        return s.group is not None and dp.group != s.group or old is not None and (old.peer, old.gen) != (t.peer, t.gen)

    def on_done(self, peer: str, msg: Done) -> KVSender | None:
        """Decode rank ``peer`` confirmed its request: the sender it is bound to (None: not one of
        its own), with that target marked confirmed."""
        s = self.grants.get((peer, f"{msg.room}.{msg.gen}"))
        if s is not None:
            for tg in s.targets.values():
                tg.confirmed |= tg.peer == peer and tg.gen == msg.gen
        return s

    def on_abort(self, peer: str, msg: Abort, later) -> None:
        """A decode peer's ABORT ends only what that peer itself asked for: the sender its REQ of this
        very request (room and generation) is bound to, or that REQ while it waits for its sender.
        A third party's ABORT, one for another generation, or one for a room the peer never asked
        for changes nothing (a sender nobody asked for yet ends at its bootstrap deadline). A REQ
        withdrawn so before its sender exists, with no other REQ for the room, ends that sender as
        soon as the engine makes it (within ``Timeouts.bootstrap``)."""
        room, why = msg.room, f"decode rank {peer}: {msg.why[:512]}"
        s = self.grants.get((peer, f"{room}.{msg.gen}"))
        if s is not None:
            self.ep.end_request(s, Outcome.Aborted, why, later)
            return
        queued = self.pending.get(room).get(peer)
        if queued is not None and queued[0].gen == msg.gen:
            self.pending.drop(room, peer)
            if room not in self.senders and not self.pending.get(room):   # it asked, then gave up first:
                self.withdrawn[room] = (why, self.ep.clock())               # the sender, once made, ends

    def retire_peer(self, peer: str, why: str, later) -> int:
        """Decode peer ``peer`` is gone: what it asked for and did not confirm ends (returns how
        many requests). A sender serves every decode rank of a TP group; one whose part that peer
        confirmed (DONE: its bytes landed) goes on for the others (a decode rank that finished and
        closed owes that request nothing)."""
        self.pending.drop_peer(peer)
        ended = [s for s in self.senders.values()
                 if any(t.peer == peer and not t.confirmed for t in s.targets.values())]
        for s in ended:
            self.ep.end_request(s, Outcome.Failed, why, later)
        return len(ended)

    def idle(self) -> bool:
        """Nothing for ``expire`` to look after, and no live sender."""
        return not (self.senders or self.pending.rooms or self.withdrawn)

    def expire(self, now: float) -> None:
        """Every 50 ms: withdrawn rooms and REQs that waited past ``Timeouts.bootstrap`` for their
        sender are forgotten (the REQs NACKed)."""
        ep = self.ep
        for room in [r for r, (_, since) in self.withdrawn.items() if now - since > ep.timeouts.bootstrap]:
            del self.withdrawn[room]
        for room, peer, t in self.pending.expired(now, ep.timeouts.bootstrap):
            ep.channel.send(peer, Nack(room=room, gen=t.gen,
                                       why=cut(f"no prefill request for room {room} on {ep.spec.key}")))

    def forget(self, s: KVSender) -> list[tuple[str, int]]:
        """``s`` ended: it is no longer its room's live sender. Returns the (peer, generation) of
        the REQs for its room that still waited unbound (the endpoint tells them why)."""
        if self.senders.get(s.room) is s:
            del self.senders[s.room]
        return [(peer, t.gen) for peer, (t, _) in self.pending.take(s.room).items()]

    def release(self, s: KVSender) -> None:
        """``s``'s KV is released: DONEs and ABORTs naming its requests find nothing now."""
        for t in s.targets.values():
            self.grants.pop((t.peer, t.request_id), None)
