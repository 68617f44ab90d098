"""Who a rank is: ``RankSpec`` (its place in the deployment and the model shape the topology
needs), and the default head placement (``heads_held``). What a rank tells the registry and its
peers (``RankInfo``) is in ``kvxfer.control.records``; address syntax and policy in
``kvxfer.addresses``. Every field is checked on the way in (exact types, bounded sizes) and
raises nothing but ValueError.

Who calls what: ``RankSpec`` is made by every endpoint and parsed from every peer's record.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from .errors import ConfigError, LayoutError, PlanError, short
from .layout import SWA
from .pools import KVPool

MAX_PARALLEL = 1024     # setting: the largest tp/pp/dp size a record may claim (per-message work scales with it)


MAX_HEAD_IDS = 1 << 16       # setting: head ids in one explicit head map (a record's ``head_map``)


_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


# ------------------------------------------------------------------------------------
# Field checks
# ------------------------------------------------------------------------------------
def int_field(d: Mapping, name: str, lo: int, hi: int, default: int | None = None) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"field {name!r} must be an integer in {lo}..{hi}, got {short(v)}")
    return v


def heads_held(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads that ``tp_rank`` of ``tp_size`` holds by default: contiguous blocks of
    ``num_kv_heads / tp_size``, or one head replicated on ``tp_size / num_kv_heads`` ranks."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise PlanError(f"KV heads {num_kv_heads} are not divisible by TP size {tp_size}")
        n = num_kv_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % num_kv_heads:
        raise PlanError(f"TP size {tp_size} is not a multiple of KV heads {num_kv_heads}")
    h = tp_rank * num_kv_heads // tp_size
    return range(h, h + 1)


def _check_head_map(raw, num_kv_heads: int, tp_size: int, replicated: bool) -> tuple[tuple[int, ...], ...] | None:
    """An explicit head map, checked: one list of global head ids per TP rank of the group, as
    many per rank as the default split gives, each id in range and once per rank, every head
    held by the same number of ranks. None when it equals the default (the wire stays as before)."""
    if not isinstance(raw, (list, tuple)) or len(raw) != tp_size:
        raise ConfigError(f"head_map must be a list of {tp_size} lists (one per TP rank), got {short(raw)}")
    if replicated:
        raise ConfigError("head_map: replicated KV (MLA) is whole on every TP rank; it has no head placement")
    try:
        per = len(heads_held(num_kv_heads, tp_size, 0))
    except PlanError as e:
        raise ConfigError(f"head_map: {e}") from None
    if per * tp_size > MAX_HEAD_IDS:
        raise ConfigError(f"head_map: more than {MAX_HEAD_IDS} head ids")
    out, count = [], [0] * num_kv_heads
    for r, row in enumerate(raw):
        if not isinstance(row, (list, tuple)) or len(row) != per:
            raise ConfigError(f"head_map[{r}] must list {per} head id(s) (TP {tp_size}, {num_kv_heads} KV heads), "
                             f"got {short(row)}")
        for h in row:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < num_kv_heads:
                raise ConfigError(f"head_map[{r}]: head ids must be integers in 0..{num_kv_heads - 1}, got {short(h)}")
        if len(set(row)) != per:
            raise ConfigError(f"head_map[{r}] names a head twice: {short(list(row))}")
        for h in row:
            count[h] += 1
        out.append(tuple(row))
    share = per * tp_size // num_kv_heads    # how many ranks hold each head
    uneven = [h for h, c in enumerate(count) if c != share]
    if uneven:
        h = uneven[0]
        raise ConfigError(f"head_map: head {h} is held by {count[h]} TP rank(s), every head must be held by {share}")
    if all(tuple(heads_held(num_kv_heads, tp_size, r)) == row for r, row in enumerate(out)):
        return None
    return tuple(out)


# ------------------------------------------------------------------------------------
# Plain-data records
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """Where a rank sits in its serving instance, and the model shape the topology needs."""
    role: str                   # "prefill" | "decode"
    num_kv_heads: int           # global KV heads of the model (1 for MLA)
    num_layers: int             # global layers of the model
    instance: str = "default"   # one serving instance (a P or D deployment)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    replicated: bool = False    # KV identical on every TP rank (MLA): one source per head
    # The global KV heads of each TP rank of this rank's group, in the order of its pool's local
    # heads; None: the default (``heads_held``). Every rank of a TP group gives the same map.
    head_map: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        d = self._fields()
        if self.role not in ("prefill", "decode") or not isinstance(self.role, str):
            raise ConfigError(f"role must be 'prefill' or 'decode', got {short(self.role)}")
        if not isinstance(self.instance, str) or not _NAME.fullmatch(self.instance):
            raise ConfigError(f"instance must match {_NAME.pattern} (whole string), got {short(self.instance)}")
        for size in ("tp_size", "pp_size", "dp_size"):
            n = int_field(d, size, 1, MAX_PARALLEL)
            int_field(d, size.replace("size", "rank"), 0, n - 1)
        int_field(d, "num_kv_heads", 1, 1 << 20)
        int_field(d, "num_layers", 1, 1 << 20)
        if not isinstance(self.replicated, bool):
            raise ConfigError(f"replicated must be a bool, got {short(self.replicated)}")
        if self.head_map is not None:
            object.__setattr__(self, "head_map",
                               _check_head_map(self.head_map, self.num_kv_heads, self.tp_size, self.replicated))

    def heads_of(self, tp_rank: int) -> Sequence[int]:
        """The global KV heads TP rank ``tp_rank`` of this rank's group holds, in local order."""
        if self.head_map is not None:
            return self.head_map[tp_rank]
        return heads_held(self.num_kv_heads, self.tp_size, tp_rank)

    @property
    def heads(self) -> Sequence[int]:
        """The global KV heads this rank holds, in the order of its pool's local heads."""
        return self.heads_of(self.tp_rank)

    def _fields(self) -> dict:
        """Every field by name (``dataclasses.asdict`` without its deep copy: a spec is made on every
        peer record, twice per peer of a connect)."""
        return {name: getattr(self, name) for name in _SPEC_FIELDS}

    def to_dict(self) -> dict:
        """Plain data; ``head_map`` only when explicit (a default record has the old shape)."""
        d = self._fields()
        if self.head_map is None:
            del d["head_map"]
        else:
            d["head_map"] = [list(row) for row in self.head_map]
        return d

    @property
    def key(self) -> str:
        """Registry key: ``instance/dp0/pp0/tp0``."""
        return f"{self.instance}/dp{self.dp_rank}/pp{self.pp_rank}/tp{self.tp_rank}"


_SPEC_FIELDS = tuple(f.name for f in fields(RankSpec))


# ------------------------------------------------------------------------------------
# A rank's pools against its place (endpoints check them at start-up)
# ------------------------------------------------------------------------------------
def swa_window(kv: KVPool) -> int:
    """The sliding window of a hybrid pool (``HybridSWAPool.window``), 0 for any other pool."""
    if not any(s.name == SWA for s in kv.layout.spaces):
        return 0
    window = getattr(kv, "window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise LayoutError(f"a pool with a {SWA!r} slot space must say its sliding window in tokens "
                          f"(an int >= 1, as HybridSWAPool.window does), got {window!r}")
    return window


def check_heads(spec: RankSpec, kv: KVPool) -> None:
    """The KV pool holds as many heads as this rank's share (``spec.heads``), or says so in words."""
    held = list(spec.heads)
    want = spec.num_kv_heads if spec.replicated else len(held)
    wrong = sorted({p.heads for p in kv.layout.parts if p.heads != want})
    if wrong:
        which = "every head" if spec.replicated else f"heads {span(held)}"
        raise LayoutError(
            f"the KV pool of {spec.role} rank {spec.key} holds {wrong[0]} heads per layer, but TP rank "
            f"{spec.tp_rank} of {spec.tp_size} with {spec.num_kv_heads} KV heads holds {want} ({which}): "
            f"make the pool with heads=len(kvxfer.heads_held({spec.num_kv_heads}, {spec.tp_size}, {spec.tp_rank}))")


def span(heads: list[int]) -> str:
    if heads == list(range(heads[0], heads[-1] + 1)):
        return f"{heads[0]}..{heads[-1]}"
    return str(heads) if len(heads) <= 16 else f"{heads[:16]}..."
