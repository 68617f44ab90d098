"""Fencing of a UCX transport (silence is not death): what a failed, silent or closed peer holds,
and when it may go. Every method of ``Fencing`` runs on the I/O thread, called from the loop's
tick (``check_failed``, ``peer_gone``, ``fence_check``, ``expire_quarantine``,
``drop_closed_peers``) and ``Control`` (``peer_gone`` at BYE); ``snapshot`` (``fencing()``) and
``holds`` read in any thread. The rules are in the ``control`` module docstring ("Fencing").

What proves a peer's writes impossible, where:

* same kernel, PID and network namespaces (shared memory, cma): its process is gone (pid and
  start time); our endpoint to it proves nothing (closing it does not stop a peer's cma
  writes), so that is the only proof there.
* another host or network namespace, no user-chosen TLS (``Peer.err``): UCX reports its
  endpoint failed with a connection reset (``check_failed``) while the peer was not silent (we
  heard it within ``peer_timeout``): the TCP connection its writes travel on was reset or
  closed by its side. Measured (``tests/test_ucx_close_fence.py``): after its ``kill -9`` the
  close callback fires in ~0.1 s with a reset, no socket to it is left and nothing lands
  afterwards. A reset after a silence is no proof: our kernel gives up on a connection across
  a long partition (keepalive, retransmissions) and UCX reports that as a reset too
  (``tests/test_multihost_kernel_abort.py``); this holds while those kernel and UCX timeouts
  exceed ``peer_timeout``, as their defaults do (UCX's keepalive: 10 s idle, then 2 s probes).
  Nor is a timeout (a partition), nor closing our endpoint to a live peer: its writes go on
  landing.
* anything else (a user-chosen TLS across hosts, a silent live peer): nothing; its memory
  stays held until it flushes or re-handshakes, or ``quarantine_timeout`` (opt-in, unsafe)."""
from __future__ import annotations

import logging

from kvxfer.grant import GrantTable

from . import bindings as ucp
from .eager import Pregrants
from .landing import Landing
from .options import UCXOptions
from .peers import Peers, close_endpoint, close_retired, failure_of, undrained
from .receiver import Receiver
from .sender import Sender
from .settings import process_start
from .state import Peer
from .workers import Workers

log = logging.getLogger("kvxfer.transport.ucx")


class Fencing:
    """What failed, silent or closed peers hold, and when it goes (see the module docstring).
    ``released``: peers proven dead (or closed) and freed."""

    def __init__(self, transport_id: str, options: UCXOptions, grants: GrantTable, workers: Workers, peers: Peers,
                 sender: Sender, receiver: Receiver, landing: Landing, pregrants: Pregrants):
        self.id, self.options, self.grants, self.workers, self.peers = transport_id, options, grants, workers, peers
        self.sender, self.receiver, self.landing, self.pregrants = sender, receiver, landing, pregrants
        self.released = 0

    def snapshot(self) -> dict:
        """Any thread: what is held because a failed or silent peer could still write it (receiver:
        ``requests``, ``bytes``, ``transfers``) or read it (sender: ``sources``, ``source_bytes``);
        ``fenced_peers``; ``released`` (peers proven dead and freed), ``expired`` (quarantines
        given up by ``quarantine_timeout``); ``eager_fences`` (forgotten requests a pregranted
        peer has not said FENCED for); the pregrant window (``pregrant_window_bytes`` /
        ``_requests``) and what is pregranted against it (``pregranted_bytes`` / ``_requests`` in
        all, ``pregranted_peer_max_bytes`` / ``_requests``: the most any one peer holds). A
        snapshot; the I/O thread changes it."""
        held = self.landing.snapshot()
        holding = list(self.sender.holding)
        return {**held, "sources": len(holding), "source_bytes": sum(o.handle.nbytes for o in holding),
                "fenced_peers": sum(1 for p in list(self.peers.values()) if p.fenced),
                "released": self.released, "expired": self.landing.expired + self.pregrants.expired,
                "eager_fences": len(self.pregrants.fences),   # forgotten requests waiting for FENCED (``eager``)
                **self.pregrants.window_snapshot()}

    def holds(self, p: Peer) -> bool:
        """Does memory here wait for ``p`` (its writes may land, our puts to it may read, or a forgotten
        request waits for its FENCED)?"""
        return self.landing.holds(p) or self.sender.holds(p) or self.pregrants.holds(p)

    def fence_check(self, p: Peer, now: float) -> None:
        """A silent, fenced or closed peer that holds memory here.

        Proven dead: only for a peer on our kernel in our PID and network namespaces (its HELLO
        said so) whose process is gone (pid absent, or reused: another start time). It issues
        nothing more; after ``fence_grace`` s of progress the writes it had queued in our
        shared-memory FIFO or on loopback have been applied, and everything it held is freed.
        Said BYE (its transport closed): after ``fence_grace`` s our endpoint to it is closed,
        which ends our puts still reading a source, so our held sources are released; what it
        could still write here stays held unless its ABORTs came (it flushes before BYE)."""
        if not self.holds(p):
            return
        grace = self.options.fence_grace
        if p.pid and p.host and p.host == self.workers.host_id:
            if p.dead_since is None:
                if process_start(p.pid) == p.start:
                    pass   # alive (stalled): silence is not death
                else:
                    p.dead_since = now
                    log.warning("UCX transport %s: peer %s (pid %d) is gone; freeing what it held in %.1fs",
                                self.id[:8], p.id[:8], p.pid, grace)
                    return
            elif now - p.dead_since >= grace:
                return self.release_peer(p, "proven dead (its process is gone)", writes_impossible=True)
        if p.bye_at is not None and now - p.bye_at >= grace and self.sender.holds(p):
            self.release_peer(p, "closed its transport", writes_impossible=False)

    def check_failed(self, now: float) -> None:
        """Each tick: peers whose error-handling endpoint failed (``Peer.err``; queued by the close
        callback, or seen not alive). Their transfers fail at once; ``fence_grace`` s later (of
        progress: whatever their connection had delivered is applied or dropped by then) they are
        released and forgotten (to write again a peer must connect and handshake anew), as
        *writes impossible* only when UCX says the connection was reset (``failure_of``) while the
        peer was not silent (``_ep_failed``): the other side closed it (its process is gone), so
        nothing more of it is applied here.
        Measured (``tests/test_ucx_close_fence.py``): after the peer's ``kill -9`` the failure is
        a reset, nothing it had issued lands and no socket to it is left. Any other failure (a
        timeout: a partition, the peer maybe alive with writes on their way) proves nothing:
        what it could write stays held (fenced), as for a silent peer."""
        failed, peers = self.peers.failed, self.peers
        while failed:
            p = failed.popleft()
            if peers.get(p.id) is p and p.failed_at is None:
                self._ep_failed(p, now)
        for p in list(peers.values()):
            if p.err and p.failed_at is None and not p.ep.alive:   # the callback's backstop
                self._ep_failed(p, now)
            if p.failed_at is not None and now - p.failed_at >= self.options.fence_grace:
                # Kept for a later connect (the request layer's, once the peer is heard of again):
                # our epoch and which of our puts may still land there, for its HELLO's
                # ``drained``. Our puts end with our socket whatever reset it, even after a silence
                # (only the peer's side stays unproven then): without this, a peer that forgot us
                # too kept what our failed transfers held there fenced for good (issue 35: a
                # 33 s cut with TCP's backoff capped).
                if p.sizes is not None:   # first: whoever sees it gone from ``peers`` finds its record
                    self.peers.retire(p, undrained(p, ended=p.failure.startswith("reset")))
                if p.failure == "reset":
                    self.release_peer(p, "lost: its connection was reset (process gone)", writes_impossible=True)
                else:
                    self.release_peer(p, f"lost: its connection failed ({p.failure})", writes_impossible=False)

    def _ep_failed(self, p: Peer, now: float) -> None:
        p.failed_at, p.failure = now, failure_of(p.ep)
        if p.failure == "reset" and p.clock.silent(now, self.options.peer_timeout):
            # Our own kernel ends a connection the same way when a partition outlasts its
            # keepalive or retransmissions (UCX reports a reset; measured: both sides of a cut link
            # after ~22 s with net.ipv4.tcp_rto_max_ms=2000): after this much silence a reset says
            # nothing of the peer's side, whose own connection may still carry its writes.
            p.failure = f"reset after {p.clock.silent_for(now):.1f}s of silence"
        if p.failure == "reset":
            log.warning("UCX transport %s: the connection of peer %s was reset (its process is gone or its "
                        "transport closed); freeing what it held in %.1fs", self.id[:8], p.id[:8],
                        self.options.fence_grace)
        else:
            log.warning("UCX transport %s: the endpoint of peer %s failed (%s): no proof its writes stopped; what "
                        "it could write stays held until quarantine_timeout, if set", self.id[:8], p.id[:8], p.failure)
        self.peer_gone(p, f"peer lost: its connection failed ({p.failure})")

    def release_peer(self, p: Peer, why: str, writes_impossible: bool) -> None:
        """Close our endpoint to ``p`` (no flush: it cancels what is queued to it, so no put of
        ours reads a source any more), release our held sources, and forget ``p`` (a new
        connect(), a new handshake, is needed to reach it again). ``writes_impossible``: ``p``
        cannot write here any more either, so its landing and draining entries end too; else
        they stay held (fenced) until ``quarantine_timeout``, if set."""
        self.sender.fail_peer(p, f"peer {why}", tell=False)
        self.receiver.fail_peer(p, why, tell=False, puts_left=not writes_impossible)
        try:
            close_endpoint(p)   # one UCX reported failed is closed already (``Peer.err``)
            close_retired(p)
        except Exception:
            log.exception("closing the endpoint of peer %s", p.id[:8])
        for _ in range(16):
            self.workers.settle()
        if writes_impossible:
            self.pregrants.unfence_peer(p)
            self.landing.writes_impossible(p)
        self.sender.let_go(p, why)
        ucp.destroy_rkeys(p.rkeys)
        p.rkeys, p.outbox, p.waiting, p.rehello = ucp.EMPTY_TABLE, [], [], None
        self.peers.drop(p)
        self.released += 1

    def expire_quarantine(self, now: float) -> None:
        """Only with ``quarantine_timeout`` set (default None: never): give back memory held for a
        fenced peer for longer than that. Unsafe by construction (the peer may still write it)."""
        limit = self.options.quarantine_timeout
        assert limit is not None
        for rid in self.landing.expire(now, limit):
            log.warning("UCX transport %s: quarantine of request %s expired after %.0fs: releasing memory "
                        "its sender may still write", self.id[:8], rid, limit)
        self.pregrants.expire(now, limit)
        self.landing.expire_draining(now, limit)

    def drop_closed_peers(self, now: float) -> None:
        """Forget peers that said BYE a while ago and that nothing refers to any more: their
        transport closed (ids are per transport), and kept they would count against max_peers."""
        busy = self.sender.busy() | self.receiver.busy() | self.landing.busy()
        for p in [p for p in self.peers.values() if p.bye_at is not None and now - p.bye_at > self.options.peer_timeout
                  and p.id not in busy and p.clock.heard <= p.bye_at]:
            self.peers.drop(p)
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys, p.outbox = ucp.EMPTY_TABLE, []
            close_endpoint(p)   # no flush: the peer is gone
            close_retired(p)

    def peer_gone(self, p: Peer, why: str) -> None:
        """``p`` went silent (or said BYE): its transfers fail on both sides, but silence is not
        death: what it could still write (``Landing``) or read (``Sender.holding``) stays held, and
        it is fenced until it re-handshakes (see the module docstring)."""
        p.gone = p.fenced = True
        self.sender.fail_peer(p, why)
        self.receiver.fail_peer(p, why, tell=False)
