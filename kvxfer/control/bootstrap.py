"""Bootstrap: the embedded rank registry that prefill ranks register with and decode ranks query.

HTTP + JSON (served by aiohttp) so that operators can ask it with curl. It stores plain data
only: who a rank is (``RankSpec``), where its control socket and data planes are, and its layout
description (once per digest: every rank of an instance group shares one). It never sees KV
bytes. Large or highly available deployments can use etcd instead: give every rank
``etcd://host:2379[,host2:2379...]`` where they take a bootstrap URL (``kvxfer.control.client``).

Who calls what, and when
------------------------
Operator, once:     ``kvxfer bootstrap --host H --port P [--advertise A] [--expect N] [--ttl S]
                    [--secret-file F]``, or embedded in a prefill rank:
                    ``BootstrapServer(BootstrapConfig(...)).start()`` (serves from a background
                    thread) ... ``stop()``. ``url`` is the advertised address (never 0.0.0.0).
Prefill rank, at start-up: ``Registration(client, info).start()`` (``kvxfer.control.client``):
                    registers, then heartbeats from a daemon thread on one kept-alive connection.
Decode rank:        ``BootstrapClient(url).wait_ready(timeout, instance)`` (one request the server
                    holds until the instance is complete), then a watch of its instances
                    (``kvxfer.control.watch``: one request held until something changed).
Operators, any time: ``curl http://H:P/health`` (200 ready / 503 not ready), ``curl http://H:P/topology``.

The HTTP API and its bounds per request: ``kvxfer.control.bootstrap_api``; who may hold a
connection: ``kvxfer.control.admission``; the records: ``kvxfer.control.registry``; auth and
replays: ``kvxfer.control.auth``.

Sizes (``BootstrapConfig``): the defaults hold 1,024 ranks of an 80-layer FP8 page-major model with
scales (a 67 KB layout, stored once) many times over, and their connections: each rank heartbeats
on one connection and each decode rank watches on one, so 1,024 + 1,024 connections fit in
``max_connections`` with room for start-up bursts.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import threading
from dataclasses import dataclass

from aiohttp import web

from ..addresses import advertise_host
from ..errors import ConfigError, ConnectError
from .admission import Admission, Guard
from .auth import OPEN_DEPLOYMENT, as_secret
from .bootstrap_api import RegistryApi
from .discovery import REGISTRY_TTL
from .registry import Registry

log = logging.getLogger("kvxfer.control.bootstrap")

FD_SPARE = 256          # file descriptors kept for everything but client connections
MAX_CONNECTIONS = 4096  # default: 1,024 heartbeating ranks and 1,024 watching ones, and start-up bursts
# The accept queue holds connections admission has not seen yet, refused ones included: sized by
# max_connections, a flood of refused reconnects kept it full and the kernel dropped a live rank's
# SYN (its heartbeat then waited a 1 s SYN retry). The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapConfig:
    host: str = "127.0.0.1"           # where to bind ("0.0.0.0": every interface)
    port: int = 0                     # 0: pick a free port (see BootstrapServer.url)
    advertise: str | None = None      # address or interface name in ``url``; None: host, or a routable one
    ttl: float = REGISTRY_TTL         # a registration expires this long after its last heartbeat
    expect: int | None = None         # ranks to wait for; None: tp_size * pp_size * dp_size per instance
    secret: bytes | None = None       # HMAC key for writes; None: open registry (trusted network only)
    max_ranks: int = 4096             # registrations held at once
    max_record: int = 1 << 20         # bytes of one request body (one rank record, with its layout)
    max_total_bytes: int = 64 << 20   # bytes of every record and layout held
    max_connections: int = MAX_CONNECTIONS   # open connections (fewer when the file limit is lower)
    max_per_address: int = 64         # connections of one client address ...
    per_rank_connections: int = 4     # ... plus this many per rank registered from it
    reserved_connections: int | None = None   # kept for addresses with registered ranks (None: a quarter)
    header_timeout: float = 5.0       # seconds from a request's first byte to the end of its headers
    body_timeout: float = 10.0        # seconds to read a body (and to write each piece of an answer)
    idle_timeout: float = 30.0        # seconds a kept-alive connection may idle between requests
    max_wait: float = 30.0            # seconds one /watch may be held
    # A restarted rank takes its key over from a predecessor silent this long (None: ttl / 2, longer
    # than a live rank's default heartbeat period ttl / 3) whose control address refuses connections.
    takeover_silence: float | None = None
    probe_timeout: float = 1.0        # seconds to wait for that control address to answer or refuse

    def __post_init__(self):
        if self.ttl <= 0:
            raise ConfigError(f"ttl must be > 0 seconds, got {self.ttl}")
        if self.expect is not None and self.expect < 1:
            raise ConfigError(f"expect must be >= 1 ranks, got {self.expect}")
        if self.takeover_silence is not None and self.takeover_silence < 0:
            raise ConfigError(f"takeover_silence must be >= 0 seconds, got {self.takeover_silence}")
        for name in ("max_ranks", "max_record", "max_total_bytes", "max_connections", "max_per_address",
                     "header_timeout", "body_timeout", "idle_timeout", "max_wait", "probe_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.per_rank_connections < 0:
            raise ConfigError(f"per_rank_connections must be >= 0, got {self.per_rank_connections}")
        if self.reserved_connections is not None and not 0 <= self.reserved_connections < self.max_connections:
            raise ConfigError(f"reserved_connections must be in 0..max_connections-1, got {self.reserved_connections}")


def connection_budget(wanted: int) -> int:
    """Connections this process can hold: ``wanted``, or fewer when the file limit (raised to its
    hard limit as far as needed) leaves less room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_SPARE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    log.warning("bootstrap: the file limit %d holds %d connections, not max_connections %d: raise `ulimit -n`",
                soft, max(soft - FD_SPARE, 16), wanted)
    return max(soft - FD_SPARE, 16)


class BootstrapServer:
    """The registry behind aiohttp, in a background thread (``start``/``stop``) or in the
    foreground (``serve_forever``, what ``kvxfer bootstrap`` runs)."""

    def __init__(self, config: BootstrapConfig = BootstrapConfig()):
        self.config = config
        self.registry = Registry(config.ttl, config.expect, max_ranks=config.max_ranks,
                                 max_total_bytes=config.max_total_bytes)
        self.api = RegistryApi(config, self.registry)
        total = connection_budget(config.max_connections)
        reserved = total // 4 if config.reserved_connections is None else min(config.reserved_connections, total - 1)
        self.admission = Admission(max_connections=total, per_address=config.max_per_address,
                                   per_rank=config.per_rank_connections, reserved=reserved,
                                   registered=self.registry.by_remote)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.advertised = advertise_host(config.host, config.advertise, setting="BootstrapConfig.advertise")

    @property
    def url(self) -> str:
        """The advertised address: ``advertise``, or the bind host unless it is a wildcard."""
        h = self.advertised
        return f"http://{f'[{h}]' if ':' in h else h}:{self.port}"

    @property
    def open_connections(self) -> int:
        return self.admission.total

    @property
    def refused_connections(self) -> int:
        return self.admission.refused

    # -- lifecycle ------------------------------------------------------------------------
    async def _start(self) -> None:
        self._runner = web.AppRunner(self.api.app(), access_log=None, keepalive_timeout=self.config.idle_timeout,
                                     handle_signals=False, shutdown_timeout=0.25)   # stop(): held watches end now
        await self._runner.setup()
        factory = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Guard(self.admission, factory, self.config.header_timeout), self.config.host, self.config.port,
            reuse_address=True, backlog=LISTEN_BACKLOG)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._sweeper = asyncio.get_running_loop().create_task(self.api.sweep())

    async def _cleanup(self) -> None:
        self._server.close()
        self._sweeper.cancel()
        await self._runner.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:     # handlers of connections still open (slow clients, held watches): end them, quietly
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        self.api.close()

    def start(self, timeout: float = 10.0) -> "BootstrapServer":
        """Serve from a daemon thread; returns once the port is bound (``url`` is valid)."""
        ready, failure = threading.Event(), []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._start())
            except Exception as e:  # bind failure: report to the caller, not the thread
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="kvxfer-bootstrap", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            raise ConnectError(f"bootstrap server could not bind {self.config.host}:{self.config.port}: "
                               f"{failure[0] if failure else 'timed out'}")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def serve_forever(self) -> None:
        """Foreground: serve until SIGINT/SIGTERM."""
        self.start()
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        print(f"kvxfer bootstrap listening on {self.config.host}:{self.port}, advertised as {self.url} "
              f"(ttl {self.config.ttl}s, auth {'on' if self.config.secret else 'off'}, "
              f"{self.admission.max_connections} connections)", flush=True)
        while not done.wait(0.5):
            pass
        self.stop()

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()


# ------------------------------------------------------------------------------------
# kvxfer bootstrap
# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bootstrap", description="run the rank registry (HTTP + JSON)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    ap.add_argument("--advertise", default=None, help="address or interface name to advertise (default: --host, "
                                                      "or a routable interface address when --host is a wildcard)")
    ap.add_argument("--port", type=int, default=8998)
    ap.add_argument("--ttl", type=float, default=REGISTRY_TTL, help="seconds a registration lives without heartbeat")
    ap.add_argument("--expect", type=int, default=None, help="ranks to wait for (default: from their sizes)")
    ap.add_argument("--secret-file", default=None, help="file holding the shared HMAC secret")
    ap.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                    help="open client connections held at once")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = None
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = as_secret(f.read().strip())
    if secret is None:
        log.warning("kvxfer bootstrap: %s", OPEN_DEPLOYMENT)
    try:
        BootstrapServer(BootstrapConfig(host=args.host, port=args.port, advertise=args.advertise, ttl=args.ttl,
                                        expect=args.expect, secret=secret,
                                        max_connections=args.max_connections)).serve_forever()
    except (ConnectError, ValueError) as e:
        print(f"kvxfer bootstrap: {e}")
        return 1
    return 0
