"""The peers of a UCX transport: the table of ``Peer`` records and its indexes, and what closing
an endpoint means.

``Peers`` holds every peer by id (``by_id``; read like a mapping), the peers by the control tag
their batches carry (``by_tag``: ``join`` binds one, a re-handshake a new one, ``Inbox`` routes by
it; a peer's last ``OLD_TAGS`` older tags still route to it), tags of peers let
go (``retired_tags``: their late batches are dropped without a count), the channel secret and
epoch of disconnected peers (``retired``: a later ``connect`` re-handshakes with a higher epoch),
the peers whose control batches wait for their budget (``waiting``: ``Inbox``), and the peers
whose error-handling endpoint UCX closed (``failed``: queued by the close callback, ``watch``,
for ``Fencing.check_failed``). Every method runs on the I/O thread; ``get`` and the mapping
reads are also used by caller threads (a snapshot: ``submit`` looks its peer up there).
"""
from __future__ import annotations

import collections
import secrets
import weakref
from collections.abc import Iterator

from ucxx._lib import libucxx as ucx_api

from . import bindings as ucp
from .options import UCXOptions
from .protocol import MAX_CTAG
from .state import Peer
from .turn import Leftovers

OLD_TAGS = 8   # older control tags of a peer still routed to it (``rebind_tag``)


def close_ep(ep, err: bool) -> None:
    """Close ``ep`` (I/O thread) unless UCX reported it failed (``err`` endpoints: ucxx closed it
    itself; see ``close_endpoint``)."""
    if err and not ep.alive:
        return
    ep.close()


def undrained(p: Peer, ended: bool) -> int | None:
    """The oldest of our epochs to ``p`` whose puts may still land there, as our endpoints to it
    go (``Peers.retire``; call before ``close_retired``): a replaced endpoint's that has not
    drained, an earlier forgotten one's (``Peer.undrained``), and the current one's unless
    ``ended``. An endpoint ends its puts when its flush completed, or when UCX says its
    connection was reset, whoever reset it (the peer, or our kernel giving up after its
    retransmissions): our socket is gone and what it still held with it. None: nothing may land."""
    left = [r.epoch for r in p.old if not r.drained and not (r.ep is not None and failure_of(r.ep) == "reset")]
    left += [] if p.undrained is None else [p.undrained]
    left += [] if ended else [p.my_epoch]
    return min(left, default=None)


def close_retired(p: Peer) -> None:
    """Close the endpoints a re-handshake replaced (``Rehandshake.renew``, ``renew_control``) and
    destroy their rkeys: the peer is freed, or its writes are proven impossible."""
    for r in p.old:
        if r.ep is not None:
            close_ep(r.ep, p.err)
        ucp.destroy_rkeys(r.rkeys)
    for ep in p.old_ctrl:
        close_ep(ep, p.err)
    p.old, p.old_ctrl = [], []


def close_endpoint(p: Peer) -> None:
    """Close our endpoint to ``p`` (I/O thread), unless UCX reported it failed: ucxx closed that
    one itself, and closing it again crashes the process (SIGSEGV in ucxx 0.52, measured: see
    ``tests/ucx_fence_peer.py``); dropping it is safe. Its state changes only inside a worker
    progress call, which this thread makes, so nothing changes between the check and the close.
    Error handling on (``Peer.err``): ucxx closes in force mode (no flush); off: a flush-close
    that does not wait for a dead peer here, as ucxx runs it."""
    close_ep(p.ep, p.err)
    p.eph = 0   # as ucxx's handle reads once closed


def failure_of(ep) -> str:
    """What UCX says an endpoint's failure was (I/O thread): "reset" when the connection was
    reset or closed by the other side (its process is gone, or its transport closed the
    connection), else the error's name (``UCXEndpointTimeoutError``: a partition, the peer may
    be alive), or "" when UCX reports none."""
    try:
        ep.raise_on_error()
    except ucx_api.UCXConnectionResetError:
        return "reset"
    except Exception as e:
        return type(e).__name__ or "error"
    return ""


def ep_closed(peers_ref: weakref.ref, peer_ref: weakref.ref, eph: int) -> None:
    """ucxx's close callback of an ``err`` endpoint (inside a worker progress call, on the I/O
    thread): only queue the peer for ``Fencing.check_failed``. It also comes when we close the
    endpoint ourselves; the handler skips a peer already forgotten. One a re-handshake replaced
    (``eph`` is not the peer's endpoint any more) is not the peer's failure: its flush says what
    became of it (``Rehandshake.check_old``). Never raises into UCX."""
    try:
        peers, p = peers_ref(), peer_ref()
        if p is None or p.eph != eph:
            return
        p.eph = 0   # ucxx closed it: as its handle reads from now on
        if peers is not None:
            peers.failed.append(p)
    except Exception:   # pragma: no cover - nothing here raises; UCX must never see it
        pass


class Peers:
    """The peer table and its indexes (see the module docstring)."""

    def __init__(self, options: UCXOptions, leftovers: Leftovers):
        self.max_peers, self.leftovers = options.max_peers, leftovers
        self.by_id: dict[str, Peer] = {}
        self.by_tag: dict[int, Peer] = {}
        self.retired_tags: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Channel secret and epoch of disconnected peers (at most max_peers), for a later connect.
        self.retired: collections.OrderedDict[str, tuple[bytes, int, int | None]] = collections.OrderedDict()
        self.waiting: set[Peer] = set()   # peers with control batches waiting for their budget (``Inbox``)
        # Peers whose error-handling endpoint UCX closed (failure) or we closed, queued by the close
        # callback for the I/O loop (``Fencing.check_failed``); stale ones are skipped there.
        self.failed: collections.deque = collections.deque(maxlen=4 * options.max_peers)

    # ---- reads (a mapping of id -> Peer) ------------------------------------------------------
    def get(self, peer_id: str) -> Peer | None:
        return self.by_id.get(peer_id)

    def __getitem__(self, peer_id: str) -> Peer:
        return self.by_id[peer_id]

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_id)

    def values(self):
        return self.by_id.values()

    # ---- I/O thread ---------------------------------------------------------------------------
    def add(self, p: Peer) -> Peer:
        self.by_id[p.id] = p
        return p

    def bind_tag(self, p: Peer) -> None:
        """Give ``p`` the control tag its batches must carry: 62 random bits, unused here."""
        while (tag := secrets.randbelow(MAX_CTAG - 1) + 1) in self.by_tag or tag in self.retired_tags:
            pass
        p.tag_in = tag
        self.by_tag[tag] = p

    def rebind_tag(self, p: Peer) -> None:
        """A new control tag for ``p`` at a new epoch between us: ours (the HELLO that starts it
        carries the tag, ``Rehandshake.new_epoch``) or its (our WELCOME to its HELLO does,
        ``Control.on_hello``). A batch under an older tag was sent before ``p`` read that HELLO or
        WELCOME (``Inbox`` says so: ``current``), e.g. over an endpoint since replaced. The last
        ``OLD_TAGS`` still route to ``p`` (what it said before goes on being read); older ones are
        let go, as a dropped peer's, but for the one its latest batch came under."""
        if p.tag_in:
            p.old_tags.append(p.tag_in)
            if len(p.old_tags) > OLD_TAGS:   # the oldest goes, unless the peer still uses it (an
                # older kvxfer takes no new tag from a WELCOME: it says everything under its first)
                self._let_go(p, p.old_tags.pop(1 if p.old_tags[0] == p.last_tag else 0))
        self.bind_tag(p)

    def _let_go(self, p: Peer, tag: int) -> None:
        """``tag`` no longer routes to ``p``: its late batches are dropped without a count."""
        if self.by_tag.get(tag) is p:
            del self.by_tag[tag]
            self.retired_tags[tag] = None
            while len(self.retired_tags) > 4 * self.max_peers:
                self.retired_tags.popitem(last=False)

    def drop(self, p: Peer) -> None:
        """Forget ``p`` (its records only; the caller closed or is closing its endpoint). Its
        control batches waiting for their budget are dropped unread; its control tag is
        remembered a while, so its late batches are dropped without a count."""
        if self.by_id.get(p.id) is p:
            del self.by_id[p.id]
        while p.ctrl_wait:
            w, res = p.ctrl_wait.popleft()
            self.leftovers.drop(w, res, "quiet")
        self.waiting.discard(p)
        for tag in [*p.old_tags, p.tag_in]:
            self._let_go(p, tag)

    def retire(self, p: Peer, undrained: int | None = None) -> None:
        """``p`` was disconnected or lost, and freed: keep its channel secret and epoch (bounded)
        for a later ``connect``, and ``undrained``: the oldest of our epochs to it whose puts may
        still land (None: all landed or can land no more), which that connect's HELLO says."""
        self.retired[p.id] = (p.secret, p.my_epoch, undrained)
        self.retired.move_to_end(p.id)
        while len(self.retired) > self.max_peers:
            self.retired.popitem(last=False)

    def watch(self, p: Peer) -> None:
        """UCX reports the failure of ``p``'s error-handling endpoint through the close callback,
        queued in ``failed`` and handled by ``Fencing.check_failed`` on the I/O loop's next tick
        (nothing runs inside UCX's call). Weak references: ucxx holds the callback in C++, where
        no collector sees a cycle."""
        p.ep.set_close_callback(ep_closed, (weakref.ref(self), weakref.ref(p), p.eph))

    def clear(self) -> None:
        """At the I/O thread's exit: every record dropped (endpoints with them)."""
        self.by_id, self.by_tag = {}, {}
