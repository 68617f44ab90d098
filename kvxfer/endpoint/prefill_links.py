"""Decode's links to prefill: ``PrefillLinks``, the part of a ``DecodeEndpoint`` that knows the
prefill instances its requests name and the prefill ranks of each it handshook with.

It owns: the instance records (``kvxfer.endpoint.instances``), the record each prefill rank's
HELLO went to (``known``), the ranks lost since (``lost``, with why), the planners of each rank's
grants (``planners``), the connect threads and the recovery thread (``kvxfer.endpoint.recovery``).
It shares the endpoint's lock: every method below that says "under the lock" is called holding it,
and every change of a request goes back to the endpoint through its callbacks, under the lock:
``instance_ready(inst, later)``, ``instance_failed(inst, why, later)``, ``rank_lost(key, why,
later)`` and ``rank_rejoined(key, why, later)`` (``why`` empty: it answered).

Who calls what: the endpoint calls ``instance`` (scheduler thread, never blocks), ``connect``
(its own ``connect``, blocking), ``mark_lost`` (channel thread) and ``close``; the connect threads
run one instance's handshake each (registry wait, then a HELLO to each rank this decode rank
pulls from, all at once); the recovery thread calls ``registries``, ``known_peers``,
``lost_peers`` and ``rejoin``.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence

from ..control.client import BootstrapClient
from ..control.compat import require_compatible
from ..control.handshake import hello, hello_all
from ..control.messages import Bye
from ..control.records import RankInfo
from ..errors import CompatibilityError, ConnectError
from ..plan import Planner
from .instances import Groups, Phase, PrefillInstance, check_one_instance, find_ranks, plan_groups
from .receiver import ReceiverHost
from .recovery import REJOIN_HELLO, REPLACED_HELLO, PeerRecovery

log = logging.getLogger("kvxfer.request")

MAX_INSTANCES = 1024     # setting: prefill instances one decode endpoint keeps
HELLO_FANOUT = 64        # HELLOs in flight at once, per instance handshake
RETRY_FAILED = 1.0       # seconds before a request may try an instance whose handshake failed again
BUSY_RETRY = 0.25        # seconds between HELLOs to a rank that refused for now


class PrefillLinks:
    """The prefill instances and ranks of one decode endpoint (see the module docstring)."""

    def __init__(self, ep: ReceiverHost, bootstrap: str | None):
        self.ep, self.bootstrap = ep, bootstrap
        self._instances: dict[tuple[str, str], PrefillInstance] = {}   # (registry, name as asked) -> instance
        self._named: dict[str, PrefillInstance] = {}       # instance name -> instance
        self.default: PrefillInstance | None = None
        self.planners: dict[str, list[tuple[tuple[int, int], Planner]]] = {}   # rank key -> (source, planner)
        self.known: dict[str, RankInfo] = {}               # rank key -> the record our HELLO went to
        self._tids: dict[str, str] = {}                    # transport id -> rank key, of ``known``'s records
        self._admitting: dict[str, str] = {}               # transport id -> rank key, of HELLOs in flight
        self.lost: dict[str, str] = {}                     # rank key -> why it is lost (no HELLO since)
        self._connects = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                               thread_name_prefix="kvxfer-decode-connect")
        self.recovery: PeerRecovery | None = None

    # -- instances ------------------------------------------------------------------------------
    def connect(self, url: str | None, peers: Sequence[RankInfo] | None, instance: str | None,
                deadline: float) -> None:
        """Blocking (the endpoint's ``connect``): handshake with one instance now, make it the default."""
        if peers is not None:   # records: the instance is named by them
            instance = instance or check_one_instance([p for p in peers if p.spec.role == "prefill"])
        with self.ep.guard():
            inst = self.instance(url if peers is None else "", instance, start=False)
            ready = inst.phase == Phase.READY
        if not ready:
            self._connect_instance(inst, deadline, peers)
        with self.ep.guard():
            self.default = inst

    def phases(self) -> dict[str, str]:
        """Under the lock: every instance requests named, and where its handshake stands."""
        return {inst.name or f"? at {inst.ref[0]}": inst.phase.value for inst in self._instances.values()}

    def instance(self, url: str | None, name: str | None, start: bool = True) -> PrefillInstance:
        """Under the lock: the instance a request names (made, and its handshake started on a
        connect thread, the first time; a failed one is tried again after ``RETRY_FAILED`` s)."""
        if url is None and name is not None and name in self._named:
            return self._retry(self._named[name]) if start else self._named[name]
        if url is None and name is None:
            if self.default is None:
                raise ConnectError("the request names no prefill instance: pass instance= / bootstrap=, or call "
                                   "connect() first to set a default")
            return self._retry(self.default) if start else self.default
        url = url if url is not None else self.bootstrap
        if url is None:
            raise ConnectError(f"prefill instance {name!r} is unknown here and the endpoint has no registry: pass "
                               f"bootstrap= (its registry URL)")
        ref = (url, name or "")
        inst = self._instances.get(ref)
        if inst is None:
            if len(self._instances) >= MAX_INSTANCES:
                raise ConnectError(f"this decode endpoint already knows {MAX_INSTANCES} prefill instances")
            inst = PrefillInstance(ref, BootstrapClient(url, self.ep.secret, timeout=5.0) if url else None)
            self._instances[ref] = inst
            if start:
                self._start(inst)
            return inst
        return self._retry(inst) if start else inst

    def _retry(self, inst: PrefillInstance) -> PrefillInstance:
        if inst.phase == Phase.FAILED and time.monotonic() - inst.failed_at > RETRY_FAILED and inst.client:
            inst.phase, inst.error = Phase.CONNECTING, ""
            self._start(inst)
        return inst

    def _start(self, inst: PrefillInstance) -> None:
        if not self.ep.closed:
            self._connects.submit(self._connect_job, inst,
                                  time.monotonic() + min(self.ep.timeouts.bootstrap, 60.0))

    def _connect_job(self, inst: PrefillInstance, deadline: float) -> None:
        """Connect thread: one instance's handshake; the requests that waited for it go on or fail."""
        try:
            self._connect_instance(inst, deadline, None)
        except (ConnectError, CompatibilityError, ValueError) as e:
            log.info("prefill instance %s: handshake failed: %s", inst, e)
        except Exception as e:   # a bug: the waiting requests fail loudly, the thread lives
            log.exception("prefill instance %s: handshake failed", inst)
            self._failed(inst, f"handshake failed: {e!r}")

    def _connect_instance(self, inst: PrefillInstance, deadline: float, peers: Sequence[RankInfo] | None) -> None:
        """Blocking: read the registry (or ``peers``), check the pair, HELLO every rank this rank needs
        (in parallel), then mark the instance READY and resume its waiting requests. Raises
        (ConnectError, CompatibilityError) after failing the instance with the reason."""
        try:
            if peers is not None:
                ranks = [p for p in peers if p.spec.role == "prefill" and inst.name in (None, p.spec.instance)]
                name = inst.name or check_one_instance(ranks)
            else:
                name, ranks = find_ranks(inst.client, inst.name, deadline)
            with self.ep.guard():
                other = self._named.get(name)
                if other is not None and other is not inst:
                    raise ConnectError(f"prefill instance {name!r} at {inst.ref[0] or 'records'} has the name of the "
                                       f"instance at {other.ref[0] or 'records'}: give each prefill instance its own "
                                       f"name (RankSpec.instance)")
                inst.name = name
                self._named[name] = inst
            me = self.ep.info
            groups, records = plan_groups(ranks, me, self.ep.transport.name)
            self._hello_all(groups, records, me, deadline)
        except (ConnectError, CompatibilityError, ValueError) as e:
            self._failed(inst, str(e))
            raise
        with self.ep.guard() as later:
            inst.groups, inst.phase, inst.error = groups, Phase.READY, ""
            self.ep.instance_ready(inst, later)
            if self.recovery is None:
                retry = max(1.0, 2 * self.ep.timeouts.heartbeat.interval)
                self.recovery = PeerRecovery(self, self.ep.timeouts.registry, retry).start()

    def _hello_all(self, groups: Groups, records: dict[str, RankInfo], me: RankInfo, deadline: float) -> None:
        """HELLO every rank of ``records`` at once from this thread (at most ``HELLO_FANOUT`` in
        flight), then keep what each answered. A refusal raises (CompatibilityError before ConnectError)."""
        admitted: set[str] = set()
        try:
            errors = hello_all(self.ep.channel, {k: r.control for k, r in records.items()}, me,
                               self.ep.timeouts.handshake, deadline, lambda k: self._tokens(k, records[k], admitted),
                               HELLO_FANOUT, BUSY_RETRY)
            if errors:
                raise next((e for e in errors if isinstance(e, CompatibilityError)), errors[0])
            ep, dl = self.ep, self.ep.layout
            with ep.guard():
                for group in groups.values():
                    for key, sources in group.items():
                        made = [((s.p_tp_rank, s.p_pp_rank), ep.make_planner(dl, dl, s.dst_heads, s.dst_heads,
                                                                             s.layers, kinds))
                                for s in sources for kinds in (ep.kv_kinds, ep.state_kinds)]
                        self.planners[key] = [(src, p) for src, p in made if p is not None]
                        self._know(key, records[key])
                        self.lost.pop(key, None)
        finally:   # the ranks that answered hold their ids through ``known`` now
            self._admitted(admitted)

    def _tokens(self, key: str, info: RankInfo, admitting: set[str]) -> dict[str, bytes]:
        """The admission token our transport gives prefill rank ``key`` of ``info`` (``Transport.admit``).
        ConnectError when another rank holds that transport id, handshook with or being handshaken
        with (a record of the same registry read, say): admitting it again would void that rank's
        token (a record that reuses a live rank's id must not cut it off). The id is added to
        ``admitting``; the caller hands it to ``_admitted`` once its HELLOs are over."""
        desc = info.data.get(self.ep.transport.name)
        if desc is None:
            return {}
        tid = self._tid(info)
        with self.ep.guard():
            owner = self._tids.get(tid) or self._admitting.get(tid) or key
            if owner == key:
                self._admitting[tid] = key
                admitting.add(tid)
        if owner != key:
            raise ConnectError(f"prefill rank {key}'s {self.ep.transport.name} id {str(tid)[:40]} is prefill rank "
                               f"{owner}'s: a record that reuses another rank's transport is refused")
        with self.ep.xport_lock:
            token = self.ep.transport.admit(dict(desc))
        return {self.ep.transport.name: token} if token else {}

    def _admitted(self, tids: set[str]) -> None:
        """The HELLOs that ``_tokens`` admitted ``tids`` for are over (answered or not): a rank
        that answered holds its id through ``known`` from now on."""
        with self.ep.guard():
            for tid in tids:
                self._admitting.pop(tid, None)

    def _know(self, key: str, info: RankInfo) -> None:
        """Under the lock: prefill rank ``key`` answered a HELLO sent to ``info``."""
        old = self._tid(self.known[key]) if key in self.known else None
        if old is not None and self._tids.get(old) == key:
            del self._tids[old]
        self.known[key] = info
        self._tids[self._tid(info)] = key

    def _tid(self, info: RankInfo) -> str:
        """Our transport's id in ``info`` as an index key (a peer's record may hold any value there)."""
        tid = (info.data.get(self.ep.transport.name) or {}).get("id")
        return tid if isinstance(tid, str) else repr(tid)[:200]

    def _failed(self, inst: PrefillInstance, why: str) -> None:
        with self.ep.guard() as later:
            inst.phase, inst.error, inst.failed_at = Phase.FAILED, why, time.monotonic()
            self.ep.instance_failed(inst, why, later)

    # -- lost and replaced ranks ------------------------------------------------------------------
    def registries(self) -> dict[str, BootstrapClient | None]:
        """Recovery thread: every ready instance and its registry (None: connected from records)."""
        with self.ep.guard():
            return {inst.name: inst.client for inst in self._instances.values()
                    if inst.phase == Phase.READY and inst.name}

    def known_peers(self) -> dict[str, RankInfo]:
        """Recovery thread: the prefill ranks handshook with, and the record each HELLO went to."""
        with self.ep.guard():
            return dict(self.known)

    @property
    def lost_peers(self) -> dict[str, str]:
        """Any thread: prefill ranks lost (silent, replaced and not handshaken yet), with why."""
        with self.ep.guard():
            return dict(self.lost)

    def mark_lost(self, key: str, why: str, later) -> None:
        """Under the lock: ``key`` is lost; its running requests fail; the recovery thread looks."""
        self.lost[key] = why
        self.ep.rank_lost(key, why, later)
        self.poke(later)

    def poke(self, later) -> None:
        """Under the lock: the recovery thread looks at the registry soon (rate-bounded)."""
        if self.recovery is not None:
            later.append(self.recovery.poke)

    def break_endpoint(self, why: str) -> None:
        """Recovery thread: it died of a bug; the endpoint breaks."""
        self.ep.break_endpoint(why)

    def rejoin(self, key: str, info: RankInfo, *, replaced: bool, read_at: float = float("inf")) -> bool:
        """Recovery thread, blocking (one HELLO, at most ``REJOIN_HELLO`` s, ``REPLACED_HELLO`` when
        ``replaced``): handshake again with prefill rank ``key`` at ``info.control``. ``replaced``:
        the registry holds a new record for it (a restarted rank), so what ran with the old one
        fails now. ``read_at``: when the registry was read (``time.monotonic``); a failed handshake
        fails only the requests that waited since before then (a later one gets a fresh read).
        True once it answered; False (it stays lost, with the reason) otherwise. Never raises."""
        ep = self.ep
        with ep.guard() as later:
            old = self.known.get(key)
            if old is None or ep.closed or ep.broken is not None:
                return False
            if replaced:
                self.mark_lost(key, f"was replaced by a new registration (control {info.control})", later)
        admitted: set[str] = set()
        if old.spec != info.spec:
            why = (f"re-registered with another shape ({info.spec} instead of {old.spec}): restart this decode rank "
                   f"to pull from it")
        else:
            try:
                require_compatible([(info, ep.info)], ep.transport.name)
                ep.channel.forget(key)            # a new connection: its replay state, a fresh HELLO
                ep.channel.connect(key, info.control)
                wait = REPLACED_HELLO if replaced else REJOIN_HELLO
                hello(ep.channel, key, ep.info, min(ep.timeouts.handshake, wait), self._tokens(key, info, admitted))
                why = ""
            except (ConnectError, CompatibilityError, ValueError) as e:
                why = f"a new handshake with {info.control} failed: {e}"
            except BaseException:
                self._admitted(admitted)
                raise
        with ep.guard() as later:
            if not why:
                self._know(key, info)
            self._admitted(admitted)   # after ``_know``: the id is held all along
            if not why:
                if self.lost.pop(key, None) is not None:
                    log.info("prefill rank %s is back at %s: handshake done", key, info.control)
            elif key not in self.lost:
                self.mark_lost(key, why, later)
            else:
                self.lost[key] = why
            ep.rank_rejoined(key, why, read_at, later)
            if why:
                self.poke(later)   # requests that came after the read wait for the next one
            if why:
                log.info("prefill rank %s is lost: %s", key, why)
            return not why

    def bye(self) -> None:
        """Tell every prefill rank handshook with that this endpoint closes (before the channel does)."""
        with self.ep.guard():
            keys = list(self.known)
        for key in keys:
            self.ep.channel.send(key, Bye())

    def close(self) -> None:
        if self.recovery is not None:   # first: it uses the channel
            self.recovery.stop()
        self._connects.shutdown(wait=False, cancel_futures=True)


__all__ = ["PrefillLinks", "MAX_INSTANCES", "HELLO_FANOUT", "RETRY_FAILED"]
