"""Decode side: learn from the registry when a prefill rank is lost or replaced, and handshake
with the replacement without a restart.

Who calls what, and when
------------------------
``DecodeEndpoint`` starts one ``PeerRecovery`` (a daemon thread) once its first prefill instance
answered its handshake, and ``DecodeEndpoint.close`` stops it. It follows every instance the
endpoint handshook with, each on its own registry, through one ``RegistryWatch`` per registry
(``kvxfer.control.watch``: a call the registry holds until something changed, so the view is
current without re-reading anything). The endpoint calls ``poke()`` (any thread, never blocks)
when a prefill rank went silent (``on_peer_lost``) or a request failed: the thread then looks at
once, at most every ``MIN_GAP`` seconds; a watch pokes it when the registry changed; without
either it looks every ``Timeouts.registry`` seconds (no network: the view is kept current).

The thread, per pass, takes each registry's view (instances from ``DecodeEndpoint.registries()``)
and, for every prefill rank the endpoint handshook with (``DecodeEndpoint.known_peers()``),
compares the registry's record with the one it handshook with:

- a different record (a restarted rank: a new port, a new transport id): the rank was replaced;
  ``DecodeEndpoint.rejoin(key, record, replaced=True)`` fails what was running with the old one,
  connects the control channel to the new address and says HELLO again;
- the same record (or none: the registry is restarting, or unreachable) for a rank the endpoint
  marked lost: ``rejoin(key, record, replaced=False)`` tries a fresh HELLO (a silent rank that
  came back, a healed link), at most every ``retry`` seconds per rank;
- a rank absent from the registry that still answers heartbeats is left alone: a restarted
  bootstrap server forgets every rank until their heartbeats register them again.

``rejoin`` blocks (one HELLO round trip, at most ``REJOIN_HELLO`` seconds, ``REPLACED_HELLO`` for a
replaced rank) and never raises; a rank it could not reach stays lost (new requests to it fail at
once, with the reason) and is tried again later. ``read_at`` (what a failed rejoin may fail) is
the time the views are current as of. The thread touches the endpoint only through these public methods.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from ..control.client import BootstrapClient
from ..control.records import RankInfo
from ..control.watch import RegistryWatch

log = logging.getLogger("kvxfer.request")

MIN_GAP = 0.5          # seconds between two registry reads, however often the endpoint pokes
REJOIN_HELLO = 1.0     # seconds one HELLO to a lost rank (the registry's record unchanged) may take
# ... and to a replaced one: the registry holds its new record, so it is alive, maybe still starting
# or on a loaded host, and a request waiting for it fails if this HELLO does (CI, a loaded 2-core
# machine: the first request after a vLLM prefill engine's restart failed; a slow first answer is
# the cause the code allows, ``test_recovery.py``'s slow-rank case).
REPLACED_HELLO = 5.0   # close() waits for either


class RejoiningEndpoint(Protocol):
    """What the recovery thread uses of its ``DecodeEndpoint`` (a Protocol: no import cycle)."""
    @property
    def lost_peers(self) -> dict[str, str]: ...

    def registries(self) -> dict[str, BootstrapClient | None]: ...

    def known_peers(self) -> dict[str, RankInfo]: ...

    def rejoin(self, key: str, info: RankInfo, *, replaced: bool, read_at: float) -> bool: ...

    def break_endpoint(self, why: str) -> None: ...


class PeerRecovery:
    """The thread that watches the registry for one decode endpoint (see the module docstring)."""

    def __init__(self, ep: RejoiningEndpoint, interval: float, retry: float):
        self.ep = ep
        self.interval, self.retry = interval, retry
        self._wake, self._stop = threading.Event(), threading.Event()
        self._retry_at: dict[str, float] = {}       # rank key -> earliest next rejoin after a failed one
        self._watches: dict[str, RegistryWatch] = {}   # registry URL -> its watch
        self._thread = threading.Thread(target=self._run, name="kvxfer-decode-recovery", daemon=True)

    @property
    def reads(self) -> int:
        """Answers read from the registries so far (tests, metrics)."""
        return sum(w.reads for w in list(self._watches.values()))

    @property
    def bytes_read(self) -> int:
        """Bytes read from the registries so far (tests, benches)."""
        return sum(w.bytes_read for w in list(self._watches.values()))

    def start(self) -> "PeerRecovery":
        self._wake.set()       # the first pass at once: it starts the watches
        self._thread.start()
        return self

    def poke(self) -> None:
        """Any thread, never blocks: look again soon (a peer went silent, a request failed, the
        registry changed)."""
        self._wake.set()

    def stop(self) -> None:
        """``DecodeEndpoint.close``, before the channel closes: the thread ends within one HELLO, and
        the watches with their held calls."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(max(REJOIN_HELLO, REPLACED_HELLO) + 5.0 + 1.0)
        for w in list(self._watches.values()):
            w.stop()

    def _run(self) -> None:
        last = 0.0
        try:
            while not self._stop.is_set():
                self._wake.wait(self.interval if not self.ep.lost_peers else min(self.interval, self.retry))
                self._wake.clear()
                gap = last + MIN_GAP - time.monotonic()
                if gap > 0 and self._stop.wait(gap):
                    return
                if self._stop.is_set():
                    return
                last = time.monotonic()
                self._pass()
        except Exception as e:   # a bug here must not go unseen: the endpoint breaks, loudly
            log.exception("decode recovery thread died")
            self.ep.break_endpoint(f"recovery thread died: {e!r}")

    def _views(self) -> tuple[dict[str, RankInfo], float]:
        """Every followed prefill rank's record, and the time the views are current as of (a watch
        per registry URL, following the instances the endpoint uses there)."""
        wanted: dict[str, tuple[BootstrapClient, set[str]]] = {}
        for instance, client in self.ep.registries().items():
            if client is not None:
                wanted.setdefault(client.url, (client, set()))[1].add(instance)
        for url in set(self._watches) - set(wanted):
            self._watches.pop(url).stop()
        registry: dict[str, RankInfo] = {}
        read_at = time.monotonic()
        for url, (client, names) in wanted.items():
            w = self._watches.get(url)
            if w is None:
                w = self._watches[url] = RegistryWatch(client, self.poke)
            w.follow(names)
            records, as_of = w.view()
            registry.update(records)
            read_at = min(read_at, as_of)
        return registry, read_at

    def _pass(self) -> None:
        registry, read_at = self._views()   # requests that wait for a rank since before then are answered by it
        lost = self.ep.lost_peers
        now = time.monotonic()
        for key, known in self.ep.known_peers().items():
            if self._stop.is_set():
                return
            new = registry.get(key)
            replaced = new is not None and new.to_dict() != known.to_dict()
            if not replaced and key not in lost:
                continue
            if not replaced and now < self._retry_at.get(key, 0.0):   # a new registration is tried at once
                continue
            if self.ep.rejoin(key, new if new is not None else known, replaced=replaced, read_at=read_at):
                self._retry_at.pop(key, None)
            else:
                self._retry_at[key] = time.monotonic() + self.retry


__all__ = ["PeerRecovery", "MIN_GAP", "REJOIN_HELLO", "REPLACED_HELLO"]
