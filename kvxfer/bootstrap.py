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
import hashlib
import hmac
import json
import logging
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from aiohttp import web

from .errors import ConnectError

log = logging.getLogger("kvxfer.bootstrap")

PROTOCOL = 1            # bumped when RankInfo or the control messages change shape
AUTH_HEADER = "X-KVXfer-Auth"
AUTH_SKEW = 300.0       # seconds a signed request stays valid (clock skew between hosts)
MAX_BODY = 8 << 20      # a 128-layer page-major layout is ~100 KB of JSON; leave room
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


# ------------------------------------------------------------------------------------
# Plain-data records
# ------------------------------------------------------------------------------------
def _int(d: Mapping, name: str, lo: int, hi: int, default: int | None = None) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"field {name!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """Where a rank sits in its serving instance, and the model shape the topology needs."""
    role: str                   # "prefill" | "decode"
    num_kv_heads: int           # global KV heads of the model (1 for MLA)
    num_layers: int             # global layers of the model
    instance: str = "default"   # one serving instance (a P or D deployment)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    replicated: bool = False    # KV identical on every TP rank (MLA): one source per head

    def __post_init__(self):
        d = asdict(self)
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not isinstance(self.instance, str) or not _NAME.match(self.instance):
            raise ValueError(f"instance must match {_NAME.pattern}, got {self.instance!r}")
        for size in ("tp_size", "pp_size", "dp_size"):
            n = _int(d, size, 1, 1 << 16)
            _int(d, size.replace("size", "rank"), 0, n - 1)
        _int(d, "num_kv_heads", 1, 1 << 20)
        _int(d, "num_layers", 1, 1 << 20)
        if not isinstance(self.replicated, bool):
            raise ValueError(f"replicated must be a bool, got {self.replicated!r}")

    @property
    def key(self) -> str:
        """Registry key: ``instance/dp0/pp0/tp0``."""
        return f"{self.instance}/dp{self.dp_rank}/pp{self.pp_rank}/tp{self.tp_rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """What a rank tells the registry and its handshake peers. Round-trips through JSON/msgpack."""
    spec: RankSpec
    control: str = ""                               # "tcp://host:port" of the control ROUTER
    data: Mapping[str, Mapping] = field(default_factory=dict)   # transport name -> descriptor
    layout: Mapping = field(default_factory=dict)   # Layout.to_dict() (KV parts + state parts)
    aux_bytes: int = 0                              # fixed size of the aux record
    protocol: int = PROTOCOL

    def to_dict(self) -> dict:
        return {**asdict(self.spec), "control": self.control, "data": {k: dict(v) for k, v in self.data.items()},
                "layout": dict(self.layout), "aux_bytes": self.aux_bytes, "protocol": self.protocol}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RankInfo":
        """Validate a peer's record field by field; raises ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a rank record must be an object, got {type(d).__name__}")
        names = RankSpec.__dataclass_fields__
        try:
            spec = RankSpec(**{k: d[k] for k in names if k in d})
        except TypeError as e:
            raise ValueError(f"rank record: {e}") from None
        control, data, layout = d.get("control", ""), d.get("data", {}), d.get("layout", {})
        if not isinstance(control, str) or len(control) > 256 or \
                (control and not control.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"field 'control' must be a tcp:// or ipc:// address, got {control!r}")
        if not isinstance(data, Mapping) or len(data) > 16 or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in data.items()):
            raise ValueError("field 'data' must map transport names to descriptor objects")
        if not isinstance(layout, Mapping):
            raise ValueError("field 'layout' must be a layout description object")
        return cls(spec=spec, control=control, data=data, layout=layout,
                   aux_bytes=_int(d, "aux_bytes", 0, 1 << 20, 0), protocol=_int(d, "protocol", 0, 1 << 16, PROTOCOL))


# ------------------------------------------------------------------------------------
# Auth (shared with the control plane in kvxfer.handshake)
# ------------------------------------------------------------------------------------
def as_secret(secret: str | bytes | None) -> bytes | None:
    if secret is None or secret == b"" or secret == "":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def sign_http(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    t = str(int(time.time() if now is None else now))
    return t + ":" + mac(secret, f"{t}\n{method}\n{path}\n".encode(), body).hex()


def check_http(secret: bytes, header: str | None, method: str, path: str, body: bytes) -> str | None:
    """None when ``header`` authenticates the request; else why not (never echoes the secret)."""
    if not header or ":" not in header:
        return "missing authentication: this registry needs the shared secret"
    t, _, digest = header.partition(":")
    if not t.isdigit() or abs(time.time() - int(t)) > AUTH_SKEW:
        return f"stale or malformed timestamp in {AUTH_HEADER}"
    want = mac(secret, f"{t}\n{method}\n{path}\n".encode(), body).hex()
    if not hmac.compare_digest(want, digest):
        return "wrong shared secret"
    return None


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
# Client side (stdlib HTTP: ranks need no event loop to register or look up)
# ------------------------------------------------------------------------------------
class BootstrapClient:
    """Talks to a ``BootstrapServer``. Each call blocks at most ``timeout`` seconds."""

    def __init__(self, url: str, secret: str | bytes | None = None, timeout: float = 5.0):
        self.url, self.secret, self.timeout = url.rstrip("/"), as_secret(secret), timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        raw = b"" if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=raw if body is not None else None, method=method,
                                     headers={"Content-Type": "application/json"})
        if self.secret is not None and method != "GET":
            req.add_header(AUTH_HEADER, sign_http(self.secret, method, path.split("?")[0], raw))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {"error": e.reason}
        except (OSError, ValueError) as e:
            raise ConnectError(f"bootstrap server {self.url} unreachable: {e}") from None

    def register(self, info: RankInfo) -> str:
        status, body = self._call("PUT", "/register", info.to_dict())
        if status != 200:
            raise ConnectError(f"bootstrap {self.url} refused the registration of {info.spec.key} "
                               f"(HTTP {status}): {body.get('error', body)}")
        return body["key"]

    def heartbeat(self, key: str) -> bool:
        """True when the server still knows ``key``; False means register again."""
        status, body = self._call("POST", "/heartbeat", {"key": key})
        if status == 401:
            raise ConnectError(f"bootstrap {self.url} refused the heartbeat: {body.get('error')}")
        return status == 200

    def deregister(self, key: str) -> None:
        self._call("DELETE", "/register", {"key": key})

    def health(self) -> dict:
        return self._call("GET", "/health")[1]

    def topology(self, instance: str | None = None) -> tuple[bool, list[RankInfo]]:
        status, body = self._call("GET", "/topology" + (f"?instance={instance}" if instance else ""))
        if status != 200:
            raise ConnectError(f"bootstrap {self.url}: GET /topology answered HTTP {status}")
        return bool(body.get("ready")), [RankInfo.from_dict(r) for r in body.get("ranks", [])]

    def wait_ready(self, timeout: float = 60.0, instance: str | None = None, poll: float = 0.1) -> list[RankInfo]:
        """Block until every expected rank registered; the prefill ranks (of ``instance``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ready, ranks = self.topology(instance)
            except ConnectError:
                ready, ranks = False, []
            if ready and ranks:
                return ranks
            if time.monotonic() > deadline:
                raise ConnectError(f"bootstrap {self.url} not ready after {timeout}s: {self.health_or_error()}")
            time.sleep(poll)

    def health_or_error(self) -> str:
        try:
            return json.dumps(self.health())
        except ConnectError as e:
            return str(e)


class Registration:
    """A prefill rank's registration, kept alive by heartbeats from a daemon thread."""

    def __init__(self, client: BootstrapClient, info: RankInfo, interval: float | None = None, ttl: float = 10.0):
        self.client, self.info = client, info
        self.interval = ttl / 3 if interval is None else interval
        self.key: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Registration":
        self.key = self.client.register(self.info)    # fails loudly at launch: bad secret, bad record
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.client.heartbeat(self.key):
                    log.warning("bootstrap forgot %s; registering again", self.key)
                    self.key = self.client.register(self.info)
            except ConnectError as e:   # the registry may be restarting: keep trying
                log.warning("heartbeat for %s failed: %s", self.key, e)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + self.client.timeout)
        if deregister and self.key is not None:
            try:
                self.client.deregister(self.key)
            except ConnectError:
                pass


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


__all__ = ["PROTOCOL", "RankSpec", "RankInfo", "BootstrapConfig", "Registry", "BootstrapServer",
           "BootstrapClient", "Registration", "as_secret", "mac", "sign_http", "check_http", "main"]
