"""Which prefill ranks feed which decode rank, with which heads and layers. Pure data.

Heads are global KV heads of the model. With ``tp`` ranks and ``H`` KV heads a rank
holds ``H / tp`` heads when ``H >= tp``, else one head replicated on ``tp / H`` ranks
(GQA with few KV heads). MLA KV is replicated on every rank.

``sources_for_decode_rank`` answers "whom does my decode rank pull from"; every
(decode rank, head) has exactly one source, so no byte is written twice.
``targets_for_prefill_rank`` is the inverse the prefill side needs: a prefill rank
that feeds nobody (a replica) still confirms its requests.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlanError
from .plan import HeadSlice
from .ranks import RankSpec


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


def heads_held(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads that ``tp_rank`` of ``tp_size`` holds."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise PlanError(f"KV heads {num_kv_heads} are not divisible by TP size {tp_size}")
        n = num_kv_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % num_kv_heads:
        raise PlanError(f"TP size {tp_size} is not a multiple of KV heads {num_kv_heads}")
    h = tp_rank * num_kv_heads // tp_size
    return range(h, h + 1)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, ...]:
    """Layers of pipeline stage ``pp_rank``: an even split, earlier stages take the remainder."""
    if not 1 <= pp_size <= num_layers:
        raise PlanError(f"PP size {pp_size} must be in 1..{num_layers} (layers)")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return tuple(range(start, start + base + (pp_rank < extra)))


def _slice_of(held: range, chunk: range) -> HeadSlice:
    n, m = len(held), len(chunk)
    off = chunk.start - held.start
    if n % m or off % m:
        raise PlanError(f"heads {chunk.start}..{chunk.stop - 1} are not an aligned slice of "
                        f"{held.start}..{held.stop - 1}")
    return HeadSlice(off // m, n // m)


def _picks(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[tuple[range, int]]:
    """(heads of decode rank ``d_rank``, the prefill TP rank they come from), consecutive heads
    with one source merged. O(sources): the holders of a head are computed, not searched.
    Replicas of a head (fewer heads than prefill ranks) are spread: decode ranks that hold the
    same head pick different prefill replicas."""
    mine = heads_held(num_kv_heads, d_tp, d_rank)
    if num_kv_heads >= p_tp:            # each head on exactly one prefill rank, blocks of n heads
        n = num_kv_heads // p_tp
        out, h = [], mine.start
        while h < mine.stop:
            p = h // n
            stop = min(mine.stop, (p + 1) * n)
            out.append((range(h, stop), p))
            h = stop
        return out
    r = p_tp // num_kv_heads            # head h is held by prefill ranks h*r .. h*r + r - 1
    return [(range(h, h + 1), h * r + d_rank % r) for h in mine]


def sources_for_decode_rank(*, num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, num_layers: int,
                            p_pp: int = 1, replicated: bool = False) -> list[Source]:
    """The prefill sources of decode rank ``d_rank``; each (head, layer) comes from exactly one.

    ``replicated``: KV is identical on every rank (MLA): one prefill rank sends it all.
    Cost: O(sources) (at most min(heads held, p_tp) x p_pp), whatever the sizes claimed.
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
    heads_held(num_kv_heads, p_tp, 0)   # raises when the heads do not split over p_tp
    mine = heads_held(num_kv_heads, d_tp, d_rank)
    out = []
    for chunk, p in _picks(num_kv_heads, p_tp, d_tp, d_rank):
        p_held = heads_held(num_kv_heads, p_tp, p)
        for s, layers in enumerate(stages):
            out.append(Source(d_rank=d_rank, p_tp_rank=p, p_pp_rank=s, src_heads=_slice_of(p_held, chunk),
                              dst_heads=_slice_of(mine, chunk), layers=layers))
    return out


def _fed_tp_ranks(num_kv_heads: int, p_tp: int, d_tp: int, replicated: bool) -> set[int]:
    """Prefill TP ranks that feed at least one decode rank: O(d_tp + heads held per rank)."""
    if replicated:
        return {d % p_tp for d in range(min(d_tp, p_tp))}
    if num_kv_heads >= p_tp:
        return set(range(p_tp))         # every prefill rank holds heads nobody else does
    return {p for d in range(d_tp) for _, p in _picks(num_kv_heads, p_tp, d_tp, d)}


def targets_for_prefill_rank(*, num_kv_heads: int, p_tp: int, d_tp: int, p_rank: int, num_layers: int,
                             p_pp: int = 1, p_pp_rank: int = 0, replicated: bool = False) -> list[Source]:
    """Every Source whose prefill side is (``p_rank``, ``p_pp_rank``); empty for a silent replica."""
    return [s for d in range(d_tp)
            for s in sources_for_decode_rank(num_kv_heads=num_kv_heads, p_tp=p_tp, d_tp=d_tp, d_rank=d,
                                             num_layers=num_layers, p_pp=p_pp, replicated=replicated)
            if s.p_tp_rank == p_rank and s.p_pp_rank == p_pp_rank]


# ------------------------------------------------------------------------------------
# Topology between one prefill rank and one decode rank
# ------------------------------------------------------------------------------------
def decode_sources(p: RankSpec, d: RankSpec) -> list[Source]:
    """Every source of decode rank ``d`` in the prefill instance of ``p`` (all stages)."""
    return sources_for_decode_rank(num_kv_heads=d.num_kv_heads, p_tp=p.tp_size, d_tp=d.tp_size, d_rank=d.tp_rank,
                                   num_layers=d.num_layers, p_pp=p.pp_size, replicated=d.replicated)


def peers_needed(p: RankSpec, d: RankSpec) -> dict[tuple[int, int], list[Source]]:
    """Prefill ranks (tp, pp) that decode rank ``d`` contacts per request, with its sources there.

    An empty list marks a silent replica (it feeds no decode rank): decode rank 0 sends it a
    dummy request so that its sender, too, reaches an end state.
    """
    out: dict[tuple[int, int], list[Source]] = {}
    for s in decode_sources(p, d):
        out.setdefault((s.p_tp_rank, s.p_pp_rank), []).append(s)
    if d.tp_rank == 0:
        fed = _fed_tp_ranks(d.num_kv_heads, p.tp_size, d.tp_size, d.replicated)
        for key in ((t, q) for q in range(p.pp_size) for t in range(p.tp_size) if t not in fed):
            out[key] = []
    return out


def peer_sources(p: RankSpec, d: RankSpec) -> list[Source]:
    """What prefill rank ``p`` sends to decode rank ``d`` (empty: nothing, or a dummy).
    O(sources of ``d``): the prefill side runs it on a peer's HELLO."""
    if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size) or not 0 <= d.tp_rank < d.tp_size:
        return [s for s in decode_sources(p, d) if (s.p_tp_rank, s.p_pp_rank) == (p.tp_rank, p.pp_rank)]  # raises
    layers = stage_layers(d.num_layers, p.pp_size, p.pp_rank)
    if d.replicated:
        picks: list[tuple[range | None, int]] = [(None, d.tp_rank % p.tp_size)]
    else:
        heads_held(d.num_kv_heads, p.tp_size, 0)
        picks = _picks(d.num_kv_heads, p.tp_size, d.tp_size, d.tp_rank)
    out = []
    mine = heads_held(d.num_kv_heads, d.tp_size, d.tp_rank) if not d.replicated else None
    for chunk, q in picks:
        if q != p.tp_rank:
            continue
        src = dst = HeadSlice()
        if chunk is not None:
            src, dst = _slice_of(heads_held(d.num_kv_heads, p.tp_size, q), chunk), _slice_of(mine, chunk)
        out.append(Source(d_rank=d.tp_rank, p_tp_rank=q, p_pp_rank=p.pp_rank, src_heads=src, dst_heads=dst,
                          layers=layers))
    return out


def expected_decode_ranks(p: RankSpec, d: RankSpec) -> frozenset[int]:
    """Decode TP ranks (of ``d``'s group) whose requests a prefill sender of ``p`` waits for.
    O(d_tp + heads): computed from the head picks, without building every Source."""
    if d.replicated:
        fed = set(range(p.tp_rank, d.tp_size, p.tp_size))
    else:
        heads_held(d.num_kv_heads, p.tp_size, 0)
        fed = {r for r in range(d.tp_size)
               if any(q == p.tp_rank for _, q in _picks(d.num_kv_heads, p.tp_size, d.tp_size, r))}
    return frozenset(fed or {0})


def aux_source(sources: Sequence[Source]) -> tuple[int, int] | None:
    """The one source that sends the aux record: the last stage (it computed the first token),
    lowest TP rank. Both sides compute it the same way."""
    if not sources:
        return None
    last = max(s.p_pp_rank for s in sources)
    return min((s.p_tp_rank, s.p_pp_rank) for s in sources if s.p_pp_rank == last)
