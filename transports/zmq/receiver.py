"""ZMQ receiving side: a message is checked whole before a byte lands.

Checks, in order: the header parses (``protocol.parse_data``), the whole message fits
``max_message_bytes`` (zmq's own limit is per part), part lengths match the runs, every run
lies inside the request's grant and its region (``GrantTable.check``, one compiled call). A violation fails the
transfer (nack, ``Arrival(ok=False)``) and writes nothing. Otherwise each byte is copied once,
from the received zmq frame into the region.

No oracle: a refusal because of the grant (unknown, ended or live request, runs outside it)
answers the peer with the same nack text, and an empty transfer (no runs) is acked whatever
its request id; only the local counters and arrivals say which it was.

Who calls what: ``ZMQTransport`` makes the ``Receiver`` with its collaborators; every method runs
on the I/O thread: ``on_router`` when the ROUTER is readable, ``on_synced`` while device copies
are pending, ``check`` per tick, ``fail_all`` at the end.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import zmq

from kvxfer.copy import scatter_runs
from kvxfer.errors import ProtocolError
from kvxfer.grant import GrantTable
from kvxfer.transport.admission import Admissions
from kvxfer.transport.base import Arrival
from kvxfer.transport.kit import peer_reason

from .devsync import WriteSync
from .options import ZMQOptions
from .protocol import MAX_PARTS, RUN_BYTES, Ack, Data, Nack, Ping, parse_data
from .regions import Regions
from .sockets import EVENTS, NOBLOCK, POLLIN, SNDMORE, Sockets

log = logging.getLogger("kvxfer.transport.zmq")

PING_BURST, PINGS_PER_S = 1024, 256.0   # pongs per sender (routing id): a burst, then this rate


def lengths_match(nbytes, sizes, size: int) -> bool:
    """Every run is positive, the runs add up to the payload's ``size``, and with one part per
    run each part is as long as its run. Lists of Python ints, or int64 arrays."""
    if isinstance(nbytes, list):
        return min(nbytes) > 0 and sum(nbytes) == size and (len(sizes) <= 1 or sizes == nbytes)
    # each run is bounded by the payload first, so the sum cannot overflow
    return bool((nbytes > 0).all() and (nbytes <= size).all() and int(nbytes.sum()) == size
                and (len(sizes) <= 1 or (sizes == nbytes).all()))


class Incoming:
    """An incoming transfer, keyed by (routing id, request id, transfer id). ``event``: recorded
    after its latest device write (``devsync``); its arrival waits for it. ``peer``: whose share of
    the table it takes (its sender's admission, or its routing id)."""
    __slots__ = ("deadline", "start", "nbytes", "nruns", "quiet", "event", "peer")

    def __init__(self, deadline, peer):
        self.deadline, self.start, self.nbytes, self.nruns = deadline, time.monotonic(), 0, 0
        self.peer = peer
        self.event: Any = None
        self.quiet = False   # a message of it carried a wrong capability: it never yields an arrival


class Receiver:
    """The ROUTER side (I/O thread). State: ``incoming`` (open transfers), ``_dead`` (failed keys,
    so their later messages drop quietly), ``_seen`` (routing id -> last message), ``_acks`` and
    ``_completed`` (flushed once per batch), ``_open_from`` (each sender's share of ``incoming``)."""

    def __init__(self, options: ZMQOptions, regions: Regions, grants: GrantTable, admissions: Admissions,
                 sync: WriteSync, write_lock: threading.Lock, sockets: Sockets, deliver: Callable[[Arrival], None]):
        self.options, self.regions, self.grants, self.admissions = options, regions, grants, admissions
        self.sync, self.write_lock, self.sockets, self._deliver = sync, write_lock, sockets, deliver
        self.incoming: dict[tuple, Incoming] = {}
        self._open_from: collections.Counter = collections.Counter()   # peer (Incoming.peer) -> open transfers
        self._dead: collections.OrderedDict = collections.OrderedDict()
        self._seen: dict[bytes, float] = {}
        self._acks: dict[bytes, list[int]] = {}
        self._completed: list[Arrival] = []   # delivered after this turn's acks
        self._ping_budget: dict[bytes, tuple[float, float]] = {}   # routing id -> (pongs left, when)

    def on_router(self) -> bool:
        """The ROUTER is readable (the loop's poll said so): handle queued messages; True when the
        socket is drained (silence checks are fair then)."""
        drained, router = False, self.sockets.router
        if router is None:   # not bound (the loop binds before it receives)
            return True
        for i in range(4 * self.options.window):
            # The loop calls this when the poll said POLLIN: the first receive finds a message.
            # Later ones ask zmq first: a receive that finds nothing raises zmq.Again (an exception)
            try:
                parts = (router.recv_multipart(flags=NOBLOCK, copy=False)
                         if not i or cast(int, router.get(EVENTS)) & POLLIN else None)
            except zmq.Again:
                parts = None
            if parts is None:
                drained = True
                break
            rid = parts[0].bytes
            peer: str | bytes = rid
            if self.admissions.required:   # every connection passed ZAP; is its admission still in force?
                user = parts[0].get("User-Id")   # what ZAP said of this connection
                if not isinstance(user, str) or not self.admissions.current(user):
                    self.grants.reject("?", "unknown peer: a sender whose admission was replaced or dropped")
                    continue
                peer = user
            self._seen[rid] = time.monotonic()
            try:
                self._on_message(rid, peer, parts[1:])
            except Exception as e:  # a bug: count it, and never let one message take the receiver down
                log.exception("error handling a message")
                self.grants.reject("?", f"internal error: {type(e).__name__}")
        self._flush_acks()
        self.deliver_completed()
        return drained

    def deliver_completed(self) -> None:
        """Completed transfers reach the caller after the turn's acks: its handler (a decode
        endpoint's, say) wakes a waiting thread, which runs once this one blocks in poll."""
        done, self._completed = self._completed, []
        for arrival in done:
            self._deliver(arrival)

    def _flush_acks(self) -> None:
        for rid, xids in self._acks.items():   # one ack message per sender per batch
            self._reply(rid, Ack(tuple(xids)).pack())
        self._acks.clear()

    def _on_message(self, rid: bytes, peer: str | bytes, parts: list) -> None:
        try:
            if not parts:
                raise ProtocolError("empty message")
            h = parse_data(parts[0].buffer, self.options.max_message_bytes)
        except ValueError as e:
            self.grants.reject("?", f"malformed header: {e}")
            return
        if isinstance(h, Ping):   # answered after the acks so far: a pong means "all before it handled"
            if not self._pong_allowed(rid, time.monotonic()):
                self.grants.reject("?", f"ping flood: more than {PINGS_PER_S:g} pings a second from one sender")
                return
            self._flush_acks()
            self._reply(rid, Ping(h.n).pack())
            return
        self._on_data(rid, peer, h, parts[1:])

    def _pong_allowed(self, rid: bytes, now: float) -> bool:
        """A token bucket per sender: pings (heartbeats, connect probes) are answered at most at
        ``PINGS_PER_S`` after a burst of ``PING_BURST``, so a flood costs no unbounded replies."""
        left, at = self._ping_budget.get(rid, (float(PING_BURST), now))
        left = min(float(PING_BURST), left + (now - at) * PINGS_PER_S)
        self._ping_budget[rid] = (max(left - 1, 0.0), now)
        return left >= 1

    def _on_data(self, rid: bytes, peer: str | bytes, h: Data, payload: list) -> None:
        key, request_id = (rid, h.request_id, h.xid), h.request_id
        if key in self._dead:   # the transfer failed already: its later messages are dropped quietly
            return
        # Without the grant's capability: handled exactly as a message for an unknown id (the same
        # replies: no oracle; grants.check and is_live refuse it), but it never touches the
        # request: no arrival (``quiet``), so it cannot fail or complete it.
        quiet = not self.grants.capability_ok(request_id, h.cap)
        st = self.incoming.get(key)
        if st is None:
            # Each sender has its own share. Admitted senders are told apart (and their number is
            # capped), so no global cap applies to them; anonymous ones share ``max_incoming``.
            mine = self._open_from[peer]
            shared_full = not self.admissions.required and len(self.incoming) >= self.options.max_incoming
            if mine >= self.options.max_incoming_per_peer or shared_full:
                self._fail_in(key, self.grants.reject(
                    request_id, f"too many transfers: {len(self.incoming)} open, {mine} from this peer"), quiet)
                return
            st = self.incoming[key] = Incoming(time.monotonic() + h.deadline, peer)
            self._open_from[peer] += 1
        if quiet:
            st.quiet = True
        if time.monotonic() > st.deadline:   # too late: the sender has given up on it
            self._fail_in(key, f"deadline passed: {st.nbytes} bytes arrived before it")
            return
        k = h.nruns
        few = k <= self.options.few_runs   # Python ints: a few runs check and land without array setup
        region: Any    # lists of Python ints when ``few``, else int64 arrays (the checks take both)
        offset: Any
        nbytes: Any
        sizes: list[int] | np.ndarray
        if few:
            region, offset, nbytes = h.run_lists()
            sizes = [len(p) for p in payload]
            size = sum(sizes)
        else:
            region, offset, nbytes = h.run_arrays()
            sizes = np.fromiter((len(p) for p in payload), np.int64, len(payload))
            size = int(sizes.sum())
        if size + len(h.runs) > self.options.max_message_bytes:   # zmq's MAXMSGSIZE bounds one part only
            reason = f"too large: a message of {size + len(h.runs)} bytes exceeds {self.options.max_message_bytes}"
        elif len(h.runs) % RUN_BYTES or (k == 0) != (len(payload) == 0) or \
                len(payload) not in (0, 1, k) or len(payload) > MAX_PARTS:
            reason = (f"malformed message: {len(payload)} payload frames for a runs field of {len(h.runs)} bytes "
                      f"(expected none, 1, or one per run)")
        elif k and not lengths_match(nbytes, sizes, size):
            claimed = sum(n for n in (nbytes if few else nbytes.tolist()) if n > 0)
            reason = f"length mismatch: runs claim {claimed} bytes, payload has {size}"
        else:
            reason = None
        if reason is not None:
            self._fail_in(key, self.grants.reject(request_id, reason))
            return
        with self.write_lock:
            if k:   # the grant, the regions, and whether the request ended
                reason = self.grants.check(request_id, region, offset, nbytes, h.cap)
            if reason is None and size:
                device = (any(self.regions.host[r] is None for r in region) if few
                          else not bool(self.regions.is_host[region].all()))
                if self.sync.needed(device):   # copies on the transport's stream, then an event
                    st.event = self.sync.write(request_id, lambda: self._write(region, offset, nbytes, payload),
                                                device)
                else:
                    self._write(region, offset, nbytes, payload)
        if reason is not None:
            self._fail_in(key, reason)
            return
        st.nbytes += size
        st.nruns += k
        if h.end is not None:   # the transfer's last message
            if (st.nbytes, st.nruns) != (h.end.nbytes, h.end.nruns):
                self._fail_in(key, f"incomplete transfer: {st.nbytes} of {h.end.nbytes} bytes, "
                                   f"{st.nruns} of {h.end.nruns} runs arrived")
                return
            self._close_in(key)
            arrival = None
            if st.nruns or self.grants.is_live(request_id, h.cap):   # an empty transfer of no live request: ack only
                arrival = Arrival(request_id, st.nbytes, True, "", h.end.notify)
            if st.event is not None and not st.event.query():   # bytes still on their way to the device
                self.sync.hold(st.event, (rid, h.xid, arrival))
                return
            self._completed_now(rid, h.xid, arrival)

    def fail_all(self, why: str) -> None:
        """Every incoming transfer fails with ``why`` (close, or a crash), in the order things happened."""
        self.deliver_completed()
        for key in list(self.incoming):
            self._fail_in(key, why)
        for _, _, arrival in self.sync.drop():   # bytes landed, the device copy never confirmed
            if arrival is not None:
                self._deliver(Arrival(arrival.request_id, arrival.nbytes, False, why))

    def _completed_now(self, rid: bytes, xid: int, arrival: Arrival | None) -> None:
        """Every byte of a transfer is in place: ack it, and report it after this turn's acks."""
        if arrival is not None:
            self._completed.append(arrival)
        self._acks.setdefault(rid, []).append(xid)

    def on_synced(self) -> None:
        """Transfers whose device copies completed since (the loop, each turn while any wait)."""
        done = self.sync.ready()
        for rid, xid, arrival in done:
            self._completed_now(rid, xid, arrival)
        if done:
            self._flush_acks()
            self.deliver_completed()

    def _write(self, region, offset, nbytes, payload: list) -> None:
        """Copy checked runs from the received frames into the regions (one copy per byte).
        Runs come as lists of Python ints (a message of a few runs) or as int64 arrays."""
        few = isinstance(region, list)
        if few or len(payload) == len(nbytes):   # a copy per run: a few runs, or one part per (large) run
            if not few:
                region, offset, nbytes = region.tolist(), offset.tolist(), nbytes.tolist()
            packed, p = len(payload) == 1, 0
            for i, (r, o, c) in enumerate(zip(region, offset, nbytes)):
                src = payload[0].buffer[p: p + c] if packed else payload[i].buffer
                p += c
                if self.regions.host[r] is not None:
                    self.regions.host[r][o: o + c] = np.frombuffer(src, np.uint8)
                else:
                    # on the transport stream (devsync): an event after it says when it is complete
                    self.regions.tensors[r][o: o + c].copy_(torch.frombuffer(src, dtype=torch.uint8), non_blocking=True)
            return
        # One packed part: the executor's scatter (host regions: one compiled call, a memmove per
        # run, each checked against its region again; a CUDA region: indexed copies on the device)
        data = torch.frombuffer(payload[0].buffer, dtype=torch.uint8)
        scatter_runs(self.regions.tensors, region, offset, nbytes, data)

    def _fail_in(self, key: tuple, reason: str, quiet: bool = False) -> None:
        """End an incoming transfer: drop its later messages, tell the sender. ``quiet`` (or a
        transfer that carried a wrong capability): no arrival, the request is not touched."""
        rid, request_id, xid = key
        st = self._close_in(key)
        quiet = quiet or (st is not None and st.quiet)
        self._dead[key] = None
        if len(self._dead) > 65536:
            self._dead.popitem(last=False)
        log.warning("incoming transfer %d of request %s failed: %s", xid, request_id, reason)
        self.deliver_completed()   # in the order they happened
        if not quiet:
            self._deliver(Arrival(request_id, st.nbytes if st else 0, False, reason))
        self._reply(rid, Nack(xid, peer_reason(reason)).pack())

    def _close_in(self, key: tuple) -> Incoming | None:
        st = self.incoming.pop(key, None)
        if st is not None:
            self._open_from[st.peer] -= 1
            if self._open_from[st.peer] <= 0:
                del self._open_from[st.peer]
        return st

    def _reply(self, rid: bytes, msg: bytes) -> None:
        router = self.sockets.router
        if router is None:   # not bound: nothing was received either
            return
        try:   # two sends: pyzmq's send_multipart is a Python loop that costs ~2.5 us more
            router.send(rid, NOBLOCK | SNDMORE)
            router.send(msg, NOBLOCK)
        except zmq.ZMQError:  # the sender is gone: it times out on its own
            pass

    def check(self, now: float, drained: bool) -> None:
        """Deadlines and silent senders of incoming transfers (the loop's tick)."""
        for key, st in list(self.incoming.items()):
            if now > st.deadline:
                self._fail_in(key, f"deadline passed: {st.nbytes} bytes arrived before it")
            elif drained and now - max(self._seen.get(key[0], 0.0), st.start) > self.options.heartbeat_timeout:
                self._fail_in(key, f"sender went silent for more than {self.options.heartbeat_timeout}s")
        if len(self._seen) > 1024:   # forget routing ids gone quiet with nothing open
            busy = {k[0] for k in self.incoming}
            self._seen = {r: t for r, t in self._seen.items() if r in busy or now - t < 60}
            self._ping_budget = {r: v for r, v in self._ping_budget.items() if r in self._seen}
        self.sync.prune()
