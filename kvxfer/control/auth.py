"""HMAC for the control plane: the shared secret, message MACs, and signed registry requests.

Registry writes carry ``X-KVXfer-Auth: <unix time>:<nonce>:<hex HMAC-SHA256(secret,
"<time>\\n<nonce>\\n<METHOD>\\n<path>\\n" + body)>``. The server accepts a time within
``AUTH_SKEW`` of its clock and each nonce once (``kvxfer.control.registry.NonceCache``), so a
captured write cannot be replayed. Who calls what: ``BootstrapClient`` signs (``sign_http``),
``BootstrapServer`` checks (``check_http``); ``ControlChannel`` MACs through ``kvxfer.control.wire``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import time

AUTH_HEADER = "X-KVXfer-Auth"


AUTH_SKEW = 300.0       # seconds a signed request stays valid (clock skew between hosts)


_HEADER = re.compile(r"(\d{1,12}):([0-9a-f]{32}):([0-9a-f]{64})")


# What ``kvxfer rank`` and ``kvxfer bootstrap`` say at start-up when no secret is set.
OPEN_DEPLOYMENT = (
    "no shared secret (--secret-file): an open deployment. Anyone who reaches the registry can register ranks "
    "and read every record; anyone who reaches a control port can say HELLO as a decode rank of its own "
    "(never as a live one) and ask for rooms it can name; a peer that reaches a UCX data address with its "
    "descriptor can write anywhere in the registered KV regions. Set a secret on any network you do not "
    "control (README: What a peer can reach).")


def as_secret(secret: str | bytes | None) -> bytes | None:
    if secret is None or secret == b"" or secret == "":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def sign_http(secret: bytes, method: str, path: str, body: bytes, now: float | None = None,
              nonce: str | None = None) -> str:
    t = str(int(time.time() if now is None else now))
    n = nonce or os.urandom(16).hex()
    return f"{t}:{n}:" + mac(secret, f"{t}\n{n}\n{method}\n{path}\n".encode(), body).hex()


def check_http(secret: bytes, header: str | None, method: str, path: str, body: bytes) -> tuple[str | None, str]:
    """(None, nonce) when ``header`` authenticates the request; else (why not, ""). The caller
    must still admit the nonce once (replays). Never echoes the secret."""
    if not header:
        return "missing authentication: this registry needs the shared secret", ""
    m = _HEADER.fullmatch(header)
    if m is None:
        return f"malformed {AUTH_HEADER}: expected <time>:<nonce>:<mac> (upgrade the client)", ""
    t, n, digest = m.groups()
    if abs(time.time() - int(t)) > AUTH_SKEW:
        return f"stale timestamp in {AUTH_HEADER} (more than {AUTH_SKEW:g}s from the registry's clock)", ""
    want = mac(secret, f"{t}\n{n}\n{method}\n{path}\n".encode(), body).hex()
    if not hmac.compare_digest(want, digest):
        return "wrong shared secret", ""
    return None, n
