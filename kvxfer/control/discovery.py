"""What both registry backends share: the contract a backend keeps (``Backend``), the snapshot of one
instance they answer (``Snapshot``), how a layout is named by its digest, and the retry policy
(``Backoff``). No I/O here.

Records and layouts
-------------------
A rank record (``RankInfo.to_dict``) is ~97% layout, and every rank of an instance group holds the
same one. On the wire and in storage a backend carries a record without its layout but with
``layout_digest`` (``layout_digest(layout)``: the SHA-256 of the layout's canonical JSON), and each
layout once, under its digest. ``BootstrapClient`` puts the two back together (checking the digest
of every layout it fetches) so that ranks see the same ``RankInfo`` as before.

Versions
--------
Every answer about an instance carries a version that grows with every change of it (the embedded
registry: a counter per server life, named by ``epoch``; etcd: the store revision). A reader asks
"did anything change since version V" (``Backend.changes``) and the backend blocks on the server
until something did or ``wait`` passed: no polling loop, and no bytes when nothing changed.

Who calls what: ``BootstrapClient`` (``kvxfer.control.client``) is the only caller of a backend;
the backends (``kvxfer.control.http_registry``, ``kvxfer.control.etcd_registry``) and the server's
store (``kvxfer.control.registry``) use the helpers here.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ConnectError
from .httplink import HttpLink
from .records import RankInfo

DIGEST_HEX = 64                 # characters of a layout digest (hex SHA-256)
_HEX = re.compile(f"[0-9a-f]{{{DIGEST_HEX}}}")
MAX_MISSING = 64                # missing keys a readiness answer lists (the count is exact)
WHOLE = ""                      # the instance name that stands for the whole registry in ``changes``
REGISTRY_TTL = 10.0             # seconds the embedded registry keeps a registration without a heartbeat


def canonical(obj) -> bytes:
    """The one JSON encoding a digest is taken over: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def layout_digest(layout: Mapping) -> str:
    """The name of a layout: hex SHA-256 of ``canonical(layout)``."""
    return digest_of(canonical(layout))


def digest_of(raw: bytes) -> str:
    """The digest of a layout given as its canonical JSON."""
    return hashlib.sha256(raw).hexdigest()


def is_digest(value) -> bool:
    """A layout digest: ``DIGEST_HEX`` lowercase hex digits (one regex match, not a step per digit:
    a registry read checks one per record)."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def bare_record(info: RankInfo) -> dict:
    """``info`` as a record without its layout, naming the layout by digest instead."""
    d = info.to_dict()
    d["layout_digest"] = layout_digest(d.pop("layout"))
    return d


# ------------------------------------------------------------------------------------
# Readiness: one instance is ready when every rank its sizes promise is registered
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Readiness:
    """One instance (or the whole registry): ranks expected, and the first missing keys."""
    expected: int
    registered: int
    missing: tuple[str, ...]
    missing_count: int

    @property
    def ready(self) -> bool:
        return self.missing_count == 0 and self.registered > 0

    def listed(self) -> list[str]:
        """The missing keys as ``/health`` lists them: at most ``MAX_MISSING``, then a count."""
        out = list(self.missing)
        if self.missing_count > len(self.missing):
            out.append(f"... and {self.missing_count - len(self.missing)} more")
        if not self.registered and not out:
            out = ["any rank: nothing registered yet"]
        return out


def readiness(keys_by_instance: Mapping[str, tuple[tuple[int, int, int], set[str]]],
              expect: int | None = None) -> Readiness:
    """Readiness of the instances given as {name: ((tp, pp, dp) sizes, registered keys)}; ``expect``
    (the whole registry only): that many ranks, whatever their sizes. O(registered + MAX_MISSING)."""
    registered = sum(len(keys) for _, keys in keys_by_instance.values())
    if expect is not None:
        short = max(expect - registered, 0)
        return Readiness(expect, registered, (f"{short} more rank(s)",) if short else (), short)
    if not registered:
        return Readiness(0, 0, ("any rank: nothing registered yet",), 1)
    expected = count = 0
    listed: list[str] = []
    for inst in sorted(keys_by_instance):
        (tp, pp, dp), present = keys_by_instance[inst]
        expected += tp * pp * dp
        count += tp * pp * dp - len(present)
        # walk the key space in order, stopping once enough are listed: each step either meets a
        # present key or lists a missing one, so the walk is O(registrations + MAX_MISSING)
        for i in range(tp * pp * dp):
            if len(listed) >= MAX_MISSING:
                break
            d, rest = divmod(i, tp * pp)
            p, t = divmod(rest, tp)
            k = f"{inst}/dp{d}/pp{p}/tp{t}"
            if k not in present:
                listed.append(k)
    return Readiness(expected, registered, tuple(listed), count)


# ------------------------------------------------------------------------------------
# What a backend answers, and what it must do
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Snapshot:
    """One instance (``WHOLE``: every instance) as a backend answers it: its version, readiness,
    and its prefill records without layouts (``layout_digest`` instead), checked by the caller."""
    instance: str
    version: int
    ready: bool
    expected: int
    missing: tuple[str, ...]
    records: tuple[dict, ...] = field(default=(), repr=False)


class Backend(Protocol):
    """A registry backend, chosen by ``BootstrapClient`` from its URL's scheme. Every call blocks at
    most its ``timeout`` (plus ``wait`` for ``changes``); network failures and answers worth trying
    again (busy, full, a key still held by a predecessor) raise ``ConnectError(transient=True)``,
    refusals that will not change raise ``ConnectError`` (transient False). ``link``: its
    connections (``link.received``: bytes read so far)."""
    url: str
    link: HttpLink
    default_ttl: float     # seconds a registration lives without a heartbeat unless its rank says

    def register(self, record: dict, layout: Mapping, owner: str, ttl: float) -> str: ...

    def heartbeat(self, key: str, owner: str) -> bool: ...

    def deregister(self, key: str, owner: str) -> None: ...

    def snapshot(self, instance: str) -> Snapshot: ...

    def changes(self, since: Mapping[str, int], wait: float, ready: bool = False) -> dict[str, Snapshot]: ...

    def layout(self, digest: str) -> bytes: ...

    def instances(self) -> list[str]: ...

    def health(self, instance: str | None) -> dict: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------
# Retries
# ------------------------------------------------------------------------------------
class Backoff:
    """Exponential backoff with full jitter until a deadline: ``sleep()`` waits a random time in
    [0, min(cap, base * 2**tries)], never past the deadline, and returns False once it passed."""

    def __init__(self, deadline: float, base: float = 0.05, cap: float = 2.0):
        self.deadline, self.base, self.cap, self.tries = deadline, base, cap, 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def pause(self) -> float:
        """The next wait, growing with the tries so far."""
        pause = random.uniform(0, min(self.cap, self.base * (2 ** min(self.tries, 30))))
        self.tries += 1
        return pause

    def sleep(self, stop=None) -> bool:
        """Wait before the next try (``stop``: a threading.Event that cuts the wait); False when
        the deadline passed (or ``stop`` is set): give up."""
        left = self.left()
        if left <= 0:
            return False
        pause = min(left, self.pause())
        if stop is not None:
            return not stop.wait(pause) and self.left() > 0
        time.sleep(pause)
        return self.left() > 0


def transient(e: BaseException) -> bool:
    """True for a ``ConnectError`` worth trying again."""
    return isinstance(e, ConnectError) and e.transient


__all__ = ["Backend", "Backoff", "Readiness", "Snapshot", "WHOLE", "bare_record", "canonical", "digest_of", "is_digest",
           "layout_digest", "readiness", "transient"]
