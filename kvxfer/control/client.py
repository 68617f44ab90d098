"""The registry's client side, used by every rank: ``BootstrapClient`` (register, look up,
wait for a complete topology) and ``Registration`` (heartbeats that keep a rank registered).
No aiohttp here: ranks import only the standard library's urllib.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

from ..errors import ConnectError
from ..ranks import RankInfo
from .auth import AUTH_HEADER, as_secret, sign_http

log = logging.getLogger("kvxfer.control.bootstrap")


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
