"""Handshake and control channel: is this P/D pair compatible, and how do they talk.

Compatibility is decided at launch, from the layouts' parts and the topology, and
refused with every mismatch in words (``CompatibilityError.mismatches``). What the
planner can bridge (different layouts, page sizes that tile, different TP sizes) is
accepted; the final word is building a ``Planner`` for every ``Source`` the pair has.
Hybrid sliding-window pools pair only with each other, with the same window (published beside
the layout, ``layout_record``) and the same sliding-window layers.

Who calls what, and when
------------------------
Decode endpoint, at start-up, per prefill rank it needs (blocking, one round trip):
    ``check_pair(p_info, d_info)`` locally, then HELLO -> WELCOME | REFUSE over the channel.
Prefill endpoint, on each HELLO (channel thread): ``check_pair`` again with its own layout
    (the authoritative check), ``peer_sources`` to build its planners, WELCOME or REFUSE.
Both endpoints own one ``ControlChannel`` (a thread and its ZMQ sockets): prefill binds a
    ROUTER, decode connects one DEALER per prefill rank. ``send`` is thread-safe and never
    blocks; messages arrive on the channel thread through the handler.

Wire format: frames ``[mac, body]``; body is a msgpack map with ``"t"`` naming the type
(``SCHEMA``); mac is HMAC-SHA256(secret, body) or empty without a secret. Every message
is size-limited, type-checked field by field and range-checked; never pickle. A message
that fails a check is dropped and counted (``ControlChannel.dropped``), never half-used.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import msgpack
import zmq

from .bootstrap import PROTOCOL, RankInfo, RankSpec, mac
from .errors import CompatibilityError, ConnectError, LayoutError, PlanError
from .layout import SWA, Layout
from .plan import Planner
from .topology import Source, heads_held, sources_for_decode_rank, stage_layers, targets_for_prefill_rank

log = logging.getLogger("kvxfer.handshake")


# ------------------------------------------------------------------------------------
# Layouts of a rank: KV parts plus optional state parts, as one layout (one region list
# for the transport, one Planner per source covering both).
# ------------------------------------------------------------------------------------
def combine_layouts(kv: Layout, state: Layout | None = None) -> Layout:
    """``kv``'s parts and regions followed by ``state``'s (region ids shifted)."""
    if state is None:
        return kv
    n = len(kv.regions)
    parts = kv.parts + tuple(dataclasses.replace(p, region=p.region + n) for p in state.parts)
    return Layout(kind=f"{kv.kind}+{state.kind}", spaces=kv.spaces + state.spaces,
                  regions=kv.regions + state.regions, parts=parts)


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
        fed = {(s.p_tp_rank, s.p_pp_rank) for r in range(d.tp_size)
               for s in decode_sources(p, dataclasses.replace(d, tp_rank=r))}
        for key in ((t, q) for q in range(p.pp_size) for t in range(p.tp_size)):
            if key not in fed:
                out[key] = []
    return out


def peer_sources(p: RankSpec, d: RankSpec) -> list[Source]:
    """What prefill rank ``p`` sends to decode rank ``d`` (empty: nothing, or a dummy)."""
    return peers_needed(p, d).get((p.tp_rank, p.pp_rank), [])


def expected_decode_ranks(p: RankSpec, d: RankSpec) -> frozenset[int]:
    """Decode TP ranks (of ``d``'s group) whose requests a prefill sender of ``p`` waits for."""
    fed = {s.d_rank for s in targets_for_prefill_rank(
        num_kv_heads=d.num_kv_heads, p_tp=p.tp_size, d_tp=d.tp_size, p_rank=p.tp_rank, num_layers=d.num_layers,
        p_pp=p.pp_size, p_pp_rank=p.pp_rank, replicated=d.replicated)}
    return frozenset(fed or {0})


def aux_source(sources: Sequence[Source]) -> tuple[int, int] | None:
    """The one source that sends the aux record: the last stage (it computed the first token),
    lowest TP rank. Both sides compute it the same way."""
    if not sources:
        return None
    last = max(s.p_pp_rank for s in sources)
    return min((s.p_tp_rank, s.p_pp_rank) for s in sources if s.p_pp_rank == last)


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
MAX_WINDOW = 1 << 40


def is_hybrid(layout: Layout) -> bool:
    """True for a hybrid sliding-window layout (a "swa" slot space beside the token space)."""
    return any(s.name == SWA for s in layout.spaces)


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
        raise ValueError(f"field {SWA_WINDOW_KEY!r} must be an int in 0..{MAX_WINDOW}, got {w!r}")
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
    if p.aux_bytes != d.aux_bytes:
        out.append(f"aux record: P {p.aux_bytes} bytes vs D {d.aux_bytes} bytes: set the same aux_bytes")
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
        if a.head_bytes != b.head_bytes or a.head_dim != b.head_dim:
            dims[(a.head_dim, b.head_dim, a.dtype, b.dtype)].add(key[1])
    for (a, b), kinds in dtypes.items():
        out.append(f"dtype of {_names(kinds)}: P {a} vs D {b}: the bytes would be misread")
    for (a, b, _, _), kinds in dims.items():
        out.append(f"head_dim of {_names(kinds)}: P {a} vs D {b}: not the same model")
    if out:
        return out
    # What the explicit checks do not name, the planner does.
    for s in peer_sources(ps, ds):
        try:
            Planner(pl, dl, src_heads=s.src_heads, dst_heads=s.dst_heads, layers=s.layers)
        except PlanError as e:
            out.append(f"P {ps.key} -> D tp{ds.tp_rank}: {e}")
    return out


def _span(layers) -> str:
    xs = sorted(set(layers))
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]} ({len(xs)})" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)


def require_compatible(pairs: Sequence[tuple[RankInfo, RankInfo]], transport: str | None = None) -> None:
    """Raise ``CompatibilityError`` with the mismatches of every pair (each reason once)."""
    seen: dict[str, None] = {}
    for p, d in pairs:
        for m in check_pair(p, d, transport):
            seen.setdefault(m, None)
    if seen:
        raise CompatibilityError(list(seen))


# ------------------------------------------------------------------------------------
# Wire format
# ------------------------------------------------------------------------------------
MAX_MESSAGE = 64 << 20        # a REQ for a 1M-token request carries 8 MiB of slots
MAX_ROOM = (1 << 63) - 1
MAX_GEN = (1 << 31) - 1
MAX_CHUNKS = 1 << 24

_I, _B, _S, _Y, _M, _L = int, bool, str, bytes, dict, list
SCHEMA: dict[str, dict[str, tuple]] = {
    "hello":   {"i": (_I, 0, MAX_ROOM), "info": (_M,), "nonce": (_Y, 8, 64)},
    "welcome": {"re": (_I, 0, MAX_ROOM), "info": (_M,)},
    "refuse":  {"re": (_I, 0, MAX_ROOM), "why": (_L, 1, 256)},
    "req":     {"room": (_I, 0, MAX_ROOM), "gen": (_I, 0, MAX_GEN), "kv": (_Y, 0, MAX_MESSAGE),
                "prefix": (_I, 0, 1 << 40), "state": (_Y, 0, 1 << 16), "aux": (_B,), "dummy": (_B,)},
    "ack":     {"room": (_I, 0, MAX_ROOM), "gen": (_I, 0, MAX_GEN)},
    "nack":    {"room": (_I, 0, MAX_ROOM), "gen": (_I, 0, MAX_GEN), "why": (_S, 0, 4096)},
    "abort":   {"room": (_I, 0, MAX_ROOM), "gen": (_I, 0, MAX_GEN), "why": (_S, 0, 4096)},
    "done":    {"room": (_I, 0, MAX_ROOM), "gen": (_I, 0, MAX_GEN)},
    "fin":     {"meta": (_Y, 0, 1 << 20)},     # a last-chunk marker that moved no bytes (see ChunkMeta)
    "ping":    {},
    "pong":    {},
}
# Fields a message may carry, checked like SCHEMA's when present. Only a hybrid SWA decode rank
# sends these, so the messages of every other pair keep their shape.
OPTIONAL: dict[str, dict[str, tuple]] = {
    "req":     {"swa": (_Y, 0, MAX_MESSAGE),        # decode's window slots, int64 little-endian
                "swa_n": (_I, 0, MAX_WINDOW)},     # how many (the window length decode keeps)
}


def _check_field(name: str, v, spec: tuple) -> None:
    typ = spec[0]
    if typ is _I and (isinstance(v, bool) or not isinstance(v, int)) or typ is not _I and not isinstance(v, typ):
        raise ValueError(f"field {name!r} must be {typ.__name__}, got {type(v).__name__}")
    if len(spec) == 3:
        n = v if typ is _I else len(v)
        if not spec[1] <= n <= spec[2]:
            raise ValueError(f"field {name!r} = {n if typ is _I else f'{n} long'} outside {spec[1]}..{spec[2]}")


def encode(msg: Mapping, secret: bytes | None) -> list[bytes]:
    body = msgpack.packb(msg, use_bin_type=True)
    return [mac(secret, body) if secret else b"", body]


def decode(frames: Sequence[bytes], secret: bytes | None) -> dict:
    """Authenticate and schema-check one message; ValueError says what is wrong."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames [mac, body], got {len(frames)}")
    tag, body = frames
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    if secret is not None and not hmac.compare_digest(bytes(tag), mac(secret, body)):
        raise ValueError("authentication failed: missing or wrong shared secret")
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=1 << 20, max_bin_len=MAX_MESSAGE,
                              max_array_len=1 << 16, max_map_len=1 << 16, max_ext_len=0)
    except Exception as e:  # msgpack raises several types on hostile input
        raise ValueError(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict) or msg.get("t") not in SCHEMA:
        raise ValueError(f"unknown message type {msg.get('t') if isinstance(msg, dict) else type(msg).__name__!r}")
    for name, spec in SCHEMA[msg["t"]].items():
        if name not in msg:
            raise ValueError(f"{msg['t']}: field {name!r} missing")
        _check_field(name, msg[name], spec)
    for name, spec in OPTIONAL.get(msg["t"], {}).items():
        if name in msg:
            _check_field(name, msg[name], spec)
    return msg


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMeta:
    """Rides with every chunk (the transport's ``notify``), or alone in a FIN message.

    ``chunk`` numbers the transfers one source made for one decode rank; the last one also
    says how many there were (``total``) and how many bytes (``nbytes``), so the receiver
    knows when every byte of that source arrived, whatever order chunks land in."""
    room: int
    gen: int
    source: tuple[int, int]      # (p_tp_rank, p_pp_rank)
    chunk: int
    total: int = -1              # >= 1 on the last chunk
    nbytes: int = -1             # total bytes of every chunk, on the last chunk
    aux: bytes | None = None

    def pack(self) -> bytes:
        return msgpack.packb([self.room, self.gen, list(self.source), self.chunk, self.total, self.nbytes, self.aux],
                             use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "ChunkMeta":
        try:
            v = msgpack.unpackb(raw, raw=False, max_str_len=0, max_bin_len=1 << 20, max_array_len=8,
                                max_map_len=0, max_ext_len=0)
        except Exception as e:
            raise ValueError(f"chunk metadata is not msgpack ({type(e).__name__})") from None
        if not isinstance(v, list) or len(v) != 7 or not isinstance(v[2], list) or len(v[2]) != 2:
            raise ValueError("chunk metadata has the wrong shape")
        room, gen, (tp, pp), chunk, total, nbytes, aux = v
        for name, x, lo, hi in (("room", room, 0, MAX_ROOM), ("gen", gen, 0, MAX_GEN), ("tp", tp, 0, 1 << 16),
                                ("pp", pp, 0, 1 << 16), ("chunk", chunk, 0, MAX_CHUNKS),
                                ("total", total, -1, MAX_CHUNKS), ("nbytes", nbytes, -1, 1 << 50)):
            _check_field(name, x, (_I, lo, hi))
        if aux is not None and not isinstance(aux, bytes):
            raise ValueError("chunk metadata: aux must be bytes")
        return cls(room, gen, (tp, pp), chunk, total, nbytes, aux)


# ------------------------------------------------------------------------------------
# The control channel
# ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    interval: float = 1.0    # decode pings each prefill rank this often; prefill answers
    timeout: float = 5.0     # a peer silent this long is lost (its requests fail)

    def __post_init__(self):
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"heartbeat interval {self.interval}s must be > 0 and below timeout {self.timeout}s")


class ControlChannel:
    """One rank's control sockets and the thread that owns them (ZMQ sockets are not thread-safe).

    ``handler`` gets, on the channel thread: ``on_message(peer, msg)``, ``on_peer_lost(peer, why)``
    and ``on_tick(now) -> seconds until it wants the next tick``. It must not block.
    Prefill passes ``bind``; decode calls ``connect`` per prefill rank and is the side that pings.
    """

    def __init__(self, handler, *, secret: bytes | None, heartbeat: Heartbeat, bind: str | None = None,
                 identity: str = "", name: str = "ctl"):
        self.handler, self.secret, self.heartbeat = handler, secret, heartbeat
        self.identity = identity
        self.dropped: collections.Counter[str] = collections.Counter()
        self._ctx = zmq.Context(io_threads=1)
        self._router: zmq.Socket | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        self._by_sock: dict[zmq.Socket, str] = {}
        self._seen: dict[str, float] = {}        # peer -> last message time (watched peers only)
        self._lost: set[str] = set()
        self._outbox: collections.deque = collections.deque()
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.address = ""
        if bind is not None:
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unknown peer: an error, not a silent drop
            try:
                self._router.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise ConnectError(f"control channel cannot bind {bind}: {e}") from None
            self.address = self._router.last_endpoint.decode()
            self._poller.register(self._router, zmq.POLLIN)
        self._closed = self._signaled = False
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-{name}", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 0
        s.sndhwm = s.rcvhwm = 1 << 17   # 1,000s of requests in flight, each a few messages
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE + 64)
        return s

    # -- any thread -----------------------------------------------------------------------
    def _wake(self) -> None:
        # One byte per wake-up, not per message: each write hands the GIL to the channel thread,
        # so a burst of sends costs one hand-over. The channel thread needs no wake from itself.
        if self._signaled or threading.current_thread() is self._thread:
            return
        self._signaled = True
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:   # pipe full: the thread is awake anyway
            pass

    def connect(self, peer: str, address: str) -> None:
        """Decode side: open a DEALER to a prefill rank's control address (idempotent)."""
        self._outbox.append(("connect", peer, address))
        self._wake()

    def send(self, peer: str, msg: Mapping, urgent: bool = True) -> None:
        """Queue a message for ``peer``; never blocks. Lost if the peer is gone (heartbeats tell).
        ``urgent=False`` leaves it for the channel's next turn (within a tick, <= 50 ms) instead of
        waking the channel thread, which costs the caller a GIL hand-over on the hot path."""
        self._outbox.append(("send", peer, msg))
        if urgent:
            self._wake()

    def call(self, peer: str, msg: dict, timeout: float) -> dict:
        """Send ``msg`` and wait for the reply that names it (``re``); ConnectError on timeout."""
        fut: Future = Future()
        i = next(self._ids)
        self._calls[i] = fut
        self.send(peer, {**msg, "i": i})
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise ConnectError(f"no answer from {peer} within {timeout}s") from None
        finally:
            self._calls.pop(i, None)

    def watch(self, peer: str) -> None:
        """Start heartbeat accounting for ``peer`` (prefill: after an accepted HELLO)."""
        self._outbox.append(("watch", peer, None))
        self._wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- channel thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_ping, wait = 0.0, 0.0
        try:
            while not self._closed:
                events = dict(self._poller.poll(max(0, int(wait * 1000))))
                self._signaled = False    # before the outbox is flushed: a later send wakes us again
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._flush()
                for sock in [s for s in events if s is not self._wake_r]:
                    self._receive(sock)
                now = time.monotonic()
                if now >= next_ping:
                    self._heartbeat(now)
                    next_ping = now + self.heartbeat.interval / 2
                wait = min(max(self.handler.on_tick(now), 0.0), next_ping - now)
        except Exception:
            log.exception("control channel thread crashed")
        finally:
            try:
                self._flush()    # what close() left behind (e.g. the aborts of a closing endpoint)
            except Exception:
                pass
            for s in [self._router, *self._dealers.values()]:
                if s is not None:
                    s.close(linger=0)
            self._ctx.term()

    def _flush(self) -> None:
        while self._outbox:
            op, peer, arg = self._outbox.popleft()
            if op == "connect":
                if peer not in self._dealers:
                    s = self._socket(zmq.DEALER)
                    s.setsockopt(zmq.IDENTITY, self.identity.encode())
                    s.connect(arg)
                    self._dealers[peer] = s
                    self._by_sock[s] = peer
                    self._poller.register(s, zmq.POLLIN)
                self._seen[peer] = time.monotonic()
            elif op == "watch":
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            else:
                self._send_now(peer, arg)

    def _send_now(self, peer: str, msg: Mapping) -> None:
        frames = encode(msg, self.secret)
        try:
            if peer in self._dealers:
                self._dealers[peer].send_multipart(frames, zmq.NOBLOCK)
            elif self._router is not None:
                self._router.send_multipart([peer.encode()] + frames, zmq.NOBLOCK)
            else:
                self.dropped["unknown peer"] += 1
        except zmq.ZMQError as e:   # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.dropped[f"send failed: {e.strerror}"] += 1

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(4096):   # bounded, so a flood cannot starve ticks and heartbeats
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if sock is self._router:
                rid, frames = frames[0], frames[1:]
                try:
                    peer = rid.decode()
                except UnicodeDecodeError:
                    self.dropped["bad identity"] += 1
                    continue
            else:
                peer = self._by_sock[sock]
            try:
                msg = decode(frames, self.secret)
            except ValueError as e:
                self.dropped[str(e).split(":")[0]] += 1
                log.warning("dropped control message from %s: %s", peer, e)
                if len(frames) == 2:
                    self._on_refused(sock, peer, frames[1], str(e))
                continue
            if peer in self._seen:
                self._seen[peer] = time.monotonic()
                self._lost.discard(peer)
            t = msg["t"]
            if t == "ping":
                if peer in self._seen:
                    self._send_now(peer, {"t": "pong"})
                continue
            if t == "pong":
                continue
            if "re" in msg and msg["re"] in self._calls:
                fut = self._calls.get(msg["re"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            try:
                self.handler.on_message(peer, msg)
            except Exception:
                log.exception("control handler failed on %s from %s", t, peer)

    def _on_refused(self, sock: zmq.Socket, peer: str, body: bytes, why: str) -> None:
        """A handshake message failed its checks: say why, so launch fails loudly, not by timeout.
        Only the message's id is read from the untrusted body; nothing else is used."""
        try:
            msg = msgpack.unpackb(body, raw=False, max_str_len=1 << 20, max_bin_len=MAX_MESSAGE,
                                  max_array_len=1 << 16, max_map_len=1 << 16, max_ext_len=0)
        except Exception:
            return
        if not isinstance(msg, dict):
            return
        if sock is self._router and msg.get("t") == "hello" and isinstance(msg.get("i"), int):
            self._send_now(peer, {"t": "refuse", "re": msg["i"], "why": [why]})
        elif sock is not self._router and isinstance(msg.get("re"), int) and msg["re"] in self._calls:
            fut = self._calls.get(msg["re"])
            if fut is not None and not fut.done():
                fut.set_exception(ConnectError(f"prefill rank {peer} answered the handshake with a message "
                                               f"that fails our checks ({why}): is the shared secret the same "
                                               f"on both sides?"))

    def _heartbeat(self, now: float) -> None:
        for peer in self._dealers:
            self._send_now(peer, {"t": "ping"})
        for peer, seen in list(self._seen.items()):
            if peer not in self._lost and now - seen > self.heartbeat.timeout:
                self._lost.add(peer)
                try:
                    self.handler.on_peer_lost(peer, f"silent for {now - seen:.1f}s (heartbeat timeout "
                                                    f"{self.heartbeat.timeout}s)")
                except Exception:
                    log.exception("control handler failed on a lost peer")


# ------------------------------------------------------------------------------------
# The two halves of the handshake
# ------------------------------------------------------------------------------------
def hello(channel: ControlChannel, peer: str, d_info: RankInfo, timeout: float) -> RankInfo:
    """Decode side: HELLO -> the prefill rank's RankInfo, or CompatibilityError / ConnectError."""
    reply = channel.call(peer, {"t": "hello", "info": d_info.to_dict(), "nonce": os.urandom(16)}, timeout)
    if reply["t"] == "refuse":
        why = [str(w)[:1024] for w in reply["why"]]
        if any(w.startswith("authentication") for w in why):
            raise ConnectError(f"prefill rank {peer} refused the handshake: {'; '.join(why)}")
        raise CompatibilityError(why)
    if reply["t"] != "welcome":
        raise ConnectError(f"prefill rank {peer} answered HELLO with {reply['t']!r}")
    try:
        return RankInfo.from_dict(reply["info"])
    except ValueError as e:
        raise ConnectError(f"prefill rank {peer} sent an invalid rank record: {e}") from None


def answer_hello(p_info: RankInfo, msg: Mapping, transport: str) -> tuple[RankInfo | None, dict]:
    """Prefill side: (decode RankInfo or None, the reply to send)."""
    try:
        d_info = RankInfo.from_dict(msg["info"])
    except ValueError as e:
        return None, {"t": "refuse", "re": msg["i"], "why": [f"invalid rank record: {e}"]}
    if d_info.spec.role != "decode":
        return None, {"t": "refuse", "re": msg["i"], "why": ["only decode ranks say HELLO"]}
    why = check_pair(p_info, d_info, transport)
    if why:
        return None, {"t": "refuse", "re": msg["i"], "why": why}
    return d_info, {"t": "welcome", "re": msg["i"], "info": p_info.to_dict()}


__all__ = ["combine_layouts", "decode_sources", "peers_needed", "peer_sources", "expected_decode_ranks",
           "aux_source", "check_pair", "require_compatible", "encode", "decode", "ChunkMeta", "Heartbeat",
           "ControlChannel", "hello", "answer_hello", "SCHEMA", "OPTIONAL", "PROTOCOL", "is_hybrid",
           "layout_record", "swa_window_of", "SWA_WINDOW_KEY"]
