"""Which prefill ranks feed which decode rank, with which heads and layers. Pure data.

Heads are global KV heads of the model. With ``tp`` ranks and ``H`` KV heads a rank
holds ``H / tp`` heads when ``H >= tp``, else one head replicated on ``tp / H`` ranks
(GQA with few KV heads); by default in contiguous blocks (``heads_held``), or where the
group's ``RankSpec.head_map`` says. Sources are matched by global head id: each head a
decode rank holds comes from a prefill rank that holds it, slice by slice (one aligned slice
per run of heads both sides hold in the same order, else one per head). MLA KV is
replicated on every rank.

``sources_for_decode_rank`` answers "whom does my decode rank pull from"; every
(decode rank, head) has exactly one source, so no byte is written twice.
``targets_for_prefill_rank`` is the inverse the prefill side needs: a prefill rank
that feeds nobody (a replica) still confirms its requests.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlanError
from .plan import HeadSlice
from .ranks import RankSpec, heads_held


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """Decode rank ``d_rank`` takes heads from prefill rank (``p_tp_rank``, ``p_pp_rank``):
    slice ``src_heads`` of the prefill rank's local heads lands at slice ``dst_heads`` of
    the decode rank's local heads; ``layers`` are the global layers that stage holds."""
    d_rank: int
    p_tp_rank: int
    p_pp_rank: int
    src_heads: HeadSlice
    dst_heads: HeadSlice
    layers: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"d_rank": self.d_rank, "p_tp_rank": self.p_tp_rank, "p_pp_rank": self.p_pp_rank,
                "src_heads": self.src_heads.to_list(), "dst_heads": self.dst_heads.to_list(),
                "layers": list(self.layers)}


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, ...]:
    """Layers of pipeline stage ``pp_rank``: an even split, earlier stages take the remainder."""
    if not 1 <= pp_size <= num_layers:
        raise PlanError(f"PP size {pp_size} must be in 1..{num_layers} (layers)")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return tuple(range(start, start + base + (pp_rank < extra)))


HeadMap = Sequence[Sequence[int]]   # global heads of each TP rank of a group, in local order
PICKS = 1024   # answers ``_picks`` keeps for the default placement: a decode group of up to this many ranks
               # (each answer at most a run per head the decode rank holds: a few MB at most in all)


class _Group:
    """Head placement of one TP group: the default (``heads_held``, arithmetic, no tables) or an
    explicit map (``RankSpec.head_map``, at most ``MAX_HEAD_IDS`` ids: its tables are that small)."""
    __slots__ = ("heads", "tp", "map", "_holders", "_local")

    def __init__(self, num_kv_heads: int, tp: int, head_map: HeadMap | None):
        self.heads, self.tp, self.map = num_kv_heads, tp, head_map
        self._holders: dict[int, list[int]] | None = None
        self._local: dict[int, dict[int, int]] = {}

    def held(self, r: int) -> Sequence[int]:
        return heads_held(self.heads, self.tp, r) if self.map is None else self.map[r]

    def holders(self, h: int) -> Sequence[int]:
        """TP ranks holding global head ``h``, ascending."""
        if self.map is None:
            if self.heads >= self.tp:
                return (h // (self.heads // self.tp),)
            r = self.tp // self.heads
            return range(h * r, h * r + r)
        if self._holders is None:
            self._holders = {}
            for q, row in enumerate(self.map):
                for x in row:
                    self._holders.setdefault(x, []).append(q)
        return self._holders.get(h, ())

    def local(self, r: int, h: int) -> int:
        """Index of global head ``h`` among TP rank ``r``'s local heads."""
        held = self.held(r)
        if isinstance(held, range):
            return h - held.start
        if r not in self._local:
            self._local[r] = {x: i for i, x in enumerate(held)}
        return self._local[r][h]


def _picks(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, p_map: HeadMap | None = None,
           d_map: HeadMap | None = None) -> tuple[tuple[int, int, int, int], ...]:
    """(prefill TP rank, first decode local head, first prefill local head, count) per run of
    decode rank ``d_rank``'s heads that one prefill rank holds in the same order, in decode's
    local order. O(heads held). Each head comes from one holder; replicas of a head (fewer heads
    than prefill ranks) are spread: decode ranks that hold the same head pick different holders.
    With the default placement on both sides, once per (sizes, decode rank): a connect asks it
    for every prefill rank, and each rank of a prefill process for the same decode rank, with the
    same answer (explicit maps, from peers' records, are not kept: they may be large)."""
    if p_map is None and d_map is None:
        return _default_picks(num_kv_heads, p_tp, d_tp, d_rank)
    return _picks_of(num_kv_heads, p_tp, d_tp, d_rank, p_map, d_map)


@functools.lru_cache(maxsize=PICKS)
def _default_picks(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int) -> tuple[tuple[int, int, int, int], ...]:
    return _picks_of(num_kv_heads, p_tp, d_tp, d_rank, None, None)


def _picks_of(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, p_map: HeadMap | None,
              d_map: HeadMap | None) -> tuple[tuple[int, int, int, int], ...]:
    pg, dg = _Group(num_kv_heads, p_tp, p_map), _Group(num_kv_heads, d_tp, d_map)
    out: list[list[int]] = []
    for j, h in enumerate(dg.held(d_rank)):
        holders = pg.holders(h)
        if not holders:
            raise PlanError(f"decode TP rank {d_rank} holds head {h}, which no prefill TP rank holds")
        p = holders[d_rank % len(holders)]
        i = pg.local(p, h)
        last = out[-1] if out else None
        if last is not None and last[0] == p and last[1] + last[3] == j and last[2] + last[3] == i:
            last[3] += 1
        else:
            out.append([p, j, i, 1])
    return tuple((p, j, i, n) for p, j, i, n in out)


def _slices(n_dst: int, n_src: int, j: int, i: int, m: int) -> list[tuple[HeadSlice, HeadSlice]]:
    """(source slice, destination slice) pairs moving ``m`` heads from local ``i`` of a rank holding
    ``n_src`` to local ``j`` of one holding ``n_dst``: one slice when the run is aligned on both
    sides (every default placement), else one per head."""
    if n_dst % m == 0 and n_src % m == 0 and j % m == 0 and i % m == 0:
        return [(HeadSlice(i // m, n_src // m), HeadSlice(j // m, n_dst // m))]
    return [(HeadSlice(i + k, n_src), HeadSlice(j + k, n_dst)) for k in range(m)]


def sources_for_decode_rank(*, num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, num_layers: int,
                            p_pp: int = 1, replicated: bool = False, p_heads: HeadMap | None = None,
                            d_heads: HeadMap | None = None) -> list[Source]:
    """The prefill sources of decode rank ``d_rank``; each (head, layer) comes from exactly one.

    ``replicated``: KV is identical on every rank (MLA): one prefill rank sends it all.
    ``p_heads`` / ``d_heads``: the groups' head maps (``RankSpec.head_map``); None: the default.
    Cost: O(sources) (at most heads held x p_pp), whatever the sizes claimed.
    """
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise PlanError(f"P TP {p_tp} and D TP {d_tp}: one must divide the other")
    if not 0 <= d_rank < d_tp:
        raise PlanError(f"decode rank {d_rank} outside 0..{d_tp - 1}")
    stages = [stage_layers(num_layers, p_pp, s) for s in range(p_pp)]
    if replicated:
        p = d_rank % p_tp
        return [Source(d_rank=d_rank, p_tp_rank=p, p_pp_rank=s, src_heads=HeadSlice(), dst_heads=HeadSlice(),
                       layers=layers) for s, layers in enumerate(stages)]
    n_src = len(heads_held(num_kv_heads, p_tp, 0))   # raises when the heads do not split over p_tp
    n_dst = len(heads_held(num_kv_heads, d_tp, 0))
    out = []
    for p, j, i, m in _picks(num_kv_heads, p_tp, d_tp, d_rank, p_heads, d_heads):
        for src, dst in _slices(n_dst, n_src, j, i, m):
            for s, layers in enumerate(stages):
                out.append(Source(d_rank=d_rank, p_tp_rank=p, p_pp_rank=s, src_heads=src, dst_heads=dst,
                                  layers=layers))
    return out


def _fed_tp_ranks(num_kv_heads: int, p_tp: int, d_tp: int, replicated: bool, p_map: HeadMap | None = None,
                  d_map: HeadMap | None = None) -> set[int]:
    """Prefill TP ranks that feed at least one decode rank: O(d_tp + heads held per rank)."""
    if replicated:
        return {d % p_tp for d in range(min(d_tp, p_tp))}
    if num_kv_heads >= p_tp:
        return set(range(p_tp))         # every prefill rank holds heads nobody else does
    return {p for d in range(d_tp) for p, _, _, _ in _picks(num_kv_heads, p_tp, d_tp, d, p_map, d_map)}


def targets_for_prefill_rank(*, num_kv_heads: int, p_tp: int, d_tp: int, p_rank: int, num_layers: int,
                             p_pp: int = 1, p_pp_rank: int = 0, replicated: bool = False,
                             p_heads: HeadMap | None = None, d_heads: HeadMap | None = None) -> list[Source]:
    """Every Source whose prefill side is (``p_rank``, ``p_pp_rank``); empty for a silent replica."""
    return [s for d in range(d_tp)
            for s in sources_for_decode_rank(num_kv_heads=num_kv_heads, p_tp=p_tp, d_tp=d_tp, d_rank=d,
                                             num_layers=num_layers, p_pp=p_pp, replicated=replicated,
                                             p_heads=p_heads, d_heads=d_heads)
            if s.p_tp_rank == p_rank and s.p_pp_rank == p_pp_rank]


# ------------------------------------------------------------------------------------
# Topology between one prefill rank and one decode rank
# ------------------------------------------------------------------------------------
def decode_sources(p: RankSpec, d: RankSpec) -> list[Source]:
    """Every source of decode rank ``d`` in the prefill instance of ``p`` (all stages), by head id:
    ``p``'s group head map (every prefill rank of a group gives the same) and ``d``'s."""
    return sources_for_decode_rank(num_kv_heads=d.num_kv_heads, p_tp=p.tp_size, d_tp=d.tp_size, d_rank=d.tp_rank,
                                   num_layers=d.num_layers, p_pp=p.pp_size, replicated=d.replicated,
                                   p_heads=p.head_map, d_heads=d.head_map)


def peers_needed(p: RankSpec, d: RankSpec) -> dict[tuple[int, int], list[Source]]:
    """Prefill ranks (tp, pp) that decode rank ``d`` contacts per request, with its sources there.

    An empty list marks a silent replica (it feeds no decode rank): decode rank 0 sends it a
    dummy request so that its sender, too, reaches an end state.
    """
    out: dict[tuple[int, int], list[Source]] = {}
    for s in decode_sources(p, d):
        out.setdefault((s.p_tp_rank, s.p_pp_rank), []).append(s)
    if d.tp_rank == 0:
        fed = _fed_tp_ranks(d.num_kv_heads, p.tp_size, d.tp_size, d.replicated, p.head_map, d.head_map)
        for key in ((t, q) for q in range(p.pp_size) for t in range(p.tp_size) if t not in fed):
            out[key] = []
    return out


def peer_sources(p: RankSpec, d: RankSpec) -> list[Source]:
    """What prefill rank ``p`` sends to decode rank ``d`` (empty: nothing, or a dummy).
    O(sources of ``d`` in ``p``'s stage): the prefill side runs it on a peer's HELLO."""
    if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size) or not 0 <= d.tp_rank < d.tp_size:
        return [s for s in decode_sources(p, d) if (s.p_tp_rank, s.p_pp_rank) == (p.tp_rank, p.pp_rank)]  # raises
    layers = stage_layers(d.num_layers, p.pp_size, p.pp_rank)
    if d.replicated:
        if d.tp_rank % p.tp_size != p.tp_rank:
            return []
        return [Source(d_rank=d.tp_rank, p_tp_rank=p.tp_rank, p_pp_rank=p.pp_rank, src_heads=HeadSlice(),
                       dst_heads=HeadSlice(), layers=layers)]
    n_src, n_dst = len(heads_held(d.num_kv_heads, p.tp_size, 0)), len(heads_held(d.num_kv_heads, d.tp_size, 0))
    return [Source(d_rank=d.tp_rank, p_tp_rank=q, p_pp_rank=p.pp_rank, src_heads=src, dst_heads=dst, layers=layers)
            for q, j, i, m in _picks(d.num_kv_heads, p.tp_size, d.tp_size, d.tp_rank, p.head_map, d.head_map)
            if q == p.tp_rank for src, dst in _slices(n_dst, n_src, j, i, m)]


def expected_decode_ranks(p: RankSpec, d: RankSpec) -> frozenset[int]:
    """Decode TP ranks (of ``d``'s group) whose requests a prefill sender of ``p`` waits for.
    O(d_tp + heads): computed from the head picks, without building every Source."""
    if d.replicated:
        fed = set(range(p.tp_rank, d.tp_size, p.tp_size))
    else:
        heads_held(d.num_kv_heads, p.tp_size, 0)
        fed = {r for r in range(d.tp_size)
               if any(q == p.tp_rank for q, _, _, _ in _picks(d.num_kv_heads, p.tp_size, d.tp_size, r, p.head_map,
                                                              d.head_map))}
    return frozenset(fed or {0})


def aux_source(sources: Sequence[Source]) -> tuple[int, int] | None:
    """The one source that sends the aux record: the last stage (it computed the first token),
    lowest TP rank. Both sides compute it the same way."""
    if not sources:
        return None
    last = max(s.p_pp_rank for s in sources)
    return min((s.p_tp_rank, s.p_pp_rank) for s in sources if s.p_pp_rank == last)
