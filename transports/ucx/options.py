"""The UCX transport's options: one frozen dataclass, every field documented and checked here.

Who calls what: ``UCXTransport(**options)`` (as ``get_transport("ucx", **options)`` and the
endpoints' ``transport_options`` do) builds ``UCXOptions.of(options)``, which names an unknown
key; ``UCXTransport(options=UCXOptions(...))`` takes one made ahead. Any bad value raises
``kvxfer.errors.ConfigError`` (a ValueError) naming the option, the value and what is allowed,
before a worker or thread exists. The parts of the transport each get the one ``UCXOptions`` in
their constructor and read it; nothing changes it afterwards.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal, get_args

from kvxfer.errors import ConfigError
from kvxfer.plan import FEW_RUNS
from kvxfer.transport.options import check_kind, check_within, options_of

from .rto import RTO_MAX_S, RTO_MIN_S
from .settings import PUT_BELOW, PUT_BELOW_MANY

StageHost = Literal["network", "always", "never"]
STAGE_HOST: tuple[str, ...] = get_args(StageHost)   # see ``frames`` for what each one measured


_kind = functools.partial(check_kind, "ucx")
_within = functools.partial(check_within, "ucx")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UCXOptions:
    """Options of ``UCXTransport``; every one has a default."""

    tls: str | None = None
    """``UCX_TLS`` of this transport ("tcp", "sm,self", ...), for every peer. None: UCX's choice
    (shared memory on one host), except that a peer on another host or in another network
    namespace (its descriptor says) is connected through a second worker without shared memory and
    cma (``settings.FAR_TLS``), whose queues never deliver across network namespaces. Both peers
    must share a transport."""

    frame_bytes: int = 4 << 20
    """Big runs are put in pieces of this size; packed blocks go in frames of it. Staged frames
    received here must fit it: give both sides one value. In 4 KiB..4 GiB (exclusive)."""

    put_below: int = PUT_BELOW
    """Runs shorter than this are packed, longer ones put (``settings.PUT_BELOW``). At least 0."""

    put_below_many: int = PUT_BELOW_MANY
    """The same for plans of more than ``few_runs`` runs (``settings.PUT_BELOW_MANY``). At least 0."""

    few_runs: int = FEW_RUNS
    """Plans of at most this many runs are prepared with Python ints (``FEW_RUNS``). Both paths stay:
    measured (``Planner.prepare_few`` vs ``Planner.prepare``, 16 KiB runs, this 2-core box) 1 run 16
    vs 124 us, 4 runs 16 vs 86, 16 runs 51 vs 127. The conformance suite forces 0 and 2**20 so each
    path carries every case. At least 0."""

    heartbeat: float = 0.5
    """Seconds between pings to each peer. Above 0, below ``peer_timeout``."""

    peer_timeout: float = 5.0
    """Seconds of silence that fail a peer's transfers (a dead peer is silent: error handling is
    off, except to a peer elsewhere without ``tls``, whose failed connection is reported at once)."""

    max_control_bytes: int = 64 << 20
    """Largest control batch received (larger ones are dropped unread); a plan's announce takes at
    most half of it. At least 4096."""

    max_incoming: int = 4096
    """Incoming transfers open at once, all peers together. At least 1."""

    max_incoming_per_peer: int = 1024
    """Incoming transfers open at once from one peer. At least 1."""

    max_peers: int = 1024
    """Peers (sender ids) this transport keeps; a HELLO beyond it is dropped. At least 1."""

    fence_grace: float = 1.0
    """Seconds between proving a peer dead (on this kernel: its process gone; elsewhere: UCX reports
    its connection failed) and freeing what it held (its writes already queued here are applied
    meanwhile). At least 0."""

    quarantine_timeout: float | None = None
    """None: memory a failed or silent peer could still write is never given back until that peer
    flushes, re-handshakes or is proven dead (elsewhere, without ``tls``: its connection failed).
    A number (above 0): give it back after that many seconds anyway (counted in
    ``fencing()["expired"]``); a late write may then corrupt the next owner."""

    connect_timeout: float = 10.0
    """Seconds ``connect`` waits for the peer's answer over the new endpoint (a round trip on the
    data path); none: ``ConnectError`` naming the address. In (0, 600]."""

    ucx_config: Mapping[str, str] | None = None
    """More UCX settings (names without ``UCX_``), e.g. ``{"RNDV_THRESH": "8192"}``; they replace
    ``settings.UCX_DEFAULTS`` (the environment's UCX_* settings do too)."""

    staging_frames: int = 8
    """Slots of each staging ring (send and receive), each ``frame_bytes``: allocated at
    ``register`` on the regions' CUDA device, or in host memory at the first staged frame; never
    more (exhausted, the I/O thread waits: ``staging()``, kvxfer.metrics under "ucx-send" /
    "ucx-recv"). In 1..4096."""

    stage_host: StageHost = "network"
    """Which host-memory frames the sender stages: "network" (peers reached over the network:
    another host or network namespace, or a UCX_TLS without shared memory; measured faster over
    TCP), "always", "never" (UCX iovs read in place). A host receiver takes staged frames into its
    receive ring when its own pieces of them are small on average (``frames.STAGE_BELOW``), in
    place when they are long (a head slice into token-major slots) or with "never"; with "always"
    every one through the ring."""

    eager_writes: bool = True
    """Receiver (the default): pregrant each expected request (and its ranges) to the connected
    peers, which then announce and put inside them at once, without waiting for GO, and succeed
    once their puts are flushed; DONE follows the flush (``eager``). Memory of a forgotten request
    waits for every pregranted peer's FENCED; a peer holds at most its pregrant window. False:
    every transfer is announced and checked before a byte is put (GO), and a sender succeeds at
    the receiver's ACK."""

    pregrant_window_bytes: int = 1 << 30
    """Receiver, with ``eager_writes``: the most memory pregranted to any one peer at once (granted
    bytes of its pregranted requests, counted from the PREGRANT until that peer said FENCED after
    ``forget``, or was proven dead). A request that would go beyond it is not pregranted to that
    peer (its transfer is announced, GO), so a peer that stalls forever holds at most this much of
    the pool. ``fencing()`` shows what is held against it."""

    pregrant_window_requests: int = 256
    """Receiver, with ``eager_writes``: the most requests pregranted to any one peer at once (as
    ``pregrant_window_bytes``)."""

    tcp_rto_max: float | None = 2.0
    """Seconds: the most TCP's retransmit backoff waits on this transport's UCX connections to
    peers reached over TCP (Linux's per-socket ``TCP_RTO_MAX_MS``, kernel >= 6.15; ``rto``). It
    bounds how long after a partition heals a cut connection moves again, and so when what the
    cut transfers held (a sender's source, a receiver's pregranted slots) comes back: without
    it, the host's ``net.ipv4.tcp_rto_max_ms`` (120 s by default; 16-20 s after a 35 s cut,
    measured). A lower host setting stays. In [1, 120] (what the kernel accepts), or None: leave
    the kernel's."""

    admission: bool | None = None
    """None: a joining peer needs its latest ``admit`` token once this transport admitted a peer or
    was given a token by ``connect``; True: from the start; False: never (every peer that reaches
    the front worker may join)."""

    def __post_init__(self) -> None:
        _kind("tls", self.tls, str, type(None))
        for name in ("frame_bytes", "put_below", "put_below_many", "few_runs", "max_control_bytes", "max_incoming",
                     "max_incoming_per_peer", "max_peers", "staging_frames", "pregrant_window_bytes",
                     "pregrant_window_requests"):
            _kind(name, getattr(self, name), int)
        for name in ("heartbeat", "peer_timeout", "fence_grace", "connect_timeout"):
            _kind(name, getattr(self, name), int, float)
        _kind("quarantine_timeout", self.quarantine_timeout, int, float, type(None))
        _kind("tcp_rto_max", self.tcp_rto_max, int, float, type(None))
        _kind("eager_writes", self.eager_writes, bool)
        _kind("admission", self.admission, bool, type(None))
        if self.ucx_config is not None:
            if not isinstance(self.ucx_config, Mapping) or not all(
                    type(k) is str and type(v) is str for k, v in self.ucx_config.items()):
                raise ConfigError(f"ucx option ucx_config={self.ucx_config!r:.200}: give a mapping of UCX setting "
                                  "names (without UCX_) to string values, or None")
            object.__setattr__(self, "ucx_config", dict(self.ucx_config))   # a copy: nobody changes it later
        _within("frame_bytes", self.frame_bytes, 4096, (1 << 32) - 1, "in 4096..2**32-1 bytes")
        _within("staging_frames", self.staging_frames, 1, 4096, "in 1..4096")
        for name in ("put_below", "put_below_many", "few_runs"):
            _within(name, getattr(self, name), 0, 1 << 62, "at least 0")
        for name in ("pregrant_window_bytes", "pregrant_window_requests"):
            _within(name, getattr(self, name), 0, 1 << 62, "at least 0 (0: nothing is pregranted)")
        for name in ("max_incoming", "max_incoming_per_peer", "max_peers"):
            _within(name, getattr(self, name), 1, 1 << 62, "at least 1")
        _within("max_control_bytes", self.max_control_bytes, 4096, 1 << 62, "at least 4096 (a HELLO must fit)")
        _within("connect_timeout", self.connect_timeout, 0, 600, "in (0, 600] seconds", low_open=True)
        _within("fence_grace", self.fence_grace, 0, 1 << 62, "at least 0 seconds")
        if self.quarantine_timeout is not None:
            _within("quarantine_timeout", self.quarantine_timeout, 0, 1 << 62, "None or above 0 seconds",
                    low_open=True)
        if self.tcp_rto_max is not None:
            _within("tcp_rto_max", self.tcp_rto_max, RTO_MIN_S, RTO_MAX_S, "None or in [1, 120] seconds")
        if not 0 < self.heartbeat < self.peer_timeout:
            raise ConfigError(f"ucx options heartbeat={self.heartbeat} and peer_timeout={self.peer_timeout}: the "
                              "heartbeat must be above 0 and below the peer timeout")
        if self.stage_host not in STAGE_HOST:
            raise ConfigError(f"ucx option stage_host={self.stage_host!r}: give one of {', '.join(STAGE_HOST)}")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "UCXOptions":
        """Options from a mapping (an endpoint's ``transport_options``); ConfigError names an unknown key."""
        return options_of(cls, "ucx", options)
