"""The control channel's wire format, and the per-chunk metadata (``ChunkMeta``) of each transfer.

A control message travels as three ZMQ frames ``[mac, head, body]``:

    head  msgpack [1, sender, recipient, nonce, seq]    who signs, for whom, on which connection
    body  msgpack map {"t": type, ...}                   one of ``kvxfer.control.messages``
    mac   HMAC-SHA256(secret, len(head) || head || body) (empty without a secret)

``nonce`` is 16 random bytes per sending connection and ``seq`` counts that connection's
messages from 1, so a receiver that remembers the highest ``seq`` per nonce refuses a replay,
and because ``sender`` and ``recipient`` are signed a captured message cannot be replayed from
another identity or to another rank (``ControlChannel`` checks both against the connection).

Who calls what: ``ControlChannel`` calls ``seal`` per message sent and ``open_frames`` per
message received (``recv_bounded`` reads it off the socket under bounds first; ``peek_call``
reads the call id of one that failed, to answer a refused handshake); ``encode``/``decode`` are
the body alone with a MAC over it (two frames), kept for tools and tests. Everything raises
``WireError`` (a ValueError) with a fixed ``Drop`` reason.
"""
from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Sequence

import msgpack
import zmq

from ..errors import ProtocolError
from .auth import mac
from .messages import (
    MAX_GEN,
    MAX_MESSAGE,
    MAX_ROOM,
    Drop,
    Message,
    Room,
    WireError,
    check_field,
    check_room,
    parse,
)

MAX_CHUNKS = 1 << 24
MAX_AUX = 512 << 10         # bytes of one request's aux rows (they ride in the last chunk's metadata)
MAX_IDENTITY = 255          # bytes of a ZMQ routing identity
SMALL_PART = 4096           # bytes of any received part but the body (routing id, MAC, head)
HEAD_VERSION = 1

__all__ = ["MAX_MESSAGE", "MAX_ROOM", "MAX_GEN", "MAX_CHUNKS", "Head", "seal", "open_frames", "encode", "decode",
           "ChunkMeta", "WireError", "Drop"]


# ------------------------------------------------------------------------------------
# The envelope: [mac, head, body]
# ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """Who sent a message, to whom, on which connection (``nonce``), and its place (``seq``)."""
    sender: str
    recipient: str
    nonce: bytes
    seq: int

    def pack(self) -> bytes:
        return msgpack.packb([HEAD_VERSION, self.sender, self.recipient, self.nonce, self.seq], use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "Head":
        if len(raw) > 4 * MAX_IDENTITY:
            raise WireError(Drop.HEADER, f"{len(raw)} bytes")
        try:
            v = msgpack.unpackb(raw, raw=False, max_str_len=1024, max_bin_len=64, max_array_len=8, max_map_len=0,
                                max_ext_len=0)
        except Exception as e:
            raise WireError(Drop.HEADER, f"not msgpack ({type(e).__name__})") from None
        if type(v) is not list or len(v) != 5 or v[0] != HEAD_VERSION or isinstance(v[0], bool):
            raise WireError(Drop.HEADER, "wrong shape or version")
        try:
            for name, x, spec in (("sender", v[1], (str, 0, 1024)), ("recipient", v[2], (str, 0, 1024)),
                                  ("nonce", v[3], (bytes, 16, 16)), ("seq", v[4], (int, 1, (1 << 63) - 1))):
                check_field(name, x, spec)
        except WireError as e:
            raise WireError(Drop.HEADER, str(e)) from None
        return cls(v[1], v[2], v[3], v[4])


def _mac(secret: bytes, head: bytes, body: bytes) -> bytes:
    return mac(secret, len(head).to_bytes(4, "little"), head, body)


def seal(msg: Message, head: Head, secret: bytes | None) -> list[bytes]:
    """The three frames of ``msg`` (WireError if ``msg`` itself is malformed: a bug of ours)."""
    body, raw_head = msg.pack(), head.pack()
    return [_mac(secret, raw_head, body) if secret else b"", raw_head, body]


def open_frames(frames: Sequence[bytes], secret: bytes | None) -> tuple[Head, Message]:
    """Authenticate, then parse head and body. The MAC is checked before anything is parsed."""
    if len(frames) != 3:
        raise WireError(Drop.FRAMES, f"expected 3 frames [mac, head, body], got {len(frames)}")
    tag, raw_head, body = (bytes(f) for f in frames)
    if len(body) > MAX_MESSAGE:
        raise WireError(Drop.TOO_LARGE, f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    if secret is not None and not hmac.compare_digest(tag, _mac(secret, raw_head, body)):
        raise WireError(Drop.AUTH, "missing or wrong shared secret")
    return Head.unpack(raw_head), parse(body)


# ------------------------------------------------------------------------------------
# Body only (two frames [mac, body]): tools and tests
# ------------------------------------------------------------------------------------
def recv_bounded(sock: zmq.Socket, parts: int) -> tuple[list[bytes], bool] | None:
    """One whole message and whether it was too large, keeping at most ``parts`` + 1 parts and
    one part over ``SMALL_PART`` (the body): ZMQ's MAXMSGSIZE bounds a part, not a message, so
    the rest is read and discarded one part at a time. None when no message is waiting."""
    try:
        part = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    frames: list[bytes] = []
    big, oversized = 0, False
    while True:
        big += len(part) > SMALL_PART
        oversized |= big > 1
        if len(frames) <= parts and not oversized:
            frames.append(part)
        if not sock.getsockopt(zmq.RCVMORE):
            return frames, oversized
        part = sock.recv()


def peek_call(body: bytes) -> tuple[object, object, object] | None:
    """The type, call id and reply id (``t``, ``i``, ``re``) of a body that failed its checks,
    read under bounds and not trusted further (they are checked before use); None when the body
    is not a msgpack map."""
    try:
        msg = msgpack.unpackb(body, raw=False, max_str_len=1 << 20, max_bin_len=MAX_MESSAGE,
                              max_array_len=1 << 16, max_map_len=1 << 16, max_ext_len=0)
    except Exception:
        return None
    if not isinstance(msg, dict):
        return None
    return msg.get("t"), msg.get("i"), msg.get("re")


def encode(msg: Message, secret: bytes | None) -> list[bytes]:
    body = msg.pack()
    return [mac(secret, body) if secret else b"", body]


def decode(frames: Sequence[bytes], secret: bytes | None) -> Message:
    """Authenticate and schema-check one two-frame message; WireError (a ValueError) says what is wrong."""
    if len(frames) != 2:
        raise WireError(Drop.FRAMES, f"expected 2 frames [mac, body], got {len(frames)}")
    tag, body = (bytes(f) for f in frames)
    if len(body) > MAX_MESSAGE:
        raise WireError(Drop.TOO_LARGE, f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    if secret is not None and not hmac.compare_digest(tag, mac(secret, body)):
        raise WireError(Drop.AUTH, "missing or wrong shared secret")
    return parse(body)


# ------------------------------------------------------------------------------------
# Per-chunk metadata
# ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMeta:
    """Rides with every chunk (the transport's ``notify``), or alone in a FIN message.

    ``chunk`` numbers the transfers one source made for one decode rank; the last one also
    says how many there were (``total``) and how many bytes (``nbytes``), so the receiver
    knows when every byte of that source arrived, whatever order chunks land in."""
    room: Room
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
            v = msgpack.unpackb(raw, raw=False, max_str_len=1024, max_bin_len=MAX_AUX, max_array_len=8,
                                max_map_len=0, max_ext_len=0)
        except Exception as e:
            raise ProtocolError(f"chunk metadata is not msgpack ({type(e).__name__})") from None
        if not isinstance(v, list) or len(v) != 7 or not isinstance(v[2], list) or len(v[2]) != 2:
            raise ProtocolError("chunk metadata has the wrong shape")
        room, gen, (tp, pp), chunk, total, nbytes, aux = v
        check_room(room)
        for name, x, lo, hi in (("gen", gen, 0, MAX_GEN), ("tp", tp, 0, 1 << 16),
                                ("pp", pp, 0, 1 << 16), ("chunk", chunk, 0, MAX_CHUNKS),
                                ("total", total, -1, MAX_CHUNKS), ("nbytes", nbytes, -1, 1 << 50)):
            check_field(name, x, (int, lo, hi))
        if aux is not None and not isinstance(aux, bytes):
            raise ProtocolError("chunk metadata: aux must be bytes")
        return cls(room, gen, (tp, pp), chunk, total, nbytes, aux)
