"""Prefill side: ``PrefillEndpoint`` (one per prefill rank) and ``KVSender`` (one per request).

Who calls what, and when (the whole contract is in ``kvxfer.endpoint.base``):
    start-up, once: ``PrefillEndpoint(spec, kv_pool, bind=..., advertise=..., on_request=cb, ...)``;
        ``register(url)`` (bootstrap registration and its heartbeats; a loopback address for a
        bootstrap on another host is refused here, naming the setting).
    channel thread -> engine: ``cb(room, tokens)`` when a decode rank asks for a room with no
        sender (outside the endpoint lock; must not block): the engine calls ``sender(room)``.
    scheduler, per request, never blocks on the network: ``sender(room, on_release=cb)``;
        ``send(kv_slots, ..., ready=event)`` per chunk as prefill computes it (a hybrid SWA
        pool's window slots are read from its ``full_to_swa`` at that call); ``poll()``;
        ``cb(outcome)`` once prefill may reuse the KV, then ``kv_releasable`` is True.
    channel thread: ``on_message`` (hello / req / done / abort), ``on_peer_lost``, ``on_tick``
        (every 5 ms while a transfer is open or a chunk waits for its ready event: reaps
        handles, submits chunks whose event completed; deadlines and leases every 50 ms),
        ``on_dead`` (it died of a bug: every sender fails, the rank deregisters, ``broken``).

Readiness (when a chunk may be read) is ``KVSender.send``'s contract: ``kvxfer.endpoint.sender``.
Chunks may be any number of tokens; what chunk sizes cost is in ``kvxfer.endpoint.chunks``.

Which decode REQ is bound to which sender, and who may end what: ``kvxfer.endpoint.prefill_requests``
(``RequestTable``); the endpoint keeps the chunks, the transfers in flight and the leases.

A sender ends once (``end_request``): counted in ``kvxfer.metrics``, its KV then held under a
lease until decode confirms ("done"), no transfer still reads it, or the lease runs out.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np

from ..addresses import check_reachable
from ..control.channel import ControlChannel
from ..control.client import BootstrapClient, Registration
from ..control.messages import Abort, Bye, Done, Fin, Hello, Message, Req, Room
from ..control.wire import ChunkMeta
from ..errors import ConfigError, LayoutError, PlanError, RequestError
from ..layout import STATE, SWA
from ..metrics import record_request_end
from ..plan import Planner
from ..pools import KVPool
from ..ranks import RankSpec
from ..transport.base import TransferStatus, Transport
from .aux import AUX_BYTES, AuxRows
from .base import END_STATES, Clock, KVPoll, Outcome, Timeouts
from .chunks import Chunk, DecodePeer, Target, chunk_aux, plan_chunk
from .decode_links import DecodeLinks
from .prefill_requests import RequestTable
from .sender import KVSender, SenderHost, count_transfers, stalled

log = logging.getLogger("kvxfer.request")   # one logger for the control plane, both sides


class PrefillEndpoint(SenderHost):
    """A prefill rank: its senders, the control ROUTER, the planners towards each decode rank."""
    role = "prefill"

    def __init__(self, spec: RankSpec, kv: KVPool, *, state: KVPool | None = None,
                 transport: str | Transport = "zmq", transport_options: Mapping | None = None,
                 timeouts: Timeouts = Timeouts(), secret: str | bytes | None = None, host: str = "127.0.0.1",
                 port: int = 0, bind: str | None = None, advertise: str | None = None,
                 on_request: Callable[[Room, int], None] | None = None, aux: AuxRows | None = None,
                 aux_bytes: int = AUX_BYTES, clock: Clock = time.monotonic):
        """``bind``: where the control ROUTER listens (``tcp://0.0.0.0:5555``: every interface; default
        ``tcp://{host}:{port}``); ``advertise``: the address, host name or interface name (``eth0``)
        decode ranks are told (``info.control``, what ``register`` publishes); default: the bind
        host, or a routable interface for a wildcard bind (``kvxfer.addresses``).
        ``on_request(room, tokens)``: called on the channel thread, outside the endpoint lock, when
        a decode rank's request arrives for a room with no live sender (``tokens``: how many it
        asks for, 0 for a silent replica's dummy request); once per decode rank that asks. It must
        not block; it typically queues the room for the scheduler, which then calls ``sender(room)``
        (the request waits ``Timeouts.bootstrap`` for it).
        ``aux``: the engine's aux buffers (``AuxRows``), whose row ``send(..., aux_row=i)`` sends; without
        them ``send(..., aux=...)`` takes the bytes (or an ``AuxRecord`` of ``aux_bytes``).
        ``clock``: seconds, for deadlines and leases (``time.monotonic``; tests pass a manual one)."""
        if spec.role != "prefill":
            raise ConfigError(f"PrefillEndpoint needs a prefill RankSpec, got role {spec.role!r}")
        if on_request is not None and not callable(on_request):
            raise TypeError(f"on_request must be a callable (room, tokens), got {on_request!r}")
        super().__init__(spec, kv, state=state, transport=transport, transport_options=transport_options,
                         timeouts=timeouts, secret=secret, aux=aux, aux_bytes=aux_bytes, clock=clock)
        self.source = (spec.tp_rank, spec.pp_rank)
        self._advertise = advertise
        self.links = DecodeLinks(self)                        # decode peers and their HELLOs
        self.requests = RequestTable(self, self.links, on_request)   # REQs, senders, grants
        self._busy: set[KVSender] = set()                     # senders with transfers in flight
        self._unready: set[KVSender] = set()                  # senders whose next chunk waits for its event
        self._held: set[KVSender] = set()                     # ended, KV not yet released
        self._next_scan = 0.0
        self._registration: Registration | None = None
        try:
            self.channel = ControlChannel(self, secret=self.secret, heartbeat=timeouts.heartbeat, name="prefill-ctl",
                                          bind=bind if bind is not None else f"tcp://{host}:{port}",
                                          advertise=advertise, on_dead=self.on_dead, identity=spec.key,
                                          check_recipient=True, zmtp_auth=self.secret is not None)
        except BaseException:
            if self._owns_transport:
                self._close_transport()
            raise

    def register(self, bootstrap: str, ttl: float | None = None) -> Registration:
        """Register with the bootstrap registry and keep the registration alive (heartbeats every
        ttl / 3; ``ttl`` None: the registry's default, ``BootstrapClient.default_ttl``).
        ValueError, naming the setting, when a bootstrap on another host would be told an address
        of this rank that only this host reaches (loopback; see ``check_reachable``)."""
        self.check_usable()
        info = self.info
        check_reachable(info.spec.role, info.control, info.data, bootstrap, advertise=self._advertise,
                        bound=self.channel.bound)
        self._registration = Registration(BootstrapClient(bootstrap, self.secret), self.info, ttl=ttl).start()
        return self._registration

    def _on_broken(self, why: str) -> None:
        reg, self._registration = self._registration, None
        if reg is not None:   # no zombie rank: decode ranks stop being sent here
            reg.stop()

    def sender(self, room: Room, *, on_release: Callable[[Outcome], None] | None = None) -> KVSender:
        """Scheduler: a new request (Bootstrapping until every decode rank's grant arrived).
        ``on_release(outcome)`` runs exactly once, outside the endpoint lock, when prefill may
        reuse the request's KV; ``kv_releasable`` turns True after it returned."""
        self.check_usable()
        with self.guard() as later:
            s = KVSender(self, room, on_release)
            self.requests.add(s, later)
            return s

    # -- handshake and requests (channel thread) -----------------------------------------------
    def on_message(self, peer: str, msg: Message) -> None:
        if isinstance(msg, Hello):
            self.links.on_hello(peer, msg)
            return
        with self.guard() as later:
            match msg:
                case Req():
                    self.requests.on_req(peer, msg, later)
                case Done():
                    s = self.requests.on_done(peer, msg)
                    if s is not None:
                        self._settle(s, self.clock(), later)
                case Abort():
                    self.requests.on_abort(peer, msg, later)
                case Bye():   # a closing decode endpoint: retired at once (outside the lock, below)
                    later.append(lambda: self.links.retire(peer, f"decode rank {peer} closed (BYE)"))

    def retire_requests(self, peer: str, why: str, later) -> int:
        """``DecodeLinks``, under the lock: decode peer ``peer`` is gone; what it asked for ends (how many)."""
        return self.requests.retire_peer(peer, why, later)

    def pump(self, s: KVSender, later) -> None:
        """Submit the queued chunks of a bound sender, in order, up to the first whose ready event
        has not completed (that sender is then polled again at every tick)."""
        while s.queued and s.state not in END_STATES and s.state != KVPoll.Bootstrapping:
            c = s.queued[0]
            if c.ready is not None:
                try:
                    ready = bool(c.ready.query())
                except Exception as e:   # e.g. a CUDA error surfaced by the event
                    self.end_request(s, Outcome.Failed, f"the ready event of {c.what()} failed: {e}", later)
                    break
                if not ready:
                    self._unready.add(s)
                    return
            s.queued.pop(0)
            self._submit(s, c, later)
        self._unready.discard(s)

    # -- chunks (scheduler thread; queued ones on the channel thread) --------------------------
    def send_chunk(self, s: KVSender, kv_slots, start, layers, last, aux, state_slots, ready, aux_row=None) -> bool:
        """The body of ``KVSender.send`` (call that): check the chunk, queue it, submit what may go."""
        if ready is not None and not callable(getattr(ready, "query", None)):
            raise TypeError(f"ready must have a query() method saying whether the chunk's KV is written (e.g. a "
                            f"torch.cuda.Event), got {type(ready).__name__}")
        slots = self.layout.check_slots(self.token_space, np.array(kv_slots), "kv_slots")
        st = self.layout.check_slots(STATE, np.array(state_slots), "state_slots") if state_slots is not None else None
        # read the window mapping now: the engine may remap these slots before a queued chunk is planned
        swa = np.array(self._kv_pool.space_slots(SWA, slots), dtype=np.int64) if self.swa_window else None
        if st is not None and not last:
            raise RequestError("state goes with the last chunk")
        aux = chunk_aux(aux, aux_row, last, self.aux_rows, self.aux_bytes)
        with self.guard() as later:
            if s.state in END_STATES:
                return False
            if s.last_sent:
                raise RequestError(f"room {s.room}: send() after the last chunk")
            begin = s.next_pos if start is None else int(start)
            if begin < 0:
                raise RequestError(f"chunk start {begin} is negative")
            s.next_pos = max(s.next_pos, begin + len(slots))
            s.last_sent = bool(last)
            s.queued.append(Chunk(slots, begin, None if layers is None else frozenset(int(x) for x in layers),
                                   bool(last), aux, st, swa, ready))
            self.pump(s, later)
            return s.state != KVPoll.Failed

    def _planners_for(self, dp: DecodePeer, layers: frozenset | None, kinds: list) -> list[Planner]:
        key = (layers, tuple(kinds))
        if key not in dp.planners:
            made = [self.make_planner(self.layout, dp.layout, s.src_heads, s.dst_heads,
                                  s.layers if layers is None else sorted(layers & set(s.layers)), kinds)
                    for s in dp.sources]
            dp.planners[key] = [p for p in made if p is not None]
        return dp.planners[key]

    def _submit(self, s: KVSender, c: Chunk, later) -> None:
        if isinstance(c.aux, int) and self.aux_rows is not None:   # a row: read now, after the ready event
            c.aux = self.aux_rows.read_bytes(c.aux)
        now = self.clock()
        s.advance(KVPoll.Transferring, now)
        s.deadline = now + self.timeouts.transfer
        try:
            for t in s.targets.values():
                self._submit_to(s, t, c)
        except (RequestError, LayoutError, PlanError) as e:
            self.end_request(s, Outcome.Failed, str(e), later)
            return
        self._settle(s, now, later)

    def _submit_to(self, s: KVSender, t: Target, c: Chunk) -> None:
        if t.dummy:
            return
        dp = self.links.peers.peers[t.peer]
        plan = plan_chunk(c, t, next_pos=s.next_pos, token_space=self.token_space, hybrid=bool(self.swa_window),
                          kv_planners=self._planners_for(dp, c.layers, self.kv_kinds),
                          state_planners=self._planners_for(dp, None, self.state_kinds) if c.last else [])
        aux = c.aux if c.last and t.aux else None
        if plan.nbytes == 0:
            if c.last:   # nothing left to move: say so on the control channel
                meta = ChunkMeta(s.room, t.gen, self.source, t.chunks, t.chunks, t.nbytes, aux)
                self.channel.send(t.peer, Fin(meta=meta.pack()))
            return
        meta = ChunkMeta(s.room, t.gen, self.source, t.chunks, t.chunks + 1 if c.last else -1,
                         t.nbytes + plan.nbytes if c.last else -1, aux)
        with self.xport_lock:
            h = self.transport.submit(dp.xpeer, t.request_id, plan, timeout=self.timeouts.transfer, notify=meta.pack(),
                                      capability=t.cap)
        t.chunks, t.nbytes = t.chunks + 1, t.nbytes + plan.nbytes
        s.handles.append((h, plan.num_runs, t))
        s.reading.append(h)
        self._busy.add(s)

    # -- completion, deadlines, leases --------------------------------------------------------
    def _settle(self, s: KVSender, now: float, later) -> None:
        """Reap finished transfers, reach Success or Failed, release the KV when the lease allows."""
        pending, failed, done, real = [], None, [], time.monotonic()
        for h, runs, t in s.handles:
            st = h.poll()
            if st == TransferStatus.PENDING:
                pending.append((h, runs, t))
            elif st == TransferStatus.FAILED and t.confirmed:
                pass   # its decode rank said DONE first (its bytes landed; then it closed): its verdict stands
            elif st == TransferStatus.FAILED:
                failed = failed or f"transfer failed: {h.error}"
            else:
                done.append((h.nbytes, runs, real - h.started))   # real seconds: submit -> reaped (<= 1 tick late)
                if s.state == KVPoll.Transferring:
                    s.deadline = now + self.timeouts.transfer   # progress
        s.handles = pending
        if done:   # counted outside the endpoint lock
            later.append(functools.partial(count_transfers, self.transport.name, done))
        if not pending:
            self._busy.discard(s)
        confirmed = all(t.confirmed for t in s.targets.values())
        if failed:
            self.end_request(s, Outcome.Failed, failed, later)
        elif s.state == KVPoll.Transferring and s.last_sent and not s.queued and (not pending or confirmed):
            self.end_request(s, Outcome.Success, "", later)
        else:
            self._release_if_due(s, now, later)

    def _release_if_due(self, s: KVSender, now: float, later, closing: bool = False) -> None:
        """The lease: KV stays held until decode confirmed (Success), no transfer still reads it
        (Failed), or the lease ran out. Never while a transport may still read it (a zero-copy
        frame queued in a socket, a put in flight): another request's bytes would go out as
        this one's. Transports release a failed transfer's source within their peer timeout."""
        if s not in self._held:
            return
        s.reading = [h for h in s.reading if not h.source_released]
        confirmed = all(t.confirmed for t in s.targets.values())
        due = (s.state == KVPoll.Success and confirmed) or (s.state == KVPoll.Failed and not s.reading)
        if not due and not closing and s.reading and now > s.lease_end:
            if not s.overdue:
                s.overdue = True
                log.warning("room %s: lease of %ss over, but the transport still holds %d transfer(s) of its KV; "
                            "releasing it once they are let go", s.room, self.timeouts.lease, len(s.reading))
            return
        if due or now > s.lease_end or closing:
            if not due and not closing:   # nothing reads the KV: only decode's confirmation is missing
                log.debug("room %s: lease of %ss over without confirmation from decode; releasing its KV",
                          s.room, self.timeouts.lease)
            self._held.discard(s)
            self.requests.release(s)
            later.append(s.run_release)

    def on_peer_lost(self, peer: str, why: str) -> None:
        """Channel thread: a decode peer went silent: its requests fail and it is retired (it says
        HELLO again when it comes back), so a silent peer holds nothing here."""
        self.links.retire(peer, f"decode rank {peer} {why}")

    def _tick(self, now: float, later) -> float:
        for s in list(self._unready):
            self.pump(s, later)
        for s in list(self._busy):
            self._settle(s, now, later)
        real = time.monotonic()   # the scan's cadence is CPU cost, not a deadline: real time
        if real >= self._next_scan:
            self._next_scan = real + 0.05
            for s in [s for s in self.requests.senders.values() if now > s.deadline]:
                self.end_request(s, Outcome.TimedOut, f"timed out in {s.state.name}: {stalled(s)} within the "
                                                      f"deadline", later)
            for s in list(self._held):
                self._settle(s, now, later)
            self.requests.expire(now)
        if self._busy or self._unready:
            return 0.005
        return self.rest(0.05)   # reaping is not on decode's critical path

    def quiet(self) -> bool:
        """No request here for the tick to look after (any thread, no lock: a glance)."""
        return not (self._unready or self._busy or self._held) and self.requests.idle()

    def _live(self) -> list[KVSender]:
        return list(self.requests.senders.values())

    def end_request(self, s: KVSender, outcome: Outcome, reason: str, later) -> None:
        """End ``s`` once (under ``guard``): tell decode on failure, count it, hold its KV under the lease."""
        if not s.mark_ended(outcome, reason):
            return
        self._unready.discard(s)
        unbound = self.requests.forget(s)
        if outcome != Outcome.Success:
            notified = {t.peer for t in s.targets.values()}
            for t in s.targets.values():
                self.channel.send(t.peer, Abort(room=s.room, gen=t.gen, why=reason[:1024]))
            for peer, gen in unbound:
                if peer not in notified:
                    self.channel.send(peer, Abort(room=s.room, gen=gen, why=reason[:1024]))
        now = self.clock()
        s.lease_end = now + self.timeouts.lease
        self._held.add(s)
        peers, nbytes = ",".join(t.peer for t in s.targets.values()), sum(t.nbytes for t in s.targets.values())
        later.append(lambda: record_request_end(self.role, s.room, outcome, reason, peers=peers, nbytes=nbytes,
                                                seconds=s.ended_at - s.created))
        self._release_if_due(s, now, later)

    def close(self) -> None:
        reg, self._registration = self._registration, None
        if reg is not None:
            reg.stop()
        self.links.close()
        super().close()

    def _after_close(self, later) -> None:
        if self._held:   # no tick will reap their transfers now: the leases end here
            log.info("prefill endpoint closing: releasing the KV of %d request(s) still under lease", len(self._held))
        for s in list(self._held):
            self._release_if_due(s, self.clock(), later, closing=True)


__all__ = ["PrefillEndpoint", "KVSender"]
