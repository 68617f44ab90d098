"""The zmq transport's options: one frozen dataclass, every field documented and checked here.

Who calls what: ``ZMQTransport(**options)`` (as ``get_transport("zmq", **options)`` and the
endpoints' ``transport_options`` do) builds ``ZMQOptions(**options)``; ``ZMQOptions.of(mapping)``
does the same for a mapping and names an unknown key. Any bad value raises
``kvxfer.errors.ConfigError`` (a ValueError) naming the option, the value and what is allowed,
before a socket or thread exists. (The UCX transport's options are to follow the same pattern:
``UCXOptions``, ``.of``, ``ConfigError``.)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

from kvxfer.errors import ConfigError
from kvxfer.plan import FEW_RUNS
from kvxfer.transport.options import check_kind, check_within, options_of

from .addresses import check_ports
from .protocol import MAX_NOTIFY, MAX_PARTS, RUN_BYTES

HEADER_ROOM = MAX_PARTS * RUN_BYTES + 4096   # the largest header of a zero-copy message our sender makes
PART_ROOM = MAX_NOTIFY + (64 << 10)          # a header part: the notify, plus ids and fields


_kind = functools.partial(check_kind, "zmq")
_within = functools.partial(check_within, "zmq")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ZMQOptions:
    """Options of ``ZMQTransport``; every one has a default."""

    endpoint: str = "tcp://127.0.0.1:0"
    """Where the data ROUTER binds: "tcp://HOST:PORT" (port 0: a free one; HOST may be a wildcard,
    0.0.0.0) or "ipc:///path"."""

    advertise: str | None = None
    """The address, host name or interface name (``eth0``) peers are told to reach
    (``descriptor()["endpoint"]``); None: the bind host, or for a wildcard bind a routable interface
    address. A wildcard is never advertised."""

    remote: bool = False
    """Peers are on other hosts: advertising loopback (or ipc://) is refused too."""

    ports: tuple[int, int] | None = None
    """(first, last): bind the first free port of this range (the endpoint's port must be 0); None:
    the endpoint's port."""

    connect_timeout: float = 5.0
    """Seconds ``connect`` waits for a ping's answer on the data socket (an unreachable, black-holed
    or refusing data address fails there, naming the address). In (0, 600]."""

    event: Callable[[], Any] | None = None
    """A factory of events (``record(stream=None)``, ``query()``) marking writes complete; default
    ``torch.cuda.Event`` after writes to a device region (``devsync``). Given, every write records one
    (tests: a stand-in that completes late)."""

    staging_frames: int = 8
    """Frames in the staging ring (each frame_bytes * (frames_per_message + 1) bytes), allocated at
    ``register`` (pinned when a region is on a device), never more: when every one is in zmq, sending
    waits (counted: ``staging()``, kvxfer.metrics). In 1..4096."""

    frame_bytes: int = 1 << 20
    """Largest zero-copy frame (~1 MiB: zmq slows down on multi-MiB frames). In 4096..max_message_bytes/2."""

    frames_per_message: int = 4
    """Zero-copy frames per message, and the size of a packed frame in frame_bytes (fewer per-message
    costs; packed frames measured faster at 4 MiB than 1 MiB). At least 1."""

    zero_copy_min: int = 256 << 10
    """Runs at least this long go out from the region without a copy (each such part costs pyzmq
    ~40 us for its frame and tracker; a copy of 64 KiB costs ~13 us: 1000 scattered 64 KiB pages went
    1.3-1.5x faster copied, so 256 KiB). At least 1."""

    window: int = 16
    """Messages queued per peer before zmq pushes back (send high-water mark), and whole messages a
    receiver's zmq queues per sender connection before it stops reading it. At least 1."""

    heartbeat_ivl: float = 1.0
    """Seconds between pings while transfers are open. Above 0, below heartbeat_timeout."""

    heartbeat_timeout: float = 5.0
    """Seconds of silence after which a peer's open transfers fail."""

    max_message_bytes: int = 64 << 20
    """Largest message the receiver accepts, all parts together (a larger message fails its
    transfer). zmq's own limit (``ZMQ_MAXMSGSIZE``: a larger part makes zmq drop the connection) is
    the largest part this transport's options make (``part_limit``), at most this."""

    max_incoming: int = 4096
    """Most incoming transfers open at once from senders that are not admitted (``admission``
    "open": they cannot be told apart); more are rejected. At least 1."""

    max_incoming_per_peer: int = 1024
    """Most incoming transfers open at once from one sender: one admission (``admission``
    "required"), else one connection (routing id). At least 1."""

    few_runs: int = FEW_RUNS
    """Messages and plans of at most this many runs are handled with Python ints (``FEW_RUNS``: a
    1-run message's frames cost 2.3 us that way, 44 us as arrays; the conformance suite forces 0 and
    2**20 so both paths carry every case). At least 0."""

    admission: Literal["open", "required"] = "open"
    """"open": any sender may send (ZMTP's NULL mechanism; ``admit`` returns b""). "required": only
    senders ``admit`` let in, each presenting its current token at the ZMTP handshake (PLAIN, checked
    by ZAP on the I/O thread): nothing from anyone else is buffered beyond one handshake frame per
    connection (``kvxfer.transport.zmqguard``). A sender must be built the same way as the receivers
    it connects to: a token goes with PLAIN, none with NULL."""

    max_admitted: int = 4096
    """Senders admitted at once; admitting one more forgets the least recently admitted. At least 1."""

    def __post_init__(self) -> None:
        _kind("endpoint", self.endpoint, str)
        for name in ("advertise",):
            if getattr(self, name) is not None:
                _kind(name, getattr(self, name), str)
        _kind("remote", self.remote, bool)
        for name in ("staging_frames", "frame_bytes", "frames_per_message", "zero_copy_min", "window",
                     "max_message_bytes", "max_incoming", "max_incoming_per_peer", "few_runs", "max_admitted"):
            _kind(name, getattr(self, name), int)
        for name in ("connect_timeout", "heartbeat_ivl", "heartbeat_timeout"):
            _kind(name, getattr(self, name), int, float)
        if self.event is not None and not callable(self.event):
            raise ConfigError(f"zmq option event={self.event!r}: give a callable that makes an event, or None")
        try:
            object.__setattr__(self, "ports", check_ports(self.endpoint, self.ports))
        except ValueError as e:
            raise ConfigError(f"zmq option {e}") from None
        _within("connect_timeout", self.connect_timeout, 0, 600, "in (0, 600] seconds", low_open=True)
        _within("staging_frames", self.staging_frames, 1, 4096, "in 1..4096")
        _within("frame_bytes", self.frame_bytes, 4096, self.max_message_bytes // 2,
                "in 4096..max_message_bytes/2")
        for name in ("frames_per_message", "zero_copy_min", "window", "max_incoming", "max_incoming_per_peer",
                     "max_admitted"):
            _within(name, getattr(self, name), 1, 1 << 62, "at least 1")
        _within("few_runs", self.few_runs, 0, 1 << 62, "at least 0")
        if self.frame_bytes * self.frames_per_message + HEADER_ROOM > self.max_message_bytes:
            raise ConfigError(f"zmq options frame_bytes * frames_per_message "
                              f"({self.frame_bytes * self.frames_per_message}) plus {HEADER_ROOM} header bytes must "
                              f"fit max_message_bytes ({self.max_message_bytes}): send fewer frames per message")
        if not 0 < self.heartbeat_ivl < self.heartbeat_timeout:
            raise ConfigError(f"zmq options heartbeat_ivl={self.heartbeat_ivl} and heartbeat_timeout="
                              f"{self.heartbeat_timeout}: the interval must be above 0 and below the timeout")
        if self.admission not in ("open", "required"):
            raise ConfigError(f"zmq option admission={self.admission!r}: give 'open' or 'required'")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "ZMQOptions":
        """Options from a mapping (an endpoint's ``transport_options``); ConfigError names an unknown key."""
        return options_of(cls, "zmq", options)

    @property
    def part_limit(self) -> int:
        """``ZMQ_MAXMSGSIZE`` of the data ROUTER: the largest part our options make. A packed frame
        holds runs that start within frame_bytes * frames_per_message, the last one at most
        frame_bytes long (a staging frame's size, frames_per_message + 1 frames); a header holds
        fewer run bytes than that, plus its notify and ids."""
        return min(self.max_message_bytes, self.frame_bytes * (self.frames_per_message + 1) + PART_ROOM)
