"""Control batches in: probe, receive, route to their peer; drop what nobody here takes.

Every method of ``Inbox`` runs on the I/O thread (``poll`` each loop turn), except ``rejected``
(any thread). A batch is received only once its tag says whose it is (``join``: the control tag
we gave that peer, ``Peers.by_tag``; the front worker's tag 0 for a HELLO) and its size fits;
everything else is received into one byte (UCX drops the rest unread) and counted
(``Leftovers.junk``). Handled batches go to ``Join.on_join`` (front: its HELLO, then
``Control.on_message`` once it joined) or ``Control.on_message``.

Bounded (issue 34): a receive buffer is made only for a batch that fits its peer's budget
(``max_control_bytes`` being received or handled per peer, ``CTRL_BUDGETS`` times that for all);
the others wait, in order, as UCX's probed messages (a rendezvous not started: UCX keeps its
header, not its bytes), at most ``MAX_WAITING`` per peer. A front worker receives at most
``FRONT_BUDGET`` bytes of HELLO batches (256 KiB each at most) at once; the rest of a flood is
dropped unread. UCX queues what nobody receives without a
bound, and adds messages only inside a worker's progress: every turn takes or drops everything
that arrived (``drop_junk`` for tags of no kind we use), so its queue holds at most what one
progress call brought in.
"""
from __future__ import annotations

import collections
import hmac
import logging
from collections.abc import Callable

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.grant import GrantTable

from .control import Control
from .join import Join
from .options import UCXOptions
from .peers import Peers
from .protocol import CTRL_TAG, DATA_BIT, FRONT_BYTES, KIND_MASK, parse_batch
from .state import Peer
from .turn import Leftovers, Turn
from .workers import Workers

log = logging.getLogger("kvxfer.transport.ucx")

CTRL_BUDGETS = 4       # control bytes being received, all peers together: this many max_control_bytes
MAX_WAITING = 1024     # batches of one peer waiting for its budget (beyond: dropped, counted "too large")
FRONT_BUDGET = 4 << 20   # bytes of HELLO batches being received at once on a front worker (beyond: dropped)


class Inbox:
    """Control batches being received (see the module docstring). ``recvs``: (request, buffer,
    length, peer or None: front, tag) in arrival order; ``nbytes``: control bytes being received or
    waiting to be handled, all peers; ``front_inflight``: bytes of HELLO batches being received."""

    def __init__(self, transport_id: str, options: UCXOptions, grants: GrantTable, workers: Workers, peers: Peers,
                 join: Join, control: Control, leftovers: Leftovers, turn: Turn):
        self.id, self.max_control_bytes = transport_id, options.max_control_bytes
        self.grants, self.workers = grants, workers
        self.peers, self.join, self.control, self.leftovers, self.turn = peers, join, control, leftovers, turn
        self.recvs: list = []
        self.nbytes = self.front_inflight = 0

    def poll(self) -> None:
        """Receive the control batches that arrived: on the front worker one HELLO batch of at most
        ``FRONT_BYTES`` under tag 0; on the others a batch under a control tag we gave a peer, of
        at most ``max_control_bytes``. Anything else is dropped unread (a one-byte receive: UCX
        drops the rest), and so is every message no one here takes (``drop_junk``)."""
        peers, drop, limit = self.peers, self.leftovers.drop, self.max_control_bytes
        for w in self.workers.all:
            front = w is self.workers.front_worker
            while (res := w.tag_probe(ucx_api.UCXXTag(CTRL_TAG), ucx_api.UCXXTagMask(KIND_MASK), remove=True)).matched:
                tag = res.sender_tag.value & ~KIND_MASK
                p = None if front else peers.by_tag.get(tag)
                if front and (tag or res.length > FRONT_BYTES):
                    drop(w, res, "front" if tag else "too large")
                elif not front and p is None:
                    drop(w, res, "quiet" if tag in peers.retired_tags else "unknown peer")
                elif res.length > limit:
                    drop(w, res, "too large")
                elif front:
                    if self.front_inflight + res.length > FRONT_BUDGET:   # a flood of HELLOs: the rest go
                        drop(w, res, "flood")
                    else:
                        self.front_inflight += res.length
                        self._post(w, res, None)
                elif p.ctrl_wait or not self._fits(p, res.length):
                    if len(p.ctrl_wait) >= MAX_WAITING:
                        drop(w, res, "too large")
                    else:   # its rendezvous not started: UCX holds its header only
                        p.ctrl_wait.append((w, res))
                        peers.waiting.add(p)
                else:
                    self._post(w, res, p)
            self.drop_junk(w, front)
        # In arrival order: an ANNOUNCE still streaming in must not be overtaken by its DONE.
        while self.recvs and self.recvs[0][0].completed:
            req, buf, length, p, tag = self.recvs.pop(0)
            self.turn.acts += 1
            if p is None:
                self.front_inflight -= length
            else:
                p.ctrl_bytes -= length
                self.nbytes -= length
            try:
                req.check_error()
                sender, secret, msgs = parse_batch(buf[:length].tobytes(), limit)
            except Exception as e:
                self.grants.reject("?", f"malformed message: {type(e).__name__}: {e}"[:200])
                continue
            if p is None:   # the front worker's: a HELLO, checked before anything is made for it
                self._guarded(self._joined, sender, secret, msgs)
                continue
            if peers.get(p.id) is not p or sender != p.id or not hmac.compare_digest(secret, p.secret):
                self.grants.reject("?", f"unknown peer: a batch from {sender[:40]!r} without its channel")
                continue
            # else sent before the latest new epoch between us took effect there (``Peers.rebind_tag``)
            current, p.last_tag = tag == p.tag_in, tag
            for m in msgs:
                self._guarded(self.control.on_message, p, m, current)
        if peers.waiting:
            self._post_waiting()

    def _joined(self, sender: str, secret: bytes, msgs: list) -> None:
        """A front worker's batch: its HELLO, handled as any once ``Join`` let its sender in."""
        p = self.join.on_join(sender, secret, msgs)
        if p is not None:
            self.control.on_message(p, msgs[0])

    def _fits(self, p: Peer, n: int) -> bool:
        """May a batch of ``n`` bytes from ``p`` be received now? Each peer has at most
        ``max_control_bytes`` of batches being received or waiting to be handled, all peers
        together ``CTRL_BUDGETS`` times that."""
        return p.ctrl_bytes + n <= self.max_control_bytes and \
            self.nbytes + n <= CTRL_BUDGETS * self.max_control_bytes

    def _post(self, w, res, p: Peer | None) -> None:
        """Receive a probed batch (``p``: whose its tag says; None: a front worker's HELLO)."""
        buf = np.empty(max(res.length, 1), np.uint8)
        self.recvs.append((w.tag_recv_with_handle(Array(buf), res), buf, res.length, p,
                           res.sender_tag.value & ~KIND_MASK))
        if p is not None:
            p.ctrl_bytes += res.length
            self.nbytes += res.length

    def _post_waiting(self) -> None:
        """Receive waiting batches in each peer's order, as its budget and the total allow."""
        waiting = self.peers.waiting
        for p in list(waiting):
            while p.ctrl_wait and self._fits(p, p.ctrl_wait[0][1].length):
                w, res = p.ctrl_wait.popleft()
                self._post(w, res, p)
            if not p.ctrl_wait:
                waiting.discard(p)

    def _guarded(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except Exception as e:   # a bug met by one message: counted, the loop goes on
            log.exception("UCX transport %s: handling a control message", self.id[:8])
            self.grants.reject("?", f"internal error: {type(e).__name__}")

    def drop_junk(self, w, front: bool) -> None:
        """Drop every message on ``w`` that no one here takes: tags of neither kind, and data
        frames on any worker but the data one (which ``Receiver.poll_data`` drains). UCX queues
        what nobody receives without a bound; it adds messages only inside ``progress()``, so
        draining after each bounds the queue by what one progress call takes in."""
        kinds = (0, KIND_MASK) if w is self.workers.worker else (0, KIND_MASK, DATA_BIT)
        for kind in kinds:
            while (res := w.tag_probe(ucx_api.UCXXTag(kind), ucx_api.UCXXTagMask(KIND_MASK), remove=True)).matched:
                self.leftovers.drop(w, res, "front" if front else "stray")

    def rejected(self) -> collections.Counter:
        """Any thread: rejected incoming writes and messages by reason (``kvxfer.grant.Reason``
        values), with the messages dropped unread at the probe counted as "unknown peer" (a tag
        nobody was given), "too large", "too many peers" (HELLOs past what a front worker takes at
        once), "malformed message" (on a front worker: anything but a HELLO batch; elsewhere: a tag
        of no kind we use) or "malformed frame" (a data frame under no tag of a frame still to
        come); a retired peer's late batches are not counted."""
        out = collections.Counter(self.grants.rejected)
        j = self.leftovers.junk
        out.update({k: n for k, n in (("unknown peer", j["unknown peer"]), ("too large", j["too large"]),
                                      ("too many peers", j["flood"]),
                                      ("malformed message", j["front"] + j["stray"]),
                                      ("malformed frame", j["frame"])) if n})
        return out

    def clear(self) -> None:
        """At the I/O thread's exit."""
        self.recvs = []
