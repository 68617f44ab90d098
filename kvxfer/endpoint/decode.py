"""Decode side: ``DecodeEndpoint`` (one per decode rank) and ``KVReceiver`` (one per request; its
record and the checks a chunk passes live in ``kvxfer.endpoint.receiver``).

Who calls what, and when (the whole contract is in ``kvxfer.endpoint.base``):
    start-up, once: ``DecodeEndpoint(spec, kv_pool, aux=..., bootstrap=url)``; optionally
        ``connect(instance=..., timeout=...)`` (blocking: handshake with one prefill instance now,
        and make it the default for requests that name none).
    scheduler, per request, never blocks: ``receiver(room, instance=..., bootstrap=..., on_release=cb)``
        names the request's prefill instance; the first request that names one starts its handshake
        on a connect thread (``kvxfer.endpoint.instances``; the request waits, Bootstrapping).
        ``init(kv_slots, ...)`` clears the aux row, grants the slots (``transport.expect``; a hybrid
        SWA pool: also ``swa_slots=``) and sends the request, at once or once the instance answered;
        then ``poll()`` / ``wait(t)``; ``cb(outcome)`` runs once, after the grant ended, whatever the
        outcome.
    channel thread: ``on_message`` (ack / nack / abort / fin), ``on_peer_lost``, ``on_tick``
        (phase deadlines, every 50 ms), ``on_dead`` (the thread died of a bug: the endpoint breaks).
    connect threads: one instance's handshake (registry wait, then a HELLO to each of its ranks
        this rank pulls from, in parallel), then the requests that waited for it go on.
    recovery thread (``kvxfer.endpoint.recovery``): ``registries``, ``known_peers``, ``lost_peers``,
        ``rejoin`` (a lost or replaced prefill rank: fresh HELLO, new address).
    transport thread (``set_arrival_callback``), or an arrivals thread owned here polling
        ``transport.arrivals()`` where the transport cannot call back: chunk bookkeeping -> Success.
Lost prefill ranks: a rank that went silent (heartbeats) is lost: its requests fail. A new request
that names a lost rank waits while the recovery thread looks at the registry and handshakes again
(a restarted rank on a new port, a healed link); it fails, with the reason, only if that fails.
Ending a request (``end_request``, once) forgets the grant, tells the prefill ranks ("done" or
"abort"), counts it in ``kvxfer.metrics`` and queues ``on_release``, or, while the transport
says writes of it may still land (``writes_pending``: one-sided puts in flight), holds the
slots and releases them on the tick after that ends.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..addresses import check_reachable
from ..control.channel import ControlChannel
from ..control.compat import aux_format, aux_mismatch
from ..control.messages import CAP_BYTES, Abort, Ack, Done, Fin, Message, Nack, Req, Room, cut
from ..control.records import RankInfo
from ..control.wire import ChunkMeta
from ..errors import ConfigError, ConnectError, RequestError
from ..layout import STATE, SWA
from ..metrics import record_request_end
from ..pools import KVPool
from ..ranks import RankSpec
from ..transport.base import Arrival, Transport
from .aux import AUX_BYTES, AuxRows
from .base import END_STATES, Clock, KVPoll, Outcome, Timeouts
from .instances import Phase, PrefillInstance
from .prefill_links import PrefillLinks
from .receiver import KVReceiver, Pending, ReceiverHost, chunk_problem, grant_ranges, waited_for, window_slots

log = logging.getLogger("kvxfer.request")   # one logger for the control plane, both sides


class DecodeEndpoint(ReceiverHost):
    """A decode rank: its receivers, the prefill instances it pulls from, a DEALER per prefill
    rank, and the arrival handler (called on the transport's thread, or by an arrivals thread of
    its own)."""
    role = "decode"

    def __init__(self, spec: RankSpec, kv: KVPool, *, state: KVPool | None = None, aux: AuxRows | None = None,
                 transport: str | Transport = "zmq", transport_options: Mapping | None = None,
                 timeouts: Timeouts = Timeouts(), secret: str | bytes | None = None, aux_bytes: int = AUX_BYTES,
                 bootstrap: str | None = None, clock: Clock = time.monotonic):
        """``aux``: the engine's aux buffers (``AuxRows``; ``AuxBuffer`` for ``AuxRecord`` rows);
        ``bootstrap``: the registry URL of the prefill instances requests name by ``instance`` alone;
        ``clock``: seconds, for deadlines (``time.monotonic``; tests pass a manual one)."""
        if spec.role != "decode":
            raise ConfigError(f"DecodeEndpoint needs a decode RankSpec, got role {spec.role!r}")
        if aux is not None and isinstance(aux, AuxRows) and aux_bytes != AUX_BYTES and aux.record_bytes != aux_bytes:
            raise ConfigError(f"aux buffer rows are {aux.record_bytes} bytes but aux_bytes is {aux_bytes}")
        super().__init__(spec, kv, state=state, transport=transport, transport_options=transport_options,
                         timeouts=timeouts, secret=secret, aux=aux, aux_bytes=aux_bytes, clock=clock)
        self.links = PrefillLinks(self, bootstrap)
        # generations start at a random point: a peer cannot guess the next request id
        self._gens = itertools.count(secrets.randbelow(1 << 30))
        self._recvs: dict[str, KVReceiver] = {}            # request_id -> live receiver
        self._landing: list[KVReceiver] = []               # ended; puts may still land in their slots
        self.channel = ControlChannel(self, secret=self.secret, heartbeat=timeouts.heartbeat, name="decode-ctl",
                                      identity=f"{spec.key}/{uuid.uuid4().hex[:12]}", on_dead=self.on_dead,
                                      zmtp_auth=self.secret is not None)
        self._arrivals: threading.Thread | None = None
        if not self.transport.set_arrival_callback(self._on_arrival):
            self._arrivals = threading.Thread(target=self._arrivals_loop, name="kvxfer-decode-arrivals", daemon=True)
            self._arrivals.start()

    # -- prefill instances and ranks (``PrefillLinks`` owns them) -------------------------------
    def connect(self, *, bootstrap: str | None = None, peers: Sequence[RankInfo] | None = None,
                instance: str | None = None, timeout: float = 60.0) -> None:
        """Optional, blocking, at most ``timeout`` real seconds: handshake now with every prefill rank
        this rank needs in one prefill instance (the registry at ``bootstrap``, else the endpoint's;
        or the records ``peers``), and make it the default of requests that name none. ``instance``:
        its name; required when several are registered (ConnectError lists them). Raises
        CompatibilityError (every mismatch, in words) or ConnectError."""
        if not timeout > 0:
            raise ConfigError(f"connect timeout must be > 0 seconds, got {timeout}")
        self.check_usable()
        url = bootstrap or self.links.bootstrap
        if peers is None and url is None:
            raise ConfigError("connect needs bootstrap= (a registry URL) or peers= (RankInfo records)")
        if peers is None:
            check_reachable(self.info.spec.role, self.info.control, self.info.data, url)
        self.links.connect(url, peers, instance, time.monotonic() + timeout)

    @property
    def instances(self) -> dict[str, str]:
        """Any thread: every prefill instance requests named, and where its handshake stands."""
        with self._lock:
            return self.links.phases()

    @property
    def recovery(self):
        return self.links.recovery

    @property
    def lost_peers(self) -> dict[str, str]:
        """Prefill ranks lost (silent, replaced and not handshaken yet), with why. Any thread."""
        return self.links.lost_peers

    def instance_ready(self, inst: PrefillInstance, later) -> None:
        """``PrefillLinks``, under the lock: ``inst`` answered; the requests that waited for it go on."""
        waiting, inst.waiting = inst.waiting, []
        for r, dp in waiting:
            self._resume(r, dp, later)

    def instance_failed(self, inst: PrefillInstance, why: str, later) -> None:
        """``PrefillLinks``, under the lock: ``inst``'s handshake failed; its waiting requests fail."""
        waiting, inst.waiting = inst.waiting, []
        for r, _ in waiting:
            self.end_request(r, Outcome.Failed, f"prefill instance {inst.name or inst.ref[0]}: {why}", later, tell=())

    def rank_lost(self, key: str, why: str, later) -> None:
        """``PrefillLinks``, under the lock: prefill rank ``key`` is lost; its granted requests fail
        (a request not granted yet waits for the rank's new handshake)."""
        for r in [r for r in self._recvs.values() if key in r.contacts and r.granted]:
            self.end_request(r, Outcome.Failed, f"prefill rank {key} lost: {why}", later,
                             tell=set(r.contacts) - {key})

    def rank_rejoined(self, key: str, why: str, read_at: float, later) -> None:
        """``PrefillLinks``, under the lock: a new handshake with ``key`` answered (``why`` empty) or
        failed; requests that waited for it are granted now, or (those that waited since before the
        registry read it followed) fail with the reason."""
        lost = self.links.lost
        for r in [r for r in self._recvs.values() if r.pending is not None and key in r.contacts]:
            if why and r.pending.since < read_at:
                self.end_request(r, Outcome.Failed, f"prefill rank {key} is lost: {why}", later,
                                 tell=set(r.contacts) - set(lost))
            elif not why and not set(r.contacts) & set(lost):
                self._grant_pending(r, later)

    # -- per request ------------------------------------------------------------------------
    def receiver(self, room: Room, *, instance: str | None = None, bootstrap: str | None = None, p_dp_rank: int = 0,
                 on_release: Callable[[Outcome], None] | None = None) -> KVReceiver:
        """Scheduler: a new request, Bootstrapping, with a fresh generation, pulling from prefill
        instance ``instance`` (at the registry ``bootstrap``; by default the endpoint's registry, or
        the instance ``connect()`` made the default), DP group ``p_dp_rank``. Never blocks: an
        instance not handshaken yet is handshaken on a connect thread, and the request waits for it.
        ``on_release(outcome)`` runs exactly once, outside the endpoint lock, after the grant ended
        and no write of it can land any more: on ``Outcome.Success`` the slots hold the KV (keep
        them for decoding), on any other outcome free them there."""
        self.check_usable()
        with self.guard() as later:
            inst = self.links.instance(bootstrap, instance)
            if inst.phase == Phase.READY and p_dp_rank not in inst.groups:
                raise ConnectError(f"prefill instance {inst.name} has no DP group {p_dp_rank} "
                                   f"(it has {sorted(inst.groups)})")
            r = KVReceiver(self, room, next(self._gens) % (1 << 31), inst, on_release)
            self._recvs[r.request_id] = r
            if inst.phase == Phase.READY:
                r.bind(inst.groups[p_dp_rank])
            elif inst.phase == Phase.FAILED:
                self.end_request(r, Outcome.Failed, f"prefill instance {inst.name or inst.ref[0]}: {inst.error}",
                                 later, tell=())
            else:
                inst.waiting.append((r, p_dp_rank))
            return r

    def _resume(self, r: KVReceiver, p_dp_rank: int, later) -> None:
        """Under the lock: ``r``'s instance is READY: bind it, and grant what ``init`` asked for."""
        if r.state in END_STATES:
            return
        if p_dp_rank not in r.instance.groups:
            self.end_request(r, Outcome.Failed, f"prefill instance {r.instance.name} has no DP group {p_dp_rank}",
                             later, tell=())
            return
        r.bind(r.instance.groups[p_dp_rank])
        if r.pending is not None:
            self._grant_pending(r, later)

    def _senders(self, r: KVReceiver) -> frozenset[str] | None:
        """Under the lock: the transport ids of the prefill ranks ``r`` asks (their registry
        records' descriptors), so the transport tells only them of the grant; None when one is
        not known (every peer is told)."""
        known = self.links.known
        ids = [(known[k].data.get(self.transport.name) or {}).get("id") if k in known else None for k in r.contacts]
        return frozenset(ids) if all(type(i) is str for i in ids) else None

    def init_request(self, r: KVReceiver, kv_slots, prefix_len: int, state_slots, aux_slot, swa_slots=None) -> None:
        """The body of ``KVReceiver.init`` (call that): check, then grant and ask prefill now, or once
        the request's instance (or a lost rank of it) answered a handshake."""
        kv = self.layout.check_slots(self.token_space, np.asarray(kv_slots), "kv_slots", distinct=True)
        swa = window_slots(self.layout, self.swa_window, kv, swa_slots)
        st = np.zeros(0, np.int64) if state_slots is None else \
            self.layout.check_slots(STATE, np.asarray(state_slots), "state_slots", distinct=True)
        if not 0 <= prefix_len < len(kv):
            raise RequestError(f"prefix_len {prefix_len} must be in 0..{len(kv) - 1}: at least one token moves")
        if aux_slot is not None:
            if self.aux_rows is None:
                raise RequestError("aux_slot given, but this endpoint has no aux rows: "
                                   "DecodeEndpoint(aux=AuxRows(...))")
            self.aux_rows.check_row(aux_slot)
        with self.guard() as later:
            if r.state in END_STATES:   # its instance failed meanwhile: it says why (failure_exception)
                return
            if r.granted or r.pending is not None:
                raise RequestError(f"room {r.room}: init() on a request that is already initialised")
            r.pending = Pending(kv, prefix_len, st, aux_slot, swa)
            lost = [k for k in r.contacts if k in self.links.lost]
            if not r.bound or lost:   # its instance is handshaking, or a rank of it lost: wait
                if lost:
                    self.links.poke(later)   # the recovery thread looks now
                return
            self._grant_pending(r, later)

    def _grant_pending(self, r: KVReceiver, later) -> None:
        """Under the lock: clear the aux row, grant ``r``'s slots, send the REQs."""
        p, r.pending = r.pending, None
        if p is None or r.state in END_STATES:
            return
        kv, prefix_len, st, aux_slot, swa = p.kv, p.prefix, p.state, p.aux_slot, p.swa_slots
        if aux_slot is not None and r.aux_from is not None:
            key = r.peer_of[r.aux_from]
            why = aux_mismatch(key, aux_format(self.links.known[key]), self.spec.key, self.aux_format)
            if why:
                self.end_request(r, Outcome.Failed, why, later, tell=())
                return
        # window token i is request token len(kv) - len(swa) + i; those in the prefix stay as they are
        slots = {self.token_space: kv[prefix_len:], STATE: st, SWA: swa[max(prefix_len - (len(kv) - len(swa)), 0):]}
        ranges, expected = grant_ranges(r, self.links.planners, slots)
        for src, prog in r.progress.items():   # complete only when exactly these bytes landed
            prog.expected = expected.get(src, 0)
        # before the grant: a stale row from an earlier request never shows
        if aux_slot is not None and self.aux_rows is not None:
            self.aux_rows.clear(aux_slot)
        cap = secrets.token_bytes(CAP_BYTES)   # only the prefill ranks this request asks can complete it
        with self.xport_lock:
            self.transport.expect(r.request_id, ranges, capability=cap, senders=self._senders(r))
        r.granted, r.aux_slot = True, aux_slot
        kv_raw, st_raw = kv.astype("<i8").tobytes(), st.astype("<i8").tobytes()
        swa_raw = swa.astype("<i8").tobytes()
        for key, sources in r.contacts.items():
            dummy = not sources
            hybrid = bool(self.swa_window)   # only hybrid pairs carry the window
            self.channel.send(key, Req(room=r.room, gen=r.gen, kv=b"" if dummy else kv_raw, prefix=prefix_len,
                                       state=b"" if dummy else st_raw, dummy=dummy, cap=cap,
                                       aux=aux_slot is not None and r.aux_from is not None and
                                       r.peer_of.get(r.aux_from) == key,
                                       swa=(b"" if dummy else swa_raw) if hybrid else None,
                                       swa_n=(0 if dummy else len(swa)) if hybrid else None))

    # -- events (channel thread, transport thread or arrivals thread) ------------------------
    def on_message(self, peer: str, msg: Message) -> None:
        with self.guard() as later:
            match msg:
                case Fin(meta=raw):   # a last chunk that moved no bytes
                    try:
                        meta = ChunkMeta.unpack(raw)
                    except ValueError as e:
                        log.warning("bad FIN from %s: %s", peer, e)
                        return
                    r = self._recvs.get(f"{meta.room}.{meta.gen}")
                    if r is not None and r.peer_of.get(meta.source) == peer:
                        self._on_chunk(r, meta, 0, later, fin=True)
                case Ack(room=room, gen=gen):
                    r = self._recvs.get(f"{room}.{gen}")
                    if r is None or peer not in r.contacts or self._late(r, f"the acknowledgement from {peer}",
                                                                         later):
                        return
                    r.acked.add(peer)
                    if len(r.acked) == len(r.contacts):
                        r.advance(KVPoll.WaitingForInput, self.clock() + self.timeouts.waiting)
                case Nack(room=room, gen=gen, why=why) | Abort(room=room, gen=gen, why=why):
                    r = self._recvs.get(f"{room}.{gen}")
                    if r is None or peer not in r.contacts:     # ended already, or not this peer's request
                        return
                    self.end_request(r, Outcome.Aborted if isinstance(msg, Abort) else Outcome.Failed,
                                     f"prefill rank {peer}: {why[:512]}", later, tell=set(r.contacts) - {peer})

    def _arrivals_loop(self) -> None:
        try:
            self._arrivals_turns()
        except BaseException as e:   # a bug: the requests it would have completed fail now, loudly
            log.exception("decode arrivals thread died")
            self.break_endpoint(f"arrivals thread died: {e!r}")

    def _arrivals_turns(self) -> None:
        while not self._closed and self.broken is None:
            t0 = time.monotonic()
            try:
                got = self.transport.arrivals(timeout=0.05)
            except Exception:
                if self._closed:
                    return
                log.exception("transport.arrivals failed")
                got = []
            if not got and time.monotonic() - t0 < 0.01:
                time.sleep(0.002)   # a transport whose arrivals() does not block: do not spin
            for a in got:
                self._on_arrival(a)

    def _on_arrival(self, a: Arrival) -> None:
        with self.guard() as later:
            r = self._recvs.get(a.request_id)
            if r is None:
                return   # ended: its grant is gone, so no byte of it landed after the end
            if not a.ok:
                self.end_request(r, Outcome.Failed, f"a write was rejected: {a.reason}", later)
                return
            try:
                meta = ChunkMeta.unpack(a.notify)
                if f"{meta.room}.{meta.gen}" != r.request_id:
                    raise ConfigError(f"it names request {meta.room}.{meta.gen}, arrived as {r.request_id}")
            except ValueError as e:
                self.end_request(r, Outcome.Failed, f"chunk metadata: {e}", later)
                return
            self._on_chunk(r, meta, a.nbytes, later)

    def _on_chunk(self, r: KVReceiver, meta: ChunkMeta, nbytes: int, later, fin: bool = False) -> None:
        src, peer = r.progress.get(meta.source), r.peer_of.get(meta.source)
        if self._late(r, f"a chunk from {peer}", later):
            return
        fail = chunk_problem(r, meta, nbytes, fin, self.aux_bytes)
        if fail or src is None or peer is None:
            self.end_request(r, Outcome.Failed, fail or "a chunk from an unknown source", later)
            return
        if not fin:
            src.chunks.add(meta.chunk)
            src.nbytes += nbytes
        if meta.total >= 0:
            src.total, src.total_bytes = meta.total, meta.nbytes
        if meta.aux is not None and self.aux_rows is not None and r.aux_slot is not None:
            self.aux_rows.write(r.aux_slot, meta.aux)
        r.acked.add(peer)   # data can overtake the ACK; it proves that prefill rank bound the request
        now = self.clock()
        r.advance(KVPoll.Transferring, now)
        r.deadline = now + self.timeouts.transfer   # progress extends the transfer deadline
        if src.total >= 0 and len(src.chunks) == src.total and src.nbytes != src.total_bytes:
            self.end_request(r, Outcome.Failed, f"{peer} declared {src.total_bytes} bytes but {src.nbytes} arrived",
                             later)
        elif all(p.complete() for p in r.progress.values()):
            if r.aux_slot is not None and r.aux_from is not None and r.aux is None:
                self.end_request(r, Outcome.Failed, "the last chunk came without the aux row", later)
            else:
                self.end_request(r, Outcome.Success, "", later)

    def _late(self, r: KVReceiver, what: str, later) -> bool:
        """End ``r`` as timed out if its deadline passed before ``what`` was handled (this process
        was stalled, say): prefill has given up by then and may reuse the KV, so a late event
        must neither start a fresh deadline nor count toward Success."""
        if self.clock() <= r.deadline:
            return False
        self.end_request(r, Outcome.TimedOut, f"timed out in {r.state.name}: {what} was handled after the deadline",
                         later)
        return True

    def on_peer_lost(self, peer: str, why: str) -> None:
        with self.guard() as later:
            if peer in self.links.known:
                self.links.mark_lost(peer, why, later)

    def _tick(self, now: float, later) -> float:
        if self._landing:
            held = []
            for r in self._landing:
                if self.transport.writes_pending(r.request_id):
                    held.append(r)
                else:
                    later.append(r.run_release)
            self._landing = held
        for r in [r for r in self._recvs.values() if now > r.deadline]:
            what = waited_for(r, self.timeouts, self.links.lost)
            self.end_request(r, Outcome.TimedOut, f"timed out in {r.state.name}: {what}", later)
        return self.rest(0.05)

    def quiet(self) -> bool:
        """No request here for the tick to look after (any thread, no lock: a glance)."""
        return not (self._landing or self._recvs)

    def _live(self) -> list[KVReceiver]:
        return list(self._recvs.values())

    def end_request(self, r: KVReceiver, outcome: Outcome, reason: str, later, tell=None) -> None:
        """End ``r`` once (under ``guard``): forget the grant (later writes are dropped), tell the
        prefill ranks, count it, release (now, or once no write of it may still land)."""
        if r.state in END_STATES:
            return
        self._recvs.pop(r.request_id, None)
        r.pending = None
        if r.granted:
            with self.xport_lock:
                self.transport.forget(r.request_id)
        r.mark_ended(outcome, reason)   # after forget: once the scheduler sees the end, nothing more lands
        msg: Message
        if outcome == Outcome.Success:   # only releases prefill's lease early: no need to wake the channel
            msg, urgent = Done(room=r.room, gen=r.gen), False
            tell = [k for k, ss in r.contacts.items() if ss]
        else:
            msg, urgent = Abort(room=r.room, gen=r.gen, why=cut(reason[:1024])), True
            tell = r.contacts if tell is None else tell
        for key in tell:
            self.channel.send(key, msg, urgent=urgent)
        if outcome in (Outcome.Failed, Outcome.TimedOut):
            self.links.poke(later)   # a replaced prefill rank shows in the registry: look (rate-bounded)
        nbytes = sum(p.nbytes for p in r.progress.values())
        later.append(lambda: record_request_end(self.role, r.room, outcome, reason, peers=",".join(r.contacts),
                                                nbytes=nbytes, seconds=r.ended_at - r.created))
        if r.granted and self.transport.writes_pending(r.request_id):
            self._landing.append(r)
        else:
            later.append(r.run_release)

    def _after_close(self, later) -> None:   # no tick runs any more (an owned transport is closed)
        later.extend(r.run_release for r in self._landing)
        self._landing = []

    def close(self) -> None:
        self.links.close()   # first: its threads use the channel
        if not self._closed and self.broken is None:
            self.links.bye()
        super().close()
        if self._arrivals is not None:
            self._arrivals.join(1.0)


__all__ = ["DecodeEndpoint", "KVReceiver"]
