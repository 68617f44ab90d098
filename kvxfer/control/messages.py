"""The control messages, one frozen dataclass per type, the protocol version, and the fixed
reasons a message is dropped.

Every message a peer sends is parsed here (``parse``) before anything reads it: exact types (an
int is an int, never a bool or a float), bounded sizes, no unknown fields. A value that fails is
a ``WireError`` carrying a ``Drop`` reason from a fixed set, so counters are keyed by our enum,
never by a string the peer chose. Each field is declared once, with its bounds in the field's
metadata (``wire(...)``); the wire name of a type is its ``T``.

Who calls what
--------------
``ControlChannel`` (``kvxfer.control.channel``) parses every received body with ``parse`` and
sends only message objects. The endpoints build them (``Req(room=..., gen=...)``: each is checked
against its schema when built) and ``match`` on their classes; a field a peer may omit is None.
Reasons (``why``) are cut to their bound with ``cut`` before a message is built.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from ..errors import ProtocolError

# ------------------------------------------------------------------------------------
# The protocol version: bumped when RankInfo or a message changes shape. A handshake between
# ranks of two versions is refused, naming both (``kvxfer.control.compat``).
#   1  the first control plane (plain msgpack bodies)
#   2  the signed envelope [mac, head, body] (``kvxfer.control.wire``)
#   3  rooms may be strings; HELLO carries the transports' admission tokens; rank records say
#      their aux rows (``aux_rows``); aux rows of any format; BYE
# ------------------------------------------------------------------------------------
PROTOCOL = 3

MAX_MESSAGE = 64 << 20        # a REQ for a 1M-token request carries 8 MiB of slots
MAX_ROOM = (1 << 63) - 1
MAX_ROOM_CHARS = 256          # a string room (an engine's request id): 1..256 printable characters
MAX_GEN = (1 << 31) - 1
MAX_CALL_ID = (1 << 63) - 1
MAX_WHY = 4096                # characters of one reason
MAX_WHYS = 256                # reasons in one REFUSE
MAX_WINDOW = 1 << 40          # sliding-window tokens (kvxfer.control.compat checks the same bound)
CAP_BYTES = 16                # a grant's data-plane capability (Req.cap)
MAX_TOKEN = 64                # bytes of one transport admission token (Hello.tokens)

Room = Union[int, str]        # the engine's name for a request: an int, or a string id


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


class WireError(ProtocolError):
    """A message failed its checks; ``reason`` is the counter key, the text says what was wrong."""

    def __init__(self, reason: Drop, detail: str):
        self.reason = reason
        super().__init__(f"{reason.value}: {detail}")


# ------------------------------------------------------------------------------------
# Field checks. A spec is (type, lo, hi[, item spec]): for int the bounds are on the value, for
# str/bytes/list/dict on the length; a list's items (a dict's values, under short str keys)
# meet the item spec. ``ROOM`` is an int room or a string room.
# ------------------------------------------------------------------------------------
ROOM = ("room",)


def check_room(room: Any, name: str = "room") -> Room:
    """``room`` if it is one (an int in 0..2**63-1, or a string of 1..256 printable characters);
    WireError (a ValueError) naming the bound otherwise."""
    if isinstance(room, int) and not isinstance(room, bool):
        if 0 <= room <= MAX_ROOM:
            return room
        raise WireError(Drop.FIELD, f"field {name!r}: an int room must be in 0..2**63-1, got {room}")
    if type(room) is str:
        if 1 <= len(room) <= MAX_ROOM_CHARS and room.isprintable():
            return room
        raise WireError(Drop.FIELD, f"field {name!r}: a string room must be 1..{MAX_ROOM_CHARS} printable characters, "
                                    f"got {len(room)} character(s){'' if room.isprintable() else ' (unprintable)'}")
    raise WireError(Drop.FIELD, f"field {name!r}: a room is an int or a str, got {type(room).__name__}")


def check_field(name: str, v: Any, spec: tuple) -> None:
    typ = spec[0]
    if typ == "room":
        check_room(v, name)
        return
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
    if typ is dict and len(spec) == 4:
        for k, x in v.items():
            if type(k) is not str or len(k) > 64:
                raise WireError(Drop.FIELD, f"field {name!r}: keys must be strings of at most 64 characters")
            check_field(f"{name}[{k}]", x, spec[3])


def wire(*spec, optional: bool = False) -> Any:
    """A message field with its bounds (``check_field``); ``optional``: a peer may omit it (None)."""
    if optional:
        return dataclasses.field(default=None, metadata={"spec": spec, "optional": True})
    return dataclasses.field(metadata={"spec": spec, "optional": False})


def cut(why: str) -> str:
    """A reason cut to its wire bound, so a long error text of ours never turns a refusal into none."""
    return why[:MAX_WHY]


# ------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------
class Message:
    """Base of every control message: a frozen dataclass whose fields are checked at creation."""
    __slots__ = ()
    T: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[tuple[str, tuple, bool], ...]] = ()   # (name, spec, optional), set by ``message``

    def __post_init__(self):
        for name, spec, optional in self.FIELDS:
            v = getattr(self, name)
            if v is None and optional:
                continue
            check_field(name, v, spec)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Message":
        """Exactly the fields of this type; WireError (FIELD) names the first one wrong."""
        names = {name for name, _, _ in cls.FIELDS}
        extra = [k for k in d if k != "t" and k not in names]
        if extra:
            raise WireError(Drop.FIELD, f"{cls.T}: unknown field {str(extra[0])[:64]!r}")
        missing = [name for name, _, optional in cls.FIELDS if not optional and name not in d]
        if missing:
            raise WireError(Drop.FIELD, f"{cls.T}: field {missing[0]!r} missing")
        return cls(**{k: d[k] for k in names if k in d})

    def to_dict(self) -> dict:
        out: dict = {"t": self.T}
        for name, _, optional in self.FIELDS:
            v = getattr(self, name)
            if v is not None or not optional:
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


_M = TypeVar("_M", bound="type[Message]")


def message(t: str):
    """The wire name of a message class (a frozen dataclass declared under it)."""
    def wrap(cls: _M) -> _M:
        cls.T = t
        cls.FIELDS = tuple((f.name, f.metadata["spec"], f.metadata["optional"])
                           for f in dataclasses.fields(cls))   # type: ignore[arg-type]
        return cls
    return wrap


_MSG = dict(frozen=True, slots=True, kw_only=True)


@message("hello")
@dataclass(**_MSG)
class Hello(Message):
    """Decode -> prefill, once per connection: the decode rank's ``RankInfo`` as a dict, and per
    transport the admission token its ``Transport.admit`` gave for this prefill rank (the
    prefill rank presents it on the data path: ``Transport.connect(descriptor, token)``)."""
    i: int = wire(int, 0, MAX_CALL_ID)
    info: dict = wire(dict, 0, 4096)
    nonce: bytes = wire(bytes, 8, 64)
    tokens: dict | None = wire(dict, 0, 16, (bytes, 0, MAX_TOKEN), optional=True)


@message("welcome")
@dataclass(**_MSG)
class Welcome(Message):
    """Prefill -> decode: the HELLO was accepted; the prefill rank's ``RankInfo``."""
    re: int = wire(int, 0, MAX_CALL_ID)
    info: dict = wire(dict, 0, 4096)


@message("refuse")
@dataclass(**_MSG)
class Refuse(Message):
    """Prefill -> decode: every reason the HELLO was refused, in words."""
    re: int = wire(int, 0, MAX_CALL_ID)
    why: list = wire(list, 1, MAX_WHYS, (str, 0, MAX_WHY))


@message("req")
@dataclass(**_MSG)
class Req(Message):
    """Decode -> prefill, per request: the grant (slots as int64 little-endian bytes).

    ``cap``: the grant's data-plane capability, ``secrets.token_bytes(CAP_BYTES)`` made by decode
    per grant and given to its transport (``Transport.expect(..., capability=cap)``); prefill
    passes it to every ``Transport.submit(..., capability=cap)`` of the request. ``aux``: this
    prefill rank sends the request's aux row (decode's row is ``aux_bytes`` long)."""
    room: Room = wire(*ROOM)
    gen: int = wire(int, 0, MAX_GEN)
    kv: bytes = wire(bytes, 0, MAX_MESSAGE)
    prefix: int = wire(int, 0, 1 << 40)
    state: bytes = wire(bytes, 0, 1 << 16)
    aux: bool = wire(bool)
    dummy: bool = wire(bool)
    swa: bytes | None = wire(bytes, 0, MAX_MESSAGE, optional=True)    # hybrid SWA only: decode's window slots
    swa_n: int | None = wire(int, 0, MAX_WINDOW, optional=True)       # and how many
    cap: bytes | None = wire(bytes, CAP_BYTES, CAP_BYTES, optional=True)


@message("ack")
@dataclass(**_MSG)
class Ack(Message):
    """Prefill -> decode: the request is bound to a sender."""
    room: Room = wire(*ROOM)
    gen: int = wire(int, 0, MAX_GEN)


@message("nack")
@dataclass(**_MSG)
class Nack(Message):
    """Prefill -> decode: the request is refused."""
    room: Room = wire(*ROOM)
    gen: int = wire(int, 0, MAX_GEN)
    why: str = wire(str, 0, MAX_WHY)


@message("abort")
@dataclass(**_MSG)
class Abort(Message):
    """Either side: the request failed there."""
    room: Room = wire(*ROOM)
    gen: int = wire(int, 0, MAX_GEN)
    why: str = wire(str, 0, MAX_WHY)


@message("done")
@dataclass(**_MSG)
class Done(Message):
    """Decode -> prefill: every byte landed; prefill may release the KV."""
    room: Room = wire(*ROOM)
    gen: int = wire(int, 0, MAX_GEN)


@message("fin")
@dataclass(**_MSG)
class Fin(Message):
    """Prefill -> decode: a last-chunk marker that moved no bytes (``ChunkMeta`` packed)."""
    meta: bytes = wire(bytes, 0, 1 << 20)


@message("bye")
@dataclass(**_MSG)
class Bye(Message):
    """Decode -> prefill, when a decode endpoint closes: its peer is retired at once (a restarted
    process of the same rank is welcomed without waiting for the heartbeat timeout)."""


@message("ping")
@dataclass(**_MSG)
class Ping(Message):
    """Decode -> prefill, every heartbeat interval."""


@message("pong")
@dataclass(**_MSG)
class Pong(Message):
    """Prefill -> decode: the answer to a ping."""


TYPES: dict[str, type[Message]] = {c.T: c for c in (Hello, Welcome, Refuse, Req, Ack, Nack, Abort, Done, Fin,
                                                    Bye, Ping, Pong)}


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
    return from_map(msg)


def from_map(msg: object) -> Message:
    """A received map (a body msgpack-decoded) -> its ``Message``: a ``"t"`` naming a type, then
    exactly that type's fields; WireError when malformed."""
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
