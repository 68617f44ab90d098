"""ZMQ sending side: one DEALER per receiver, messages pumped as zmq takes them.

zmq's send high-water mark (``window`` messages per peer) is the back-pressure; the messages
themselves come from the ``Framer`` (``frames.py``). A transfer ends when the receiver acks it
(every byte landed), nacks it, goes silent, or its deadline passes; its source is released only
once zmq let go of every zero-copy frame of it (its trackers), whatever the receiver said.

Who calls what: ``ZMQTransport`` makes the ``Sender`` with its collaborators; every method runs
on the I/O thread: ``start`` per ``Submit``, ``connect`` per ``Connect``, ``disconnect`` (a
``Call``), ``on_events`` with each poll's events, ``reap`` while ``release_soon``, ``check`` per
tick, ``fail_all`` and ``free`` at the end. ``fencing`` (any thread) is a snapshot.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from concurrent.futures import Future

import zmq

from kvxfer.errors import ConnectError, PlanError, RejectedWrite
from kvxfer.transport.base import TransferStatus, peer_failed
from kvxfer.transport.kit import Connect, PeerClock, StagingPool, Submit, runs_inside, runs_inside_few

from .frames import Framer
from .options import ZMQOptions
from .protocol import RUN_BYTES, Ack, Data, End, Ping, parse_reply
from .regions import Regions
from .sockets import EVENTS, NOBLOCK, POLLIN, POLLOUT, SNDMORE, Sockets

log = logging.getLogger("kvxfer.transport.zmq")

_COPY_BELOW = 256 << 10          # messages up to this size are copied into zmq (see _pump)
RELEASE_SOON = 0.01              # seconds after a deferred release during which the loop looks every 1 ms


class Outgoing:
    """An outgoing transfer (I/O thread). ``frames``: its messages, made as zmq takes them (a
    packed one takes a staging frame then), each saying whether it is the last. ``trackers``: of
    its zero-copy messages, which may read the source until zmq lets go of them."""
    __slots__ = ("xid", "handle", "peer", "frames", "end", "nruns", "trackers", "cap")

    def __init__(self, xid, handle, peer, frames, end: End, cap: bytes = b""):
        self.xid, self.handle, self.peer, self.frames, self.end = xid, handle, peer, frames, end
        self.cap = cap   # the grant's capability: in every header
        self.nruns = 0   # runs in the headers sent so far: the last header's total
        self.trackers: list[zmq.MessageTracker] = []


class Pending:
    """A message zmq refused for now (EAGAIN): its parts, staging block and transfer."""
    __slots__ = ("parts", "stage", "out")

    def __init__(self, parts: list, stage, out: Outgoing):
        self.parts, self.stage, self.out = parts, stage, out


class Probe:
    """``connect``'s round trip on the data socket: a ping with ``nonce``, sent once zmq has a
    connection (DEALERs are IMMEDIATE), answered by a pong echoing it before ``deadline``."""
    __slots__ = ("pid", "nonce", "future", "deadline", "sent")

    def __init__(self, pid: str, nonce: int, future: Future, deadline: float):
        self.pid, self.nonce, self.future, self.deadline, self.sent = pid, nonce, future, deadline, False


class Peer:
    """One DEALER and its transfers. ``clock``: last reply or progress (silence fails them).
    ``probe``: set while ``connect`` waits for the data path's round trip. ``token``: the admission
    token it presents at each (re)connection (b"": none). ``want``: the events the poller watches
    its socket for."""
    __slots__ = ("endpoint", "sock", "sending", "open", "pending", "clock", "pinged", "probe", "token", "want")

    def __init__(self, endpoint, sock, probe: Probe | None = None, token: bytes = b""):
        self.endpoint, self.sock, self.token = endpoint, sock, token
        self.sending: collections.deque[Outgoing] = collections.deque()
        self.open: dict[int, Outgoing] = {}
        self.pending: Pending | None = None
        self.probe = probe
        self.want = POLLIN | POLLOUT
        self.clock = PeerClock()
        self.pinged = self.clock.heard


class Sender:
    """The DEALER side (I/O thread). State: ``peers`` (by peer id), ``out`` (open transfers by id),
    ``releasing`` (ended, zero-copy messages of theirs still in zmq), ``release_soon`` (until then
    the loop looks at ``releasing`` every turn)."""

    def __init__(self, options: ZMQOptions, regions: Regions, framer: Framer, staging: StagingPool,
                 sockets: Sockets):
        self.options, self.regions, self.framer, self.staging, self.sockets = options, regions, framer, staging, sockets
        self.peers: dict[str, Peer] = {}
        self.out: dict[int, Outgoing] = {}
        self.releasing: list[Outgoing] = []
        self.release_soon = 0.0
        self._xids = itertools.count(1)
        self._pids = itertools.count()

    # -- transfers -------------------------------------------------------------------------
    def start(self, cmd: Submit) -> None:
        plan, notify, cap = cmd.work
        pid, request_id, handle = cmd.peer, cmd.request_id, cmd.handle
        peer = self.peers.get(pid)
        if peer is None:
            handle.finish(peer_failed(request_id, f"unknown peer {pid!r}; call connect() first"), release=True)
            return
        # Empty runs carry nothing (and the receiver refuses them).
        runs = [run for run in plan.run_tuples() if run[4] > 0] if plan.num_runs <= self.options.few_runs else None
        if runs is not None and all(self.regions.host[run[0]] is not None for run in runs):
            # a few runs in CPU regions: Python ints, no array setup
            inside = runs_inside_few([(r, o, c) for r, o, _, _, c in runs], self.regions.size_list)
            nbytes, frames = sum(run[4] for run in runs), functools.partial(self.framer.frames_few, runs)
        else:
            sr, so, dr, do, n, _ = plan.runs()
            if len(n) and n.min() <= 0:
                keep = n > 0
                sr, so, dr, do, n = sr[keep], so[keep], dr[keep], do[keep], n[keep]
            inside = runs_inside(sr, so, n, self.regions.sizes)
            nbytes, frames = int(n.sum()), functools.partial(self.framer.frames, sr, so, dr, do, n)
        if not inside:
            handle.finish(PlanError(f"request {request_id}: the plan reads outside the registered source regions"),
                          release=True)
            return
        xid = next(self._xids)
        try:
            out = Outgoing(xid, handle, peer, frames(), End(0, nbytes, notify), cap)
        except Exception as e:  # e.g. a CUDA copy failed: this transfer fails, not the thread
            handle.finish(peer_failed(request_id, f"cannot read the source: {e}"), release=True)
            return
        if not peer.open:
            peer.clock.touch()   # silence counts from now on
        self.out[xid] = peer.open[xid] = out
        peer.sending.append(out)
        self._pump(peer)

    def _drop_pending(self, peer: Peer) -> None:
        """The message zmq refused is dropped, never sent: its staging frame is free again."""
        if peer.pending is not None:
            self.staging.put(peer.pending.stage)
            peer.pending = None

    def _pump(self, peer: Peer) -> None:
        """Hand messages to zmq, round-robin over the peer's transfers, until it pushes back."""
        starved = 0   # transfers in a row whose next message waits for a staging frame
        for _ in range(4 * self.options.window):
            if peer.pending is None:
                if not peer.sending or starved >= len(peer.sending):
                    break
                out = peer.sending.popleft()
                if out.handle.poll() != TransferStatus.PENDING:
                    continue
                try:
                    msg = next(out.frames)
                except Exception as e:  # a bad source fails this transfer, not the thread
                    out.handle.finish(peer_failed(out.handle.request_id, f"cannot read the source: {e}"))
                    continue
                if msg is None:   # waits for a staging frame: the peer's other transfers go on
                    peer.sending.append(out)
                    starved += 1
                    continue
                starved = 0
                runs, parts, stage, last = msg
                out.nruns += len(runs) // RUN_BYTES
                end = None
                if last:
                    end = End(out.nruns, out.end.nbytes, out.end.notify)
                else:
                    peer.sending.append(out)
                hdr = Data(out.handle.request_id, out.xid, out.handle.deadline - time.monotonic(), runs, end, out.cap)
                peer.pending = Pending([hdr.pack(), *parts], stage, out)
            parts, stage, out = peer.pending.parts, peer.pending.stage, peer.pending.out
            # Small messages are copied into zmq: zero-copy costs pyzmq a tracked buffer and a
            # wake-up of its garbage-collector thread (~100 us), more than copying 256 KiB.
            copy = sum(map(len, parts)) <= _COPY_BELOW
            sock, last = peer.sock, len(parts) - 1
            try:   # part by part (pyzmq's send_multipart is a Python loop that costs ~2.5 us more)
                # The header is our own bytes (24 per run): always copied, untracked. Only the first
                # part can meet the high-water mark: zmq takes the rest of a message it started.
                sock.send(parts[0], NOBLOCK | (SNDMORE if last else 0))
                # zero-copy: a tracker per payload part, as zmq reads each (the source, or staging) until it lets go
                trackers = [sock.send(parts[i], NOBLOCK | (SNDMORE if i < last else 0), copy=copy, track=not copy)
                            for i in range(1, last + 1)]
                if not copy:
                    out.trackers += trackers
            except zmq.Again:
                break
            if stage is not None:   # reuse the buffer once zmq is done with it (no fresh pages)
                self.staging.put(stage, None if copy or not trackers else trackers[-1])
            peer.pending = None
            peer.clock.touch()
        # POLLOUT only when zmq pushed back, or when messages are ready to go. Not while every
        # transfer waits for a staging frame: the socket is writable, so poll would return at
        # once and the loop would spin a core until zmq frees a frame (the loop's short tick,
        # ``Framer.starved``, looks again instead).
        ready = bool(peer.sending) and starved < len(peer.sending)
        self._watch(peer, POLLIN | (POLLOUT if peer.pending is not None or ready else 0))

    def _watch(self, peer: Peer, want: int) -> None:
        """The poller watches ``peer``'s socket for ``want`` (told only when it changes)."""
        if want != peer.want:
            self.sockets.poller.modify(peer.sock, want)
            peer.want = want

    def _retire(self, out: Outgoing) -> None:
        """``out`` ended: forget it, and release its source once zmq holds nothing of it."""
        self.out.pop(out.xid, None)
        out.peer.open.pop(out.xid, None)
        if out.peer.pending is not None and out.peer.pending.out is out:
            self._drop_pending(out.peer)   # never handed to zmq: dropped (the receiver fails the transfer)
        out.frames = None
        if not self._release_if_free(out):
            self.releasing.append(out)
            # zmq usually lets go within milliseconds (pyzmq's tracker thread): look again soon for
            # a while, then at the tick (a receiver that stops reading must not make us spin)
            self.release_soon = time.monotonic() + RELEASE_SOON

    def reap(self) -> None:
        """Release the sources zmq let go of since."""
        if self.releasing:
            self.releasing = [out for out in self.releasing if not self._release_if_free(out)]

    @staticmethod
    def _release_if_free(out: Outgoing) -> bool:
        if out.handle.source_released or all(t.done for t in out.trackers):
            out.handle.release_source()
            return True
        return False

    def idle(self) -> bool:
        """No transfer open, no source held in zmq, no connect waiting for its pong: the tick has
        nothing to look after here."""
        return not (self.out or self.releasing) and all(p.probe is None for p in self.peers.values())

    def fencing(self) -> dict:
        rel = list(self.releasing)
        return {"requests": 0, "bytes": 0, "sources": len(rel), "source_bytes": sum(o.handle.nbytes for o in rel)}

    # -- peers -----------------------------------------------------------------------------
    def connect(self, cmd: Connect) -> None:
        """A DEALER to ``cmd.target`` = (endpoint, token); ``cmd.future`` gets the peer id once the
        probe's pong came back, or fails at ``connect_timeout``."""
        (endpoint, token), fut = cmd.target, cmd.future
        try:
            sock = self.sockets.dealer(endpoint, token)
        except zmq.ZMQError as e:
            fut.set_exception(e)
            return
        n = next(self._pids)
        pid = f"{endpoint}#{n}"   # never reused, so a stale id reaches no new peer
        probe = Probe(pid, n, fut, time.monotonic() + self.options.connect_timeout)
        peer = self.peers[pid] = Peer(endpoint, sock, probe, token)
        self.sockets.poller.register(sock, peer.want)
        self._probe(peer, time.monotonic())

    def _reconnect(self, peer: Peer) -> None:
        """A fresh DEALER for a silent peer: closing the old one (linger 0) drops every message
        queued for it, so zero-copy frames stop referencing their sources."""
        poller = self.sockets.poller
        poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        self._drop_pending(peer)
        try:
            peer.sock = self.sockets.dealer(peer.endpoint, peer.token)
        except zmq.ZMQError as e:   # cannot happen for an endpoint that connected before; keep going
            log.error("cannot reconnect to %s: %s", peer.endpoint, e)
            peer.sock = self.sockets.ctx.socket(zmq.DEALER)
        poller.register(peer.sock, POLLIN)
        peer.want = POLLIN

    def disconnect(self, pid: str) -> None:
        """``disconnect`` on the I/O thread: fail the peer's transfers, close its socket (linger 0,
        so zmq drops the frames queued for it; their sources are released once zmq lets go)."""
        peer = self.peers.pop(pid, None)
        if peer is None:
            return
        if peer.probe is not None and not peer.probe.future.done():
            peer.probe.future.set_exception(ConnectError(f"{peer.endpoint}: disconnected while connecting"))
        for out in list(peer.open.values()):
            out.handle.finish(peer_failed(out.handle.request_id, f"peer {pid} was disconnected"))
            self._retire(out)
        peer.sending.clear()
        self._drop_pending(peer)
        self.sockets.poller.unregister(peer.sock)
        peer.sock.close(linger=0)

    def _probe(self, peer: Peer, now: float) -> None:
        """Send the connect ping once zmq has a connection; fail ``connect`` past the deadline."""
        probe = peer.probe
        if probe is None:
            return
        if now > probe.deadline:
            if not probe.future.done():
                probe.future.set_exception(ConnectError(
                    f"no answer on the data socket within {self.options.connect_timeout:g}s: nothing listens "
                    f"there, the address is unreachable or filtered from this host, or the receiver refused "
                    f"our admission token ({'one' if peer.token else 'none'} presented)"))
            self.disconnect(probe.pid)   # frees the socket: it never became a peer
            return
        if not probe.sent:
            try:
                peer.sock.send(Ping(probe.nonce).pack(), flags=NOBLOCK)
            except zmq.Again:   # no connection yet: POLLOUT (or the tick) brings us back
                return
            probe.sent = True
            self._watch(peer, POLLIN)

    # -- the loop's calls --------------------------------------------------------------------
    def on_events(self, events: dict) -> None:
        """Each peer's share of one poll: its probe, its replies, and pumping."""
        for peer in list(self.peers.values()):
            flags = events.get(peer.sock, 0)
            if peer.probe is not None and flags & POLLOUT:
                self._probe(peer, 0.0)   # connected: the ping goes out (the tick checks the deadline)
            if flags & POLLIN:
                self._on_replies(peer)
            if peer.pending is not None or peer.sending:
                self._pump(peer)

    def _on_replies(self, peer: Peer) -> None:
        """The peer's DEALER is readable (the poll said so): its replies so far."""
        sock = peer.sock
        for i in itertools.count():
            # The first receive finds a reply; later ones ask zmq first: a receive that finds
            # nothing raises zmq.Again (an exception)
            if i and not sock.get(EVENTS) & POLLIN:
                return
            try:
                parts = sock.recv_multipart(flags=NOBLOCK)
            except zmq.Again:
                return
            peer.clock.touch()
            try:
                h = parse_reply(parts[0])
            except ValueError as e:
                log.warning("ignoring a malformed reply: %s", e)
                continue
            if isinstance(h, Ping):
                probe = peer.probe
                if probe is not None and probe.sent and h.n == probe.nonce:   # the data path works
                    peer.probe = None
                    if not probe.future.done():
                        probe.future.set_result(probe.pid)
                continue
            for xid in h.xids if isinstance(h, Ack) else (h.xid,):
                out = peer.open.get(xid)
                if out is None:
                    continue
                if isinstance(h, Ack):   # done, as the receiver says; the source is released by
                    out.handle.finish()  # _retire once zmq's trackers let go, whatever the receiver says
                else:
                    out.handle.finish(RejectedWrite(
                        f"request {out.handle.request_id}: the receiver failed the transfer: {h.why}"))
                self._retire(out)

    def check(self, now: float) -> None:
        """Deadlines, pings and silence of outgoing transfers (the loop's tick)."""
        for out in list(self.out.values()):
            if out.handle.poll() != TransferStatus.PENDING:   # poll() times out a passed deadline
                self._retire(out)
        self.reap()
        hb_ivl, hb_timeout = self.options.heartbeat_ivl, self.options.heartbeat_timeout
        for pid, peer in list(self.peers.items()):
            self._probe(peer, now)
            if not peer.open:
                continue
            if peer.clock.silent(now, hb_timeout):
                silent = peer.clock.silent_for(now)
                for out in list(peer.open.values()):
                    out.handle.finish(peer_failed(out.handle.request_id,
                                                  f"peer {pid} stopped answering for {silent:.1f}s"))
                    self._retire(out)
                peer.sending.clear()
                self._reconnect(peer)
            elif now - peer.pinged >= hb_ivl:
                peer.pinged = now
                try:
                    peer.sock.send(Ping().pack(), flags=NOBLOCK)
                except zmq.Again:
                    pass

    def fail_all(self, why: str) -> None:
        """Every open transfer, and every connect still waiting for its pong, fails with ``why``."""
        for out in list(self.out.values()):
            out.handle.finish(peer_failed(out.handle.request_id, why))
        for peer in self.peers.values():
            if peer.probe is not None and not peer.probe.future.done():
                peer.probe.future.set_exception(ConnectError(why))

    def dealers(self) -> list[zmq.Socket]:
        return [p.sock for p in self.peers.values()]

    def free(self) -> None:
        """After the sockets and context are gone (nothing reads a source any more)."""
        for out in [*self.out.values(), *self.releasing]:
            out.handle.release_source()
        self.staging.clear()
