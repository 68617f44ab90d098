"""A decode endpoint's live view of one registry: the records of the prefill instances it uses,
kept current by one call the registry holds until something changed (``BootstrapClient.changes``:
the embedded registry's ``/watch``, or an etcd watch). No polling: with nothing changing, a decode
rank sends one small request per ``WAIT`` seconds and reads a few hundred bytes back.

Who calls what: ``PeerRecovery`` (``kvxfer.endpoint.recovery``) makes one ``RegistryWatch`` per
registry URL its endpoint uses, tells it which instances to follow (``follow``, any thread, never
blocks), reads ``view()`` on each pass (never blocks), and ``stop``s it at close. The watch's own
daemon thread calls the registry and then ``on_change()`` (the recovery thread's poke) after each
answer that changed something.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import ConnectError
from .client import BootstrapClient
from .discovery import Backoff, transient
from .records import RankInfo

log = logging.getLogger("kvxfer.request")

WAIT = 25.0       # seconds one held call lasts (the embedded registry holds at most 30)
LAG = 0.2         # seconds a change may take to reach the view (the view is current as of now - LAG)
RETRY_CAP = 5.0   # seconds between tries at most while the registry is unreachable (with jitter)


class RegistryWatch:
    """The instances one decode endpoint follows on one registry (see the module docstring)."""

    def __init__(self, client: BootstrapClient, on_change: Callable[[], None], wait: float = WAIT):
        # a client of its own: ``follow`` cuts its held call, and no one else's
        self.client = BootstrapClient(client.url, client.secret, client.timeout, source=client.source)
        self.on_change, self.wait = on_change, wait
        self.reads = 0                                     # answers read from the registry
        self.healthy = False                               # the last call was answered
        # Since when the view may be stale (None: current, within ``LAG``): from the start until
        # the first answer, and from a failed call until the next answer.
        self._stale_since: float | None = time.monotonic()
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._versions: dict[str, int] = {}
        self._records: dict[str, dict[str, RankInfo]] = {}   # instance -> rank key -> record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-registry-watch", daemon=True)
        self._thread.start()

    def follow(self, names: set[str]) -> None:
        """Any thread, never blocks: follow exactly ``names`` from now on (a held call is cut short
        when an instance was added, so that it is read at once)."""
        with self._lock:
            added = names - self._names
            self._names = set(names)
            for gone in set(self._versions) - names:
                self._versions.pop(gone, None)
                self._records.pop(gone, None)
        if added:
            self.client.interrupt()

    @property
    def bytes_read(self) -> int:
        """Bytes read from the registry by this watch so far."""
        return self.client.bytes_read

    def view(self) -> tuple[dict[str, RankInfo], float]:
        """(every followed prefill rank's record by key, the time the view is current as of). While
        the registry does not answer (a restarting prefill engine's embedded registry, a cut), the
        view is current only as of the failed call: a request that came later is not failed by a
        handshake the stale view led to (``PeerRecovery``: ``read_at``); the next answer is awaited."""
        with self._lock:
            records = {k: r for recs in self._records.values() for k, r in recs.items()}
            stale = self._stale_since
        return records, time.monotonic() - LAG if stale is None else stale - LAG

    def stop(self) -> None:
        self._stop.set()
        self.client.interrupt()
        if self._thread is not threading.current_thread():
            self._thread.join(self.client.timeout + 1.0)
        self.client.close()

    def _run(self) -> None:
        back = Backoff(float("inf"), base=0.1, cap=RETRY_CAP)
        while not self._stop.is_set():
            with self._lock:
                since = {n: self._versions.get(n, -1) for n in self._names}
            if not since:
                self._stop.wait(0.1)
                continue
            try:
                snaps = self.client.changes(since, self.wait)
                got = {n: {r.spec.key: r for r in self.client.ranks_of(s) if r.spec.role == "prefill"}
                       for n, s in snaps.items()}
            except ConnectError as e:
                if self._stop.is_set():
                    return
                with self._lock:
                    cut = any(n not in since for n in self._names)   # interrupted to add an instance
                if cut:
                    continue
                with self._lock:
                    if self._stale_since is None:
                        self._stale_since = time.monotonic()
                self.healthy = False
                log.debug("registry watch on %s: %s", self.client.url, e)
                if not transient(e):
                    log.warning("registry %s: %s", self.client.url, e)
                self._stop.wait(back.pause())
                continue
            except Exception:   # a bug: logged, the thread lives (recovery keeps the records it had)
                log.exception("registry watch on %s failed", self.client.url)
                self._stop.wait(RETRY_CAP)
                continue
            back.tries, self.healthy = 0, True
            self.reads += 1
            with self._lock:
                for n, s in snaps.items():
                    if n in self._names:
                        self._versions[n], self._records[n] = s.version, got[n]
                self._stale_since = None
            if snaps:
                self.on_change()


__all__ = ["RegistryWatch", "WAIT", "LAG"]
