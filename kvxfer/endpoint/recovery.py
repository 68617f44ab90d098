"""Decode side: learn from the registry when a prefill rank is lost or replaced, and handshake
with the replacement without a restart.

Who calls what, and when
------------------------
``DecodeEndpoint`` starts one ``PeerRecovery`` (a daemon thread) once its first prefill instance
answered its handshake, and ``DecodeEndpoint.close`` stops it. It watches every instance the
endpoint handshook with, each against its own registry. The endpoint calls
``poke()`` (any thread, never blocks) when a prefill rank went silent (``on_peer_lost``) or a
request failed: the thread then re-reads the registry at once, at most every ``MIN_GAP``
seconds; without a poke it re-reads every ``Timeouts.registry`` seconds.

The thread, per pass, reads each instance's registry (``DecodeEndpoint.registries()``) and, for
every prefill rank the endpoint handshook with (``DecodeEndpoint.known_peers()``), compares the
registry's record with the one it handshook with:

- a different record (a restarted rank: a new port, a new transport id): the rank was replaced;
  ``DecodeEndpoint.rejoin(key, record, replaced=True)`` fails what was running with the old one,
  connects the control channel to the new address and says HELLO again;
- the same record (or none: the registry is restarting, or unreachable) for a rank the endpoint
  marked lost: ``rejoin(key, record, replaced=False)`` tries a fresh HELLO (a silent rank that
  came back, a healed link), at most every ``retry`` seconds per rank;
- a rank absent from the registry that still answers heartbeats is left alone: a restarted
  bootstrap server forgets every rank until their heartbeats register them again.

``rejoin`` blocks (one HELLO round trip, at most ``REJOIN_HELLO`` seconds) and never raises; a
rank it could not reach stays lost (new requests to it fail at once, with the reason) and is
tried again later. The thread touches the endpoint only through these public methods.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from ..control.client import BootstrapClient
from ..control.records import RankInfo
from ..errors import ConnectError

log = logging.getLogger("kvxfer.request")

MIN_GAP = 0.5          # seconds between two registry reads, however often the endpoint pokes
REJOIN_HELLO = 1.0     # seconds one HELLO to a lost or replaced rank may take (close() waits for it)


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
        self.reads = 0                               # registry reads done (tests, metrics)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._retry_at: dict[str, float] = {}       # rank key -> earliest next rejoin after a failed one
        self._thread = threading.Thread(target=self._run, name="kvxfer-decode-recovery", daemon=True)

    def start(self) -> "PeerRecovery":
        self._thread.start()
        return self

    def poke(self) -> None:
        """Any thread, never blocks: re-read the registry soon (a peer went silent, a request failed)."""
        self._wake.set()

    def stop(self) -> None:
        """``DecodeEndpoint.close``, before the channel closes: the thread ends within one HELLO or
        one registry call."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(REJOIN_HELLO + 5.0 + 1.0)

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

    def _read(self, client: BootstrapClient | None, instance: str) -> dict[str, RankInfo]:
        if client is None:
            return {}
        try:
            _, ranks = client.topology(instance)
        except ConnectError as e:   # the registry may be restarting: keep what we know
            log.debug("registry re-read failed: %s", e)
            return {}
        finally:
            self.reads += 1
        return {r.spec.key: r for r in ranks if r.spec.role == "prefill"}

    def _pass(self) -> None:
        read_at = time.monotonic()   # requests that wait for a rank since before this read are answered by it
        registry: dict[str, RankInfo] = {}
        for instance, client in self.ep.registries().items():
            if self._stop.is_set():
                return
            registry.update(self._read(client, instance))
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


__all__ = ["PeerRecovery", "MIN_GAP", "REJOIN_HELLO"]
