"""The control channel's wire format: msgpack maps checked against a typed, bounded schema
(``decode`` refuses anything else), optionally HMAC-signed, and the per-chunk metadata
(``ChunkMeta``) that travels with each transfer.
"""
from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping, Sequence

import msgpack

from .auth import mac
from .compat import MAX_WINDOW

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
