"""HMAC for the control plane: the shared secret, message MACs, and signed registry requests.
"""
from __future__ import annotations

import hashlib
import hmac
import time

AUTH_HEADER = "X-KVXfer-Auth"


AUTH_SKEW = 300.0       # seconds a signed request stays valid (clock skew between hosts)


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
