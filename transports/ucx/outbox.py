"""Control messages out: queued per peer during a turn, sent as one tagged batch per peer.

Who calls what (I/O thread): every part that answers or tells a peer something calls ``send``
(``Sender`` an eager ANNOUNCE: ``send_now``); the loop calls ``flush`` once a turn, with
``lazy=True`` at each tick (and ``Lifecycle.shutdown`` before it says BYE). ``sends`` holds each
batch's request and buffer until UCX sent it.

Lazy messages (``send(lazy=True)``): a FENCE (receiver, at ``forget``) and a FENCED (sender,
once its flush completed) wait, in order, for the next batch to their peer (a PREGRANT, an
ANNOUNCE, a DONE, a ping), or for the loop's next tick (``tick``: at most a tenth of a second),
whichever comes first. Nothing waits for either at once: the memory of a forgotten request stays
held (``writes_pending``) until its FENCED came, and decode reuses the memory of a request that
succeeded only once it finished decoding. So in a stream of requests each one's FENCE rides with
the next one's PREGRANT and its FENCED with the next transfer's batch: one control batch each way
per request, not two, and no wake-up of either side for the fence alone. To a closing peer they
leave at once, and so does a peer's queue once it holds ``LAZY_HELD`` messages (each of up to
``MERGE_RIDS`` ids): a flood of FENCEs from a peer is answered as it comes, never held a tick.
"""
from __future__ import annotations

from . import bindings as ucp
from .options import UCXOptions
from .peers import Peers
from .protocol import CTRL_TAG, Fence, Fenced, Message, Pregrant, pack_batch
from .state import Peer
from .turn import Turn

_MERGED = (Pregrant, Fence, Fenced)   # consecutive ones to a peer in a turn go as one (``send``)
MERGE_RIDS = 512   # ids per merged message (joining copies the tuple: bounded, and below MAX_RIDS)
MERGE_GRANT_BYTES = 1 << 20   # PREGRANTs join while their grants stay this small (one may be MAX_PREGRANT_BYTES)
LAZY_HELD = 4   # messages a peer's queue holds before a lazy one makes it leave this turn


class Outbox:
    """Each peer's control messages of this turn (``Peer.outbox``), and the batches UCX still sends."""

    def __init__(self, transport_id: str, options: UCXOptions, peers: Peers, turn: Turn):
        self.id, self.max_control_bytes, self.peers, self.turn = transport_id, options.max_control_bytes, peers, turn
        self.sends: list = []   # (request, buffer): buffers live until sent

    def send(self, p: Peer, msg: Message, lazy: bool = False) -> None:
        """Queue a control message; each peer's queue leaves as one tagged message per turn
        (``lazy``: with the next one, or at the next tick; see the module docstring). A PREGRANT,
        FENCE or FENCED (not "all") right after one of its kind joins it, up to ``MERGE_RIDS``
        ids: the sender answers each FENCE with an endpoint flush and a FENCED, and the receiver
        sends one per forgotten request (a turn of forgets: one flush, not one each)."""
        if (not lazy or p.closing or len(p.outbox) >= LAZY_HELD) and not p.outbox_due:
            p.outbox_due = True
            self.turn.acts += 1
        if p.outbox and isinstance(msg, _MERGED) and not (isinstance(msg, Fenced) and msg.all):
            last = p.outbox[-1]
            same = type(last) is type(msg) and not (isinstance(last, Fenced) and last.all)
            if same and len(last.rids) + len(msg.rids) <= MERGE_RIDS:
                if not isinstance(msg, Pregrant):
                    p.outbox[-1] = type(msg)(last.rids + msg.rids)
                    return
                if sum(map(len, last.grants)) + sum(map(len, msg.grants)) <= MERGE_GRANT_BYTES:
                    p.outbox[-1] = Pregrant(last.rids + msg.rids, last.grants + msg.grants)
                    return
        p.outbox.append(msg)

    def send_now(self, p: Peer, msg: Message) -> None:
        """Send ``msg`` now, after what this turn queued for ``p`` (an eager ANNOUNCE: it must
        leave before the transfer's puts)."""
        self.send(p, msg)
        self._send_batch(p, p.outbox)
        p.outbox, p.outbox_due = [], False

    def flush(self, lazy: bool = False) -> None:
        """Send every peer's queue that holds a message not lazy (``lazy``: every queue; once a
        turn, and at each tick), and forget the batches UCX has sent."""
        for p in self.peers.values():
            if p.outbox and (p.outbox_due or lazy):
                self._send_batch(p, p.outbox)
                p.outbox = []
            p.outbox_due = False
        self.sends = [s for s in self.sends if not s[0].completed]

    def _send_batch(self, p: Peer, msgs: list) -> None:
        """One tagged control message, or several when one would pass ``max_control_bytes``; under
        the control tag ``p`` gave us (0 while we join it: its front worker)."""
        wire = pack_batch(self.id, p.secret, msgs)
        if len(wire) > self.max_control_bytes and len(msgs) > 1:
            half = len(msgs) // 2
            self._send_batch(p, msgs[:half])
            self._send_batch(p, msgs[half:])
            return
        p.last_send = ucp.send_tagged(p.eph, wire, CTRL_TAG | p.tag_out)
        self.sends.append((p.last_send, wire))
