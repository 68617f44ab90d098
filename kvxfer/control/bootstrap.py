"""Bootstrap: the rank registry that prefill ranks register with and decode ranks query.

HTTP + JSON (served by aiohttp) so that operators can ask it with curl. It stores plain
data only: who a rank is (``RankSpec``), where its control socket and data planes are,
and its layout description. It never sees KV bytes.

Who calls what, and when
------------------------
Operator, once:     ``kvxfer bootstrap --host H --port P [--advertise A] [--expect N] [--ttl S]
                    [--secret-file F]``, or embedded in a prefill rank:
                    ``BootstrapServer(BootstrapConfig(...)).start()`` (serves from a background
                    thread) ... ``stop()``. ``url`` is the advertised address (never 0.0.0.0).
Prefill rank, at start-up (blocking, seconds at most):
                    ``Registration(client, info).start()``: registers, then heartbeats from a
                    daemon thread every ``ttl / 3`` and registers again if the server forgot it
                    (restart, expiry); ``stop()`` deregisters.
Decode rank, at start-up: ``BootstrapClient(url).wait_ready(timeout, instance)`` -> the prefill
                    ``RankInfo``s of that instance once it is complete (readiness is per instance),
                    then the handshake (``kvxfer.control.handshake``) with the ranks it needs.
Operators, any time: ``curl http://H:P/health`` (200 ready / 503 not ready), ``curl http://H:P/topology``.

HTTP API (JSON bodies; the writes need ``X-KVXfer-Auth`` when the server has a secret)
    PUT    /register    RankInfo + "owner"   200 {"key"} | 400 bad field | 401 auth | 409 owned / sizes
    POST   /heartbeat   {"key", "owner"}     200 | 404 unknown, expired or not yours: register again
    DELETE /register    {"key", "owner"}     200 | 403 another owner's
    GET    /health[?instance=I]              200 {"status": "ready"} | 503 {"status": "not ready", "missing"}
    GET    /topology[?instance=I]            200 {"ready", "expected", "ranks": [RankInfo, ...]}

Auth and replays: see ``kvxfer.control.auth`` (time window + a nonce accepted once); ownership:
see ``kvxfer.control.registry``. Reads stay open so operators can curl them.

Bounds (``BootstrapConfig``): registrations (``max_ranks``), one record (``max_record``), all
records (``max_total_bytes``), open connections (``max_connections``), time to send the
headers (``header_timeout``) and the body (``body_timeout``); one request per connection.
A body that is not a flat enough JSON object is a 400 with a short reason, never a 500.
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
from ..ranks import split_address
from .addresses import advertise_host, is_loopback
from .auth import AUTH_HEADER, AUTH_SKEW, OPEN_DEPLOYMENT, as_secret, check_http
from .records import RankInfo
from .registry import KEY, OWNER, NonceCache, Registry, RegistryError

log = logging.getLogger("kvxfer.control.bootstrap")


MAX_BODY = 8 << 20      # a 128-layer page-major layout is ~100 KB of JSON; leave room
MAX_DEPTH = 32          # JSON nesting a record may have (a layout record is 3 deep)


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapConfig:
    host: str = "127.0.0.1"           # where to bind ("0.0.0.0": every interface)
    port: int = 0                     # 0: pick a free port (see BootstrapServer.url)
    advertise: str | None = None      # address or interface name in ``url``; None: host, or a routable one
    ttl: float = 10.0                 # a registration expires this long after its last heartbeat
    expect: int | None = None         # ranks to wait for; None: tp_size * pp_size * dp_size per instance
    secret: bytes | None = None       # HMAC key for writes; None: open registry (trusted network only)
    max_ranks: int = 4096             # registrations held at once
    max_record: int = 1 << 20         # bytes of one request body (one rank record)
    max_total_bytes: int = 64 << 20   # bytes of every record held
    max_connections: int = 256        # open connections; more are closed at once
    header_timeout: float = 5.0       # seconds from connect to the end of the request headers
    body_timeout: float = 10.0        # seconds to read the body
    # A restarted rank takes its key over from a predecessor silent this long (None: ttl / 2, longer
    # than a live rank's default heartbeat period ttl / 3) whose control address refuses connections.
    takeover_silence: float | None = None
    probe_timeout: float = 1.0        # seconds to wait for that control address to answer or refuse

    def __post_init__(self):
        if self.ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {self.ttl}")
        if self.expect is not None and self.expect < 1:
            raise ValueError(f"expect must be >= 1 ranks, got {self.expect}")
        if self.takeover_silence is not None and self.takeover_silence < 0:
            raise ValueError(f"takeover_silence must be >= 0 seconds, got {self.takeover_silence}")
        for name in ("max_ranks", "max_record", "max_total_bytes", "max_connections", "header_timeout",
                     "body_timeout", "probe_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


async def refuses(address: str, timeout: float) -> bool:
    """True when a connection to control ``address`` is refused: nothing listens there. False when
    it connects, or times out, or the network says anything else (a silent host is not a gone one)."""
    try:
        kind, host, port = split_address(address)
        if kind == "ipc":
            opened = asyncio.open_unix_connection(host)
        else:
            opened = asyncio.open_connection(host.strip("[]"), port)
        _, writer = await asyncio.wait_for(opened, timeout)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _depth_ok(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """JSON nesting at most ``limit`` (a cheap scan; brackets inside strings only overcount)."""
    depth = 0
    for b in raw.translate(None, _NOT_BRACKETS):
        if b in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


class _Guard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol: caps open connections and closes a connection
    whose request headers did not arrive within ``header_timeout`` (slow senders)."""

    def __init__(self, server: "BootstrapServer"):
        self.server, self.inner, self.transport, self.timer = server, None, None, None
        self.headers_done, self.tail = False, b""

    def connection_made(self, transport):
        self.transport = transport
        srv = self.server
        if srv.open_connections >= srv.config.max_connections:
            srv.refused_connections += 1
            transport.abort()
            return
        srv.open_connections += 1
        self.inner = srv.protocol_factory()
        self.inner.connection_made(transport)
        self.timer = asyncio.get_running_loop().call_later(srv.config.header_timeout, self._slow)

    def _slow(self):
        if not self.headers_done and self.transport is not None:
            self.server.refused_connections += 1
            self.transport.abort()

    def data_received(self, data):
        if self.inner is None:
            return
        if not self.headers_done:
            seen = self.tail + data[:65536]
            if b"\r\n\r\n" in seen:
                self.headers_done = True
                self.timer.cancel()
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc):
        if self.inner is None:
            return
        self.server.open_connections -= 1
        if self.timer is not None:
            self.timer.cancel()
        self.inner.connection_lost(exc)

    def pause_writing(self):
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self):
        if self.inner is not None:
            self.inner.resume_writing()


class BootstrapServer:
    """The registry behind aiohttp, in a background thread (``start``/``stop``) or in the
    foreground (``serve_forever``, what ``kvxfer bootstrap`` runs)."""

    def __init__(self, config: BootstrapConfig = BootstrapConfig()):
        self.config = config
        self.registry = Registry(config.ttl, config.expect, max_ranks=config.max_ranks,
                                 max_total_bytes=config.max_total_bytes)
        self.nonces = NonceCache(AUTH_SKEW)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.port: int | None = None
        self.open_connections = self.refused_connections = 0
        self.advertised = advertise_host(config.host, config.advertise, setting="BootstrapConfig.advertise")

    @property
    def url(self) -> str:
        """The advertised address: ``advertise``, or the bind host unless it is a wildcard."""
        h = self.advertised
        return f"http://{f'[{h}]' if ':' in h else h}:{self.port}"

    def protocol_factory(self):
        return self._runner.server()

    # -- handlers (event-loop thread) -----------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every failure is a short JSON error: never a traceback to the client or the log."""
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as e:
            log.warning("%s %s from %s failed: %s", request.method, request.path, request.remote, type(e).__name__)
            raise _error(web.HTTPBadRequest, f"request failed: {type(e).__name__}") from None

    async def _body(self, request: web.Request) -> tuple[dict, int]:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise _error(web.HTTPRequestTimeout, f"body not sent within {self.config.body_timeout}s") from None
        if self.config.secret is not None:
            why, nonce = check_http(self.config.secret, request.headers.get(AUTH_HEADER), request.method,
                                    request.path, raw)
            why = why or self.nonces.admit(nonce, time.time())
            if why:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, why)
                raise _error(web.HTTPUnauthorized, why)
        if not _depth_ok(raw):
            raise _bad(f"body nests deeper than {MAX_DEPTH}")
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            raise _bad("body is not JSON") from None
        if not isinstance(body, dict):
            raise _bad("body must be a JSON object")
        return body, len(raw)

    @staticmethod
    def _owner(body: dict) -> str:
        owner = body.pop("owner", "")
        if owner != "" and (not isinstance(owner, str) or not OWNER.fullmatch(owner)):
            raise _bad(f"field 'owner' must match {OWNER.pattern}")
        return owner

    @staticmethod
    def _key(body: dict) -> str:
        key = body.get("key", "")
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise _bad(f"field 'key' must be a rank key like default/dp0/pp0/tp0, got {str(key)[:80]!r}")
        return key

    def _reachable(self, request: web.Request, info: RankInfo) -> None:
        """A rank on another host must not advertise loopback (control address, or a tcp:// data
        endpoint in a transport descriptor): its peers there could not reach it."""
        if request.remote is None or is_loopback(request.remote, resolve=False):
            return
        tried = [("control", info.control)] if info.control else []
        tried += [(f"data.{name}.{k}", v) for name, d in info.data.items() for k, v in d.items()
                  if isinstance(v, str) and v.startswith(("tcp://", "ipc://"))]
        for field, address in tried:
            try:
                kind, host, _ = split_address(address)
            except ValueError:
                continue
            if kind == "ipc" or is_loopback(host, resolve=False):
                raise _bad(f"{info.spec.key} registers from {request.remote} but advertises {field} {address}, "
                           f"which peers on other hosts cannot reach: start the rank with a routable host / "
                           f"advertise address")

    async def _register(self, request: web.Request) -> web.Response:
        if (request.content_length or 0) > self.config.max_record:
            raise _error(web.HTTPRequestEntityTooLarge, f"record over max_record {self.config.max_record} bytes")
        body, size = await self._body(request)
        owner = self._owner(body)
        try:
            info = RankInfo.from_dict(body)
            if info.spec.role != "prefill":
                raise ValueError("only prefill ranks register; decode ranks look up")
        except ValueError as e:
            raise _bad(str(e)) from None
        self._reachable(request, info)
        gone = await self._predecessor_gone(info, owner)
        try:
            key = self.registry.register(info, time.monotonic(), owner, size, replace_owner=gone)
        except RegistryError as e:
            raise _error(_STATUS.get(e.status, web.HTTPConflict), str(e)) from None
        log.info("registered %s (control %s)", key, info.control)
        return web.json_response({"key": key})

    async def _predecessor_gone(self, info: RankInfo, owner: str) -> str | None:
        """The owner of another owner's registration of ``info``'s key when it is provably gone: no
        heartbeat for ``takeover_silence`` and its control address refuses connections (nothing
        listens there). A live rank heartbeats more often and listens: it is never replaced."""
        prev = self.registry.holder(info.spec.key, time.monotonic())
        if prev is None or prev[2] == owner:
            return None
        silence = self.config.ttl / 2 if self.config.takeover_silence is None else self.config.takeover_silence
        if prev[1] < silence or not await refuses(prev[0].control, self.config.probe_timeout):
            return None
        log.warning("%s: its registration (control %s) was silent %.1fs and its control address refuses "
                    "connections: a restarted rank takes the key over", info.spec.key, prev[0].control, prev[1])
        return prev[2]

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body, _ = await self._body(request)
        owner, key = self._owner(body), self._key(body)
        if not self.registry.heartbeat(key, time.monotonic(), owner):
            raise _error(web.HTTPNotFound, f"{key} is not registered by you (expired?)")
        return web.json_response({"key": key})

    async def _deregister(self, request: web.Request) -> web.Response:
        body, _ = await self._body(request)
        owner, key = self._owner(body), self._key(body)
        try:
            return web.json_response({"key": key, "removed": self.registry.remove(key, owner)})
        except RegistryError as e:
            raise _error(web.HTTPForbidden, str(e)) from None

    def _instance(self, request: web.Request) -> str | None:
        inst = request.query.get("instance")
        if inst is not None and not KEY.fullmatch(f"{inst}/dp0/pp0/tp0"):
            raise _bad("query 'instance' is not an instance name")
        return inst

    async def _health(self, request: web.Request) -> web.Response:
        now, inst = time.monotonic(), self._instance(request)
        r = self.registry.readiness(now, inst)
        expected, missing = self.registry.missing(now, inst)
        if not r.ready:
            return web.json_response({"status": "not ready", "registered": r.registered, "expected": expected,
                                      "missing": missing}, status=503)
        return web.json_response({"status": "ready", "registered": r.registered, "expected": expected})

    async def _topology(self, request: web.Request) -> web.Response:
        now, inst = time.monotonic(), self._instance(request)
        r = self.registry.readiness(now, inst)
        expected, missing = self.registry.missing(now, inst)
        return web.json_response({"ready": r.ready, "expected": expected, "missing": [] if r.ready else missing,
                                  "ranks": [i.to_dict() for i in self.registry.ranks(now, inst)]})

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=min(MAX_BODY, self.config.max_record), middlewares=[self._errors])
        app.add_routes([web.put("/register", self._register), web.delete("/register", self._deregister),
                        web.post("/heartbeat", self._heartbeat), web.get("/health", self._health),
                        web.get("/topology", self._topology)])
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def _start(self) -> None:
        # one request per connection (keepalive 0): the header timeout then covers every request
        self._runner = web.AppRunner(self._app(), access_log=None, keepalive_timeout=0, handle_signals=False)
        await self._runner.setup()
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guard(self), self.config.host, self.config.port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _cleanup(self) -> None:
        self._server.close()
        await self._runner.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:     # handlers of connections still open (slow clients): end them, quietly
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

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
        print(f"kvxfer bootstrap listening on {self.config.host}:{self.port}, advertised as {self.url} "
              f"(ttl {self.config.ttl}s, auth {'on' if self.config.secret else 'off'})", flush=True)
        while not done.wait(0.5):
            pass
        self.stop()

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()


_STATUS = {400: web.HTTPBadRequest, 403: web.HTTPForbidden, 409: web.HTTPConflict,
           413: web.HTTPRequestEntityTooLarge, 507: web.HTTPInsufficientStorage}


def _error(cls, why: str) -> web.HTTPException:
    kw = {"max_size": 0, "actual_size": 0} if cls is web.HTTPRequestEntityTooLarge else {}
    return cls(text=json.dumps({"error": why[:2048]}), content_type="application/json", **kw)


def _bad(why: str) -> web.HTTPException:
    return _error(web.HTTPBadRequest, why)


# ------------------------------------------------------------------------------------
# kvxfer bootstrap
# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bootstrap", description="run the rank registry (HTTP + JSON)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    ap.add_argument("--advertise", default=None, help="address or interface name to advertise (default: --host, "
                                                      "or a routable interface address when --host is a wildcard)")
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
    if secret is None:
        log.warning("kvxfer bootstrap: %s", OPEN_DEPLOYMENT)
    try:
        BootstrapServer(BootstrapConfig(host=args.host, port=args.port, advertise=args.advertise, ttl=args.ttl,
                                        expect=args.expect, secret=secret)).serve_forever()
    except (ConnectError, ValueError) as e:
        print(f"kvxfer bootstrap: {e}")
        return 1
    return 0
