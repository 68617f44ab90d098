"""etcd as the registry (``etcd://host:2379[,host2:2379...][/prefix]``): the backend of
``BootstrapClient`` for large or highly available deployments.

etcd's v3 API through its HTTP/JSON gateway (``/v3/...``, in every etcd since 3.4), spoken with the
standard library over kept-alive connections (``kvxfer.control.httplink``): no client library to
install, and the same few calls a gRPC client would make. Keys, under ``prefix`` (default
``kvxfer``):

    <prefix>/ranks/<instance>/dp<d>/pp<p>/tp<t>   a rank's record without layout (JSON, with
                                                  ``layout_digest``), attached to the rank's lease
    <prefix>/layouts/<digest>                     a layout (canonical JSON), written once by the
                                                  first rank that needs it, shared, never rewritten

A rank registers under a lease (``ttl`` seconds, default ``ETCD_TTL``) and keeps it alive on one
connection (``heartbeat``: one keep-alive call every ttl / 3, etcd's own client's period; every
third also checks that the key is still on the lease). The key is
written only when it is free or already on this lease (one transaction), so a restarted rank
takes its key over exactly when its predecessor's lease expired: etcd's TTL, no probe. Decode
ranks watch their instances' prefix (``changes``: a watch from the version they know; only the
instances an event names are read again). Layouts stay when ranks go (a few per model
configuration; ``etcdctl del --prefix <prefix>/layouts/`` clears them once no rank runs).

Trust: etcd's own access control guards writes (the registry secret signs only the embedded
registry's requests); every record read is checked as one from the embedded registry is
(``BootstrapClient.ranks_of``), and a record whose fields disagree with its key is dropped.

Who calls what: ``BootstrapClient`` only (see ``kvxfer.control.discovery.Backend``).
"""
from __future__ import annotations

import base64
import json
import logging
import time
import urllib.parse
from collections.abc import Mapping

from ..errors import ConnectError
from .discovery import WHOLE, Snapshot, canonical, readiness
from .httplink import HttpLink, endpoints

log = logging.getLogger("kvxfer.control.bootstrap")

MAX_LINE = 64 << 20      # bytes of one watch message
MAX_RECORDS = 1 << 16    # records one read returns
CHECK_EVERY = 3          # heartbeats per check that the key is still on the rank's lease
# A lease's default ttl, in seconds. Keep-alives are most of what etcd spends on a deployment (one
# lease per rank, renewed every ttl / 3): 1,024 leases of 10 s cost one etcd 3.4 node ~9% of a core
# for keep-alives alone (a bare client, gRPC or gateway alike), 1,024 ranks with their decode
# ranks' watches 17.7% in all; with 30 s, 7.2% (scripts/bench_registry.py). What a longer ttl
# costs: a rank killed and restarted takes its key over up to ttl after its last keep-alive (the
# key follows the lease); a dead rank's record stays that long, which decode ranks do not rely
# on (a lost peer is found by its transport and its control channel). Kubernetes renews node
# leases of 40 s every 10 s; etcd's own sessions default to 60 s.
ETCD_TTL = 30.0


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s) -> bytes:
    try:
        return base64.b64decode(s, validate=True) if isinstance(s, str) else b""
    except ValueError:
        return b""


def _end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (it ends with '/')."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _key_of(rec: dict) -> str | None:
    try:
        return f"{rec['instance']}/dp{int(rec['dp_rank'])}/pp{int(rec['pp_rank'])}/tp{int(rec['tp_rank'])}"
    except (KeyError, TypeError, ValueError):
        return None


class EtcdRegistry:
    """etcd's client side (``Backend``; see the module docstring)."""
    default_ttl = ETCD_TTL

    def __init__(self, url: str, timeout: float, source: str | None = None):
        self.url = url.rstrip("/")
        self.prefix = urllib.parse.urlsplit(self.url).path.strip("/") or "kvxfer"
        self.link = HttpLink(endpoints(self.url, {"etcd": "http"}, 2379), timeout, f"etcd {self.url}", source)
        self._leases: dict[str, str] = {}      # owner -> its lease id
        self._beats: dict[str, int] = {}       # owner -> heartbeats so far

    # -- the gateway ------------------------------------------------------------------------
    def _rpc(self, path: str, body: dict) -> dict:
        status, raw = self.link.request("POST", "/v3/" + path, json.dumps(body).encode())
        for line in raw.splitlines():   # a streaming call answers {"result": ...} lines: the first
            raw = line
            break
        try:
            answer = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        if status != 200 or "error" in answer:
            why = answer.get("message") or answer.get("error") or f"HTTP {status}"
            code = answer.get("code")     # gRPC's: 4 deadline, 8 exhausted, 10 aborted, 14 unavailable
            raise ConnectError(f"etcd {self.url}: {path}: {str(why)[:300]}",
                               transient=status >= 500 or code in (4, 8, 10, 14))
        res = answer.get("result", answer)
        return res if isinstance(res, dict) else {}

    def _ranks(self, sub: str = "") -> str:
        return f"{self.prefix}/ranks/{sub}"

    def _range(self, prefix: str, keys_only: bool = False) -> tuple[int, list[tuple[str, dict]]]:
        """(revision, [(key under ``prefix``, kv)]) of every key starting with ``prefix``."""
        ans = self._rpc("kv/range", {"key": _b64(prefix), "range_end": _b64(_end(prefix)), "keys_only": keys_only,
                                     "limit": MAX_RECORDS})
        kvs = ans.get("kvs", [])
        out = [(_unb64(kv.get("key")).decode(errors="replace")[len(prefix):], kv)
               for kv in (kvs if isinstance(kvs, list) else []) if isinstance(kv, dict)]
        return int(ans.get("header", {}).get("revision", 0)), out

    # -- writes -----------------------------------------------------------------------------
    def register(self, record: dict, layout: Mapping, owner: str, ttl: float) -> str:
        key = _key_of(record)
        digest = record["layout_digest"]
        lay_key = f"{self.prefix}/layouts/{digest}"
        self._rpc("kv/txn", {"compare": [{"key": _b64(lay_key), "target": "CREATE", "create_revision": "0"}],
                             "success": [{"request_put": {"key": _b64(lay_key), "value": _b64(canonical(layout))}}]})
        shape = tuple(record[f] for f in ("role", "tp_size", "pp_size", "dp_size"))
        for _, kv in self._range(self._ranks(record["instance"] + "/"))[1]:
            rec = self._record(kv)
            if rec is not None and _key_of(rec) != key and \
                    tuple(rec.get(f) for f in ("role", "tp_size", "pp_size", "dp_size")) != shape:
                raise ConnectError(f"etcd {self.url} refused the registration of {key} (HTTP 409): it registers "
                                   f"tp/pp/dp sizes {shape[1:]} but {_key_of(rec)} registered "
                                   f"{tuple(rec.get(f) for f in ('tp_size', 'pp_size', 'dp_size'))}")
        k, value = _b64(self._ranks(key)), _b64(canonical(record))
        for attempt in (0, 1):
            lease = self._lease(owner, ttl)
            put = [{"request_put": {"key": k, "value": value, "lease": lease}}]
            try:
                for compare in ({"key": k, "target": "CREATE", "create_revision": "0"},     # free
                                {"key": k, "target": "LEASE", "lease": lease}):              # or already ours
                    if self._rpc("kv/txn", {"compare": [compare], "success": put}).get("succeeded") is True:
                        return key
                break
            except ConnectError as e:   # our lease ran out while we waited for the key: take a new one
                if "lease not found" not in str(e) or attempt:
                    raise
                self._leases.pop(owner, None)
        raise ConnectError(f"etcd {self.url} refused the registration of {key} (HTTP 409): {key} is registered "
                           f"by another owner (its lease lives); it is free once that lease expires",
                           transient=True)

    def _lease(self, owner: str, ttl: float) -> str:
        """``owner``'s lease, kept alive just now (so that it outlives the write that follows: a
        registration may wait a whole TTL for a predecessor's key), or a new one of ``ttl`` seconds."""
        lease = self._leases.get(owner)
        if lease is not None and int(self._rpc("lease/keepalive", {"ID": lease}).get("TTL", 0) or 0) > 0:
            return lease
        lease = str(self._rpc("lease/grant", {"TTL": max(int(round(ttl)), 1)}).get("ID", ""))
        if not lease.isdigit():
            raise ConnectError(f"etcd {self.url}: lease/grant answered no lease", transient=True)
        self._leases[owner] = lease
        return lease

    def heartbeat(self, key: str, owner: str) -> bool:
        """The lease kept alive; every ``CHECK_EVERY``th beat (once a ttl at ttl / 3 a beat) also a
        check that the key is still on it: nothing but an explicit delete (an operator's, or anyone's
        with write access) takes a key off a live lease, and that costs etcd a read per beat."""
        lease = self._leases.get(owner)
        if lease is None:
            return False
        if int(self._rpc("lease/keepalive", {"ID": lease}).get("TTL", 0) or 0) <= 0:
            self._leases.pop(owner, None)        # expired: the next registration takes a new lease
            return False
        self._beats[owner] = beat = self._beats.get(owner, 0) + 1
        if beat % CHECK_EVERY:
            return True
        mine = {"key": _b64(self._ranks(key)), "target": "LEASE", "lease": lease}
        return self._rpc("kv/txn", {"compare": [mine]}).get("succeeded") is True

    def deregister(self, key: str, owner: str) -> None:
        lease = self._leases.pop(owner, None)
        self._beats.pop(owner, None)
        if lease is None:
            return
        k = _b64(self._ranks(key))
        self._rpc("kv/txn", {"compare": [{"key": k, "target": "LEASE", "lease": lease}],
                             "success": [{"request_delete_range": {"key": k}}]})
        self._rpc("lease/revoke", {"ID": lease})

    # -- reads ------------------------------------------------------------------------------
    def _record(self, kv: dict) -> dict | None:
        try:
            rec = json.loads(_unb64(kv.get("value")))
        except (ValueError, RecursionError):
            return None
        return rec if isinstance(rec, dict) else None

    def snapshot(self, instance: str) -> Snapshot:
        revision, kvs = self._range(self._ranks("" if instance == WHOLE else instance + "/"))
        records: list[dict] = []
        by_instance: dict[str, tuple[tuple, set[str]]] = {}
        for sub, kv in kvs:
            rec = self._record(kv)
            key = sub if instance == WHOLE else f"{instance}/{sub}"
            if rec is None or _key_of(rec) != key:
                log.warning("etcd %s: the record under %s is not that rank's: ignored", self.url, key[:200])
                continue
            records.append(rec)
            sizes = tuple(rec.get(f) for f in ("tp_size", "pp_size", "dp_size"))
            if all(type(n) is int and 1 <= n <= 1 << 16 for n in sizes):
                by_instance.setdefault(rec["instance"], (sizes, set()))[1].add(key)
        r = readiness(by_instance)
        return Snapshot(instance, revision, r.ready, r.expected, tuple(r.listed()) if not r.ready else (),
                        tuple(records))

    def changes(self, since: Mapping[str, int], wait: float, ready: bool = False) -> dict[str, Snapshot]:
        deadline = time.monotonic() + wait
        since = dict(since)
        fresh = {n: self.snapshot(n) for n, v in since.items() if v <= 0}
        out = {n: s for n, s in fresh.items() if (since[n] < 0 or s.records) and (not ready or s.ready)}
        if out:
            return out
        for n, s in fresh.items():
            since[n] = s.version
        while (left := deadline - time.monotonic()) > 0:
            changed = self._watch(since, left)
            snaps = {n: self.snapshot(n) for n in changed}
            out = {n: s for n, s in snaps.items() if not ready or s.ready}
            if out:
                return out
            for n, s in snaps.items():
                since[n] = s.version
        return {}

    def _watch(self, since: Mapping[str, int], wait: float) -> set[str]:
        """The instances of ``since`` that changed after their versions, once one did (a watch from
        the oldest version, on the prefix that covers them); empty after ``wait`` seconds."""
        names = list(since)
        prefix = self._ranks(names[0] + "/") if len(names) == 1 and names[0] != WHOLE else self._ranks()
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_end(prefix)),
                                   "start_revision": str(min(since.values()) + 1)}}
        changed: set[str] = set()
        end = time.monotonic() + wait
        with self.link.stream("POST", "/v3/watch", json.dumps(body).encode(), wait) as resp:
            while not changed and time.monotonic() < end:
                try:
                    line = resp.readline(MAX_LINE)
                except TimeoutError:
                    break
                if not line:
                    raise ConnectError(f"etcd {self.url}: the watch ended", transient=True)
                try:
                    res = json.loads(line).get("result", {})
                except (ValueError, RecursionError, AttributeError):
                    raise ConnectError(f"etcd {self.url}: a watch message is not JSON", transient=True) from None
                if res.get("compact_revision") or res.get("canceled"):
                    return set(names)    # history compacted past what we knew: read everything again
                for ev in res.get("events", []):
                    sub = _unb64(ev.get("kv", {}).get("key")).decode(errors="replace")[len(self._ranks()):]
                    mod = int(ev.get("kv", {}).get("mod_revision", 0) or 0)
                    inst = sub.rsplit("/", 3)[0]
                    for n in names:
                        if (n == WHOLE or n == inst) and mod > since[n]:
                            changed.add(n)
        return changed

    def layout(self, digest: str) -> bytes:
        _, kvs = self._range(f"{self.prefix}/layouts/{digest}")
        for sub, kv in kvs:
            if sub == "":
                return _unb64(kv.get("value"))
        raise ConnectError(f"etcd {self.url}: no layout {digest[:16]}...", transient=True)

    def instances(self) -> list[str]:
        _, kvs = self._range(self._ranks(), keys_only=True)
        return sorted({sub.rsplit("/", 3)[0] for sub, _ in kvs if sub.count("/") >= 3})

    def health(self, instance: str | None) -> dict:
        s = self.snapshot(instance or WHOLE)
        if s.ready:
            return {"status": "ready", "registered": len(s.records), "expected": s.expected}
        return {"status": "not ready", "registered": len(s.records), "expected": s.expected, "missing": list(s.missing)}

    def interrupt(self) -> None:
        self.link.interrupt()

    def close(self) -> None:
        self.link.close()


__all__ = ["EtcdRegistry"]
