"""Decode's view of the prefill instances it pulls from: one ``PrefillInstance`` per instance a
request named, and the pure steps of connecting to one (``find_ranks``, ``plan_groups``).

One decode endpoint serves requests from any number of prefill instances; each request names its
own (``DecodeEndpoint.receiver(room, instance=..., bootstrap=...)``). The first request that
names an instance starts its handshake on a connect thread (the request waits, Bootstrapping);
the instance is kept afterwards and recovered on its own (``kvxfer.endpoint.recovery``). An
instance is named by its registry (``bootstrap``, a URL; None: the endpoint's default registry)
and its name there (``instance``; None: the only instance registered there, as SGLang runs one
bootstrap server per prefill instance). Instance names are unique per decode endpoint: two
registries that hold instances of the same name are refused, naming both.

Who calls what: ``DecodeEndpoint`` makes and keeps the records, under its lock; the connect
thread calls ``find_ranks`` (blocking, registry reads) and ``plan_groups`` (pure).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from ..control.client import BootstrapClient
from ..control.compat import check_group, require_compatible
from ..control.records import RankInfo
from ..errors import CompatibilityError, ConnectError
from ..topology import peers_needed

Groups = dict[int, dict[str, list]]   # prefill dp rank -> prefill rank key -> the sources it feeds here


class Phase(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


class PrefillInstance:
    """One prefill instance as a decode endpoint knows it. ``ref``: (registry URL or "", name or "")
    as requests name it; ``name``: its name once known; ``groups``: its DP groups' ranks and
    sources (READY); ``error``: why its handshake failed (FAILED); ``waiting``: receivers made
    before it was READY; ``client``: its registry (None when connected from records)."""
    __slots__ = ("ref", "name", "client", "phase", "groups", "error", "waiting", "failed_at")

    def __init__(self, ref: tuple[str, str], client: BootstrapClient | None):
        self.ref, self.client = ref, client
        self.name = ref[1] or None
        self.phase, self.error = Phase.CONNECTING, ""
        self.groups: Groups = {}
        self.waiting: list = []
        self.failed_at = 0.0

    def __repr__(self) -> str:
        return f"PrefillInstance({self.name or '?'} at {self.ref[0] or 'records'}, {self.phase.value})"


def check_one_instance(ranks: Sequence[RankInfo], where: str = "") -> str:
    """The one prefill instance of ``ranks``; ConnectError listing them when there are several."""
    names = sorted({r.spec.instance for r in ranks if r.spec.role == "prefill"})
    if len(names) > 1:
        raise ConnectError(f"several prefill instances are registered{where} ({', '.join(names)}): name the one "
                           f"to pull from (connect(instance=...), or receiver(..., instance=...))")
    if not names:
        raise ConnectError(f"no prefill rank is registered{where}")
    return names[0]


def find_ranks(client: BootstrapClient, name: str | None, deadline: float) -> tuple[str, list[RankInfo]]:
    """Blocking, until ``deadline`` (``time.monotonic``): the instance's name and its prefill ranks,
    once the registry holds every rank it expects (one request the registry holds until then; an
    unreachable registry is asked again with backoff). ``name`` None: the only instance there (the
    registry's list of names is read first, a few bytes; never every record)."""
    if name is None:
        try:
            names = client.instances()
        except ConnectError:   # not up yet: wait_ready below says so if it stays down
            names = []
        if len(names) == 1:
            name = names[0]
        elif names:            # several: the error names them all
            check_one_instance(client.topology()[1], f" at {client.url}")
    ranks = client.wait_ready(max(deadline - time.monotonic(), 0.0), name)
    ranks = [r for r in ranks if r.spec.role == "prefill" and (name is None or r.spec.instance == name)]
    return name or check_one_instance(ranks, f" at {client.url}"), ranks


def plan_groups(ranks: Sequence[RankInfo], me: RankInfo, transport: str) -> tuple[Groups, dict[str, RankInfo]]:
    """Which prefill ranks of one instance this decode rank pulls from, per DP group, with the
    sources each feeds here; CompatibilityError (every mismatch) or ConnectError (a rank missing)."""
    by_key = {p.spec.key: p for p in ranks}
    if not by_key:
        raise ConnectError("no prefill rank to connect to")
    conflicts = check_group(list(by_key.values()))   # sources by head id: one head map per group
    if conflicts:
        raise CompatibilityError(conflicts)
    groups: Groups = {}
    for p in by_key.values():
        if p.spec.dp_rank not in groups:
            groups[p.spec.dp_rank] = {f"{p.spec.instance}/dp{p.spec.dp_rank}/pp{pp}/tp{tp}": ss
                                      for (tp, pp), ss in peers_needed(p.spec, me.spec).items()}
    missing = [k for g in groups.values() for k in g if k not in by_key]
    if missing:
        raise ConnectError(f"prefill rank(s) {', '.join(missing)} needed but not registered")
    require_compatible([(by_key[k], me) for g in groups.values() for k in g], transport)
    return groups, {k: by_key[k] for g in groups.values() for k in g}


def instance_of(key: str) -> str:
    """The instance name in a rank key (``RankSpec.key``: ``instance/dpD/ppP/tpT``)."""
    return key.rsplit("/", 3)[0]


__all__ = ["PrefillInstance", "Phase", "Groups", "check_one_instance", "find_ranks", "plan_groups", "instance_of"]
