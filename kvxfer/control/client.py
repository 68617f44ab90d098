"""The registry's client side, used by every rank: ``BootstrapClient`` (register, look up,
wait for a complete topology) and ``Registration`` (heartbeats that keep a rank registered).
No aiohttp here: ranks import only the standard library's urllib.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request

from ..errors import ConnectError
from ..metrics import record_registration_lost
from .auth import AUTH_HEADER, as_secret, sign_http
from .records import RankInfo

log = logging.getLogger("kvxfer.control.bootstrap")


MAX_REPLY = 256 << 20    # bytes of one /topology answer we read (the server caps what it holds at 64 MiB)


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
                body = json.loads(r.read(MAX_REPLY) or b"{}")
                return r.status, body if isinstance(body, dict) else {}
        except urllib.error.HTTPError as e:
            try:
                body = json.loads(e.read(1 << 16) or b"{}")
                return e.code, body if isinstance(body, dict) else {"error": str(body)[:256]}
            except (ValueError, RecursionError):
                return e.code, {"error": e.reason}
        except (OSError, ValueError, RecursionError) as e:
            raise ConnectError(f"bootstrap server {self.url} unreachable: {e}") from None

    def register(self, info: RankInfo, owner: str | None = None) -> str:
        """Register ``info``; ``owner`` (16-64 of [A-Za-z0-9_-]) is the token that owns the key: the
        registry refuses the key to any other owner while this registration lives."""
        status, body = self._call("PUT", "/register", {**info.to_dict(), **({"owner": owner} if owner else {})})
        if status != 200:
            raise ConnectError(f"bootstrap {self.url} refused the registration of {info.spec.key} "
                               f"(HTTP {status}): {body.get('error', body)}")
        key = body.get("key")
        if not isinstance(key, str) or key != info.spec.key:
            raise ConnectError(f"bootstrap {self.url} answered the registration with key {str(key)[:80]!r}")
        return key

    def heartbeat(self, key: str, owner: str | None = None) -> bool:
        """True when the server still knows ``key`` (as ``owner``'s); False means register again."""
        status, body = self._call("POST", "/heartbeat", {"key": key, **({"owner": owner} if owner else {})})
        if status == 401:
            raise ConnectError(f"bootstrap {self.url} refused the heartbeat: {body.get('error')}")
        return status == 200

    def deregister(self, key: str, owner: str | None = None) -> None:
        self._call("DELETE", "/register", {"key": key, **({"owner": owner} if owner else {})})

    def health(self) -> dict:
        return self._call("GET", "/health")[1]

    def topology(self, instance: str | None = None) -> tuple[bool, list[RankInfo]]:
        status, body = self._call("GET", "/topology" + (f"?instance={instance}" if instance else ""))
        if status != 200:
            raise ConnectError(f"bootstrap {self.url}: GET /topology answered HTTP {status}")
        ranks = body.get("ranks", [])
        if not isinstance(ranks, list):
            raise ConnectError(f"bootstrap {self.url}: GET /topology answered a malformed body")
        try:
            return body.get("ready") is True, [RankInfo.from_dict(r) for r in ranks]
        except ValueError as e:
            raise ConnectError(f"bootstrap {self.url}: GET /topology holds an invalid rank record: {e}") from None

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
    """A prefill rank's registration, kept alive by heartbeats from a daemon thread. It owns its
    key (a random ``owner`` token sent with every write): another process cannot replace or
    delete it while it lives. ``start`` waits up to 1.5 x ``ttl`` for a predecessor's registration
    of the same key (a restarted rank) to go, then fails loudly.

    The registry hands the key over before the predecessor's registration expires once that
    predecessor is provably gone: silent for ``BootstrapConfig.takeover_silence`` (ttl / 2: a live
    rank heartbeats every ttl / 3) and its control address refuses connections (nothing listens
    there). Not at once, and not on refusal alone: a rank may heartbeat while its control port
    refuses the registry (starting up, or a firewall rejecting the registry's host), and telling
    two processes apart at one address would take a signed identity probe on the control channel
    that the registry does not speak. A predecessor that still listens (a live rank, or this
    restarted rank on the same fixed port) is never replaced early: the key then expires at ttl."""

    def __init__(self, client: BootstrapClient, info: RankInfo, interval: float | None = None, ttl: float = 10.0):
        self.client, self.info, self.ttl = client, info, ttl
        self.interval = ttl / 3 if interval is None else interval
        self.owner = os.urandom(16).hex()
        self.key: str | None = None
        self.state = "starting"   # "registered", "expired" (registering again) or "taken" (another owner has the key)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Registration":
        deadline = time.monotonic() + self.ttl * 1.5
        while True:   # fails loudly at launch: bad secret, bad record, a key another live rank owns
            try:
                self.key = self.client.register(self.info, self.owner)
                break
            except ConnectError as e:
                if "HTTP 409" not in str(e) or "another owner" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(min(0.5, self.ttl / 4))
        self.state = "registered"
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.client.heartbeat(self.key, self.owner):
                    self.state = "registered"
                    continue
                log.warning("bootstrap %s forgot %s (its registration expired): registering again",
                            self.client.url, self.info.spec.key)
                record_registration_lost("expired")
                self.state = "expired"
                self.key = self.client.register(self.info, self.owner)
                self.state = "registered"
            except ConnectError as e:   # the registry may be restarting: keep trying
                if "another owner" in str(e):
                    if self.state != "taken":
                        log.error("bootstrap %s gave the key of %s to another owner while this rank lives: decode "
                                  "ranks are sent elsewhere; trying to take it back every %.1fs", self.client.url,
                                  self.info.spec.key, self.interval)
                        record_registration_lost("taken")
                    self.state = "taken"
                else:
                    log.warning("heartbeat for %s failed: %s", self.info.spec.key, e)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + self.client.timeout)
        if deregister and self.key is not None:
            try:
                self.client.deregister(self.key, self.owner)
            except ConnectError:
                pass
