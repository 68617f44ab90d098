"""The control messages, one frozen dataclass per type, and the fixed reasons a message is dropped.

Every message a peer sends is parsed here (``Message.from_dict``) before anything reads it:
exact types (an int is an int, never a bool or a float), bounded sizes, no unknown fields. A
value that fails is a ``WireError`` carrying a ``Drop`` reason from a fixed set, so counters
are keyed by our enum, never by a string the peer chose.

Who calls what
--------------
``ControlChannel`` (``kvxfer.control.channel``) parses every received body with ``parse`` and
builds every outgoing one with ``as_message`` (dicts from the endpoints are checked the same way,
so a bug on our side fails on the sender's thread, not on the peer's). Handlers receive a
``Message``; it reads like a read-only mapping (``msg["room"]``, ``msg.get("swa")``, ``"swa_n" in
msg``) so endpoint code written against dicts keeps working, and compares equal to the dict it
came from. An absent optional field is ``None`` on the dataclass and absent from the mapping.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

MAX_MESSAGE = 64 << 20        # a REQ for a 1M-token request carries 8 MiB of slots
MAX_ROOM = (1 << 63) - 1
MAX_GEN = (1 << 31) - 1
MAX_CALL_ID = (1 << 63) - 1
MAX_WHY = 4096                # characters of one reason
MAX_WHYS = 256                # reasons in one REFUSE
MAX_WINDOW = 1 << 40          # sliding-window tokens (kvxfer.control.compat checks the same bound)
CAP_BYTES = 16                # a grant's data-plane capability (Req.cap)


class Drop(str, enum.Enum):
    """Why the channel dropped (or refused) a message. The only keys of ``ControlChannel.dropped``."""
    FRAMES = "wrong frame count"
    TOO_LARGE = "message too large"
    AUTH = "authentication failed"
    HEADER = "bad envelope"
    RECIPIENT = "addressed to another rank"
    SENDER = "sender identity does not match the connection"
    REPLAY = "replayed or reordered"
    NOT_MSGPACK = "not msgpack"
    TYPE = "unknown message type"
    FIELD = "bad field"
    IDENTITY = "bad routing identity"
    PEERS = "too many peers"
    UNEXPECTED = "reply to no call"
    UNKNOWN_PEER = "unknown peer"
    SEND_FAILED = "send failed"
    CONNECT = "bad peer address"
    HANDLER = "handler raised"

    def __str__(self) -> str:
        return self.value


class WireError(ValueError):
    """A message failed its checks; ``reason`` is the counter key, the text says what was wrong."""

    def __init__(self, reason: Drop, detail: str):
        self.reason = reason
        super().__init__(f"{reason.value}: {detail}")


# ------------------------------------------------------------------------------------
# Field checks: (type, lo, hi); for str/bytes/list the bounds are on the length
# ------------------------------------------------------------------------------------
def check_field(name: str, v: Any, spec: tuple) -> None:
    typ = spec[0]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)) or typ is not int and type(v) is not typ:
        raise WireError(Drop.FIELD, f"field {name!r} must be {typ.__name__}, got {type(v).__name__}")
    if len(spec) >= 3:
        n = v if typ is int else len(v)
        if not spec[1] <= n <= spec[2]:
            raise WireError(Drop.FIELD, f"field {name!r} = {n if typ is int else f'{n} long'} "
                                        f"outside {spec[1]}..{spec[2]}")
    if typ is list and len(spec) == 4:
        for x in v:
            check_field(f"{name}[]", x, spec[3])


class Message(Mapping):
    """Base of every control message: checked in ``__post_init__``, read like a mapping."""
    __slots__ = ()
    T: ClassVar[str] = ""
    SPEC: ClassVar[dict[str, tuple]] = {}       # required fields
    OPTIONAL: ClassVar[dict[str, tuple]] = {}   # may be absent (None on the dataclass)

    def __post_init__(self):
        for name, spec in self.SPEC.items():
            check_field(name, getattr(self, name), spec)
        for name, spec in self.OPTIONAL.items():
            if getattr(self, name) is not None:
                check_field(name, getattr(self, name), spec)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Message":
        """Exactly the fields of this type; WireError (FIELD) names the first one wrong."""
        known = cls.SPEC.keys() | cls.OPTIONAL.keys()
        extra = [k for k in d if k != "t" and k not in known]
        if extra:
            raise WireError(Drop.FIELD, f"{cls.T}: unknown field {str(extra[0])[:64]!r}")
        missing = [k for k in cls.SPEC if k not in d]
        if missing:
            raise WireError(Drop.FIELD, f"{cls.T}: field {missing[0]!r} missing")
        return cls(**{k: d[k] for k in known if k in d})

    def to_dict(self) -> dict:
        out: dict = {"t": self.T}
        for name in self.SPEC:
            out[name] = getattr(self, name)
        for name in self.OPTIONAL:
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        return out

    def pack(self) -> bytes:
        """The msgpack body of this message."""
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "Message":
        """Parse a body that must hold this type (``Message.unpack``: any type); WireError if not."""
        msg = parse(raw)
        if cls is not Message and type(msg) is not cls:
            raise WireError(Drop.TYPE, f"expected {cls.T}, got {msg.T}")
        return msg

    # -- read-only mapping view (endpoint code reads messages by key) ---------------------
    def __getitem__(self, key: str) -> Any:
        if key == "t":
            return self.T
        if key in self.SPEC or (key in self.OPTIONAL and getattr(self, key) is not None):
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


_M = TypeVar("_M", bound="type[Message]")


def _msg(t: str, spec: dict, optional: dict | None = None) -> Callable[[_M], _M]:
    """The wire name and field bounds of a message class (a frozen dataclass, declared under it)."""
    def wrap(cls: _M) -> _M:
        cls.T, cls.SPEC, cls.OPTIONAL = t, spec, optional or {}
        return cls
    return wrap


_RC = {"room": (int, 0, MAX_ROOM), "gen": (int, 0, MAX_GEN)}


@_msg("hello", {"i": (int, 0, MAX_CALL_ID), "info": (dict, 0, 4096), "nonce": (bytes, 8, 64)})
@dataclass(frozen=True, slots=True, eq=False)
class Hello(Message):
    """Decode -> prefill, once per connection: the decode rank's ``RankInfo`` as a dict."""
    i: int
    info: dict
    nonce: bytes


@_msg("welcome", {"re": (int, 0, MAX_CALL_ID), "info": (dict, 0, 4096)})
@dataclass(frozen=True, slots=True, eq=False)
class Welcome(Message):
    """Prefill -> decode: the HELLO was accepted; the prefill rank's ``RankInfo``."""
    re: int
    info: dict


@_msg("refuse", {"re": (int, 0, MAX_CALL_ID), "why": (list, 1, MAX_WHYS, (str, 0, MAX_WHY))})
@dataclass(frozen=True, slots=True, eq=False)
class Refuse(Message):
    """Prefill -> decode: every reason the HELLO was refused, in words."""
    re: int
    why: list


@_msg("req", {**_RC, "kv": (bytes, 0, MAX_MESSAGE), "prefix": (int, 0, 1 << 40), "state": (bytes, 0, 1 << 16),
              "aux": (bool,), "dummy": (bool,)},
      {"swa": (bytes, 0, MAX_MESSAGE), "swa_n": (int, 0, MAX_WINDOW), "cap": (bytes, CAP_BYTES, CAP_BYTES)})
@dataclass(frozen=True, slots=True, eq=False)
class Req(Message):
    """Decode -> prefill, per request: the grant (slots as int64 little-endian bytes).

    ``cap``: the grant's data-plane capability, ``secrets.token_bytes(CAP_BYTES)`` made by decode
    per grant and given to its transport (``Transport.expect(..., capability=cap)``); prefill
    passes it to every ``Transport.submit(..., capability=cap)`` of the request. Absent: the
    grant has none (older decode ranks)."""
    room: int
    gen: int
    kv: bytes
    prefix: int
    state: bytes
    aux: bool
    dummy: bool
    swa: bytes | None = None      # hybrid SWA only: decode's window slots
    swa_n: int | None = None      # and how many
    cap: bytes | None = None      # the grant's capability (exactly CAP_BYTES), see above


@_msg("ack", _RC)
@dataclass(frozen=True, slots=True, eq=False)
class Ack(Message):
    """Prefill -> decode: the request is bound to a sender."""
    room: int
    gen: int


@_msg("nack", {**_RC, "why": (str, 0, MAX_WHY)})
@dataclass(frozen=True, slots=True, eq=False)
class Nack(Message):
    """Prefill -> decode: the request is refused."""
    room: int
    gen: int
    why: str


@_msg("abort", {**_RC, "why": (str, 0, MAX_WHY)})
@dataclass(frozen=True, slots=True, eq=False)
class Abort(Message):
    """Either side: the request failed there."""
    room: int
    gen: int
    why: str


@_msg("done", _RC)
@dataclass(frozen=True, slots=True, eq=False)
class Done(Message):
    """Decode -> prefill: every byte landed; prefill may release the KV."""
    room: int
    gen: int


@_msg("fin", {"meta": (bytes, 0, 1 << 20)})
@dataclass(frozen=True, slots=True, eq=False)
class Fin(Message):
    """Prefill -> decode: a last-chunk marker that moved no bytes (``ChunkMeta`` packed)."""
    meta: bytes


@_msg("ping", {})
@dataclass(frozen=True, slots=True, eq=False)
class Ping(Message):
    """Decode -> prefill, every heartbeat interval."""


@_msg("pong", {})
@dataclass(frozen=True, slots=True, eq=False)
class Pong(Message):
    """Prefill -> decode: the answer to a ping."""


TYPES: dict[str, type[Message]] = {c.T: c for c in (Hello, Welcome, Refuse, Req, Ack, Nack, Abort, Done, Fin,
                                                    Ping, Pong)}


def parse(body: bytes) -> Message:
    """A received body -> its message: size, msgpack limits (no ext types, bounded lengths and
    nesting), then the schema of its type. WireError with a fixed reason otherwise."""
    if len(body) > MAX_MESSAGE:
        raise WireError(Drop.TOO_LARGE, f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=1 << 20, max_bin_len=MAX_MESSAGE,
                              max_array_len=1 << 16, max_map_len=1 << 16, max_ext_len=0)
    except Exception as e:  # msgpack raises several types on hostile input (also nesting too deep)
        raise WireError(Drop.NOT_MSGPACK, type(e).__name__) from None
    return as_message(msg)


def as_message(msg: Mapping | Message) -> Message:
    """A ``Message`` from a dict with a ``"t"`` (or the message itself); WireError when malformed."""
    if isinstance(msg, Message):
        return msg
    if not isinstance(msg, Mapping):
        raise WireError(Drop.TYPE, f"a message must be a map, got {type(msg).__name__}")
    t = msg.get("t")
    cls = TYPES.get(t) if type(t) is str else None
    if cls is None:
        raise WireError(Drop.TYPE, f"unknown message type ({type(t).__name__})")
    return cls.from_dict(msg)


def call_id(msg: Message) -> int | None:
    """The call id a reply names (``re``), or None for a message that is not a reply."""
    return msg.re if isinstance(msg, (Welcome, Refuse)) else None


def outgoing(msg: Mapping | Message) -> Message:
    """``as_message`` for what we send: reasons (``why``) are cut to their bounds first, so a long
    error text of ours never turns a refusal into no answer. Anything else malformed raises."""
    if isinstance(msg, Mapping) and not isinstance(msg, Message) and "why" in msg:
        why = msg["why"]
        if isinstance(why, str):
            msg = {**msg, "why": why[:MAX_WHY]}
        elif isinstance(why, list):
            msg = {**msg, "why": [w[:MAX_WHY] if isinstance(w, str) else w for w in why[:MAX_WHYS]]}
    return as_message(msg)
