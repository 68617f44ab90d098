"""Fencing of a UCX transport (silence is not death): what a failed, silent or closed peer holds,
and when it may go. ``UCXFencing`` is a mixin of ``UCXTransport``; every method runs on the I/O
thread, called from ``control`` (``_housekeeping``: ``_check_failed``, ``_fence_check``,
``_expire_quarantine``, ``_drop_closed_peers``; ``_handle``: ``_peer_gone``). The rules are in
the ``control`` module docstring ("Fencing").

What proves a peer's writes impossible, where:

* same kernel, PID and network namespaces (shared memory, cma): its process is gone (pid and
  start time); our endpoint to it proves nothing (closing it does not stop a peer's cma
  writes), so that is the only proof there.
* another host or network namespace, no user-chosen TLS (``Peer.err``): UCX reports its
  endpoint failed with a connection reset (``_check_failed``): the TCP connection its writes
  travel on was reset or closed by its side. Measured (``tests/test_ucx_close_fence.py``):
  after its ``kill -9`` the close callback fires in ~0.1 s with a reset, no socket to it is
  left and nothing lands afterwards. A timeout (a partition) is no proof, nor is closing our
  endpoint to a live peer: its writes go on landing.
* anything else (a user-chosen TLS across hosts, a silent live peer): nothing; its memory
  stays held until it flushes or re-handshakes, or ``quarantine_timeout`` (opt-in, unsafe)."""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxfer.errors import PeerError

from . import bindings as ucp
from .control import process_start
from .lifecycle import close_endpoint, failure_of
from .state import Peer

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable

log = logging.getLogger("kvxfer.transport.ucx")


class UCXFencing:
    """Fencing half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only (set in ``UCXTransport.__init__`` or by the other halves).
    id: str
    grants: GrantTable
    peer_timeout: float
    fence_grace: float
    quarantine_timeout: float | None
    _host_id: str
    _fence_released: int
    _fence_expired: int
    _workers: list
    _peers: dict[str, Peer]
    _out: dict
    _in: dict
    _unflushed: dict
    _flushing: list
    _holding: list
    _zombies: list
    _landing: dict
    _draining: list
    _landing_rids: collections.Counter
    _fences: dict[str, tuple[set[str], float]]   # UCXEager
    _failed_eps: collections.deque
    _fail_out: Callable[..., None]            # UCXSender._fail_out(o, err, tell=True)
    _fail_in: Callable[..., None]             # UCXReceiver._fail_in(i, reason, tell=True, puts_left=True)
    _landed: Callable[[str], None]
    _unfence_peer: Callable[[Peer], None]      # UCXEager
    _drop_peer: Callable[[Peer], None]         # UCXJoin
    _expire_fences: Callable[[float, float], None]

    def fencing(self) -> dict:
        """Any thread: what is held because a failed or silent peer could still write it (receiver:
        ``requests``, ``bytes``, ``transfers``) or read it (sender: ``sources``, ``source_bytes``);
        ``fenced_peers``; ``released`` (peers proven dead and freed), ``expired`` (quarantines
        given up by ``quarantine_timeout``); ``eager_fences`` (forgotten requests a pregranted
        peer has not said FENCED for). A snapshot; the I/O thread changes it."""
        landing, draining, holding = list(self._landing.values()), list(self._draining), list(self._holding)
        rids = {e[0] for e in landing} | {e[1] for e in draining}
        return {"requests": len(rids), "bytes": sum(e[1] for e in landing) + sum(e[3] for e in draining),
                "transfers": len(landing) + len(draining), "sources": len(holding),
                "source_bytes": sum(o.handle.nbytes for o in holding),
                "fenced_peers": sum(1 for p in list(self._peers.values()) if p.fenced),
                "released": self._fence_released, "expired": self._fence_expired,
                "eager_fences": len(self._fences)}   # forgotten requests waiting for FENCED (``eager``)

    def _holds(self, p: Peer) -> bool:
        return any(k[0] == p.id for k in self._landing) or any(e[0] == p.id for e in self._draining) or \
            any(o.peer is p for o in self._holding) or any(p.id in e[0] for e in self._fences.values())

    def _fence_check(self, p: Peer, now: float) -> None:
        """A silent, fenced or closed peer that holds memory here.

        Proven dead: only for a peer on our kernel in our PID and network namespaces (its HELLO
        said so) whose process is gone (pid absent, or reused: another start time). It issues
        nothing more; after ``fence_grace`` s of progress the writes it had queued in our
        shared-memory FIFO or on loopback have been applied, and everything it held is freed.
        Said BYE (its transport closed): after ``fence_grace`` s our endpoint to it is closed,
        which ends our puts still reading a source, so our held sources are released; what it
        could still write here stays held unless its ABORTs came (it flushes before BYE)."""
        if not self._holds(p):
            return
        if p.pid and p.host and p.host == self._host_id:
            if p.dead_since is None:
                if process_start(p.pid) == p.start:
                    pass   # alive (stalled): silence is not death
                else:
                    p.dead_since = now
                    log.warning("UCX transport %s: peer %s (pid %d) is gone; freeing what it held in %.1fs",
                                self.id[:8], p.id[:8], p.pid, self.fence_grace)
                    return
            elif now - p.dead_since >= self.fence_grace:
                return self._release_peer(p, "proven dead (its process is gone)", writes_impossible=True)
        if p.bye_at is not None and now - p.bye_at >= self.fence_grace and any(o.peer is p for o in self._holding):
            self._release_peer(p, "closed its transport", writes_impossible=False)

    def _check_failed(self, now: float) -> None:
        """Each tick: peers whose error-handling endpoint failed (``Peer.err``; queued by the close
        callback, or seen not alive). Their transfers fail at once; ``fence_grace`` s later (of
        progress: whatever their connection had delivered is applied or dropped by then) they are
        released and forgotten (to write again a peer must connect and handshake anew), as
        *writes impossible* only when UCX says the connection was reset (``failure_of``): the
        other side closed it (its process is gone), so nothing more of it is applied here.
        Measured (``tests/test_ucx_close_fence.py``): after the peer's ``kill -9`` the failure is
        a reset, nothing it had issued lands and no socket to it is left. Any other failure (a
        timeout: a partition, the peer maybe alive with writes on their way) proves nothing:
        what it could write stays held (fenced), as for a silent peer."""
        while self._failed_eps:
            p = self._failed_eps.popleft()
            if self._peers.get(p.id) is p and p.failed_at is None:
                self._ep_failed(p, now)
        for p in list(self._peers.values()):
            if p.err and p.failed_at is None and not p.ep.alive:   # the callback's backstop
                self._ep_failed(p, now)
            if p.failed_at is not None and now - p.failed_at >= self.fence_grace:
                if p.failure == "reset":
                    self._release_peer(p, "lost: its connection was reset (process gone)", writes_impossible=True)
                else:
                    self._release_peer(p, f"lost: its connection failed ({p.failure})", writes_impossible=False)

    def _ep_failed(self, p: Peer, now: float) -> None:
        p.failed_at, p.failure = now, failure_of(p.ep)
        if p.failure == "reset":
            log.warning("UCX transport %s: the connection of peer %s was reset (its process is gone or its "
                        "transport closed); freeing what it held in %.1fs", self.id[:8], p.id[:8], self.fence_grace)
        else:
            log.warning("UCX transport %s: the endpoint of peer %s failed (%s): no proof its writes stopped; what "
                        "it could write stays held until quarantine_timeout, if set", self.id[:8], p.id[:8], p.failure)
        self._peer_gone(p, f"peer lost: its connection failed ({p.failure})")

    def _release_peer(self, p: Peer, why: str, writes_impossible: bool) -> None:
        """Close our endpoint to ``p`` (no flush: it cancels what is queued to it, so no put of
        ours reads a source any more), release our held sources, and forget ``p`` (a new
        connect(), a new handshake, is needed to reach it again). ``writes_impossible``: ``p``
        cannot write here any more either, so its landing and draining entries end too; else
        they stay held (fenced) until ``quarantine_timeout``, if set."""
        for o in [o for o in self._out.values() if o.peer is p]:
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: peer {why}"), tell=False)
        for i in [i for i in self._in.values() if i.peer is p]:
            self._fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"), tell=False,
                          puts_left=not writes_impossible)
        try:
            close_endpoint(p)   # one UCX reported failed is closed already (``Peer.err``)
        except Exception:
            log.exception("closing the endpoint of peer %s", p.id[:8])
        for _ in range(16):
            for w in self._workers:
                w.progress()
        if writes_impossible:
            self._unfence_peer(p)
            for key in [k for k in self._landing if k[0] == p.id]:
                self._landed(self._landing.pop(key)[0])
            for entry in [e for e in self._draining if e[0] == p.id]:
                self._draining.remove(entry)
                self._zombies.append((entry[2], None))
                self._landed(entry[1])
        for o in [o for o in (*self._holding, *self._flushing) if o.peer is p]:
            o.handle.release_source()
        self._holding = [o for o in self._holding if o.peer is not p]
        self._flushing = [o for o in self._flushing if o.peer is not p]
        self._unflushed.pop(p.id, None)
        for o in p.waiting:
            o.handle.finish(PeerError(f"request {o.handle.request_id}: peer {why}"), release=True)
        ucp.destroy_rkeys(p.rkeys)
        p.rkeys, p.outbox, p.waiting, p.rehello = ucp.EMPTY_TABLE, [], [], None
        self._drop_peer(p)
        self._fence_released += 1

    def _expire_quarantine(self, now: float) -> None:
        """Only with ``quarantine_timeout`` set (default None: never): give back memory held for a
        fenced peer for longer than that. Unsafe by construction (the peer may still write it)."""
        limit = self.quarantine_timeout
        for key, (rid, _n, since) in list(self._landing.items()):
            if now - since > limit:
                del self._landing[key]
                self._landed(rid)
                self._fence_expired += 1
                log.warning("UCX transport %s: quarantine of request %s expired after %.0fs: releasing memory "
                            "its sender may still write", self.id[:8], rid, limit)
        self._expire_fences(now, limit)
        for entry in [e for e in self._draining if now - e[4] > limit]:
            self._draining.remove(entry)
            self._zombies.append((entry[2], None))
            self._landed(entry[1])
            self._fence_expired += 1

    def _drop_closed_peers(self, now: float) -> None:
        """Forget peers that said BYE a while ago and that nothing refers to any more: their
        transport closed (ids are per transport), and kept they would count against max_peers."""
        busy = {o.peer.id for o in (*self._out.values(), *self._holding, *self._flushing)} | \
            {key[0] for key in (*self._in, *self._landing)} | {e[0] for e in self._draining} | set(self._unflushed)
        for p in [p for p in self._peers.values() if p.bye_at is not None and now - p.bye_at > self.peer_timeout
                  and p.id not in busy and p.clock.heard <= p.bye_at]:
            self._drop_peer(p)
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys, p.outbox = ucp.EMPTY_TABLE, []
            close_endpoint(p)   # no flush: the peer is gone

    def _peer_gone(self, p: Peer, why: str) -> None:
        """``p`` went silent (or said BYE): its transfers fail on both sides, but silence is not
        death: what it could still write (``_landing``, ``_draining``) or read (``_holding``)
        stays held, and it is fenced until it re-handshakes (see the module docstring)."""
        p.gone = p.fenced = True
        for o in [o for o in self._out.values() if o.peer is p]:
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"))
        for i in [i for i in self._in.values() if i.peer is p]:
            self._fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"), tell=False)
