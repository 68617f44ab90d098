"""Bootstrap: the rank registry that prefill ranks register with and decode ranks query.

HTTP + JSON (served by aiohttp) so that operators can ask it with curl. It stores plain
data only: who a rank is (``RankSpec``), where its control socket and data planes are,
and its layout description. It never sees KV bytes.

Who calls what, and when
------------------------
Operator, once:     ``kvxfer bootstrap --host H --port P [--expect N] [--ttl S] [--secret-file F]``,
                    or embedded in a prefill rank: ``BootstrapServer(BootstrapConfig(...)).start()``
                    (serves from a background thread) ... ``stop()``.
Prefill rank, at start-up (blocking, seconds at most):
                    ``Registration(client, info).start()``: registers, then heartbeats from a
                    daemon thread every ``ttl / 3`` and registers again if the server forgot it
                    (restart, expiry); ``stop()`` deregisters.
Decode rank, at start-up: ``BootstrapClient(url).wait_ready(timeout)`` -> the prefill ``RankInfo``s,
                    then the handshake (``kvxfer.handshake``) with the ranks it needs.
Operators, any time: ``curl http://H:P/health`` (200 ready / 503 not ready), ``curl http://H:P/topology``.

HTTP API (JSON bodies; the writes need ``X-KVXfer-Auth`` when the server has a secret)
    PUT    /register    RankInfo          200 {"key"} | 400 bad field | 401 auth | 409 conflicting sizes
    POST   /heartbeat   {"key"}           200 | 404 unknown or expired: register again
    DELETE /register    {"key"}           200
    GET    /health                        200 {"status": "ready"} | 503 {"status": "not ready", "missing"}
    GET    /topology[?instance=I]         200 {"ready", "expected", "ranks": [RankInfo, ...]}

Auth: ``X-KVXfer-Auth: <unix time>:<hex HMAC-SHA256(secret, "<time>\\n<METHOD>\\n<path>\\n" + body)>``,
accepted within ``AUTH_SKEW`` seconds. Reads stay open so operators can curl them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from ..errors import ConnectError
from ..ranks import RankInfo
from .auth import AUTH_HEADER, as_secret, check_http

log = logging.getLogger("kvxfer.control.bootstrap")


MAX_BODY = 8 << 20      # a 128-layer page-major layout is ~100 KB of JSON; leave room


# ------------------------------------------------------------------------------------
# The registry (pure state; the server calls it from its event-loop thread)
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapConfig:
    host: str = "127.0.0.1"
    port: int = 0                     # 0: pick a free port (see BootstrapServer.url)
    ttl: float = 10.0                 # a registration expires this long after its last heartbeat
    expect: int | None = None         # ranks to wait for; None: tp_size * pp_size * dp_size per instance
    secret: bytes | None = None       # HMAC key for writes; None: open registry (trusted network only)

    def __post_init__(self):
        if self.ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {self.ttl}")
        if self.expect is not None and self.expect < 1:
            raise ValueError(f"expect must be >= 1 ranks, got {self.expect}")


class Registry:
    """Live registrations keyed by ``RankSpec.key``; expiry by heartbeat age."""

    def __init__(self, ttl: float, expect: int | None = None):
        self.ttl, self.expect = ttl, expect
        self._ranks: dict[str, tuple[RankInfo, float]] = {}

    def expire(self, now: float) -> list[str]:
        gone = [k for k, (_, seen) in self._ranks.items() if now - seen > self.ttl]
        for k in gone:
            log.warning("registration %s expired: no heartbeat for %.1fs", k, self.ttl)
            del self._ranks[k]
        return gone

    def register(self, info: RankInfo, now: float) -> str:
        """Add or replace a registration; ValueError (-> 409) when sizes disagree with the instance."""
        self.expire(now)
        s = info.spec
        for other, _ in self._ranks.values():
            o = other.spec
            if o.instance == s.instance and o.key != s.key and \
                    (o.role, o.tp_size, o.pp_size, o.dp_size) != (s.role, s.tp_size, s.pp_size, s.dp_size):
                raise ValueError(f"{s.key} registers role {s.role} with tp/pp/dp sizes {s.tp_size}/{s.pp_size}/"
                                 f"{s.dp_size} but {o.key} registered {o.role} {o.tp_size}/{o.pp_size}/{o.dp_size}")
        self._ranks[s.key] = (info, now)
        return s.key

    def heartbeat(self, key: str, now: float) -> bool:
        self.expire(now)
        if key not in self._ranks:
            return False
        self._ranks[key] = (self._ranks[key][0], now)
        return True

    def remove(self, key: str) -> bool:
        return self._ranks.pop(key, None) is not None

    def ranks(self, now: float, instance: str | None = None) -> list[RankInfo]:
        self.expire(now)
        return [i for i, _ in sorted(self._ranks.values(), key=lambda x: x[0].spec.key)
                if instance is None or i.spec.instance == instance]

    def missing(self, now: float) -> tuple[int, list[str]]:
        """(ranks expected, keys still missing). Sizes come from the registrations themselves."""
        ranks = self.ranks(now)
        if self.expect is not None:
            return self.expect, [f"{self.expect - len(ranks)} more rank(s)"] if len(ranks) < self.expect else []
        if not ranks:
            return 0, ["any rank: nothing registered yet"]
        present = {i.spec.key for i in ranks}
        want: set[str] = set()
        for i in ranks:
            s = i.spec
            want |= {f"{s.instance}/dp{d}/pp{p}/tp{t}" for d in range(s.dp_size) for p in range(s.pp_size)
                     for t in range(s.tp_size)}
        return len(want), sorted(want - present)


# ------------------------------------------------------------------------------------
# The HTTP server
# ------------------------------------------------------------------------------------
class BootstrapServer:
    """The registry behind aiohttp, in a background thread (``start``/``stop``) or in the
    foreground (``serve_forever``, what ``kvxfer bootstrap`` runs)."""

    def __init__(self, config: BootstrapConfig = BootstrapConfig()):
        self.config = config
        self.registry = Registry(config.ttl, config.expect)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    # -- handlers (event-loop thread) -----------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        if self.config.secret is not None:
            why = check_http(self.config.secret, request.headers.get(AUTH_HEADER), request.method,
                             request.path, raw)
            if why:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, why)
                raise web.HTTPUnauthorized(text=json.dumps({"error": why}), content_type="application/json")
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _bad("body is not JSON") from None
        if not isinstance(body, dict):
            raise _bad("body must be a JSON object")
        return body

    async def _register(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            info = RankInfo.from_dict(body)
            if info.spec.role != "prefill":
                raise ValueError("only prefill ranks register; decode ranks look up")
        except ValueError as e:
            raise _bad(str(e)) from None
        try:
            key = self.registry.register(info, time.monotonic())
        except ValueError as e:
            raise web.HTTPConflict(text=json.dumps({"error": str(e)}), content_type="application/json") from None
        log.info("registered %s (control %s)", key, info.control)
        return web.json_response({"key": key})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        key = str((await self._body(request)).get("key", ""))
        if not self.registry.heartbeat(key, time.monotonic()):
            raise web.HTTPNotFound(text=json.dumps({"error": f"{key} is not registered (expired?)"}),
                                   content_type="application/json")
        return web.json_response({"key": key})

    async def _deregister(self, request: web.Request) -> web.Response:
        key = str((await self._body(request)).get("key", ""))
        return web.json_response({"key": key, "removed": self.registry.remove(key)})

    async def _health(self, request: web.Request) -> web.Response:
        expected, missing = self.registry.missing(time.monotonic())
        n = len(self.registry.ranks(time.monotonic()))
        if missing:
            return web.json_response({"status": "not ready", "registered": n, "expected": expected,
                                      "missing": missing}, status=503)
        return web.json_response({"status": "ready", "registered": n, "expected": expected})

    async def _topology(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        instance = request.query.get("instance")
        expected, missing = self.registry.missing(now)
        return web.json_response({"ready": not missing, "expected": expected, "missing": missing,
                                  "ranks": [i.to_dict() for i in self.registry.ranks(now, instance)]})

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([web.put("/register", self._register), web.delete("/register", self._deregister),
                        web.post("/heartbeat", self._heartbeat), web.get("/health", self._health),
                        web.get("/topology", self._topology)])
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        self.port = int(self._runner.addresses[0][1])

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
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()
            self._stopped.set()

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
        print(f"kvxfer bootstrap listening on {self.url} (ttl {self.config.ttl}s, "
              f"auth {'on' if self.config.secret else 'off'})", flush=True)
        while not done.wait(0.5):
            pass
        self.stop()

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()


def _bad(why: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": why}), content_type="application/json")


# ------------------------------------------------------------------------------------
# kvxfer bootstrap
# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bootstrap", description="run the rank registry (HTTP + JSON)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8998)
    ap.add_argument("--ttl", type=float, default=10.0, help="seconds a registration lives without heartbeat")
    ap.add_argument("--expect", type=int, default=None, help="ranks to wait for (default: from their sizes)")
    ap.add_argument("--secret-file", default=None, help="file holding the shared HMAC secret")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = None
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = as_secret(f.read().strip())
    try:
        BootstrapServer(BootstrapConfig(host=args.host, port=args.port, ttl=args.ttl, expect=args.expect,
                                        secret=secret)).serve_forever()
    except ConnectError as e:
        print(f"kvxfer bootstrap: {e}")
        return 1
    return 0
