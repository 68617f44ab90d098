"""Prefill's per-request records and the planning of one chunk for one decode rank.

``PrefillEndpoint`` (``kvxfer.endpoint.prefill``) keeps a ``DecodePeer`` per decode rank that
said HELLO, a ``Target`` per decode rank that granted a request, and a ``Chunk`` per
``KVSender.send``; when a chunk may go (bound, ready), it calls ``plan_chunk`` once per target
on the channel or scheduler thread, under the endpoint lock, and submits the plan. Pure
bookkeeping and numpy: no I/O, no locks.

Chunks may be any number of tokens (plans are per token, so 1-token chunks and chunks that
split a page land exactly). Whole pages are cheaper on page-major pools, where whole pages in a
row coalesce into one run but a split page moves as one run per layer and K/V. Measured with
``Planner`` + ``execute_plan`` on CPU (4,096 tokens, 16 layers, 8 heads x 64, page 16,
page-major to page-major): chunks of 256 tokens plan 16 runs and take 25 ms; chunks of
248 or 264 tokens plan 529 runs and take 28-33 ms. Token-major pools plan ~512 runs either way.
Over a network the run count costs more than on CPU (one descriptor or put per run).
"""
from __future__ import annotations

import numpy as np

from ..control.messages import Req
from ..control.records import RankInfo
from ..errors import LayoutError, RequestError
from ..layout import STATE, SWA, Layout
from ..plan import Planner, TransferPlan
from .aux import AuxRecord


class DecodePeer:
    """A decode rank that said HELLO: its record, transport peer and planners from us to it."""
    __slots__ = ("info", "layout", "xpeer", "sources", "group", "expected", "planners")

    def __init__(self, info: RankInfo, layout: Layout, xpeer: str, sources: list, expected: frozenset):
        self.info, self.layout, self.xpeer, self.sources, self.expected = info, layout, xpeer, sources, expected
        self.group = (info.spec.instance, info.spec.dp_rank)
        self.planners: dict = {}   # (layers, kinds) -> planners, made on first use by the endpoint


class Target:
    """One decode rank's grant inside one sender (from its "req" message)."""
    __slots__ = ("peer", "d_rank", "gen", "request_id", "kv", "prefix", "state", "swa", "window_start", "aux", "dummy",
                 "chunks", "nbytes", "confirmed", "cap")

    def __init__(self, peer: str, d_rank: int, msg: Req, kv: np.ndarray, state: np.ndarray, swa: np.ndarray):
        self.peer, self.d_rank, self.gen = peer, d_rank, msg.gen
        self.request_id = f"{msg.room}.{msg.gen}"   # the transport's name for it
        self.kv, self.prefix, self.state = kv, msg.prefix, state
        # hybrid SWA: decode's window slots, for request tokens window_start .. len(kv) - 1
        self.swa, self.window_start = swa, len(kv) - len(swa)
        self.aux, self.dummy = msg.aux, msg.dummy
        self.cap = msg.cap or b""   # the grant's data-plane capability: every submit carries it
        self.chunks = self.nbytes = 0   # submitted to this target so far
        self.confirmed = self.dummy     # a dummy target has nothing to confirm


class Chunk:
    """One ``KVSender.send``: tokens ``start .. start + len(slots) - 1`` of ``layers`` (None: all)."""
    __slots__ = ("slots", "start", "layers", "last", "aux", "state", "swa", "ready")

    def __init__(self, slots, start, layers, last, aux, state, swa, ready):
        self.slots, self.start, self.layers, self.last, self.aux, self.state = slots, start, layers, last, aux, state
        self.swa = swa   # hybrid SWA: full_to_swa of ``slots`` when send() was called (0 = unmapped); else None
        self.ready = ready   # None, or an object whose query() says the KV is written

    def what(self) -> str:
        return f"the chunk of tokens {self.start}..{self.start + len(self.slots) - 1}"


def chunk_aux(aux, aux_row, last: bool, rows, aux_bytes: int):
    """``send()``'s aux arguments, checked: the bytes (an ``AuxRecord`` packed to ``aux_bytes``), or
    the row ``aux_row`` of the endpoint's ``AuxRows`` ``rows`` (read when the chunk is submitted), or
    None; RequestError naming what is wrong."""
    if isinstance(aux, AuxRecord):
        aux = aux.pack(aux_bytes)
    if aux is not None and aux_row is not None:
        raise RequestError("send() takes aux= (bytes) or aux_row= (a row of this endpoint's AuxRows), not both")
    if aux_row is not None:
        if rows is None:
            raise RequestError("aux_row= needs the endpoint's aux buffers: PrefillEndpoint(aux=AuxRows([...]))")
        rows.check_row(aux_row)
        if not last:
            raise RequestError("aux rows go with the last chunk")
        return aux_row
    if aux is not None and len(aux) != aux_bytes:
        raise RequestError(f"aux record is {len(aux)} bytes, this endpoint's aux rows are {aux_bytes} bytes")
    return aux


def plan_chunk(c: Chunk, t: Target, *, next_pos: int, token_space: str, hybrid: bool, kv_planners: list[Planner],
               state_planners: list[Planner]) -> TransferPlan:
    """The bytes ``c`` moves to ``t`` (the tokens decode lacks, the window's sliding-window
    layers, the state with the last chunk). ``next_pos``: where the sender's chunks end.
    RequestError when the chunk does not fit the grant (the request must fail, not send)."""
    end = c.start + len(c.slots)
    if end > len(t.kv):
        raise RequestError(f"chunk reaches token {end} but decode rank {t.d_rank} granted {len(t.kv)}")
    if c.last and next_pos != len(t.kv):   # decode would reach Success with tokens never written
        raise RequestError(f"the chunks end at token {next_pos} but decode rank {t.d_rank} granted "
                           f"{len(t.kv)} tokens: tokens {next_pos}..{len(t.kv) - 1} would never arrive")
    skip = min(max(t.prefix - c.start, 0), len(c.slots))    # tokens decode already has
    src, dst = {token_space: c.slots[skip:]}, {token_space: t.kv[c.start + skip:end]}
    if hybrid:
        src[SWA], dst[SWA] = window_part(c, t, c.start + skip, end)
    plans = [pl.plan(src, dst) for pl in kv_planners] if len(src[token_space]) else []
    if c.last:
        st = c.state if c.state is not None else np.zeros(0, np.int64)
        if len(st) != len(t.state):
            raise RequestError(f"state: the last chunk has {len(st)} slot(s), decode rank {t.d_rank} "
                               f"granted {len(t.state)}")
        if len(st):
            plans += [pl.plan({STATE: st}, {STATE: t.state}) for pl in state_planners]
        if t.aux and c.aux is None:
            raise RequestError("decode asked for the aux record but the last chunk carries none")
    return TransferPlan.concat(plans)


def window_part(c: Chunk, t: Target, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) "swa" slots of request tokens ``first .. end - 1`` that fall in
    decode's window; RequestError when one of them has no window slot here (never send garbage)."""
    first = max(first, t.window_start)
    if first >= end:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    src = c.swa[first - c.start:end - c.start]
    unmapped = np.flatnonzero(src == 0)
    if len(unmapped):
        raise RequestError(f"{len(unmapped)} token(s) of decode's sliding window (tokens {t.window_start}.."
                           f"{len(t.kv) - 1}), first token {first + int(unmapped[0])}, have no sliding-window "
                           f"slot on prefill (full_to_swa is 0): evicted or never written")
    return src, t.swa[first - t.window_start:end - t.window_start]


def request_slots(dp: DecodePeer, msg: Req, token_space: str, swa_window: int,
                  key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decode rank's REQ: its (kv, state, window) slots, each checked against its layout;
    LayoutError says why not (prefill ``key`` then nacks it)."""
    swa_raw = msg.swa or b""
    if len(msg.kv) % 8 or len(msg.state) % 8 or len(swa_raw) % 8:
        raise LayoutError("slot arrays must be whole int64s")
    kv, st = np.frombuffer(msg.kv, "<i8"), np.frombuffer(msg.state, "<i8")
    swa = np.frombuffer(swa_raw, "<i8")
    if not msg.dummy:
        kv = dp.layout.check_slots(token_space, kv, "kv slots")
        st = dp.layout.check_slots(STATE, st, "state slots") if len(st) else st
        if msg.prefix >= len(kv):
            raise LayoutError(f"prefix {msg.prefix} leaves none of the {len(kv)} tokens to send")
        swa = check_window(swa_window, key, dp, msg, kv, swa)
    return kv, st, swa


def check_window(swa_window: int, key: str, dp: DecodePeer, msg: Req, kv: np.ndarray, swa: np.ndarray) -> np.ndarray:
    """Decode's window slots of a request (hybrid SWA), bounds-checked; LayoutError says why not."""
    if not swa_window:
        if len(swa) or msg.swa_n:
            raise LayoutError(f"sliding-window slots sent to prefill {key}, whose pool has no "
                              f"sliding-window layers")
        return swa
    if msg.swa_n is None or msg.swa_n != len(swa):
        raise LayoutError(f"a hybrid SWA request must carry its window slots and their count; got "
                          f"{len(swa)} slot(s) and count {msg.swa_n}")
    swa = dp.layout.check_slots(SWA, swa, "swa slots")
    most = min(swa_window, len(kv))
    if not 1 <= len(swa) <= most:
        raise LayoutError(f"{len(swa)} window slot(s) for a request of {len(kv)} tokens: must be "
                          f"1..{most} (sliding window {swa_window})")
    return swa


__all__ = ["DecodePeer", "Target", "Chunk", "plan_chunk", "window_part", "check_window", "request_slots"]
