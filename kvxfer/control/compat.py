"""Launch-time compatibility of a prefill/decode pair, in words ("P page_size 16 vs D page_size
24: ..."): every mismatch is listed at connect, never found at the first request.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from ..errors import CompatibilityError, ConfigError, LayoutError, PlanError
from ..layout import SWA, Layout, is_hybrid
from ..plan import Planner
from ..ranks import RankSpec
from ..topology import heads_held, peer_sources, stage_layers
from .messages import MAX_WINDOW  # one bound for the wire and the record
from .records import RankInfo


# ------------------------------------------------------------------------------------
# Compatibility, in words
# ------------------------------------------------------------------------------------
def _layout(info: RankInfo, side: str, out: list[str]) -> Layout | None:
    try:
        return Layout.from_dict(info.layout)
    except (LayoutError, ValueError, TypeError) as e:
        out.append(f"{side}'s layout description is invalid: {e}")
        return None


# A hybrid pool's sliding window rides in its rank record beside the layout: the layout says
# where bytes live, the window says how many trailing tokens decode keeps of the "swa" layers.
SWA_WINDOW_KEY = "swa_window"




def layout_record(layout: Layout, swa_window: int = 0) -> dict:
    """What a rank publishes as its ``RankInfo.layout``: the layout, plus the window if hybrid."""
    out = layout.to_dict()
    if swa_window:
        out[SWA_WINDOW_KEY] = int(swa_window)
    return out


def swa_window_of(info: RankInfo) -> int:
    """The sliding window a rank published (0: none); ValueError when it is not a sane int."""
    w = info.layout.get(SWA_WINDOW_KEY, 0)
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WINDOW:
        raise ConfigError(f"field {SWA_WINDOW_KEY!r} must be an int in 0..{MAX_WINDOW}, got {w!r}")
    return w


def _check_hybrid(pl: Layout, dl: Layout, p: RankInfo, d: RankInfo, out: list[str]) -> None:
    """Both sides hybrid sliding-window or neither; the same window and the same SWA layers."""
    p_hybrid, d_hybrid = is_hybrid(pl), is_hybrid(dl)
    if p_hybrid != d_hybrid:
        has, lacks = ("P", "D") if p_hybrid else ("D", "P")
        out.append(f"hybrid SWA: {has} keeps its sliding-window layers in a window pool (space {SWA!r}) but "
                   f"{lacks} does not: use a hybrid SWA pool on both sides or on neither")
        return
    if not p_hybrid:
        return
    windows = []
    for side, info in (("P", p), ("D", d)):
        try:
            windows.append(swa_window_of(info))
        except ValueError as e:
            out.append(f"{side}'s rank record: {e}")
            return
    pw, dw = windows
    if pw != dw or not pw:
        out.append(f"sliding window: P {pw} tokens vs D {dw} tokens: not the same model (both must be >= 1 "
                   f"and equal)")
    p_swa = {q.layer for q in pl.parts if q.space == SWA}
    d_swa = {q.layer for q in dl.parts if q.space == SWA}
    for layers, on, off in ((p_swa - d_swa, "P", "D"), (d_swa - p_swa, "D", "P")):
        layers &= set(pl.layers) & set(dl.layers)
        if layers:
            out.append(f"hybrid SWA: layer(s) {_span(layers)} are sliding-window on {on} but full-attention on "
                       f"{off}: not the same model")


def _names(keys) -> str:
    return ", ".join(sorted({str(k) for k in keys}))


def aux_format(info: RankInfo) -> tuple[int, ...]:
    """The bytes of one row of each of a rank's aux buffers (a single record of ``aux_bytes`` for a
    rank without buffers; () for none)."""
    return tuple(info.aux_rows) or ((info.aux_bytes,) if info.aux_bytes else ())


def aux_mismatch(p_key: str, p_format: tuple[int, ...], d_key: str, d_format: tuple[int, ...]) -> str | None:
    """Why prefill rank ``p_key`` cannot fill decode rank ``d_key``'s aux rows, or None. Not a
    handshake refusal: only requests that ask for aux rows fail with it (a pair may move KV
    without them)."""
    if tuple(p_format) == tuple(d_format):
        return None
    return (f"aux rows differ: prefill {p_key} has rows of {list(p_format) or 'no'} bytes per buffer, decode "
            f"{d_key} {list(d_format) or 'none'}: give both sides aux buffers of the same row sizes")


def check_pair(p: RankInfo, d: RankInfo, transport: str | None = None) -> list[str]:
    """Every reason prefill rank ``p`` and decode rank ``d`` cannot work together; [] when they can."""
    out: list[str] = []
    ps, ds = p.spec, d.spec
    if p.protocol != d.protocol:
        out.append(f"protocol: P speaks version {p.protocol} vs D {d.protocol}: upgrade the older side")
    if transport is not None and transport not in p.data:
        out.append(f"transport: D uses {transport!r} but P offers only {sorted(p.data) or 'none'}")
    if ps.num_layers != ds.num_layers:
        out.append(f"layer count: P has {ps.num_layers} layers vs D {ds.num_layers}: not the same model")
    if ps.num_kv_heads != ds.num_kv_heads:
        out.append(f"KV heads: P has {ps.num_kv_heads} vs D {ds.num_kv_heads}: not the same model")
    if ps.replicated != ds.replicated:
        out.append(f"KV replication: P {'replicates' if ps.replicated else 'shards'} KV across TP but D "
                   f"{'replicates' if ds.replicated else 'shards'} it (MLA vs MHA/GQA)")
    if ds.pp_size != 1:
        out.append(f"D pp_size {ds.pp_size}: decode ranks must hold every layer (pp_size 1)")
    if not ps.replicated:
        for side, s in (("P", ps), ("D", ds)):
            try:
                heads_held(s.num_kv_heads, s.tp_size, 0)
            except PlanError:
                out.append(f"KV heads {s.num_kv_heads} not divisible by {side} TP size {s.tp_size}: each "
                           f"{side} rank must hold a whole number of heads (or TP be a multiple of the heads)")
    if max(ps.tp_size, ds.tp_size) % min(ps.tp_size, ds.tp_size):
        out.append(f"TP sizes: P {ps.tp_size} vs D {ds.tp_size}: one must divide the other")
    pl, dl = _layout(p, "P", out), _layout(d, "D", out)
    if pl is None or dl is None:
        return out
    _check_hybrid(pl, dl, p, d, out)
    # Page sizes: the planner maps tokens, so any pair could move; we accept pairs that tile
    # (one a multiple of the other), so P's whole-page chunks fill whole D pages or whole
    # D pages hold whole P pages, and freeing by page on either side never splits a request.
    for sp in pl.spaces:
        if any(x.name == sp.name for x in dl.spaces):
            dp = dl.space(sp.name).page_size
            if max(dp, sp.page_size) % min(dp, sp.page_size):
                out.append(f"P page_size {sp.page_size} vs D page_size {dp}"
                           f"{'' if sp.name == 'token' else f' (space {sp.name!r})'}: one must be a multiple "
                           f"of the other")
    # Parts: which (layer, kind) P holds and D must hold, as this P stage sees it.
    try:
        stage = set(stage_layers(ps.num_layers, ps.pp_size, ps.pp_rank))
    except PlanError as e:
        out.append(f"P stage: {e}")
        stage = set(pl.layers)
    dkeys = {q.key for q in dl.parts if q.layer in stage}
    pkeys = {q.key for q in pl.parts}
    if ps.num_layers == ds.num_layers:
        if {k[0] for k in pkeys} - stage:
            out.append(f"P {ps.key} holds layers {sorted({k[0] for k in pkeys} - stage)} outside its stage "
                       f"{ps.pp_rank} of {ps.pp_size} (layers {min(stage)}..{max(stage)})")
        if {k[0] for k in dkeys} != {k[0] for k in pkeys}:
            out.append(f"layer set: P {ps.key} holds layers {_span(k[0] for k in pkeys)} vs D "
                       f"{_span(k[0] for k in dkeys)} in that stage")
    if pkeys - dkeys and {k[1] for k in pkeys - dkeys} - {k[1] for k in dkeys}:
        out.append(f"parts: P sends {_names(k[1] for k in pkeys - dkeys)} that D's layout lacks")
    if dkeys - pkeys and {k[1] for k in dkeys - pkeys} - {k[1] for k in pkeys}:
        out.append(f"parts: D expects {_names(k[1] for k in dkeys - pkeys)} that P does not produce")
    dtypes, dims = collections.defaultdict(set), collections.defaultdict(set)
    for key in sorted(pkeys & dkeys):
        a, b = pl.part(*key), dl.part(*key)
        if a.dtype != b.dtype:
            dtypes[(a.dtype, b.dtype)].add(key[1])
        if a.head_dim != b.head_dim:   # a dtype mismatch alone also changes head_bytes: said above
            dims[(a.head_dim, b.head_dim, a.dtype, b.dtype)].add(key[1])
    for (p_dtype, d_dtype), kinds in dtypes.items():
        out.append(f"dtype of {_names(kinds)}: P {p_dtype} vs D {d_dtype}: the bytes would be misread")
    for (p_dim, d_dim, _, _), kinds in dims.items():
        out.append(f"head_dim of {_names(kinds)}: P {p_dim} vs D {d_dim}: not the same model")
    if out:
        return out
    # What the explicit checks do not name, the planner does.
    for src in peer_sources(ps, ds):
        try:
            Planner(pl, dl, src_heads=src.src_heads, dst_heads=src.dst_heads, layers=src.layers)
        except PlanError as e:
            out.append(f"P {ps.key} -> D tp{ds.tp_rank}: {e}")
    return out


def head_map_mismatch(a: RankSpec, b: RankSpec) -> str | None:
    """Why ranks ``a`` and ``b`` of one TP group (same role, instance and DP rank) cannot both be
    right about where the group's heads are (``RankSpec.head_map``), naming both ranks and both
    assignments; None when they agree or are not of one group. O(heads)."""
    if (a.role, a.instance, a.dp_rank, a.tp_size, a.num_kv_heads) != (b.role, b.instance, b.dp_rank, b.tp_size,
                                                                        b.num_kv_heads) or a.head_map == b.head_map:
        return None
    side = "P" if a.role == "prefill" else "D"
    for r in range(a.tp_size):
        ha, hb = list(a.heads_of(r)), list(b.heads_of(r))
        if ha != hb:
            return (f"head placement: {side} {a.key} holds heads {list(a.heads)} and says TP rank {r} holds {ha}, but "
                    f"{side} {b.key} holds {list(b.heads)} and says TP rank {r} holds {hb}: every rank of a TP group "
                    f"must give the same head_map")
    return None


def check_group(ranks: Sequence[RankInfo]) -> list[str]:
    """Ranks of one TP group that disagree on its head placement (each against the first of its
    group, so O(ranks x heads)); [] when every group agrees."""
    first: dict[tuple, RankInfo] = {}
    out: list[str] = []
    for info in ranks:
        s = info.spec
        ref = first.setdefault((s.role, s.instance, s.dp_rank), info)   # every stage too
        why = head_map_mismatch(ref.spec, s)
        if why:
            out.append(why)
    return out


def _span(layers) -> str:
    xs = sorted(set(layers))
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]} ({len(xs)})" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)


def require_compatible(pairs: Sequence[tuple[RankInfo, RankInfo]], transport: str | None = None) -> None:
    """Raise ``CompatibilityError`` with the mismatches of every pair (each reason once)."""
    seen: dict[str, None] = {}
    checked: set = set()
    for p, d in pairs:
        # the ranks of one instance differ in TP rank only and share their layout record (a registry
        # client keeps one per digest): one check per kind of pair, not one per rank
        kind = (id(p.layout), id(d.layout), dataclasses.replace(p.spec, tp_rank=0, head_map=None), p.spec.head_map,
                d.spec, p.protocol, d.protocol, tuple(sorted(p.data)))
        if kind in checked:
            continue
        checked.add(kind)
        for m in check_pair(p, d, transport):
            seen.setdefault(m, None)
    if seen:
        raise CompatibilityError(list(seen))
