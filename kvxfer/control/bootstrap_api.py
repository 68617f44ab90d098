"""The embedded registry's HTTP API: the aiohttp handlers behind ``BootstrapServer``.

HTTP API (JSON bodies; the writes need ``X-KVXfer-Auth`` when the server has a secret)
    PUT    /register   record + "owner", with "layout" or "layout_digest"
                       200 {"key", "layout_digest"} | 400 bad field | 401 auth | 409 owned / sizes
                       | 428 {"code": "layout"}: the layout is not held here, send it | 507 full
    POST   /heartbeat  {"key", "owner"}    200 | 404 unknown, expired or not yours: register again
    DELETE /register   {"key", "owner"}    200 | 403 another owner's
    POST   /watch      {"epoch", "since": {instance: version}, "wait": s, "ready": bool}
                       200 {"epoch", "version", "changed": {instance: snapshot}}: answered as soon as
                       one instance's version passed ``since`` (and, with "ready", it is complete), or
                       after ``wait`` seconds with nothing changed; "" stands for every instance.
                       A snapshot: {"version", "ready", "expected", "missing", "ranks": [record with
                       "layout_digest", ...]}. Another epoch (a restarted registry): every snapshot.
    GET    /layout?digest=D                  200 the layout (canonical JSON) | 404
    GET    /instances                        200 {"version", "instances": {name: {registered, expected, ready}}}
    GET    /health[?instance=I]              200 {"status": "ready"} | 503 {"status": "not ready", "missing"}
    GET    /topology[?instance=I]            200 {"ready", "expected", "missing", "ranks": [RankInfo, ...]}

Every error is JSON {"error": why, "code": what}: "owned" and "full" (and 5xx) are worth trying
again; the others are not. Reads stay open so operators can curl them.

Bounded work: an answer is built once per version of what it shows (``kvxfer.control.registry``)
and a large one is written in pieces, each within ``body_timeout``; a request body over
``PARSE_AWAY`` bytes is parsed and checked off the event loop; a held ``/watch`` costs a future
on the loop and its connection (whose count ``kvxfer.control.admission`` caps).

Who calls what: ``BootstrapServer`` makes one ``RegistryApi``, serves ``app()`` and calls
``sweep()`` from its event loop; every handler runs on that loop.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import time

from aiohttp import web

from ..addresses import is_loopback, split_address
from ..errors import ProtocolError
from .auth import AUTH_HEADER, AUTH_SKEW, check_http
from .discovery import WHOLE, canonical, digest_of, is_digest
from .records import RankInfo, check_layout_record
from .registry import KEY, OWNER, NonceCache, Registry, RegistryError

log = logging.getLogger("kvxfer.control.bootstrap")

MAX_BODY = 8 << 20      # a 128-layer page-major layout is ~100 KB of JSON; leave room
MAX_DEPTH = 32          # JSON nesting a record may have (a layout record is 3 deep)
MAX_WATCHED = 1024      # instances one /watch names
MAX_WATCH_BODY = 128 << 10
PARSE_AWAY = 64 << 10   # bodies larger than this are parsed off the event loop
CHUNK = 256 << 10       # an answer larger than this is written in pieces of this size


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


def _parse(raw: bytes) -> dict | str:
    """The body as a JSON object, with its layout (when it has one) checked; or why not."""
    if not _depth_ok(raw):
        return f"body nests deeper than {MAX_DEPTH}"
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        return "body is not JSON"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if "layout" in body:
        try:
            check_layout_record(body["layout"])
        except ValueError as e:
            return str(e)
        body["layout"] = canonical(body["layout"])     # the layout's one encoding, named by its digest
    return body


def error(cls, why: str, code: str = "refused") -> web.HTTPException:
    kw = {"max_size": 0, "actual_size": 0} if cls is web.HTTPRequestEntityTooLarge else {}
    return cls(text=json.dumps({"error": why[:2048], "code": code}), content_type="application/json", **kw)


def bad(why: str) -> web.HTTPException:
    return error(web.HTTPBadRequest, why, "bad")


_STATUS = {400: web.HTTPBadRequest, 403: web.HTTPForbidden, 409: web.HTTPConflict, 413: web.HTTPRequestEntityTooLarge,
           428: web.HTTPPreconditionRequired, 507: web.HTTPInsufficientStorage}


class RegistryApi:
    """The handlers, over one ``Registry`` (see the module docstring). ``config``: a BootstrapConfig."""

    def __init__(self, config, registry: Registry):
        self.config, self.registry = config, registry
        self.nonces = NonceCache(AUTH_SKEW)
        self._waiters: dict[str, set[asyncio.Future]] = collections.defaultdict(set)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvxfer-bootstrap-parse")
        self._parsing: asyncio.Semaphore | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- changes ----------------------------------------------------------------------------
    def wake(self) -> None:
        """After a change: every /watch on a changed instance (or on the whole registry) looks again."""
        changed = self.registry.take_changed()
        if not changed:
            return
        for name in (*changed, WHOLE):
            for fut in self._waiters.pop(name, ()):
                if not fut.done():
                    fut.set_result(None)

    async def sweep(self) -> None:
        """Expire silent registrations, and wake their watchers, until cancelled."""
        period = min(1.0, self.config.ttl / 4)
        while True:
            await asyncio.sleep(period)
            self.registry.expire(time.monotonic())
            self.wake()

    # -- request bodies ---------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler):
        """Every failure is a short JSON error: never a traceback to the client or the log."""
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as e:
            log.warning("%s %s from %s failed: %s", request.method, request.path, request.remote, type(e).__name__)
            raise error(web.HTTPBadRequest, f"request failed: {type(e).__name__}") from None

    async def _body(self, request: web.Request, signed: bool = True) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise error(web.HTTPRequestTimeout, f"body not sent within {self.config.body_timeout}s") from None
        if signed and self.config.secret is not None:
            why, nonce = check_http(self.config.secret, request.headers.get(AUTH_HEADER), request.method,
                                    request.path, raw)
            why = why or self.nonces.admit(nonce, time.time())
            if why:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, why)
                raise error(web.HTTPUnauthorized, why, "auth")
        if len(raw) <= PARSE_AWAY:
            body = _parse(raw)
        else:   # a large record: parsed and checked on a worker, two at a time, the loop free meanwhile
            if self._parsing is None:
                self._parsing = asyncio.Semaphore(2)
            async with self._parsing:
                body = await asyncio.get_running_loop().run_in_executor(self._pool, _parse, raw)
        if isinstance(body, str):
            raise bad(body)
        return body

    @staticmethod
    def _owner(body: dict) -> str:
        owner = body.pop("owner", "")
        if owner != "" and (not isinstance(owner, str) or not OWNER.fullmatch(owner)):
            raise bad(f"field 'owner' must match {OWNER.pattern}")
        return owner

    @staticmethod
    def _key(body: dict) -> str:
        key = body.get("key", "")
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise bad(f"field 'key' must be a rank key like default/dp0/pp0/tp0, got {str(key)[:80]!r}")
        return key

    # -- writes -----------------------------------------------------------------------------
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
                raise bad(f"{info.spec.key} registers from {request.remote} but advertises {field} {address}, "
                          f"which peers on other hosts cannot reach: start the rank with a routable host / "
                          f"advertise address")

    async def register(self, request: web.Request) -> web.Response:
        if (request.content_length or 0) > self.config.max_record:
            raise error(web.HTTPRequestEntityTooLarge, f"record over max_record {self.config.max_record} bytes",
                        "bad")
        body = await self._body(request)
        owner = self._owner(body)
        raw_layout, named = body.pop("layout", None), body.pop("layout_digest", None)
        digest = digest_of(raw_layout) if raw_layout is not None else named
        if not is_digest(digest) or (named is not None and named != digest):
            raise bad("field 'layout_digest' must be the hex SHA-256 of the record's layout (or send 'layout')")
        try:
            info = RankInfo.from_dict(body)
            if info.spec.role != "prefill":
                raise ProtocolError("only prefill ranks register; decode ranks look up")
        except ValueError as e:
            raise bad(str(e)) from None
        self._reachable(request, info)
        gone = await self._predecessor_gone(info, owner)
        fields = info.to_dict()
        del fields["layout"]
        record = json.dumps(fields, separators=(",", ":")).encode()
        try:
            key = self.registry.register(info, record, digest, raw_layout, time.monotonic(), owner,
                                         request.remote or "", replace_owner=gone)
        except RegistryError as e:
            raise error(_STATUS.get(e.status, web.HTTPConflict), str(e), e.code) from None
        finally:
            self.wake()
        log.info("registered %s (control %s)", key, info.control)
        return web.json_response({"key": key, "layout_digest": digest})

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

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        owner, key = self._owner(body), self._key(body)
        alive = self.registry.heartbeat(key, time.monotonic(), owner)
        self.wake()
        if not alive:
            raise error(web.HTTPNotFound, f"{key} is not registered by you (expired?)", "gone")
        return web.json_response({"key": key})

    async def deregister(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        owner, key = self._owner(body), self._key(body)
        try:
            return web.json_response({"key": key, "removed": self.registry.remove(key, owner)})
        except RegistryError as e:
            raise error(web.HTTPForbidden, str(e)) from None
        finally:
            self.wake()

    # -- reads ------------------------------------------------------------------------------
    @staticmethod
    def _instance(request: web.Request) -> str | None:
        inst = request.query.get("instance")
        if inst is not None and not KEY.fullmatch(f"{inst}/dp0/pp0/tp0"):
            raise bad("query 'instance' is not an instance name")
        return inst

    async def health(self, request: web.Request) -> web.Response:
        r = self.registry.readiness(time.monotonic(), self._instance(request))
        if not r.ready:
            return web.json_response({"status": "not ready", "registered": r.registered, "expected": r.expected,
                                      "missing": r.listed()}, status=503)
        return web.json_response({"status": "ready", "registered": r.registered, "expected": r.expected})

    async def topology(self, request: web.Request) -> web.StreamResponse:
        return await self._send(request, self.registry.topology(time.monotonic(), self._instance(request)))

    async def instances(self, request: web.Request) -> web.StreamResponse:
        return await self._send(request, [self.registry.instances(time.monotonic())])

    async def layout(self, request: web.Request) -> web.StreamResponse:
        digest = request.query.get("digest")
        raw = self.registry.layout(digest) if is_digest(digest) else None
        if raw is None:
            raise error(web.HTTPNotFound, "no layout of that digest is held here", "gone")
        return await self._send(request, [raw])

    async def watch(self, request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > MAX_WATCH_BODY:
            raise error(web.HTTPRequestEntityTooLarge, f"a watch body is at most {MAX_WATCH_BODY} bytes", "bad")
        body = await self._body(request, signed=False)
        since, wait, ready = body.get("since"), body.get("wait", 0), body.get("ready", False) is True
        if not isinstance(since, dict) or not 0 < len(since) <= MAX_WATCHED or not all(
                isinstance(v, int) and not isinstance(v, bool) and (k == WHOLE or KEY.fullmatch(f"{k}/dp0/pp0/tp0"))
                for k, v in since.items()):
            raise bad(f"field 'since' must map 1..{MAX_WATCHED} instance names to versions")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait:
            raise bad("field 'wait' must be seconds >= 0")
        if body.get("epoch", "") not in ("", self.registry.epoch):   # another life of the registry: all changed
            since = dict.fromkeys(since, -1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(float(wait), self.config.max_wait)
        while True:
            now = time.monotonic()
            changed = [n for n, v in since.items() if self.registry.version_of(n) > v and
                       (not ready or self.registry.readiness(now, n).ready)]
            left = deadline - loop.time()
            if changed or left <= 0:
                break
            fut = loop.create_future()
            for n in since:
                self._waiters[n].add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                pass
            finally:
                for n in since:
                    self._waiters[n].discard(fut)
                    if not self._waiters[n]:
                        del self._waiters[n]
        head = f'{{"epoch":"{self.registry.epoch}","version":{self.registry.version},"changed":{{'.encode()
        parts = [head]
        for i, n in enumerate(changed):
            parts += [(b"," if i else b"") + json.dumps(n).encode() + b":", self.registry.snapshot(now, n)]
        return await self._send(request, [*parts, b"}}"])

    async def _send(self, request: web.Request, pieces: list[bytes]) -> web.StreamResponse:
        """Answer ``pieces`` (JSON); a large answer goes out in ``CHUNK``s, each written within
        ``body_timeout`` (a reader that stops reading is cut, its buffer never grows past a chunk)."""
        self.wake()     # reads expire silent registrations too: their watchers look now
        size = sum(len(p) for p in pieces)
        if size <= CHUNK:
            return web.Response(body=b"".join(pieces), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = size
        await resp.prepare(request)
        for piece in pieces:
            view = memoryview(piece)
            for at in range(0, len(view), CHUNK):
                try:
                    await asyncio.wait_for(resp.write(view[at:at + CHUNK]), self.config.body_timeout)
                except asyncio.TimeoutError:   # the reader stopped reading: cut it
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application(client_max_size=min(MAX_BODY, self.config.max_record), middlewares=[self.errors])
        app.add_routes([web.put("/register", self.register), web.delete("/register", self.deregister),
                        web.post("/heartbeat", self.heartbeat), web.post("/watch", self.watch),
                        web.get("/health", self.health), web.get("/topology", self.topology),
                        web.get("/instances", self.instances), web.get("/layout", self.layout)])
        return app


__all__ = ["RegistryApi", "refuses", "MAX_BODY", "MAX_WATCHED"]
