"""The embedded registry's state: live registrations, their owners, one layout per digest, a
version per instance, and the answers built from them. Pure state, no I/O.

Who calls what: ``BootstrapServer`` (``kvxfer.control.bootstrap``) calls every method from its one
event-loop thread. Nothing here costs more than the request's own size: expiry pops the oldest
registrations only (they are kept in heartbeat order), a registration touches its instance only,
and every answer (a snapshot of an instance, the whole topology, the instance list) is built once
per version of what it shows, from the records' JSON kept as bytes, and then reused.

Records and layouts: a registration keeps its record's JSON without the layout, and the layout
once per digest (``kvxfer.control.discovery``), shared by every rank that names it and dropped
with the last. ``snapshot`` answers records with ``layout_digest``; ``topology`` (operators' curl)
puts the layout back in.

Ownership: the first registrant of a key owns it (``owner``: a random token the client's
``Registration`` sends with every write, never returned by a read). While that registration
lives, a PUT, heartbeat or DELETE of the key with another owner is refused; once it expired (no
heartbeat for ``ttl``) anyone may register the key. A restarted rank may take the key over sooner
when its predecessor is provably gone: ``BootstrapServer`` decides that (silent and its control
address refuses connections) and passes ``replace_owner``.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
from dataclasses import dataclass

from ..errors import ProtocolError
from .discovery import WHOLE, Readiness, readiness
from .records import RankInfo

log = logging.getLogger("kvxfer.control.bootstrap")

OWNER = re.compile(r"[A-Za-z0-9_\-]{16,64}")
KEY = re.compile(r"[A-Za-z0-9_.:\-]{1,128}/dp\d{1,5}/pp\d{1,5}/tp\d{1,5}")


class RegistryError(ProtocolError):
    """A write the registry refuses; ``status`` is the HTTP status to answer and ``code`` says to
    the client whether trying again may help ("owned", "full": yes; "conflict", "layout": no)."""

    def __init__(self, status: int, why: str, code: str = "refused"):
        self.status, self.code = status, code
        super().__init__(why)


@dataclass(slots=True)
class Entry:
    info: RankInfo        # the record without its layout
    digest: str           # its layout's
    body: bytes           # the record's JSON without layout (and without digest)
    seen: float           # last heartbeat (time.monotonic)
    owner: str
    remote: str           # the address it registered from (connection reserve)


@dataclass(slots=True)
class Layout:
    raw: bytes            # canonical JSON
    refs: int


class Instance:
    """One instance's registrations, its sizes, its version and the answers built at that version."""
    __slots__ = ("name", "keys", "shape", "version", "_built")

    def __init__(self, name: str):
        self.name = name
        self.keys: dict[str, Entry] = {}
        self.shape: tuple[str, int, int, int] | None = None
        self.version = 0
        self._built: dict[str, tuple[int, object]] = {}

    def built(self, what: str, make):
        hit = self._built.get(what)
        if hit is None or hit[0] != self.version:
            hit = (self.version, make())
            self._built[what] = hit
        return hit[1]


def _with_digest(e: Entry) -> bytes:
    return b'{"layout_digest":"' + e.digest.encode() + b'",' + e.body[1:]


class Registry:
    """Live registrations keyed by ``RankSpec.key``; expiry by heartbeat age; caps on count and bytes."""

    def __init__(self, ttl: float, expect: int | None = None, *, max_ranks: int = 4096,
                 max_total_bytes: int = 64 << 20):
        self.ttl, self.expect = ttl, expect
        self.max_ranks, self.max_total_bytes = max_ranks, max_total_bytes
        self.epoch = os.urandom(8).hex()          # names this life of the registry: versions restart with it
        self.version = 0
        self._ranks: collections.OrderedDict[str, Entry] = collections.OrderedDict()   # oldest heartbeat first
        self._layouts: dict[str, Layout] = {}
        self._instances: dict[str, Instance] = {}
        self._whole = Instance(WHOLE)
        self._bytes = 0
        self.by_remote: collections.Counter[str] = collections.Counter()   # registrations per address
        self.changed: set[str] = set()     # instances changed since ``take_changed``
        self.computations = 0              # readiness computations so far (once per change and instance asked)

    # -- changes ----------------------------------------------------------------------------
    def _touch(self, inst: Instance) -> None:
        self.version += 1
        inst.version = self._whole.version = self.version
        self.changed.add(inst.name)

    def take_changed(self) -> set[str]:
        out, self.changed = self.changed, set()
        return out

    def _drop(self, key: str) -> None:
        e = self._ranks.pop(key)
        self._bytes -= len(e.body)
        lay = self._layouts[e.digest]
        lay.refs -= 1
        if not lay.refs:
            del self._layouts[e.digest]
            self._bytes -= len(lay.raw)
        self.by_remote[e.remote] -= 1
        if self.by_remote[e.remote] <= 0:
            del self.by_remote[e.remote]
        inst = self._instances[e.info.spec.instance]
        del inst.keys[key]
        self._touch(inst)
        if not inst.keys:
            del self._instances[inst.name]

    def expire(self, now: float) -> list[str]:
        gone = []
        while self._ranks:
            key, e = next(iter(self._ranks.items()))
            if now - e.seen <= self.ttl:
                break
            log.warning("registration %s expired: no heartbeat for %.1fs", key, self.ttl)
            self._drop(key)
            gone.append(key)
        return gone

    # -- writes -----------------------------------------------------------------------------
    def holder(self, key: str, now: float) -> tuple[RankInfo, float, str] | None:
        """The live registration of ``key``: (record, seconds since its last heartbeat, owner)."""
        self.expire(now)
        e = self._ranks.get(key)
        return None if e is None else (e.info, now - e.seen, e.owner)

    def has_layout(self, digest: str) -> bool:
        return digest in self._layouts

    def layout(self, digest: str) -> bytes | None:
        lay = self._layouts.get(digest)
        return None if lay is None else lay.raw

    def register(self, info: RankInfo, body: bytes, digest: str, raw_layout: bytes | None, now: float,
                 owner: str = "", remote: str = "", replace_owner: str | None = None) -> str:
        """Add or replace (same owner) a registration of ``info`` (its record's JSON ``body``, its
        layout by ``digest``: ``raw_layout`` when the registry may not hold it yet). RegistryError:
        428 "layout" (send the layout), 409 "owned" (another owner holds the key) or "conflict"
        (sizes differ from the instance's), 400, 507 "full" past the caps. ``replace_owner``: the
        owner of a predecessor shown to be gone, whose registration this one may replace."""
        self.expire(now)
        s = info.spec
        n = s.tp_size * s.pp_size * s.dp_size
        if self.expect is None and n > self.max_ranks:
            raise RegistryError(400, f"{s.key} claims {s.tp_size}x{s.pp_size}x{s.dp_size} = {n} ranks, more than "
                                     f"this registry holds (max_ranks {self.max_ranks})")
        if raw_layout is None and digest not in self._layouts:
            raise RegistryError(428, f"layout {digest[:16]}... is not held here: send the record with its layout",
                                "layout")
        old = self._ranks.get(s.key)
        if old is not None and old.owner != owner and (replace_owner is None or old.owner != replace_owner):
            raise RegistryError(409, f"{s.key} is registered by another owner (a live rank heartbeats it); it can "
                                     f"be registered again {self.ttl:g}s after that rank stops", "owned")
        inst = self._instances.get(s.instance)
        shape = (s.role, s.tp_size, s.pp_size, s.dp_size)
        if inst is not None and inst.shape != shape and any(k != s.key for k in inst.keys):
            o = inst.keys[next(k for k in inst.keys if k != s.key)].info.spec
            raise RegistryError(409, f"{s.key} registers role {s.role} with tp/pp/dp sizes {s.tp_size}/{s.pp_size}/"
                                     f"{s.dp_size} but {o.key} registered {o.role} {o.tp_size}/{o.pp_size}/"
                                     f"{o.dp_size}", "conflict")
        if old is None and len(self._ranks) >= self.max_ranks:
            raise RegistryError(507, f"registry full: {len(self._ranks)} registrations (max_ranks)", "full")
        new_layout = 0 if digest in self._layouts or raw_layout is None else len(raw_layout)
        freed = len(old.body) if old is not None else 0
        if old is not None and old.digest != digest and self._layouts[old.digest].refs == 1:
            freed += len(self._layouts[old.digest].raw)
        if self._bytes - freed + len(body) + new_layout > self.max_total_bytes:
            raise RegistryError(507, f"registry full: records total more than max_total_bytes "
                                     f"{self.max_total_bytes}", "full")
        if digest not in self._layouts:
            self._layouts[digest] = Layout(raw_layout, 0)
            self._bytes += len(raw_layout)
        self._layouts[digest].refs += 1          # before the old one's drop: the same layout stays
        if old is not None:
            self._drop(s.key)
        inst = self._instances.get(s.instance)
        if inst is None:
            inst = self._instances[s.instance] = Instance(s.instance)
        inst.shape = shape
        e = Entry(info, digest, body, now, owner, remote)
        self._ranks[s.key] = inst.keys[s.key] = e
        self._bytes += len(body)
        self.by_remote[remote] += 1
        self._touch(inst)
        return s.key

    def heartbeat(self, key: str, now: float, owner: str = "") -> bool:
        """True when ``key`` is live and ``owner``'s; False: register again."""
        self.expire(now)
        e = self._ranks.get(key)
        if e is None or e.owner != owner:
            return False
        e.seen = now
        self._ranks.move_to_end(key)
        return True

    def remove(self, key: str, owner: str = "") -> bool:
        """Remove ``owner``'s registration of ``key``; RegistryError 403 when another owner holds it."""
        e = self._ranks.get(key)
        if e is None:
            return False
        if e.owner != owner:
            raise RegistryError(403, f"{key} is registered by another owner")
        self._drop(key)
        return True

    # -- reads ------------------------------------------------------------------------------
    def version_of(self, instance: str) -> int:
        """The version of ``instance`` (``WHOLE``: of the registry); 0 while nothing is registered."""
        if instance == WHOLE:
            return self._whole.version
        inst = self._instances.get(instance)
        return 0 if inst is None else inst.version

    def ranks(self, now: float, instance: str | None = None) -> list[RankInfo]:
        """The records (without layouts) of ``instance`` (None: every one), by key."""
        self.expire(now)
        return [self._ranks[k].info for k in sorted(self._keys(instance))]

    def _keys(self, instance: str | None) -> list[str]:
        if instance is None or instance == WHOLE:
            return list(self._ranks)
        inst = self._instances.get(instance)
        return [] if inst is None else list(inst.keys)

    def readiness(self, now: float, instance: str | None = None) -> Readiness:
        """Readiness of ``instance`` (None: every instance), computed once per version of it."""
        self.expire(now)
        inst = self._whole if instance is None or instance == WHOLE else self._instances.get(instance)
        if inst is None:
            return readiness({})

        def compute() -> Readiness:
            self.computations += 1
            insts = self._instances.values() if inst is self._whole else [inst]
            return readiness({i.name: (i.shape[1:], set(i.keys)) for i in insts},
                             self.expect if inst is self._whole else None)
        return inst.built("readiness", compute)

    def snapshot(self, now: float, instance: str) -> bytes:
        """JSON of ``instance`` (``WHOLE``: every one) at its version: version, readiness and its
        records with ``layout_digest``; built once per version."""
        r = self.readiness(now, instance)
        inst = self._whole if instance == WHOLE else self._instances.get(instance)
        if inst is None:
            return _snapshot_json(0, r, [])
        return inst.built("snapshot", lambda: _snapshot_json(inst.version, r, [
            _with_digest(self._ranks[k]) for k in sorted(self._keys(instance))]))

    def topology(self, now: float, instance: str | None) -> list[bytes]:
        """The pieces of ``/topology``'s JSON (records with their layouts), built once per version."""
        r = self.readiness(now, instance)
        inst = self._whole if instance is None else self._instances.get(instance)

        def build() -> list[bytes]:
            recs: list[bytes] = []
            for k in sorted(self._keys(instance)):
                e = self._ranks[k]
                recs += [b',{"layout":' if recs else b'{"layout":', self._layouts[e.digest].raw, b",", e.body[1:]]
            head = (f'{{"ready":{"true" if r.ready else "false"},"expected":{r.expected},"missing":'
                    f'{_json_list([] if r.ready else r.listed())},"ranks":[').encode()
            return [head, *recs, b"]}"]
        return build() if inst is None else inst.built("topology", build)

    def instances(self, now: float) -> bytes:
        """JSON {"version", "instances": {name: {"registered", "expected", "ready"}}}, once per version."""
        self.expire(now)

        def build() -> bytes:
            out = {}
            for name in sorted(self._instances):
                r = self.readiness(now, name)
                out[name] = {"registered": r.registered, "expected": r.expected, "ready": r.ready}
            return _dumps({"version": self._whole.version, "instances": out})
        return self._whole.built("instances", build)


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _json_list(items: list[str]) -> str:
    return json.dumps(items)


def _snapshot_json(version: int, r: Readiness, records: list[bytes]) -> bytes:
    head = (f'{{"version":{version},"ready":{"true" if r.ready else "false"},"expected":{r.expected},'
            f'"missing":{_json_list([] if r.ready else r.listed())},"ranks":[').encode()
    return head + b",".join(records) + b"]}"


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
