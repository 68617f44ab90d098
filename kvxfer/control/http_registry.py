"""The embedded registry's backend for ``BootstrapClient`` (``http://`` URLs): the HTTP API of
``kvxfer.control.bootstrap_api`` over kept-alive connections (``kvxfer.control.httplink``).

A registration names its layout by digest first and sends the layout only when the registry
answers it does not hold it (428): an instance's layout crosses the network once, not once per rank.
Reads go through ``/watch``, which the server holds until something changed.

Who calls what: ``BootstrapClient`` only (see ``kvxfer.control.discovery.Backend``).
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from ..errors import ConnectError
from .auth import AUTH_HEADER, sign_http
from .discovery import REGISTRY_TTL, Snapshot, canonical
from .httplink import HttpLink, endpoints

RETRY_CODES = ("owned", "full")          # error codes the server says are worth trying again
MAX_INSTANCES = 1 << 16


def _retry(status: int, body: dict) -> bool:
    return status in (408, 429) or status >= 500 or body.get("code") in RETRY_CODES


def _json(status: int, raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        return {"error": f"HTTP {status} with a body that is not JSON"}
    return body if isinstance(body, dict) else {"error": str(body)[:256]}


def snapshot_of(name: str, d) -> Snapshot:
    """A snapshot from the server's JSON; ConnectError when it is not one (the records themselves
    are checked by ``BootstrapClient``)."""
    if not isinstance(d, dict) or not isinstance(d.get("ranks"), list) or not all(
            isinstance(r, dict) for r in d["ranks"]):
        raise ConnectError(f"the registry answered a malformed snapshot of {name!r}")
    version, expected, missing = d.get("version"), d.get("expected"), d.get("missing", [])
    if type(version) is not int or type(expected) is not int or not isinstance(missing, list) or not all(
            isinstance(m, str) for m in missing):
        raise ConnectError(f"the registry answered a malformed snapshot of {name!r}")
    return Snapshot(name, version, d.get("ready") is True, expected, tuple(m[:256] for m in missing[:65]),
                    tuple(d["ranks"]))


class HttpRegistry:
    """``kvxfer bootstrap``'s client side (``Backend``). The server keeps a registration ``--ttl``
    seconds without a heartbeat; ``default_ttl`` is its default (a rank's heartbeat period is a
    third of the ttl it is given)."""
    default_ttl = REGISTRY_TTL

    def __init__(self, url: str, secret: bytes | None, timeout: float, source: str | None = None):
        self.url, self.secret = url.rstrip("/"), secret
        self.link = HttpLink(endpoints(self.url, {"http": "http", "https": "https"}, 80), timeout,
                             f"bootstrap server {self.url}", source)
        self._epoch = ""

    def _call(self, method: str, path: str, body: dict | None = None, wait: float = 0.0) -> tuple[int, dict]:
        raw = b"" if body is None else json.dumps(body).encode()
        headers = {}
        if self.secret is not None and method not in ("GET",) and path != "/watch":
            headers[AUTH_HEADER] = sign_http(self.secret, method, path.split("?")[0], raw)
        status, answer = self.link.request(method, path, raw if body is not None else None, headers, wait)
        return status, _json(status, answer)

    def register(self, record: dict, layout: Mapping, owner: str, ttl: float) -> str:
        key = f"{record['instance']}/dp{record['dp_rank']}/pp{record['pp_rank']}/tp{record['tp_rank']}"
        body = {**record, **({"owner": owner} if owner else {})}
        status, answer = self._call("PUT", "/register", body)
        if status == 428 and answer.get("code") == "layout":   # the registry does not hold it: send it
            body = {k: v for k, v in body.items() if k != "layout_digest"}
            status, answer = self._call("PUT", "/register", {**body, "layout": json.loads(canonical(layout))})
        if status != 200:
            raise ConnectError(f"bootstrap {self.url} refused the registration of {key} (HTTP {status}): "
                               f"{answer.get('error', answer)}", transient=_retry(status, answer))
        if answer.get("key") != key:
            raise ConnectError(f"bootstrap {self.url} answered the registration with key "
                               f"{str(answer.get('key'))[:80]!r}")
        return key

    def heartbeat(self, key: str, owner: str) -> bool:
        status, answer = self._call("POST", "/heartbeat", {"key": key, **({"owner": owner} if owner else {})})
        if status == 200:
            return True
        if status == 404:
            return False
        raise ConnectError(f"bootstrap {self.url} refused the heartbeat (HTTP {status}): {answer.get('error')}",
                           transient=_retry(status, answer))

    def deregister(self, key: str, owner: str) -> None:
        self._call("DELETE", "/register", {"key": key, **({"owner": owner} if owner else {})})

    def changes(self, since: Mapping[str, int], wait: float, ready: bool = False) -> dict[str, Snapshot]:
        status, answer = self._call("POST", "/watch", {"epoch": self._epoch, "since": dict(since), "wait": wait,
                                                       "ready": ready}, wait)
        if status != 200:
            raise ConnectError(f"bootstrap {self.url}: POST /watch answered HTTP {status}: {answer.get('error')}",
                               transient=_retry(status, answer))
        changed = answer.get("changed")
        if not isinstance(changed, dict) or not isinstance(answer.get("epoch"), str) or \
                any(name not in since for name in changed):
            raise ConnectError(f"bootstrap {self.url}: POST /watch answered a malformed body")
        out = {name: snapshot_of(name, snap) for name, snap in changed.items()}
        self._epoch = answer["epoch"][:64]
        return out

    def snapshot(self, instance: str) -> Snapshot:
        return self.changes({instance: -1}, 0.0)[instance]

    def layout(self, digest: str) -> bytes:
        status, raw = self.link.request("GET", f"/layout?digest={digest}")
        if status != 200:
            raise ConnectError(f"bootstrap {self.url}: no layout {digest[:16]}... (HTTP {status})",
                               transient=status == 404 or status >= 500)
        return raw

    def instances(self) -> list[str]:
        status, answer = self._call("GET", "/instances")
        names = answer.get("instances")
        if status != 200 or not isinstance(names, dict) or len(names) > MAX_INSTANCES:
            raise ConnectError(f"bootstrap {self.url}: GET /instances answered HTTP {status}",
                               transient=_retry(status, answer))
        return sorted(str(n)[:128] for n in names)

    def health(self, instance: str | None) -> dict:
        return self._call("GET", "/health" + (f"?instance={instance}" if instance else ""))[1]

    def interrupt(self) -> None:
        self.link.interrupt()

    def close(self) -> None:
        self.link.close()


__all__ = ["HttpRegistry", "snapshot_of"]
