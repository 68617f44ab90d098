"""``kvxfer compat``: the layout x capability table, computed from the code.

Nothing in the table is written by hand. Each cell builds a tiny pool of the row's
layout (random bytes everywhere), runs the capability for real and checks the bytes:

- the request's cells hold exactly the expected bytes, and
- nothing else changed: the request's cells are written back to their old values
  through the pool's own ``set_parts``, after which every buffer must equal the
  snapshot taken before the operation. A stray write anywhere survives that.

A cell prints ``yes``, or ``no (why)`` with the exception or the first mismatch.

    kvxfer compat           the table
    kvxfer compat --json    {row: {column: "yes" | "no (...)"}}

Exit status: 0 when every cell is yes (a missing ``kvxfer.offload`` is not a
failure), 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..copy import execute_plan
from ..layout import Part, host_layout
from ..plan import plan_transfer
from ..pools import HybridSWAPool, KVPool, MHAPool, MLAPool, StatePool, torch_dtype
from ..topology import sources_for_decode_rank

COLUMNS = ("transfer", "CPU copy", "prefix-valid write", "head slicing", "offload")
HEADS = 4           # KV heads of the tiny model (TP 1); TP 2 ranks hold 2 each
PAGE = 4
N = 10              # tokens of the test request: two full pages and a partial one
OFFLOAD_MISSING = "no (kvxfer.offload missing)"


class CheckFailed(Exception):
    """A capability ran but produced wrong bytes."""


# ------------------------------------------------------------------------------------
# Rows: a pool factory per layout, taking the TP size (heads are split by it)
# ------------------------------------------------------------------------------------
def _mha(layout: str) -> Callable[[int], KVPool]:
    return lambda tp: MHAPool(layers=[0, 1], heads=HEADS // tp, head_dim=8, v_head_dim=4, dtype="bfloat16",
                              num_pages=12, page_size=PAGE, layout=layout)


def _mla(tp: int) -> KVPool:
    return MLAPool(layers=2, kv_lora_rank=8, rope_dim=4, dtype="bfloat16", num_pages=12, page_size=PAGE)


def _state(tp: int) -> KVPool:
    return StatePool(layers=[0, 1], conv_blocks=[4 // tp, 2 // tp, 2 // tp], conv_width=3,
                     temporal_heads=HEADS // tp, temporal_head_shape=[2, 2], num_slots=24)


def _swa(tp: int) -> KVPool:
    return HybridSWAPool(full_layers=[0, 2], swa_layers=[1], heads=HEADS // tp, head_dim=8, dtype="bfloat16",
                         num_pages=12, swa_num_pages=6, page_size=PAGE, window=6, layout="page_major")


def _host(style: str) -> Callable[[int], KVPool]:
    return lambda tp: KVPool(host_layout(_mha("page_major")(tp).layout, style, 12 * PAGE))


@dataclass(frozen=True)
class Row:
    name: str
    make: Callable[[int], KVPool]
    replicated: bool = False          # KV identical on every rank (MLA): TP sends whole copies
    host_style: str = "layer_first"   # the host layout the offload cell uses
    offload_device: Callable[[int], KVPool] | None = None  # device pool offloaded into host_style


ROWS = (
    Row("MHA token_major", _mha("token_major")),
    Row("MHA hnd", _mha("hnd")),
    Row("MHA page_major", _mha("page_major")),
    Row("MLA", _mla, replicated=True),
    Row("state", _state),
    Row("hybrid SWA", _swa),
    Row("host layer_first", _host("layer_first"), host_style="layer_first", offload_device=_mha("token_major")),
    Row("host page_first", _host("page_first"), host_style="page_first", offload_device=_mha("token_major")),
)


# ------------------------------------------------------------------------------------
# Helpers: requests, snapshots, verification
# ------------------------------------------------------------------------------------
def _fill(pool: KVPool, seed: int) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8, generator=g))
    return pool


def _request(pool: KVPool, rng: np.random.Generator, n: int = N, avoid: np.ndarray | None = None,
             window: np.ndarray | None = None) -> np.ndarray:
    """``n`` usable slots in random order. A hybrid pool also maps request positions
    ``window`` (default: the last ``pool.window``) to sliding-window slots, as an engine
    does after evicting older ones."""
    sp = pool.layout.spaces[0]
    usable = np.setdiff1d(np.arange(sp.page_size, sp.num_slots), [] if avoid is None else avoid)
    slots = rng.permutation(usable)[:n]
    if isinstance(pool, HybridSWAPool):
        swa = pool.layout.space("swa")
        free = np.setdiff1d(np.arange(swa.page_size, swa.num_slots), pool.full_to_swa)
        win = slots[-pool.window:] if window is None else slots[window]
        pool.map_swa(win, rng.permutation(free)[:len(win)])
    return slots


def _by_space(pool: KVPool, slots: np.ndarray) -> dict[str, np.ndarray]:
    """Plan input: per slot space, the slots of the request positions it holds."""
    out = {}
    for sp in pool.layout.spaces:
        mapped = pool.space_slots(sp.name, slots)
        out[sp.name] = mapped[mapped != 0]
    return out


def _cells(pool: KVPool, slots: np.ndarray) -> dict[tuple[int, str], tuple[np.ndarray, torch.Tensor]]:
    """Per part: the request positions it holds and their values (``[tokens, heads, dim]``)."""
    out = {}
    for p in pool.layout.parts:
        pos = np.flatnonzero(pool.space_slots(p.space, slots) != 0)
        out[p.key] = pos, pool.get_part(p.layer, p.kind, slots[pos])
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _expect_cells(pool: KVPool, slots: np.ndarray, want: dict, heads: Callable | None = None) -> None:
    """The request's cells equal ``want`` (after ``heads(key, tensor)`` picks a head range)."""
    for key, (pos, got) in _cells(pool, slots).items():
        wpos, wval = want[key]
        if heads is not None:
            wval = heads(key, wval)
        if not (np.array_equal(pos, wpos) and _same(got, wval)):
            raise CheckFailed(f"part {key}: bytes differ")


def _untouched_elsewhere(pool: KVPool, slots: np.ndarray, before_cells: dict, before: list[torch.Tensor],
                         padding: bool = False) -> None:
    """Write the request's old cell values back; then every byte must match ``before``.
    ``padding``: the padding page (slot 0.. page_size - 1, where dummy writes go) may change."""
    for (layer, kind), (pos, val) in before_cells.items():
        pool.set_parts(layer, slots[pos], [(kind, val)])
    for p in pool.layout.parts if padding else ():
        ps = pool.layout.space(p.space).page_size
        cells = p.base + np.arange(ps)[:, None] * p.token_stride + np.arange(p.heads)[None, :] * p.head_stride
        idx = torch.from_numpy((cells[..., None] + np.arange(p.head_bytes)).ravel())
        pool.buffers[p.region][idx] = before[p.region][idx]
    for i, (b, old) in enumerate(zip(pool.buffers, before)):
        if not torch.equal(b, old):
            n = int((b != old).sum())
            raise CheckFailed(f"{n} bytes outside the request changed in region {pool.layout.regions[i].name}")


def _guarded(pool: KVPool, slots: np.ndarray) -> tuple[dict, list[torch.Tensor]]:
    """Snapshot for ``_untouched_elsewhere``: (cells of the request, copies of all buffers)."""
    return _cells(pool, slots), [b.clone() for b in pool.buffers]


# ------------------------------------------------------------------------------------
# The capabilities
# ------------------------------------------------------------------------------------
def check_transfer(row: Row) -> None:
    """Plan and execute a request from one pool to another (other slots), byte-exact.
    Host rows are also filled straight from a device pool (direct-to-host)."""
    rng = np.random.default_rng(1)
    sources = [row.make(1)] + ([_mha("page_major")(1)] if row.offload_device is not None else [])
    for src in sources:
        _fill(src, 2)
        dst = _fill(row.make(1), 3)
        s_slots, d_slots = _request(src, rng), _request(dst, rng)
        want = _cells(src, s_slots)
        guard = _guarded(dst, d_slots)
        execute_plan(plan_transfer(src.layout, _by_space(src, s_slots), dst.layout, _by_space(dst, d_slots)),
                     src.buffers, dst.buffers)
        _expect_cells(dst, d_slots, want)
        _untouched_elsewhere(dst, d_slots, *guard)


def check_cpu_copy(row: Row) -> None:
    """get_cpu_copy, then load_cpu_copy into different slots of another pool."""
    rng = np.random.default_rng(2)
    src, dst = _fill(row.make(1), 4), _fill(row.make(1), 5)
    s_slots = _request(src, rng)
    d_slots = _request(dst, rng, avoid=s_slots)
    want = _cells(src, s_slots)
    guard = _guarded(dst, d_slots)
    dst.load_cpu_copy(src.get_cpu_copy(s_slots), d_slots)
    _expect_cells(dst, d_slots, want)
    _untouched_elsewhere(dst, d_slots, *guard)


def check_prefix_valid(row: Row) -> None:
    """Rows of a [batch, cols] slot table, each written only below its commit length."""
    rng = np.random.default_rng(3)
    pool = _fill(row.make(1), 6)
    g = torch.Generator().manual_seed(6)
    table = _request(pool, rng, 2 * 4, window=np.arange(2 * 4)).reshape(2, 4)  # new tokens are in the window
    commit = np.array([3, 1])
    written = np.concatenate([table[r, :c] for r, c in enumerate(commit)])
    # Only the committed cells (and the padding page, where uncommitted columns are sent as
    # dummy writes) are restored before the final comparison, so a write of an uncommitted
    # column anywhere else shows up as a changed byte.
    guard = _guarded(pool, written)
    for layer in pool.layout.layers:
        parts = [pool.layout.part(layer, k) for k in pool.kv_kinds if pool.layout.has_part((layer, k))]
        if len(parts) != len(pool.kv_kinds):
            continue
        extra = [pool.layout.part(layer, k) for k in ("k_scale", "v_scale") if pool.layout.has_part((layer, k))]
        vals = {p.kind: _random(p, 2 * 4, g).reshape(2, 4, p.heads, p.head_dim) for p in parts + extra}
        pool.set_kv_buffer_prefix_valid(layer, table, commit, *(vals[p.kind] for p in parts),
                                        **{p.kind: vals[p.kind] for p in extra})
        for p in parts + extra:
            pos = np.flatnonzero(pool.space_slots(p.space, written) != 0)
            want = torch.cat([vals[p.kind][r, :c] for r, c in enumerate(commit)])[pos]
            if not _same(pool.get_part(layer, p.kind, written[pos]), want):
                raise CheckFailed(f"part {p.key}: committed columns differ")
    _untouched_elsewhere(pool, written, *guard, padding=True)


def _random(p: Part, n: int, g: torch.Generator) -> torch.Tensor:
    dt = torch_dtype(p.dtype)
    if dt in (torch.uint8, torch.int32):
        return torch.randint(0, 100, (n, p.heads, p.head_dim), dtype=dt, generator=g)
    return torch.randn((n, p.heads, p.head_dim), generator=g).to(dt)


def check_head_slicing(row: Row) -> None:
    """Heterogeneous TP through the topology's head slices: P TP 1 -> D TP 2 (each decode
    rank takes its half of every part) and P TP 2 -> D TP 1 (the decode rank assembles
    both halves). Replicated KV (MLA) goes whole to every decode rank."""
    rng = np.random.default_rng(4)
    for p_tp, d_tp in ((1, 2), (2, 1)):
        p_pools = [_fill(row.make(p_tp), 10 + r) for r in range(p_tp)]
        p_slots = _request(p_pools[0], rng)
        first = p_pools[0]
        for other in p_pools[1:]:   # every P rank holds the request in the same slots
            if isinstance(other, HybridSWAPool):
                assert isinstance(first, HybridSWAPool)   # every P rank is built by the same row.make
                other.load_swa_map(first.full_to_swa)
        # The model's whole KV per part, by global head: concatenated over P ranks.
        cells = [_cells(pool, p_slots) for pool in p_pools]
        full = {key: (pos, val if row.replicated else torch.cat([c[key][1] for c in cells], dim=1))
                for key, (pos, val) in cells[0].items()}
        for d_rank in range(d_tp):
            dst = _fill(row.make(d_tp), 20 + d_rank)
            d_slots = _request(dst, rng)
            guard = _guarded(dst, d_slots)
            for src in sources_for_decode_rank(num_kv_heads=HEADS, p_tp=p_tp, d_tp=d_tp, d_rank=d_rank,
                                               num_layers=len(dst.layout.layers), replicated=row.replicated):
                pool = p_pools[src.p_tp_rank]
                plan = plan_transfer(pool.layout, _by_space(pool, p_slots), dst.layout, _by_space(dst, d_slots),
                                     src_heads=src.src_heads, dst_heads=src.dst_heads)
                execute_plan(plan, pool.buffers, dst.buffers)

            def mine(key: tuple[int, str], val: torch.Tensor, d_rank: int = d_rank, d_tp: int = d_tp) -> torch.Tensor:
                if row.replicated:
                    return val
                n = val.shape[1] // d_tp
                return val[:, d_rank * n:(d_rank + 1) * n]
            _expect_cells(dst, d_slots, full, mine)
            _untouched_elsewhere(dst, d_slots, *guard)


def check_offload(row: Row) -> str | None:
    """Offload a request through ``kvxfer.offload`` and reload it into other slots,
    byte-exact. Returns a reason when the module is missing. Kept in one function so
    it can follow that module's API: HostPool.for_pool(pool, layout=, size=) and
    DecodeOffloadManager(pool, host, OffloadConfig(stride=)) with step / release /
    poll / positions / reload / forget / close."""
    try:
        off = importlib.import_module("kvxfer.offload")
    except ImportError:
        return "kvxfer.offload missing"
    rng = np.random.default_rng(5)
    make = row.offload_device or row.make
    pool = _fill(make(1), 7)
    host = off.HostPool.for_pool(pool, layout=row.host_style, size=64)
    slots = _request(pool, rng)
    token_ids = rng.integers(0, 32000, len(slots)).tolist()
    want = _cells(pool, slots)
    mgr = off.DecodeOffloadManager(pool, host, off.OffloadConfig(stride=2 * PAGE))
    try:
        mgr.step([("r0", token_ids, slots)])
        mgr.release("r0", token_ids, slots)
        deadline = time.monotonic() + 10
        while "r0" not in (res := mgr.poll()).released:
            if res.failed or time.monotonic() > deadline:
                raise CheckFailed(f"offload did not complete: {res.failed or 'timed out'}")
            time.sleep(0.002)
        # The engine frees the device slots and reuses them: scribble over the request.
        _fill(pool, 8)
        if isinstance(pool, HybridSWAPool):
            pool.load_swa_map(np.zeros_like(pool.full_to_swa))
        # fresh slots; a hybrid pool maps window slots for the positions the host holds
        new = _request(pool, rng, avoid=slots, window=mgr.positions("r0").get("swa"))
        guard = _guarded(pool, new)
        mgr.reload("r0", new)
        _expect_cells(pool, new, want)
        _untouched_elsewhere(pool, new, *guard)
        mgr.forget("r0")
    finally:
        mgr.close()
    return None


CHECKS: dict[str, Callable[[Row], object]] = {
    "transfer": check_transfer, "CPU copy": check_cpu_copy, "prefix-valid write": check_prefix_valid,
    "head slicing": check_head_slicing, "offload": check_offload,
}


def cell(row: Row, column: str) -> str:
    try:
        reason = CHECKS[column](row)
    except CheckFailed as e:
        return f"no ({e})"
    except Exception as e:  # noqa: BLE001 - any failure is a "no" with its reason
        return f"no ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return "yes" if reason is None else f"no ({reason})"


def compute_table(rows=ROWS, columns=COLUMNS) -> dict[str, dict[str, str]]:
    return {row.name: {col: cell(row, col) for col in columns} for row in rows}


def render(table: dict[str, dict[str, str]]) -> str:
    cols = list(next(iter(table.values())))
    width0 = max(len(r) for r in table)
    widths = [max(len(c), *(len(table[r][c]) for r in table)) for c in cols]
    lines = [" | ".join([" " * width0] + [c.ljust(w) for c, w in zip(cols, widths)]),
             "-+-".join(["-" * width0] + ["-" * w for w in widths])]
    for r, cells in table.items():
        lines.append(" | ".join([r.ljust(width0)] + [cells[c].ljust(w) for c, w in zip(cols, widths)]))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer compat", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print {row: {column: cell}} as JSON")
    args = ap.parse_args(argv or [])
    table = compute_table()
    print(json.dumps(table, indent=2) if args.json else render(table))
    bad = [c for cells in table.values() for c in cells.values() if c != "yes" and c != OFFLOAD_MISSING]
    return 1 if bad else 0
