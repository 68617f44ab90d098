"""The registry's client side, used by every rank: ``BootstrapClient`` (register, look up, wait for a
complete instance, watch for changes) and ``Registration`` (what keeps a prefill rank registered).
Standard library only: ranks need no event loop and no aiohttp to register or look up.

One interface, two backends, chosen by the URL's scheme here and nowhere else:

    http://host:port, https://...          the embedded registry (``kvxfer bootstrap``, or
                                           ``BootstrapServer`` in a prefill rank)
    etcd://host:2379[,host2:2379...][/prefix]   etcd (v3, through its HTTP/JSON gateway): leases
                                           kept alive on one connection, watches, replicas

Ranks see the same ``RankInfo`` records and run the same checks either way: every record read is
parsed by ``RankInfo.from_dict``, and every layout fetched by digest is checked against its digest
(``kvxfer.control.discovery``) before use.

Who calls what: ``PrefillEndpoint.register`` makes a ``Registration``; a decode endpoint's connect
thread calls ``instances`` / ``wait_ready`` (``kvxfer.endpoint.instances.find_ranks``) and its
recovery thread watches through ``changes`` (``kvxfer.control.watch``); tools call ``topology``.
Every call blocks at most the client's ``timeout`` (``wait_ready`` and ``changes``: their own
deadline); calls from several threads are fine (each takes its own connection).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping

from ..errors import ConfigError, ConnectError
from ..metrics import record_registration_lost
from .auth import as_secret
from .discovery import WHOLE, Backend, Backoff, Snapshot, bare_record, digest_of, is_digest, transient
from .etcd_registry import EtcdRegistry
from .http_registry import HttpRegistry
from .records import RankInfo, check_layout_record

log = logging.getLogger("kvxfer.control.bootstrap")

LAYOUTS_CACHED = 64          # layouts a client keeps by digest
WAIT_SLICE = 25.0            # seconds one held request of ``wait_ready`` lasts (the server caps it at 30)


class BootstrapClient:
    """A registry client; the backend follows the URL's scheme (see the module docstring).
    ``source``: the local address to connect from (a host with several interfaces)."""

    def __init__(self, url: str, secret: str | bytes | None = None, timeout: float = 5.0, *,
                 source: str | None = None):
        self.url, self.secret, self.timeout, self.source = url.rstrip("/"), as_secret(secret), timeout, source
        scheme = urllib.parse.urlsplit(self.url).scheme
        self.backend: Backend
        if scheme in ("http", "https"):
            self.backend = HttpRegistry(self.url, self.secret, timeout, source)
        elif scheme == "etcd":
            self.backend = EtcdRegistry(self.url, timeout, source)
        else:
            raise ConfigError(f"registry URL {url!r}: use http://HOST:PORT (what `kvxfer bootstrap` prints) or "
                             f"etcd://HOST:2379[,HOST2:2379...]")
        self._layouts: collections.OrderedDict[str, Mapping] = collections.OrderedDict()
        self._lock = threading.Lock()

    # -- writes (prefill ranks, through ``Registration``) -----------------------------------
    @property
    def default_ttl(self) -> float:
        """Seconds a registration lives without a heartbeat unless its rank says otherwise: the
        embedded registry's default (10 s; the server's ``--ttl`` decides), etcd's lease (30 s:
        ``kvxfer.control.etcd_registry.ETCD_TTL`` says why)."""
        return self.backend.default_ttl

    def register(self, info: RankInfo, owner: str | None = None, ttl: float | None = None) -> str:
        """Register ``info`` once (no retry: ``Registration.start`` retries); ``owner`` (16-64 of
        [A-Za-z0-9_-]) owns the key: it is refused to any other owner while this registration lives.
        ``ttl``: how long it lives without a heartbeat where the backend takes it from the client
        (etcd's lease; the embedded registry has its own); None: ``default_ttl``."""
        return self.backend.register(bare_record(info), info.layout, owner or "",
                                     self.default_ttl if ttl is None else ttl)

    def heartbeat(self, key: str, owner: str | None = None) -> bool:
        """True when the registry still holds ``key`` (as ``owner``'s); False means register again."""
        return self.backend.heartbeat(key, owner or "")

    def deregister(self, key: str, owner: str | None = None) -> None:
        self.backend.deregister(key, owner or "")

    # -- reads ------------------------------------------------------------------------------
    def health(self, instance: str | None = None) -> dict:
        return self.backend.health(instance)

    def instances(self) -> list[str]:
        """The names of the prefill instances registered now."""
        return self.backend.instances()

    def topology(self, instance: str | None = None) -> tuple[bool, list[RankInfo]]:
        """(ready, the prefill ranks of ``instance`` (None: every one)), read now. A layout that went
        between reading the records and reading it (its last rank deregistered) means the snapshot
        is stale: it is read again, up to three times."""
        for _ in range(2):
            snap = self.backend.snapshot(instance or WHOLE)
            try:
                return snap.ready, self.ranks_of(snap)
            except ConnectError as e:
                if not transient(e):
                    raise
        snap = self.backend.snapshot(instance or WHOLE)
        return snap.ready, self.ranks_of(snap)

    def changes(self, since: Mapping[str, int], wait: float, ready: bool = False) -> dict[str, Snapshot]:
        """The instances of ``since`` whose version passed the one given (-1: any), as snapshots; the
        registry holds the call up to ``wait`` seconds for a change (``ready``: and for the instance
        to be complete) and answers {} when nothing changed. ``ranks_of`` reads a snapshot."""
        return self.backend.changes(since, wait, ready)

    def wait_ready(self, timeout: float = 60.0, instance: str | None = None) -> list[RankInfo]:
        """Block until every expected rank (of ``instance``; None: of the registry) registered; the
        prefill ranks. The registry holds each request until then; an unreachable registry is asked
        again with backoff until ``timeout``."""
        name = instance or WHOLE
        back = Backoff(time.monotonic() + timeout, cap=1.0)
        while True:
            try:
                snap = self.changes({name: 0}, min(max(back.left(), 0.0), WAIT_SLICE), ready=True).get(name)
                if snap is not None and snap.ready and snap.records:
                    return self.ranks_of(snap)
                if back.left() <= 0:
                    raise ConnectError(f"bootstrap {self.url} not ready after {timeout}s: {self.health_or_error()}")
                continue
            except ConnectError as e:
                if not transient(e):
                    raise
                if not back.sleep():
                    raise ConnectError(f"bootstrap {self.url} not ready after {timeout}s: {e}") from None

    def ranks_of(self, snap: Snapshot) -> list[RankInfo]:
        """The records of ``snap`` as ``RankInfo``s, each with its layout (fetched once per digest and
        checked against it); ConnectError naming the first invalid record."""
        out = []
        for rec in snap.records:
            digest = rec.get("layout_digest")
            if not is_digest(digest):
                raise ConnectError(f"bootstrap {self.url}: a record of {snap.instance or 'the registry'} names "
                                   f"no layout digest")
            try:
                bare = RankInfo.from_dict({k: v for k, v in rec.items() if k != "layout_digest"})
            except ValueError as e:
                raise ConnectError(f"bootstrap {self.url}: the registry holds an invalid rank record: {e}") from None
            out.append(dataclasses.replace(bare, layout=self._layout(digest)))
        return out

    def _layout(self, digest: str) -> Mapping:
        with self._lock:
            hit = self._layouts.get(digest)
            if hit is not None:
                self._layouts.move_to_end(digest)
                return hit
        raw = self.backend.layout(digest)
        if digest_of(raw) != digest:
            raise ConnectError(f"bootstrap {self.url}: layout {digest[:16]}... does not match its digest")
        try:
            layout = json.loads(raw)
            check_layout_record(layout)
        except (ValueError, RecursionError) as e:
            raise ConnectError(f"bootstrap {self.url}: layout {digest[:16]}... is invalid: {e}") from None
        with self._lock:
            self._layouts[digest] = layout
            while len(self._layouts) > LAYOUTS_CACHED:
                self._layouts.popitem(last=False)
        return layout

    def health_or_error(self) -> str:
        try:
            return json.dumps(self.health())
        except ConnectError as e:
            return str(e)

    @property
    def bytes_read(self) -> int:
        """Bytes this client read from its registry so far (answers: status lines, headers, bodies)."""
        return self.backend.link.received

    def interrupt(self) -> None:
        """Any thread: end a held ``changes`` call now (it raises a transient ConnectError)."""
        self.backend.interrupt()

    def close(self) -> None:
        self.backend.close()


class Registration:
    """A prefill rank's registration, kept alive by heartbeats from a daemon thread (one kept-alive
    connection; with etcd, the keep-alive of its lease). It owns its key (a random ``owner`` token
    sent with every write; with etcd, its lease): another process cannot replace or delete it while
    it lives. ``start`` tries until ``timeout`` (default 3 x ``ttl``) through every transient failure
    (the registry unreachable or busy, a predecessor's registration of the same key still held),
    with backoff and jitter, then fails loudly; a refusal that will not change fails at once.

    The embedded registry hands the key over before the predecessor's registration expires once that
    predecessor is provably gone: silent for ``BootstrapConfig.takeover_silence`` (ttl / 2: a live
    rank heartbeats every ttl / 3) and its control address refuses connections (nothing listens
    there). A predecessor that still heartbeats is never replaced. With etcd the key follows the
    lease: it is free once the predecessor's lease expired (etcd's own TTL: 30 s unless ``ttl``
    says otherwise, so a rank restarted at once registers up to 30 s after its predecessor's last
    keep-alive).

    ``state``: "starting", "registered", "expired" (registering again) or "taken" (another owner
    has the key: logged as an error, counted in ``kvxfer_registrations_lost{why}``)."""

    def __init__(self, client: BootstrapClient, info: RankInfo, interval: float | None = None,
                 ttl: float | None = None):
        self.client, self.info = client, info
        self.ttl = client.default_ttl if ttl is None else ttl      # None: the registry's default
        self.interval = self.ttl / 3 if interval is None else interval
        self.owner = os.urandom(16).hex()
        self.key: str | None = None
        self.state = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout: float | None = None) -> "Registration":
        back = Backoff(time.monotonic() + (3 * self.ttl if timeout is None else timeout), cap=min(1.0, self.ttl / 4))
        while True:
            try:
                self.key = self.client.register(self.info, self.owner, self.ttl)
                break
            except ConnectError as e:
                if not transient(e) or not back.sleep():
                    raise
                log.debug("registering %s: %s (trying again)", self.info.spec.key, e)
        self.state = "registered"
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        back = Backoff(float("inf"), cap=min(1.0, self.interval))
        pause = self.interval
        while not self._stop.wait(pause):
            try:
                self._beat()
                back.tries, pause = 0, self.interval
            except ConnectError as e:   # the registry may be restarting or busy: try again soon
                if "another owner" in str(e):
                    if self.state != "taken":
                        log.error("bootstrap %s gave the key of %s to another owner while this rank lives: decode "
                                  "ranks are sent elsewhere; trying to take it back every %.1fs", self.client.url,
                                  self.info.spec.key, self.interval)
                        record_registration_lost("taken")
                    self.state = "taken"
                    pause = self.interval
                else:
                    log.warning("heartbeat for %s failed: %s", self.info.spec.key, e)
                    pause = back.pause()

    def _beat(self) -> None:
        if self.state == "registered" and self.client.heartbeat(self.key, self.owner):
            return
        if self.state == "registered":
            log.warning("bootstrap %s forgot %s (its registration expired): registering again",
                        self.client.url, self.info.spec.key)
            record_registration_lost("expired")
            self.state = "expired"
        self.key = self.client.register(self.info, self.owner, self.ttl)
        self.state = "registered"

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + self.client.timeout)
        if deregister and self.key is not None:
            try:
                self.client.deregister(self.key, self.owner)
            except ConnectError:
                pass


__all__ = ["BootstrapClient", "Registration"]
