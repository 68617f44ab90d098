"""ZMQ wire messages: one frozen dataclass each, packed and parsed here and nowhere else.

Headers are msgpack maps (never pickle); run arrays are little-endian int64 bytes::

    data  [hdr, part...]  {"t": "d", "r": request id, "x": transfer id, "dl": seconds left,
                           "runs": int64 LE bytes [dst_region * k, dst_offset * k, nbytes * k],
                           "c": the grant's capability (optional; bytes, at most MAX_CAPABILITY)}
                          parts: one part holding the k runs back to back (packed), or k parts,
                          part i holding run i (zero-copy), or none when k == 0.
                          The last message of a transfer adds its totals:
                          "nruns", "nbytes" (all messages together) and "notify".
    ping  [hdr]           {"t": "p"} (optional integer "n"), every heartbeat while transfers are open.
    reply [hdr]           receiver -> sender: {"t": "a", "x": [transfer ids]} acks,
                          {"t": "n", "x": transfer id, "why": reason} nack, {"t": "p"} pong.
                          A pong comes after the replies to everything sent before its ping,
                          and echoes the ping's optional integer "n".

The receiver's I/O thread calls ``parse_data`` on every message's first part and
``parse_reply`` on every reply; both raise ``ValueError`` (saying what is wrong) for anything
that is not exactly a message below: exact types (a bool is no int), ids in range, finite
deadlines, bounded sizes and counts. The sender calls the ``pack`` methods.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import msgpack
import numpy as np

from kvxfer.errors import ProtocolError

RUN_BYTES = 24                  # one run on the wire: region, offset, nbytes as int64
MAX_PARTS = 1024                # payload parts per message
MAX_ID = 1 << 63                # transfer ids and ping nonces lie in [0, MAX_ID)
MAX_REQUEST_ID = 4096           # characters of a request id
MAX_NOTIFY = 1 << 20            # bytes of a transfer's notify
MAX_DEADLINE = 86400.0          # seconds: a longer deadline is cut to this
MAX_ACKS = 1 << 20              # transfer ids per ack
MAX_CAPABILITY = 64             # bytes of a grant capability (kvxfer.grant.MAX_CAPABILITY)
MAX_REPLY = 1 << 24             # bytes of one reply (an ack of MAX_ACKS ids fits)


@dataclass(frozen=True, slots=True)
class End:
    """The totals on a transfer's last message."""
    nruns: int
    nbytes: int
    notify: bytes


@dataclass(frozen=True, slots=True)
class Data:
    """One data message's header; ``runs`` is the raw int64 array (``run_arrays`` reads it)."""
    request_id: str
    xid: int
    deadline: float       # seconds left when it was sent
    runs: bytes
    end: End | None = None
    cap: bytes = b""      # the grant's capability: every message of a transfer carries it

    def pack(self) -> bytes:
        h = {"t": "d", "r": self.request_id, "x": self.xid, "dl": self.deadline, "runs": self.runs}
        if self.cap:
            h["c"] = self.cap
        if self.end is not None:
            h.update(nruns=self.end.nruns, nbytes=self.end.nbytes, notify=self.end.notify)
        return msgpack.packb(h)

    @property
    def nruns(self) -> int:
        return len(self.runs) // RUN_BYTES

    def run_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The runs as lists of Python ints: (regions, offsets, lengths) (a few runs)."""
        k = self.nruns
        v = struct.unpack_from(f"<{3 * k}q", self.runs)
        return list(v[:k]), list(v[k: 2 * k]), list(v[2 * k:])

    def run_arrays(self) -> np.ndarray:
        """The runs as an int64 array of three rows: regions, offsets, lengths."""
        return np.frombuffer(self.runs, "<i8", 3 * self.nruns).reshape(3, -1).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Ping:
    """Sender -> receiver, and the receiver's pong back (same shape)."""
    n: int | None = None

    def pack(self) -> bytes:
        return msgpack.packb({"t": "p"} if self.n is None else {"t": "p", "n": self.n})


@dataclass(frozen=True, slots=True)
class Ack:
    xids: tuple[int, ...]

    def pack(self) -> bytes:
        return msgpack.packb({"t": "a", "x": list(self.xids)})


@dataclass(frozen=True, slots=True)
class Nack:
    xid: int
    why: str

    def pack(self) -> bytes:
        return msgpack.packb({"t": "n", "x": self.xid, "why": self.why[:1024]})


def _map(buf, limit: int, max_array: int) -> dict:
    if len(buf) > limit:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds {limit}")
    try:
        h = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_str_len=MAX_REQUEST_ID, max_bin_len=limit,
                            max_array_len=max_array, max_map_len=16, max_ext_len=0)
    except Exception as e:  # msgpack raises many types on hostile input
        raise ProtocolError(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict) or type(h.get("t")) is not str:
        raise ProtocolError("not a header map with a known type")
    return h


def _field(h: dict, name: str, *types: type):
    v = h.get(name)
    if type(v) not in types:
        raise ProtocolError(f"field {name!r} missing or of the wrong type")
    return v


def _id(h: dict, name: str) -> int:
    v = _field(h, name, int)
    if not 0 <= v < MAX_ID:
        raise ProtocolError("transfer id out of range")
    return v


def _nonce(h: dict) -> int | None:
    n = h.get("n")
    return n if type(n) is int and 0 <= n < MAX_ID else None


def parse_data(buf, limit: int) -> Data | Ping:
    """A data message's header, or a ping. ``limit``: the largest header accepted."""
    h = _map(buf, limit, 0)
    if h["t"] == "p":
        return Ping(_nonce(h))
    if h["t"] != "d":
        raise ProtocolError("not a header map with a known type")
    request_id, xid = _field(h, "r", str), _id(h, "x")
    dl, runs = _field(h, "dl", int, float), _field(h, "runs", bytes)
    if not math.isfinite(dl):
        raise ProtocolError("deadline not finite")
    cap = h.get("c", b"")
    if type(cap) is not bytes or len(cap) > MAX_CAPABILITY:
        raise ProtocolError("capability is not bytes of at most 64")
    end = None
    if h.keys() & {"nruns", "nbytes", "notify"}:
        nruns, nbytes, notify = _field(h, "nruns", int), _field(h, "nbytes", int), _field(h, "notify", bytes)
        if not (0 <= nruns < MAX_ID and 0 <= nbytes < MAX_ID and len(notify) <= MAX_NOTIFY):
            raise ProtocolError("totals out of range")
        end = End(nruns, nbytes, notify)
    return Data(request_id, xid, min(float(dl), MAX_DEADLINE), runs, end, cap)


def parse_reply(buf, limit: int = MAX_REPLY) -> Ack | Nack | Ping:
    """A receiver's reply (sender side)."""
    h = _map(buf, limit, MAX_ACKS)
    t = h["t"]
    if t == "a":
        xids = _field(h, "x", list)
        return Ack(tuple(x for x in xids if type(x) is int))
    if t == "n":
        return Nack(_id(h, "x"), _field(h, "why", str))
    if t == "p":
        return Ping(_nonce(h))
    raise ProtocolError("not a reply with a known type")
