"""Prometheus metrics and per-request log lines.

The control plane calls ``record_transfer`` when a transfer completes (prefill, as it reaps
the handle) and ``record_request_end`` once per request end on each side; offload calls
``record_offload``. Both run on the control plane's threads, outside the endpoint lock, and
cost a few microseconds: labelled children are cached, and the log line is only formatted
when INFO is enabled for ``kvxfer.request``.
``start_exporter(port)`` serves them over HTTP for a Prometheus scrape (optional).
Metrics live in a registry of their own so tests and several ranks in one process
never collide with an application's default registry.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

log = logging.getLogger("kvxfer.request")

REGISTRY = CollectorRegistry(auto_describe=True)

BYTES_MOVED = Counter("kvxfer_bytes_moved", "KV bytes moved by transfers", ["transport", "role"],
                      registry=REGISTRY)
TRANSFER_SECONDS = Histogram("kvxfer_transfer_seconds", "Duration of one transfer, submit to confirmed",
                             ["transport"], registry=REGISTRY,
                             buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
RUNS_PER_TRANSFER = Histogram("kvxfer_runs_per_transfer", "Byte runs in one transfer plan", ["transport"],
                              registry=REGISTRY, buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144))
REQUESTS = Counter("kvxfer_requests", "Requests by end state and failure reason", ["role", "state", "reason"],
                   registry=REGISTRY)
OFFLOAD_BYTES = Counter("kvxfer_offload_bytes", "Bytes offloaded to or reloaded from host", ["direction"],
                        registry=REGISTRY)


STAGING_FRAMES = Gauge("kvxfer_staging_frames", "Staging ring frames allocated (all transports of the process)",
                       ["transport"], registry=REGISTRY)
STAGING_IN_USE = Gauge("kvxfer_staging_in_use", "Staging ring frames in use", ["transport"], registry=REGISTRY)
STAGING_WAITS = Counter("kvxfer_staging_waits", "Times an I/O path waited for a free staging frame (ring exhausted)",
                        ["transport"], registry=REGISTRY)
PREGRANTED_BYTES = Gauge("kvxfer_pregranted_bytes", "Receive memory pregranted to peers (eager writes) and not yet "
                         "fenced, all transports of the process", registry=REGISTRY)
PREGRANTED_REQUESTS = Gauge("kvxfer_pregranted_requests", "Requests pregranted to peers and not yet fenced (one "
                            "per request and peer)", registry=REGISTRY)


REGISTRATIONS_LOST = Counter("kvxfer_registrations_lost", "Times a rank found its registry key expired (registered "
                             "again) or taken by another owner", ["why"], registry=REGISTRY)


def record_registration_lost(why: str) -> None:
    """A ``Registration`` found its key gone: ``why`` is "expired" (registered again) or "taken"."""
    REGISTRATIONS_LOST.labels(why).inc()


_children: dict[tuple, Any] = {}       # label values -> labelled metric children (hot path)
_VARIABLE = re.compile(r"\S*/\S*|\d+")   # peer keys, rooms, counts: kept out of the reason label


def reason_label(reason: str) -> str:
    """A bounded label for a failure reason: its head (before the first colon), peer keys and
    numbers replaced by ``*`` ("decode rank */dp0/... lost" and room numbers do not explode it)."""
    return _VARIABLE.sub("*", reason.split(":", 1)[0])[:60] if reason else ""


def record_transfer(transport: str, role: str, nbytes: int, runs: int, seconds: float) -> None:
    key = ("transfer", transport, role)
    c = _children.get(key)
    if c is None:
        c = _children[key] = (BYTES_MOVED.labels(transport, role), TRANSFER_SECONDS.labels(transport),
                              RUNS_PER_TRANSFER.labels(transport))
    c[0].inc(nbytes)
    c[1].observe(seconds)
    c[2].observe(runs)


def record_request_end(role: str, room: int | str, outcome, reason: str = "", *, peers: str = "",
                       nbytes: int = 0, seconds: float = 0.0) -> None:
    """One call per request end: counts it under ``state`` = the outcome's value (an
    ``kvxfer.endpoint.Outcome``: success / failed / timed_out / aborted; a plain string is taken
    as is) and writes the per-request log line."""
    state = getattr(outcome, "value", outcome)
    key = ("request", role, state, reason_label(reason))
    c = _children.get(key)
    if c is None:
        c = _children[key] = REQUESTS.labels(*key[1:])
    c.inc()
    log.info("room=%s role=%s peers=%s bytes=%d duration_ms=%.2f state=%s%s", room, role, peers, nbytes,
             seconds * 1e3, state, f" reason={reason!r}" if reason else "")


def record_offload(direction: str, nbytes: int) -> None:
    OFFLOAD_BYTES.labels(direction).inc(nbytes)


def record_pregrant(nbytes: int, requests: int) -> None:
    """A receiver's pregrants (``transports/ucx/eager.py``): memory and requests pregranted to a
    peer (+) or fenced (-). Each peer's window bounds its part (``Transport.fencing()``)."""
    PREGRANTED_BYTES.inc(nbytes)
    PREGRANTED_REQUESTS.inc(requests)


def record_staging(transport: str, *, frames: int = 0, in_use: int = 0, waits: int = 0) -> None:
    """A staging ring's changes (``kvxfer.transport.kit.StagingPool``): frames allocated (+) or
    freed (-), frames taken (+) or given back (-), waits for a free frame."""
    key = ("staging", transport)
    c = _children.get(key)
    if c is None:
        c = _children[key] = (STAGING_FRAMES.labels(transport), STAGING_IN_USE.labels(transport),
                              STAGING_WAITS.labels(transport))
    if frames:
        c[0].inc(frames)
    if in_use:
        c[1].inc(in_use)
    if waits:
        c[2].inc(waits)


def start_exporter(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the metrics at http://addr:port/metrics (a daemon thread)."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def render() -> bytes:
    return generate_latest(REGISTRY)
