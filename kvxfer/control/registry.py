"""The registry's state: live registrations, their owners, readiness per instance, and the
nonce cache that refuses replayed signed writes. Pure state, no I/O.

Who calls what: ``BootstrapServer`` (``kvxfer.control.bootstrap``) calls every method from its
one event-loop thread, once per HTTP request; nothing here blocks or costs more than the
request's own size (readiness is computed once per change, and at most ``MAX_LISTED`` missing
keys are ever listed).

Ownership: the first registrant of a key owns it (``owner``: a random token the client's
``Registration`` sends with every write, never returned by a read). While that registration
lives, a PUT, heartbeat or DELETE of the key with another owner is refused; once it expired
(no heartbeat for ``ttl``) anyone may register the key. A restarted rank may take the key over
sooner when its predecessor is provably gone: ``BootstrapServer`` decides that (silent and its
control address refuses connections) and passes ``replace_owner``.
"""
from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass

from ..errors import ProtocolError
from .records import RankInfo

log = logging.getLogger("kvxfer.control.bootstrap")

MAX_LISTED = 64             # missing keys listed by /health and /topology (the count is exact)
OWNER = re.compile(r"[A-Za-z0-9_\-]{16,64}")
KEY = re.compile(r"[A-Za-z0-9_.:\-]{1,128}/dp\d{1,5}/pp\d{1,5}/tp\d{1,5}")


class RegistryError(ProtocolError):
    """A write the registry refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, why: str):
        self.status = status
        super().__init__(why)


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


class Registry:
    """Live registrations keyed by ``RankSpec.key``; expiry by heartbeat age; caps on count and bytes."""

    def __init__(self, ttl: float, expect: int | None = None, *, max_ranks: int = 4096,
                 max_total_bytes: int = 64 << 20):
        self.ttl, self.expect = ttl, expect
        self.max_ranks, self.max_total_bytes = max_ranks, max_total_bytes
        self._ranks: dict[str, tuple[RankInfo, float, str, int]] = {}   # key -> (info, seen, owner, bytes)
        self._bytes = 0
        self._version = 0
        self._cache: dict[str | None, tuple[int, Readiness]] = {}
        self.computations = 0     # readiness computations so far (once per change and instance asked)

    def _drop(self, key: str) -> None:
        info, _, _, n = self._ranks.pop(key)
        self._bytes -= n
        self._version += 1

    def expire(self, now: float) -> list[str]:
        gone = [k for k, (_, seen, _, _) in self._ranks.items() if now - seen > self.ttl]
        for k in gone:
            log.warning("registration %s expired: no heartbeat for %.1fs", k, self.ttl)
            self._drop(k)
        return gone

    def holder(self, key: str, now: float) -> tuple[RankInfo, float, str] | None:
        """The live registration of ``key``: (record, seconds since its last heartbeat, owner)."""
        self.expire(now)
        rec = self._ranks.get(key)
        return None if rec is None else (rec[0], now - rec[1], rec[2])

    def register(self, info: RankInfo, now: float, owner: str = "", size: int = 0,
                 replace_owner: str | None = None) -> str:
        """Add or replace (same owner) a registration; RegistryError 409 when sizes disagree with
        the instance or another owner holds the key, 413/507 past the caps. ``replace_owner``: the
        owner of a predecessor shown to be gone, whose registration this one may replace."""
        self.expire(now)
        s = info.spec
        n = s.tp_size * s.pp_size * s.dp_size
        if self.expect is None and n > self.max_ranks:
            raise RegistryError(400, f"{s.key} claims {s.tp_size}x{s.pp_size}x{s.dp_size} = {n} ranks, more than "
                                     f"this registry holds (max_ranks {self.max_ranks})")
        old = self._ranks.get(s.key)
        if old is not None and old[2] != owner and (replace_owner is None or old[2] != replace_owner):
            raise RegistryError(409, f"{s.key} is registered by another owner (a live rank heartbeats it); it can "
                                     f"be registered again {self.ttl:g}s after that rank stops")
        for other, _, _, _ in self._ranks.values():
            o = other.spec
            if o.instance == s.instance and o.key != s.key and \
                    (o.role, o.tp_size, o.pp_size, o.dp_size) != (s.role, s.tp_size, s.pp_size, s.dp_size):
                raise RegistryError(409, f"{s.key} registers role {s.role} with tp/pp/dp sizes {s.tp_size}/"
                                         f"{s.pp_size}/{s.dp_size} but {o.key} registered {o.role} {o.tp_size}/"
                                         f"{o.pp_size}/{o.dp_size}")
        if old is None and len(self._ranks) >= self.max_ranks:
            raise RegistryError(507, f"registry full: {len(self._ranks)} registrations (max_ranks)")
        if self._bytes - (old[3] if old else 0) + size > self.max_total_bytes:
            raise RegistryError(507, f"registry full: records total more than max_total_bytes "
                                     f"{self.max_total_bytes}")
        if old is not None:
            self._drop(s.key)
        self._ranks[s.key] = (info, now, owner, size)
        self._bytes += size
        self._version += 1
        return s.key

    def heartbeat(self, key: str, now: float, owner: str = "") -> bool:
        """True when ``key`` is live and ``owner``'s; False: register again."""
        self.expire(now)
        rec = self._ranks.get(key)
        if rec is None or rec[2] != owner:
            return False
        self._ranks[key] = (rec[0], now, rec[2], rec[3])
        return True

    def remove(self, key: str, owner: str = "") -> bool:
        """Remove ``owner``'s registration of ``key``; RegistryError 403 when another owner holds it."""
        rec = self._ranks.get(key)
        if rec is None:
            return False
        if rec[2] != owner:
            raise RegistryError(403, f"{key} is registered by another owner")
        self._drop(key)
        return True

    def ranks(self, now: float, instance: str | None = None) -> list[RankInfo]:
        self.expire(now)
        return [i for i, _, _, _ in sorted(self._ranks.values(), key=lambda x: x[0].spec.key)
                if instance is None or i.spec.instance == instance]

    def readiness(self, now: float, instance: str | None = None) -> Readiness:
        """Readiness of ``instance`` (None: every instance), recomputed only after a change."""
        self.expire(now)
        hit = self._cache.get(instance)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        r = self._compute(instance)
        if len(self._cache) > 1024:
            self._cache.clear()
        self._cache[instance] = (self._version, r)
        return r

    def missing(self, now: float, instance: str | None = None) -> tuple[int, list[str]]:
        """(ranks expected, missing keys: at most ``MAX_LISTED``, then a count of the rest)."""
        r = self.readiness(now, instance)
        out = list(r.missing)
        if r.missing_count > len(r.missing):
            out.append(f"... and {r.missing_count - len(r.missing)} more")
        if not r.registered and not out:
            out = ["any rank: nothing registered yet"]
        return r.expected, out

    def _compute(self, instance: str | None) -> Readiness:
        self.computations += 1
        infos = [i for i, _, _, _ in self._ranks.values() if instance is None or i.spec.instance == instance]
        if self.expect is not None and instance is None:
            short = max(self.expect - len(infos), 0)
            return Readiness(self.expect, len(infos), (f"{short} more rank(s)",) if short else (), short)
        if not infos:
            return Readiness(0, 0, ("any rank: nothing registered yet",), 1)
        present = collections.defaultdict(set)
        sizes = {}
        for i in infos:
            s = i.spec
            present[s.instance].add(s.key)
            sizes[s.instance] = (s.tp_size, s.pp_size, s.dp_size)
        expected, count = 0, 0
        listed: list[str] = []
        for inst in sorted(sizes):
            tp, pp, dp = sizes[inst]
            expected += tp * pp * dp
            count += tp * pp * dp - len(present[inst])
            # walk the key space in order, stopping once enough are listed: each step either
            # meets a present key or lists a missing one, so the walk is O(registrations + MAX_LISTED)
            for d in range(dp):
                for p in range(pp):
                    for t in range(tp):
                        if len(listed) >= MAX_LISTED:
                            break
                        k = f"{inst}/dp{d}/pp{p}/tp{t}"
                        if k not in present[inst]:
                            listed.append(k)
                    else:
                        continue
                    break
                else:
                    continue
                break
        return Readiness(expected, len(infos), tuple(listed), count)


class NonceCache:
    """Nonces of signed writes seen within the auth window; a nonce is accepted once."""

    def __init__(self, window: float, cap: int = 100_000):
        self.window, self.cap = window, cap
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def admit(self, nonce: str, now: float) -> str | None:
        """None when ``nonce`` is new (it is remembered); else why the request is refused."""
        while self._seen:
            k, t = next(iter(self._seen.items()))
            if now - t <= 2 * self.window:
                break
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "replayed request: this signed request was already used"
        if len(self._seen) >= self.cap:
            return "too many signed requests in the auth window: retry later"
        self._seen[nonce] = now
        return None
