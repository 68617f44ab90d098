"""Prometheus metrics and per-request log lines.

The control plane calls ``record_transfer`` when a transfer completes and
``record_request_end`` once per request end; offload calls ``record_offload``.
``start_exporter(port)`` serves them over HTTP for a Prometheus scrape (optional).
Metrics live in a registry of their own so tests and several ranks in one process
never collide with an application's default registry.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

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


def record_transfer(transport: str, role: str, nbytes: int, runs: int, seconds: float) -> None:
    BYTES_MOVED.labels(transport, role).inc(nbytes)
    TRANSFER_SECONDS.labels(transport).observe(seconds)
    RUNS_PER_TRANSFER.labels(transport).observe(runs)


def record_request_end(role: str, room: str, state: str, reason: str = "", *, peers: str = "",
                       nbytes: int = 0, seconds: float = 0.0) -> None:
    """One call per request end: counts it and writes the per-request log line."""
    REQUESTS.labels(role, state, reason.split(":")[0][:60]).inc()
    log.info("room=%s role=%s peers=%s bytes=%d duration_ms=%.2f state=%s%s", room, role, peers, nbytes,
             seconds * 1e3, state, f" reason={reason!r}" if reason else "")


def record_offload(direction: str, nbytes: int) -> None:
    OFFLOAD_BYTES.labels(direction).inc(nbytes)


def start_exporter(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the metrics at http://addr:port/metrics (a daemon thread)."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def render() -> bytes:
    return generate_latest(REGISTRY)
