"""Decode side: ``DecodeEndpoint`` (one per decode rank) and ``KVReceiver`` (one per request; its
record and the checks a chunk passes live in ``kvxfer.endpoint.receiver``).

Who calls what, and when (the whole contract is in ``kvxfer.endpoint.base``):
    start-up, once, blocking: ``DecodeEndpoint(spec, kv_pool, aux=...)``; ``connect(bootstrap=url,
        instance=..., timeout=...)`` (the HELLO handshake with every prefill rank this rank pulls
        from; ``timeout`` bounds the whole call, registry wait and HELLOs together).
    scheduler, per request, never blocks: ``receiver(room, on_release=cb)``; ``init(kv_slots, ...)``
        clears the aux row, grants the slots (``transport.expect``; a hybrid SWA pool: also
        ``swa_slots=``, the window it keeps) and sends the request; then ``poll()`` / ``wait(t)``;
        ``cb(outcome)`` runs once, after the grant ended, whatever the outcome.
    channel thread: ``on_message`` (ack / nack / abort / fin), ``on_peer_lost``, ``on_tick``
        (phase deadlines, every 50 ms), ``on_dead`` (the thread died of a bug: the endpoint breaks).
    recovery thread (``kvxfer.endpoint.recovery``, started by ``connect``): ``known_peers``,
        ``lost_peers``, ``rejoin`` (a lost or replaced prefill rank: fresh HELLO, new address).
Lost prefill ranks: a rank that went silent (heartbeats) is lost: its requests fail, and new
requests to it fail at ``init`` at once, with the reason, until the recovery thread handshook
with it again (it came back, or its replacement registered, possibly on a new port).
    transport thread (``set_arrival_callback``), or an arrivals thread owned here polling
        ``transport.arrivals()`` where the transport cannot call back: chunk bookkeeping -> Success.
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
import torch

from ..control.channel import ControlChannel
from ..control.client import BootstrapClient
from ..control.compat import check_group, require_compatible
from ..control.handshake import hello
from ..control.messages import CAP_BYTES
from ..control.wire import ChunkMeta
from ..errors import CompatibilityError, ConnectError, RequestError
from ..grant import ByteRanges
from ..layout import STATE, SWA
from ..metrics import record_request_end
from ..plan import Planner
from ..pools import KVPool
from ..ranks import RankInfo, RankSpec
from ..topology import peers_needed
from ..transport.base import Arrival, Transport
from .aux import AUX_BYTES, AuxBuffer
from .base import END_STATES, Clock, KVPoll, Outcome, Timeouts, check_reachable
from .receiver import KVReceiver, ReceiverHost, check_one_instance, chunk_problem
from .recovery import REJOIN_HELLO, PeerRecovery

log = logging.getLogger("kvxfer.request")   # one logger for the control plane, both sides


class DecodeEndpoint(ReceiverHost):
    """A decode rank: its receivers, a DEALER per prefill rank, and the arrival handler
    (called on the transport's thread, or by an arrivals thread of its own)."""
    role = "decode"

    def __init__(self, spec: RankSpec, kv: KVPool, *, state: KVPool | None = None, aux: AuxBuffer | None = None,
                 transport: str | Transport = "zmq", transport_options: Mapping | None = None,
                 timeouts: Timeouts = Timeouts(), secret: str | bytes | None = None, aux_bytes: int = AUX_BYTES,
                 clock: Clock = time.monotonic):
        """``clock``: seconds, for deadlines (``time.monotonic``; tests pass a manual one)."""
        if spec.role != "decode":
            raise ValueError(f"DecodeEndpoint needs a decode RankSpec, got role {spec.role!r}")
        if aux is not None and aux.record_bytes != aux_bytes:
            raise ValueError(f"aux buffer rows are {aux.record_bytes} bytes but aux_bytes is {aux_bytes}")
        super().__init__(spec, kv, state=state, transport=transport, transport_options=transport_options,
                         timeouts=timeouts, secret=secret, aux_bytes=aux_bytes, clock=clock)
        self.aux_buffer = aux
        self._gens = itertools.count(1)
        self._recvs: dict[str, KVReceiver] = {}            # request_id -> live receiver
        self._landing: list[KVReceiver] = []               # ended; puts may still land in their slots
        self._groups: dict[int, dict[str, list]] = {}     # prefill dp rank -> peer key -> sources
        self._grant_planners: dict[str, list[tuple[tuple[int, int], Planner]]] = {}   # key -> (source, planner)
        self._known: dict[str, RankInfo] = {}              # prefill key -> the record we handshook with
        self._lost: dict[str, str] = {}                    # prefill key -> why it is lost (no HELLO since)
        self.recovery: PeerRecovery | None = None
        self.channel = ControlChannel(self, secret=self.secret, heartbeat=timeouts.heartbeat, name="decode-ctl",
                                      identity=f"{spec.key}/{uuid.uuid4().hex[:12]}", on_dead=self.on_dead)
        self._arrivals: threading.Thread | None = None
        if not self.transport.set_arrival_callback(self._on_arrival):
            self._arrivals = threading.Thread(target=self._arrivals_loop, name="kvxfer-decode-arrivals", daemon=True)
            self._arrivals.start()

    # -- start-up ---------------------------------------------------------------------------
    def connect(self, *, bootstrap: str | None = None, peers: Sequence[RankInfo] | None = None,
                instance: str | None = None, timeout: float = 60.0) -> None:
        """Start-up, once: handshake with every prefill rank this rank needs, in every prefill DP
        group of one prefill instance. Blocking, at most ``timeout`` real seconds in all (waiting for
        the registry, then one HELLO per rank, each also capped by ``Timeouts.handshake``).
        ``instance``: which prefill instance to pull from; required when several are registered
        (ConnectError lists them). Raises CompatibilityError (every mismatch, in words) or
        ConnectError."""
        if not timeout > 0:
            raise ValueError(f"connect timeout must be > 0 seconds, got {timeout}")
        self.check_usable()
        deadline = time.monotonic() + timeout
        client = None
        if peers is None:
            if bootstrap is None:
                raise ValueError("connect needs bootstrap= (a registry URL) or peers= (RankInfo records)")
            check_reachable(self.info, bootstrap)
            client = BootstrapClient(bootstrap, self.secret, timeout=min(5.0, timeout))
            if instance is None:   # several instances: say so now, not after waiting for all of them
                try:
                    early = client.topology()[1]
                except ConnectError:   # not up yet: wait_ready below says so if it stays down
                    early = []
                check_one_instance(early)
            peers = client.wait_ready(max(deadline - time.monotonic(), 0.0), instance)
        peers = [p for p in peers if p.spec.role == "prefill" and (instance is None or p.spec.instance == instance)]
        if instance is None:
            check_one_instance(peers)
        me = self.info
        by_key = {p.spec.key: p for p in peers}
        if not by_key:
            raise ConnectError("no prefill rank to connect to" + (f" in instance {instance!r}" if instance else ""))
        conflicts = check_group(list(by_key.values()))   # sources by head id: one head map per group
        if conflicts:
            raise CompatibilityError(conflicts)
        groups: dict[int, dict[str, list]] = {}
        for p in by_key.values():
            if p.spec.dp_rank not in groups:
                groups[p.spec.dp_rank] = {f"{p.spec.instance}/dp{p.spec.dp_rank}/pp{pp}/tp{tp}": ss
                                          for (tp, pp), ss in peers_needed(p.spec, self.spec).items()}
        missing = [k for g in groups.values() for k in g if k not in by_key]
        if missing:
            raise ConnectError(f"prefill rank(s) {', '.join(missing)} needed but not registered")
        require_compatible([(by_key[k], me) for g in groups.values() for k in g], self.transport.name)
        dl = self.layout
        for dp, group in groups.items():
            for key, sources in group.items():
                self.channel.connect(key, by_key[key].control)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectError(f"connect timed out after {timeout}s before the handshake with {key}")
                hello(self.channel, key, me, min(self.timeouts.handshake, left))   # the prefill rank checks too
                planners = [((s.p_tp_rank, s.p_pp_rank), self._planner(dl, dl, s.dst_heads, s.dst_heads, s.layers,
                                                                         kinds))
                            for s in sources for kinds in (self.kv_kinds, self.state_kinds)]
                with self._lock:
                    self._grant_planners[key] = [(src, p) for src, p in planners if p is not None]
                    self._known[key] = by_key[key]
            with self._lock:
                self._groups[dp] = group
        if self.recovery is None:
            retry = max(1.0, 2 * self.timeouts.heartbeat.interval)
            self.recovery = PeerRecovery(self, client, instance, self.timeouts.registry, retry).start()

    # -- lost and replaced prefill ranks (recovery thread) -------------------------------------
    def known_peers(self) -> dict[str, RankInfo]:
        """Recovery thread: the prefill ranks handshook with, and the record each HELLO went to."""
        with self._lock:
            return dict(self._known)

    @property
    def lost_peers(self) -> dict[str, str]:
        """Prefill ranks lost (silent, replaced and not handshaken yet), with why. Any thread."""
        with self._lock:
            return dict(self._lost)

    def _mark_lost(self, key: str, why: str, later) -> None:
        """Under the lock: ``key`` is lost; its running requests fail; the recovery thread looks."""
        self._lost[key] = why
        for r in [r for r in self._recvs.values() if key in r.contacts]:
            self.end_request(r, Outcome.Failed, f"prefill rank {key} lost: {why}", later, tell=set(r.contacts) - {key})
        if self.recovery is not None:
            later.append(self.recovery.poke)

    def rejoin(self, key: str, info: RankInfo, *, replaced: bool) -> bool:
        """Recovery thread, blocking (one HELLO, at most ``REJOIN_HELLO`` s): handshake again with
        prefill rank ``key`` at ``info.control``. ``replaced``: the registry holds a new record for
        it (a restarted rank), so what ran with the old one fails now. True once it answered;
        False (it stays lost, with the reason) otherwise. Never raises."""
        with self.guard() as later:
            old = self._known.get(key)
            if old is None or self._closed or self.broken is not None:
                return False
            if replaced:
                self._mark_lost(key, f"was replaced by a new registration (control {info.control})", later)
        if old.spec != info.spec:
            why = (f"re-registered with another shape ({info.spec} instead of {old.spec}): restart this decode rank "
                   f"to pull from it")
        else:
            try:
                require_compatible([(info, self.info)], self.transport.name)
                self.channel.forget(key)            # a new connection: its replay state, a fresh HELLO
                self.channel.connect(key, info.control)
                hello(self.channel, key, self.info, min(self.timeouts.handshake, REJOIN_HELLO))
                why = ""
            except (ConnectError, CompatibilityError, ValueError) as e:
                why = f"a new handshake with {info.control} failed: {e}"
        with self.guard() as later:
            if not why:
                self._known[key] = info
                if self._lost.pop(key, None) is not None:
                    log.info("prefill rank %s is back at %s: handshake done", key, info.control)
                return True
            if key not in self._lost:
                self._mark_lost(key, why, later)
            else:
                self._lost[key] = why
            log.info("prefill rank %s is lost: %s", key, why)
            return False

    # -- per request ------------------------------------------------------------------------
    def receiver(self, room: int, *, p_dp_rank: int = 0,
                 on_release: Callable[[Outcome], None] | None = None) -> KVReceiver:
        """Scheduler: a new request, Bootstrapping, with a fresh generation. ``on_release(outcome)``
        runs exactly once, outside the endpoint lock, after the grant ended and no write of it can
        land any more: on ``Outcome.Success`` the slots hold the KV (keep them for decoding), on
        any other outcome free them there."""
        self.check_usable()
        with self._lock:
            if p_dp_rank not in self._groups:
                raise ConnectError(f"not connected to prefill DP group {p_dp_rank}: call connect() first")
            r = KVReceiver(self, room, next(self._gens) % (1 << 31), self._groups[p_dp_rank], on_release)
            self._recvs[r.request_id] = r
            return r

    def _senders(self, r: KVReceiver) -> frozenset[str] | None:
        """Under the lock: the transport ids of the prefill ranks ``r`` asks (their registry
        records' descriptors), so the transport tells only them of the grant; None when one is
        not known (every peer is told)."""
        ids = [(self._known[k].data.get(self.transport.name) or {}).get("id") if k in self._known else None
               for k in r.contacts]
        return frozenset(ids) if all(type(i) is str for i in ids) else None

    def _grant(self, r: KVReceiver, kv: np.ndarray, st: np.ndarray,
               swa: np.ndarray) -> tuple[ByteRanges, dict[tuple[int, int], int]]:
        """Exactly the bytes r's sources will write: each source's heads and layers at the slots
        (``swa``: the window slots of the sliding-window layers that will be sent); and how many
        bytes each source of r writes (0 for a source with nothing to send)."""
        slots = {self.token_space: kv, STATE: st, SWA: swa}
        cols: list[list[np.ndarray]] = [[], [], []]
        expected = dict.fromkeys(r.progress, 0)
        for key in r.contacts:
            for src, pl in self._grant_planners[key]:
                mine = {k: v for k, v in slots.items() if k in {a for a, _ in pl.spaces}}
                runs = pl.plan(mine, mine).runs()
                for c, a in zip(cols, (runs.dst_region, runs.dst_offset, runs.nbytes)):
                    c.append(a)
                expected[src] = expected.get(src, 0) + int(runs.nbytes.sum(dtype=np.int64))
        return ByteRanges(*(np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols)), expected

    def _window_slots(self, kv: np.ndarray, swa_slots) -> np.ndarray:
        """The checked window slots of a hybrid pool's request; empty for any other pool."""
        if not self.swa_window:
            if swa_slots is not None:
                raise RequestError("swa_slots given, but this endpoint's pool has no sliding-window layers")
            return np.zeros(0, np.int64)
        if swa_slots is None:
            raise RequestError(f"this pool has sliding-window layers: pass swa_slots, the {SWA!r} slots of the "
                               f"last 1..{self.swa_window} tokens (the window decode keeps)")
        swa = self.layout.check_slots(SWA, np.asarray(swa_slots), "swa_slots", distinct=True)
        most = min(self.swa_window, len(kv))
        if not 1 <= len(swa) <= most:
            raise RequestError(f"swa_slots has {len(swa)} slot(s) but must cover the last 1..{most} tokens "
                               f"(sliding window {self.swa_window}, request of {len(kv)} tokens)")
        return swa

    def init_request(self, r: KVReceiver, kv_slots, prefix_len: int, state_slots, aux_slot, swa_slots=None) -> None:
        """The body of ``KVReceiver.init`` (call that): check, clear the aux row, grant, ask prefill."""
        kv = self.layout.check_slots(self.token_space, np.asarray(kv_slots), "kv_slots", distinct=True)
        swa = self._window_slots(kv, swa_slots)
        st = np.zeros(0, np.int64) if state_slots is None else \
            self.layout.check_slots(STATE, np.asarray(state_slots), "state_slots", distinct=True)
        if not 0 <= prefix_len < len(kv):
            raise RequestError(f"prefix_len {prefix_len} must be in 0..{len(kv) - 1}: at least one token moves")
        if aux_slot is not None and (self.aux_buffer is None or not 0 <= aux_slot < len(self.aux_buffer.tensor)):
            raise RequestError(f"aux_slot {aux_slot} is not a row of this endpoint's aux buffer")
        with self.guard() as later:
            if r.state in END_STATES or r.granted:
                raise RequestError(f"room {r.room}: init() on a request that is {r.state.name}"
                                   f"{' and already initialised' if r.granted else ''}")
            lost = [(k, self._lost[k]) for k in r.contacts if k in self._lost]
            if lost:   # fail at once, not at the bootstrap deadline; nothing granted, nothing sent
                why = "; ".join(f"prefill rank {k} is lost: {w}" for k, w in lost)
                self.end_request(r, Outcome.Failed, why, later, tell=())
                if self.recovery is not None:
                    later.append(self.recovery.poke)
                return
            # window token i is request token len(kv) - len(swa) + i; those in the prefix stay as they are
            ranges, expected = self._grant(r, kv[prefix_len:], st, swa[max(prefix_len - (len(kv) - len(swa)), 0):])
            for src, p in r.progress.items():   # complete only when exactly these bytes landed
                p.expected = expected.get(src, 0)
            # before the grant: a stale record from an earlier request never shows
            if aux_slot is not None and self.aux_buffer is not None:
                self.aux_buffer.clear(aux_slot)
            cap = secrets.token_bytes(CAP_BYTES)   # only the prefill ranks this request asks can complete it
            with self._xport_lock:
                self.transport.expect(r.request_id, ranges, capability=cap, senders=self._senders(r))
            r.granted, r.aux_slot = True, aux_slot
            kv_raw, st_raw = kv.astype("<i8").tobytes(), st.astype("<i8").tobytes()
            swa_raw = swa.astype("<i8").tobytes()
            for key, sources in r.contacts.items():
                dummy = not sources
                msg = {"t": "req", "room": r.room, "gen": r.gen, "kv": b"" if dummy else kv_raw,
                       "prefix": prefix_len, "state": b"" if dummy else st_raw, "dummy": dummy,
                       "aux": aux_slot is not None and r.aux_from is not None and r.peer_of.get(r.aux_from) == key,
                       "cap": cap}
                if self.swa_window:   # only hybrid pairs carry the window: other requests keep their shape
                    msg["swa"], msg["swa_n"] = (b"", 0) if dummy else (swa_raw, len(swa))
                self.channel.send(key, msg)

    # -- events (channel thread, transport thread or arrivals thread) ------------------------
    def on_message(self, peer: str, msg: dict) -> None:
        t = msg["t"]
        with self.guard() as later:
            if t == "fin":   # a last chunk that moved no bytes
                try:
                    meta = ChunkMeta.unpack(msg["meta"])
                except ValueError as e:
                    log.warning("bad FIN from %s: %s", peer, e)
                    return
                r = self._recvs.get(f"{meta.room}.{meta.gen}")
                if r is not None and r.peer_of.get(meta.source) == peer:
                    self._on_chunk(r, meta, 0, later, fin=True)
                return
            if t not in ("ack", "nack", "abort"):
                return
            r = self._recvs.get(f"{msg['room']}.{msg['gen']}")
            if r is None or peer not in r.contacts:     # ended already, or not this peer's request
                return
            if t == "ack":
                if self._late(r, f"the acknowledgement from {peer}", later):
                    return
                r.acked.add(peer)
                if len(r.acked) == len(r.contacts):
                    r.advance(KVPoll.WaitingForInput, self.clock() + self.timeouts.waiting)
            else:
                self.end_request(r, Outcome.Aborted if t == "abort" else Outcome.Failed,
                                 f"prefill rank {peer}: {msg['why'][:512]}", later, tell=set(r.contacts) - {peer})

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
                    raise ValueError(f"it names request {meta.room}.{meta.gen}, arrived as {r.request_id}")
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
        if meta.aux is not None and self.aux_buffer is not None and r.aux_slot is not None:
            self.aux_buffer.tensor[r.aux_slot] = torch.frombuffer(bytearray(meta.aux), dtype=torch.uint8)
        r.acked.add(peer)   # data can overtake the ACK; it proves that prefill rank bound the request
        now = self.clock()
        r.advance(KVPoll.Transferring, now)
        r.deadline = now + self.timeouts.transfer   # progress extends the transfer deadline
        if src.total >= 0 and len(src.chunks) == src.total and src.nbytes != src.total_bytes:
            self.end_request(r, Outcome.Failed, f"{peer} declared {src.total_bytes} bytes but {src.nbytes} arrived",
                             later)
        elif all(p.complete() for p in r.progress.values()):
            if r.aux_slot is not None and r.aux_from is not None and r.aux is None:
                self.end_request(r, Outcome.Failed, "the last chunk came without the aux record", later)
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
            if peer in self._known:
                self._mark_lost(peer, why, later)

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
            what = {KVPoll.Bootstrapping: ("no acknowledgement from " + ", ".join(sorted(set(r.contacts) - r.acked))
                                           if r.granted else "init() was not called"),
                    KVPoll.WaitingForInput: "no chunk arrived",
                    KVPoll.Transferring: "the transfer made no progress"}[r.state]
            limit = {KVPoll.Bootstrapping: self.timeouts.bootstrap, KVPoll.WaitingForInput: self.timeouts.waiting,
                     KVPoll.Transferring: self.timeouts.transfer}[r.state]
            self.end_request(r, Outcome.TimedOut, f"timed out in {r.state.name}: {what} within {limit}s", later)
        return 0.05

    def _live(self) -> list[KVReceiver]:
        return list(self._recvs.values())

    def end_request(self, r: KVReceiver, outcome: Outcome, reason: str, later, tell=None) -> None:
        """End ``r`` once (under ``guard``): forget the grant (later writes are dropped), tell the
        prefill ranks, count it, release (now, or once no write of it may still land)."""
        if r.state in END_STATES:
            return
        self._recvs.pop(r.request_id, None)
        if r.granted:
            with self._xport_lock:
                self.transport.forget(r.request_id)
        r.mark_ended(outcome, reason)   # after forget: once the scheduler sees the end, nothing more lands
        if outcome == Outcome.Success:   # only releases prefill's lease early: no need to wake the channel
            msg, urgent = {"t": "done", "room": r.room, "gen": r.gen}, False
            tell = [k for k, ss in r.contacts.items() if ss]
        else:
            msg, urgent = {"t": "abort", "room": r.room, "gen": r.gen, "why": reason[:1024]}, True
            tell = r.contacts if tell is None else tell
        for key in tell:
            self.channel.send(key, msg, urgent=urgent)
        if outcome in (Outcome.Failed, Outcome.TimedOut) and self.recovery is not None:
            later.append(self.recovery.poke)   # a replaced prefill rank shows in the registry: look (rate-bounded)
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
        if self.recovery is not None:   # first: it uses the channel
            self.recovery.stop()
        super().close()
        if self._arrivals is not None:
            self._arrivals.join(1.0)


__all__ = ["DecodeEndpoint", "KVReceiver"]
