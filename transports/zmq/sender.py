"""ZMQ sending side: runs cut into messages, zero-copy or staged, pumped as zmq takes them.

Runs of at least ``zero_copy_min`` bytes in CPU regions go out as zero-copy views of the region
(split into ``frame_bytes`` parts, ``frames_per_message`` parts per message); shorter runs, and
every run of a CUDA region, are gathered (``torch.index_select``) into staging frames of
~``frame_bytes * frames_per_message``, sorted by region so that the receiver scatters each
region's share with one indexed copy. zmq's send high-water mark (``window`` messages per peer)
is the back-pressure; staging blocks (``kit.StagingPool``) are reused once zmq has sent them.

``ZMQSender`` is a mixin of ``ZMQTransport``; its methods run on the I/O thread.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch
import zmq

from kvxfer.errors import ConnectError, PlanError, RejectedWrite
from kvxfer.plan import TransferPlan, merge_runs
from kvxfer.transport.base import TransferHandle, TransferStatus, peer_failed
from kvxfer.transport.kit import PeerClock, runs_inside, runs_inside_few, split_long_runs

from .protocol import MAX_PARTS, RUN_BYTES, Ack, Data, End, Ping, parse_reply
from .receiver import region_spans, row_index

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable
    from kvxfer.transport.kit import StagingPool

log = logging.getLogger("kvxfer.transport.zmq")

_COPY_BELOW = 256 << 10          # messages up to this size are copied into zmq (see _pump)
RELEASE_SOON = 0.1               # seconds after a deferred release during which the loop looks every 1 ms


def pack_runs(runs: list[tuple[int, int, int, int, int]]) -> bytes:
    """The header's runs field for (src region, src offset, dst region, dst offset, nbytes) runs."""
    return struct.pack(f"<{3 * len(runs)}q", *[r[2] for r in runs], *[r[3] for r in runs], *[r[4] for r in runs])


def fill_messages(runs: list[tuple], budget: int, overhead: int) -> list[list[tuple]]:
    """Runs in order, cut into messages of at most ``budget`` bytes (each run costing its
    length plus ``overhead``) and ``MAX_PARTS`` runs; a longer run gets a message of its own."""
    out: list[list[tuple]]
    cur: list[tuple]
    out, cur, used = [], [], 0
    for run in runs:
        cost = run[4] + overhead
        if cur and (used + cost > budget or len(cur) == MAX_PARTS):
            out.append(cur)
            cur, used = [], 0
        cur.append(run)
        used += cost
    return out + [cur] if cur else out


def gather_rows(region: torch.Tensor, off: np.ndarray, n: np.ndarray, out: torch.Tensor) -> None:
    """out = the region's runs back to back, with one index_select (any device)."""
    off, _, n = merge_runs(off, np.cumsum(n) - n, n)   # runs that touch in the region: longer rows
    length, idx, window = row_index(off, n)
    rows = (region.as_strided((region.numel() - length + 1, length), (1, 1)) if window
            else region[: region.numel() // length * length].view(-1, length))
    torch.index_select(rows, 0, torch.from_numpy(idx).to(region.device), out=out.view(-1, length))


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

    def __init__(self, parts: list, stage: torch.Tensor | None, out: Outgoing):
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
    token it presents at each (re)connection (b"": none)."""
    __slots__ = ("endpoint", "sock", "sending", "open", "pending", "clock", "pinged", "probe", "token")

    def __init__(self, endpoint, sock, probe: Probe | None = None, token: bytes = b""):
        self.endpoint, self.sock, self.token = endpoint, sock, token
        self.sending: collections.deque[Outgoing] = collections.deque()
        self.open: dict[int, Outgoing] = {}
        self.pending: Pending | None = None
        self.probe = probe
        self.clock = PeerClock()
        self.pinged = self.clock.heard


class ZMQSender:
    """The DEALER side of ``ZMQTransport`` (I/O thread). State: ``_peers``, ``_out`` (open
    transfers by id), ``_releasing`` (ended, zero-copy messages of theirs still in zmq)."""

    # Declared for the type checker only: set in ``ZMQTransport.__init__`` / ``_run`` or defined
    # by ``ZMQTransport``. Annotations, no values, so nothing here shadows them at run time.
    grants: GrantTable
    frame_bytes: int
    frames_per_message: int
    zero_copy_min: int
    window: int
    few_runs: int
    hb_ivl: float
    hb_timeout: float
    connect_timeout: float
    _regions: list[torch.Tensor]
    _host: list[np.ndarray | None]
    _is_host: np.ndarray
    _sizes: np.ndarray
    _staging: StagingPool
    staging_wait: bool
    _xids: itertools.count[int]
    _ctx: zmq.Context
    _poller: zmq.Poller
    _dealer: Callable[[str, bytes], zmq.Socket]

    def _sender_init(self) -> None:
        self.release_soon = 0.0   # until then, sources zmq still held are looked at every loop turn
        self._peers: dict[str, Peer] = {}
        self._out: dict[int, Outgoing] = {}
        self._releasing: list[Outgoing] = []

    def _start(self, pid: str, request_id: str, plan: TransferPlan, notify: bytes, handle: TransferHandle,
               cap: bytes = b""):
        peer = self._peers.get(pid)
        if peer is None:
            handle.finish(peer_failed(request_id, f"unknown peer {pid!r}; call connect() first"), release=True)
            return
        # Empty runs carry nothing (and the receiver refuses them).
        runs = [run for run in plan.run_tuples() if run[4] > 0] if plan.num_runs <= self.few_runs else None
        if runs is not None and all(self._host[run[0]] is not None for run in runs):
            # a few runs in CPU regions: Python ints, no array setup
            inside = runs_inside_few([(r, o, c) for r, o, _, _, c in runs], self.grants.region_sizes)
            nbytes, frames = sum(run[4] for run in runs), functools.partial(self._frames_few, runs)
        else:
            sr, so, dr, do, n, _ = plan.runs()
            if len(n) and n.min() <= 0:
                keep = n > 0
                sr, so, dr, do, n = sr[keep], so[keep], dr[keep], do[keep], n[keep]
            inside = runs_inside(sr, so, n, self._sizes)
            nbytes, frames = int(n.sum()), functools.partial(self._frames, sr, so, dr, do, n)
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
        self._out[xid] = peer.open[xid] = out
        peer.sending.append(out)
        self._pump(peer)

    def _frames(self, sr, so, dr, do, n) -> Iterator[tuple]:
        """(runs bytes, parts, staging buffer) per message, made lazily as zmq takes them."""
        fb = self.frame_bytes
        n, (so, do), (sr, dr) = split_long_runs(fb, n, (so, do), (sr, dr))
        zc = (n >= self.zero_copy_min) & self._is_host[sr]

        def runs(sel) -> bytes:
            return np.concatenate((dr[sel], do[sel], n[sel])).astype("<i8").tobytes()

        def views(sel) -> list[memoryview]:
            return [memoryview(self._host[r][o: o + c]) for r, o, c in zip(sr[sel].tolist(), so[sel].tolist(),
                                                                           n[sel].tolist())]

        def messages(sel: np.ndarray, overhead: int, budget: int) -> list[np.ndarray]:
            cost = n[sel] + overhead                 # header bytes count toward a packed frame
            if len(sel) <= 1 or (len(sel) <= MAX_PARTS and cost.sum() <= budget):
                return [sel] if len(sel) else []
            frame_of = (np.cumsum(cost) - cost) // budget
            if not overhead:                         # zero-copy: at most MAX_PARTS parts
                frame_of = frame_of * len(sel) + np.arange(len(sel)) // MAX_PARTS
            return np.split(sel, np.flatnonzero(np.diff(frame_of)) + 1) if len(sel) else []

        zmsgs = messages(np.flatnonzero(zc), 0, fb * self.frames_per_message)
        small = np.flatnonzero(~zc)
        if len(small) > 1 and ((sr[small] != sr[small[0]]).any() or (dr[small] != dr[small[0]]).any()):
            small = small[np.lexsort((sr[small], dr[small]))]   # stable: plan order within a region pair
        packed = fb * self.frames_per_message   # measured: packed frames gain from size, zero-copy parts do not
        smsgs = messages(small, RUN_BYTES, packed)
        left = len(zmsgs) + len(smsgs)          # messages still to make: 1 is the last
        if not left:
            yield b"", [], None, True   # an empty transfer still sends its totals
        for sel in zmsgs:
            left -= 1
            yield runs(sel), views(sel), None, not left
        for sel in smsgs:
            left -= 1
            if len(sel) == 1 and self._is_host[sr[sel[0]]]:     # a lone run needs no staging
                yield runs(sel), views(sel), None, not left
                continue
            pos = np.concatenate(([0], np.cumsum(n[sel])))
            while (base := self._stage()) is None:
                yield None   # the staging ring is exhausted: asked again once zmq freed a frame
            try:
                msg = self._gather(sel, pos, base, sr, so, dr, do, n)
            except BaseException:
                self._staging.put(base)   # never handed to zmq: free again at once
                raise
            yield msg, [memoryview(base[: pos[-1]].numpy())], base, not left  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only

    def _gather(self, sel, pos, base, sr, so, dr, do, n) -> bytes:
        """A packed frame: the runs ``sel`` gathered into ``base``; returns the header's runs."""
        header = []
        for a, b in region_spans(sr[sel], dr[sel]):         # loop per region pair in the frame
            region = self._regions[sr[sel[a]]]
            out = base[pos[a]: pos[b]] if region.is_cpu else torch.empty(
                int(pos[b] - pos[a]), dtype=torch.uint8, device=region.device)
            gather_rows(region, so[sel[a:b]], n[sel[a:b]], out)
            if not region.is_cpu:   # CUDA: gather on the device, one copy to pinned host memory
                base[pos[a]: pos[b]].copy_(out)
            # Runs back to back in the frame and at the receiver are one run there: a head
            # slice of token-major pages gathers 512 B rows into 8 KiB destination runs.
            start, _, length = merge_runs(do[sel[a:b]], pos[a:b], n[sel[a:b]])
            header.append((np.full(len(start), dr[sel[a]]), start, length))
        return np.concatenate([np.concatenate(c) for c in zip(*header)]).astype("<i8").tobytes()

    def _frames_few(self, runs: list[tuple[int, int, int, int, int]]) -> Iterator[tuple]:
        """``_frames`` for a few runs in CPU regions, as ``TransferPlan.run_tuples`` gives them."""
        fb, budget = self.frame_bytes, self.frame_bytes * self.frames_per_message
        views: list[tuple[int, int, int, int, int]]
        small: list[tuple[int, int, int, int, int]]
        views, small = [], []
        for r, o, d, e, c in runs:
            for x in range(0, c, fb):   # runs longer than a frame go in frame-sized chunks
                (views if c >= self.zero_copy_min else small).append((r, o + x, d, e + x, min(fb, c - x)))
        vmsgs, smsgs = fill_messages(views, budget, 0), fill_messages(small, budget, RUN_BYTES)
        left = len(vmsgs) + len(smsgs)
        if not left:
            yield b"", [], None, True
        for msg in vmsgs:
            left -= 1
            yield pack_runs(msg), [memoryview(self._host[r][o: o + c]) for r, o, _, _, c in msg], None, not left
        for msg in smsgs:
            left -= 1
            if len(msg) == 1:   # a lone run needs no staging
                r, o, _, _, c = msg[0]
                yield pack_runs(msg), [memoryview(self._host[r][o: o + c])], None, not left
                continue
            while (base := self._stage()) is None:
                yield None   # the staging ring is exhausted: asked again once zmq freed a frame
            stage, p = base.numpy(), 0
            for r, o, _, _, c in msg:   # host regions, checked in bounds: nothing here raises
                stage[p: p + c] = self._host[r][o: o + c]
                p += c
            yield pack_runs(msg), [memoryview(stage[:p])], base, not left  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only

    def _stage(self) -> torch.Tensor | None:
        """A frame of the staging ring for a packed message, or None (counted as a wait) while
        every frame is still in zmq: the I/O thread never allocates one, it waits."""
        if not self._staging.available():
            self.staging_wait = True   # the loop looks again soon
            return None
        return self._staging.get(self.frame_bytes * (self.frames_per_message + 1))

    def _drop_pending(self, peer: Peer) -> None:
        """The message zmq refused is dropped, never sent: its staging frame is free again."""
        if peer.pending is not None:
            self._staging.put(peer.pending.stage)
            peer.pending = None

    def _pump(self, peer: Peer) -> None:
        """Hand messages to zmq, round-robin over the peer's transfers, until it pushes back."""
        starved = 0   # transfers in a row whose next message waits for a staging frame
        for _ in range(4 * self.window):
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
            copy = sum(len(p) for p in parts) <= _COPY_BELOW
            try:
                if copy:
                    peer.sock.send_multipart(parts, flags=zmq.NOBLOCK)
                else:   # a tracker per part: zmq reads each (the source, or staging) until it lets go
                    last = len(parts) - 1   # only the first part can meet the high-water mark
                    trackers = [peer.sock.send(p, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=False,
                                               track=True) for i, p in enumerate(parts)]
                    out.trackers += trackers
            except zmq.Again:
                break
            if stage is not None:   # reuse the buffer once zmq is done with it (no fresh pages)
                self._staging.put(stage, None if copy else trackers[-1])
            peer.pending = None
            peer.clock.touch()
        # POLLOUT only when zmq pushed back, or when messages are ready to go. Not while every
        # transfer waits for a staging frame: the socket is writable, so poll would return at
        # once and the loop would spin a core until zmq frees a frame (the loop's short tick,
        # ``staging_wait``, looks again instead).
        ready = bool(peer.sending) and starved < len(peer.sending)
        want = zmq.POLLIN | (zmq.POLLOUT if peer.pending is not None or ready else 0)
        self._poller.modify(peer.sock, want)

    def _retire(self, out: Outgoing) -> None:
        """``out`` ended: forget it, and release its source once zmq holds nothing of it."""
        self._out.pop(out.xid, None)
        out.peer.open.pop(out.xid, None)
        if out.peer.pending is not None and out.peer.pending.out is out:
            self._drop_pending(out.peer)   # never handed to zmq: dropped (the receiver fails the transfer)
        out.frames = None
        if not self._release_if_free(out):
            self._releasing.append(out)
            # zmq usually lets go within milliseconds (pyzmq's tracker thread): look again soon for
            # a while, then at the tick (a receiver that stops reading must not make us spin)
            self.release_soon = time.monotonic() + RELEASE_SOON

    def _reap_releasing(self) -> None:
        """Release the sources zmq let go of since (the loop: each turn while ``release_soon``, then
        each tick)."""
        if self._releasing:
            self._releasing = [out for out in self._releasing if not self._release_if_free(out)]

    @staticmethod
    def _release_if_free(out: Outgoing) -> bool:
        if out.handle.source_released or all(t.done for t in out.trackers):
            out.handle.release_source()
            return True
        return False

    def _reconnect(self, peer: Peer) -> None:
        """A fresh DEALER for a silent peer: closing the old one (linger 0) drops every message
        queued for it, so zero-copy frames stop referencing their sources."""
        self._poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        self._drop_pending(peer)
        try:
            peer.sock = self._dealer(peer.endpoint, peer.token)
        except zmq.ZMQError as e:   # cannot happen for an endpoint that connected before; keep going
            log.error("cannot reconnect to %s: %s", peer.endpoint, e)
            peer.sock = self._ctx.socket(zmq.DEALER)
        self._poller.register(peer.sock, zmq.POLLIN)

    def _disconnect(self, pid: str) -> None:
        """``disconnect`` on the I/O thread: fail the peer's transfers, close its socket (linger 0,
        so zmq drops the frames queued for it; their sources are released once zmq lets go)."""
        peer = self._peers.pop(pid, None)
        if peer is None:
            return
        if peer.probe is not None and not peer.probe.future.done():
            peer.probe.future.set_exception(ConnectError(f"{peer.endpoint}: disconnected while connecting"))
        for out in list(peer.open.values()):
            out.handle.finish(peer_failed(out.handle.request_id, f"peer {pid} was disconnected"))
            self._retire(out)
        peer.sending.clear()
        self._drop_pending(peer)
        self._poller.unregister(peer.sock)
        peer.sock.close(linger=0)

    def _probe(self, peer: Peer, now: float) -> None:
        """Send the connect ping once zmq has a connection; fail ``connect`` past the deadline."""
        probe = peer.probe
        if probe is None:
            return
        if now > probe.deadline:
            if not probe.future.done():
                probe.future.set_exception(ConnectError(
                    f"no answer on the data socket within {self.connect_timeout:g}s: nothing listens there, "
                    f"the address is unreachable or filtered from this host, or the receiver refused our "
                    f"admission token ({'one' if peer.token else 'none'} presented)"))
            self._disconnect(probe.pid)   # frees the socket: it never became a peer
            return
        if not probe.sent:
            try:
                peer.sock.send(Ping(probe.nonce).pack(), flags=zmq.NOBLOCK)
            except zmq.Again:   # no connection yet: POLLOUT (or the tick) brings us back
                return
            probe.sent = True
            self._poller.modify(peer.sock, zmq.POLLIN)

    def _on_replies(self, peer: Peer) -> None:
        while peer.sock.get(zmq.EVENTS) & zmq.POLLIN:   # asked first: an empty receive raises zmq.Again
            try:
                parts = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
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

    def _check_outgoing(self, now: float) -> None:
        """Deadlines, pings and silence of outgoing transfers (the loop's tick)."""
        for out in list(self._out.values()):
            if out.handle.poll() != TransferStatus.PENDING:   # poll() times out a passed deadline
                self._retire(out)
        self._reap_releasing()
        for pid, peer in list(self._peers.items()):
            self._probe(peer, now)
            if not peer.open:
                continue
            if peer.clock.silent(now, self.hb_timeout):
                silent = peer.clock.silent_for(now)
                for out in list(peer.open.values()):
                    out.handle.finish(peer_failed(out.handle.request_id,
                                                  f"peer {pid} stopped answering for {silent:.1f}s"))
                    self._retire(out)
                peer.sending.clear()
                self._reconnect(peer)
            elif now - peer.pinged >= self.hb_ivl:
                peer.pinged = now
                try:
                    peer.sock.send(Ping().pack(), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
