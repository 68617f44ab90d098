"""Grants: the byte ranges a receiver allows a request to write, and the receiver's table of them.

``ByteRanges`` is a sorted set of (region, start, nbytes) intervals made from a layout and the
slots a request was granted; ``covers`` checks a whole run list against it in one compiled call
(``kvxfer/rangecheck.c``).
``GrantTable`` is what every receiving transport keeps: request id -> ranges, and the check that
runs before a single byte lands (counted under a fixed reason when it fails).
"""
from __future__ import annotations

import enum
import hmac
import logging
import struct
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import PlanError, ProtocolError, TransportError
from .layout import Layout
from .plan import Planner, TransferPlan, merge_runs

try:
    from . import rangecheck
except ImportError as e:   # an install that did not build it
    raise ImportError(f"kvxfer's compiled helper (kvxfer/rangecheck.c) is not built: {e}. "
                      "Run scripts/setup, or pip install -e . (needs a C compiler and the Python headers)") from e

# ------------------------------------------------------------------------------------
# Byte ranges: what a grant allows a peer to write.
# ------------------------------------------------------------------------------------
MAX_OFFSET = 1 << 62


# Intervals of every region live on one axis, region r at [r << _REGION_BITS, (r + 1) << _REGION_BITS),
# so a check is one search however many regions the runs name. Regions up to 1 TiB (rangecheck.c's
# REGION_BITS is the same).
_REGION_BITS = 40


_FEW_PACKED = 32         # packed() / from_packed() of at most this many intervals use Python ints


class ByteRanges:
    """Sorted, merged ``[start, end)`` intervals per region; checks runs against them."""

    def __init__(self, region: np.ndarray, start: np.ndarray, nbytes: np.ndarray):
        region, start, nbytes = (np.asarray(x, dtype=np.int64) for x in (region, start, nbytes))
        if len(region) and ((region < 0).any() or (region >= 1 << (62 - _REGION_BITS)).any()
                            or (start < 0).any() or (nbytes < 0).any()
                            or (start + nbytes > 1 << _REGION_BITS).any()):
            raise PlanError(f"byte ranges must lie in regions 0..{(1 << (62 - _REGION_BITS)) - 1} "
                            f"of at most {1 << _REGION_BITS} bytes")
        key = (region << _REGION_BITS) + start
        order = np.argsort(key, kind="stable")
        s, _, n = merge_runs(key[order], key[order], nbytes[order])
        self._starts, self._ends = np.ascontiguousarray(s), s + n   # never crosses a region: ends stay <= its limit
        self.nbytes = int(nbytes.sum())

    @classmethod
    def of_slots(cls, layout: Layout, slots) -> "ByteRanges":
        """Every byte of every part of ``layout`` at ``slots`` (one array, or ``{space: array}``)."""
        spaces = sorted({p.space for p in layout.parts})
        if not isinstance(slots, Mapping):
            slots = {s: slots for s in spaces}
        pieces = []
        for space in spaces:
            if space in slots and len(slots[space]):
                pieces.append(Planner(layout, layout, kinds=[p.kind for p in layout.parts if p.space == space],
                                      pack_below=0).plan(slots[space], slots[space]))
        r = TransferPlan.concat(pieces).runs()
        return cls(r.dst_region, r.dst_offset, r.nbytes)

    def __len__(self) -> int:
        """How many merged intervals."""
        return len(self._starts)

    def packed(self) -> bytes:
        """The merged intervals as little-endian int64 ``(start, end)`` pairs on the one axis of
        all regions (what a PREGRANT carries; ``from_packed`` reads it back)."""
        n = len(self._starts)
        if n <= _FEW_PACKED:   # struct on ints: ~1 us instead of ~8 for one interval
            pairs = [0] * (2 * n)
            pairs[0::2], pairs[1::2] = self._starts.tolist(), self._ends.tolist()
            return struct.pack(f"<{2 * n}q", *pairs)
        return np.stack([self._starts, self._ends], 1).astype("<i8", copy=False).tobytes()

    @classmethod
    def from_packed(cls, buf: bytes) -> "ByteRanges":
        """``packed()`` bytes from a peer: ValueError unless they are ``(start, end)`` pairs with
        ``0 <= start < end``, each interval in one region, starts increasing (as ``packed`` makes)."""
        if type(buf) is not bytes or len(buf) % 16:
            raise ProtocolError("byte ranges are not int64 (start, end) pairs")
        out = cls.__new__(cls)
        if len(buf) <= 16 * _FEW_PACKED:   # a few: checked as Python ints (~4 us instead of ~35 for one)
            v = struct.unpack(f"<{len(buf) // 8}q", buf)
            s, e = v[0::2], v[1::2]
            if not (all(0 <= a < b <= MAX_OFFSET and a >> _REGION_BITS == (b - 1) >> _REGION_BITS
                        for a, b in zip(s, e)) and all(a < b for a, b in zip(s, s[1:]))):
                raise ProtocolError("byte ranges are not sorted, each inside one region")
            out._starts, out._ends = np.array(s, np.int64), np.array(e, np.int64)
            out.nbytes = sum(e) - sum(s)
            return out
        pairs = np.frombuffer(buf, "<i8").reshape(-1, 2).astype(np.int64)
        lo, hi = pairs[:, 0], pairs[:, 1]
        if not ((lo >= 0).all() and (hi > lo).all() and (hi <= MAX_OFFSET).all()
                and ((lo >> _REGION_BITS) == ((hi - 1) >> _REGION_BITS)).all() and (lo[1:] > lo[:-1]).all()):
            raise ProtocolError("byte ranges are not sorted, each inside one region")
        out._starts, out._ends = np.ascontiguousarray(lo), np.ascontiguousarray(hi)
        out.nbytes = int((hi - lo).sum())
        return out

    def intervals(self, region: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of the merged intervals in ``region``."""
        lo, hi = np.searchsorted(self._starts, [region << _REGION_BITS, (region + 1) << _REGION_BITS])
        base = region << _REGION_BITS
        return self._starts[lo:hi] - base, self._ends[lo:hi] - base

    def covers_run(self, region: int, offset: int, nbytes: int) -> bool:
        """``covers`` for one run of Python ints (a message of a few runs skips array setup)."""
        try:
            return rangecheck.covers_one(self._starts, self._ends, region, offset, nbytes)
        except OverflowError:   # beyond int64: no run of any region
            return False

    def first_outside(self, region, offset, nbytes, sizes: np.ndarray) -> int:
        """A message's whole check in one compiled call, given the regions' sizes (int64, one
        per region id): -2 when a run names a region id outside them, else the index of the first
        run not wholly inside one interval, else -3 when a run passes its region's end (a grant
        larger than its region), else -1. Int arrays or lists of ints (OverflowError for a value
        beyond int64)."""
        region, offset, nbytes = (np.ascontiguousarray(x, dtype=np.int64) for x in (region, offset, nbytes))
        return rangecheck.first_outside(self._starts, self._ends, region, offset, nbytes, sizes)

    def covers(self, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bool per run: lies wholly inside one granted interval. Safe on hostile values (the
        compiled check bounds every value before any sum)."""
        region, offset, nbytes = (np.ascontiguousarray(x, dtype=np.int64) for x in (region, offset, nbytes))
        out = np.empty(len(nbytes), bool)
        rangecheck.covered(self._starts, self._ends, region, offset, nbytes, out)
        return out


log = logging.getLogger("kvxfer.transport")

MAX_CAPABILITY = 64   # bytes; the endpoints use 16 (secrets.token_bytes(16))


def _cap_ok(want: bytes, got) -> bool:
    """A message's capability against the grant's (constant time; no capability wanted: any)."""
    return not want or (type(got) is bytes and hmac.compare_digest(want, got))


class Reason(str, enum.Enum):
    """Why an incoming message was refused or dropped: the fixed keys of ``GrantTable.rejected``.

    A reason string starts with one of these values and a colon ("outside grant: run 3 ...");
    ``GrantTable.reject`` counts it under that value, and anything else under ``OTHER``, so no
    peer can grow the counter with names of its own choosing."""
    UNKNOWN_REQUEST = "unknown request"
    ENDED_REQUEST = "ended request"
    OUTSIDE_GRANT = "outside grant"
    OUTSIDE_REGION = "outside region"
    UNKNOWN_REGION = "unknown region"
    MALFORMED_HEADER = "malformed header"
    MALFORMED_MESSAGE = "malformed message"
    MALFORMED_FRAME = "malformed frame"
    LENGTH_MISMATCH = "length mismatch"
    UNKNOWN_PEER = "unknown peer"
    TOO_MANY = "too many transfers"
    TOO_MANY_PEERS = "too many peers"
    TOO_LARGE = "too large"
    DEADLINE = "deadline passed"
    PEER_FAILED = "peer failed"
    INTERNAL = "internal error"
    OTHER = "other"

    @classmethod
    def of(cls, reason: str) -> "Reason":
        """The counter key of a reason string (its text before the first colon)."""
        return _REASONS.get(reason.split(":", 1)[0], cls.OTHER)


_REASONS = {r.value: r for r in Reason}


class GrantTable:
    """The receiver's record of what each request may write. Every transport uses it.

    Thread-safe. Rejections are counted by reason (``rejected``) and logged with the
    request id; a rejected message never writes a byte.
    """

    def __init__(self, region_sizes: Sequence[int] = ()):
        self._lock = threading.Lock()
        self._grants: dict[str, ByteRanges] = {}
        self._caps: dict[str, bytes] = {}          # request id -> capability (only non-empty ones)
        self._ended: set[str] = set()
        self.region_sizes = region_sizes   # the setter below keeps an int64 copy for the check
        self.rejected: Counter[str] = Counter()   # keys: Reason values only
        self.bad_capability = 0   # of those counted as unknown request: a live id with a wrong capability

    @property
    def region_sizes(self) -> list[int]:
        """Bytes per region id, set by the transport when it registers its regions."""
        return self._size_list

    @region_sizes.setter
    def region_sizes(self, sizes: Sequence[int]) -> None:
        self._size_list = list(sizes)
        self._sizes = np.asarray(self._size_list, np.int64).reshape(-1)

    def expect(self, request_id: str, ranges: ByteRanges, capability: bytes = b"") -> None:
        """Decode's endpoint (through ``Transport.expect``), once per request before its sender
        may write. ``capability``: the grant's secret (``secrets.token_bytes(16)``, delivered to
        the granted sender over the authenticated control channel); when non-empty, every data
        message and completion for the request must carry it (``check``, ``is_live``) or it is
        refused exactly as an unknown request id is (no oracle)."""
        if type(capability) is not bytes or len(capability) > MAX_CAPABILITY:
            raise TransportError(f"a capability is bytes of at most {MAX_CAPABILITY}")
        with self._lock:
            if request_id in self._grants:
                raise TransportError(f"request {request_id} is already expected")
            self._ended.discard(request_id)
            self._grants[request_id] = ranges
            if capability:
                self._caps[request_id] = capability

    def forget(self, request_id: str) -> bool:
        """End a grant; True if it was live (so callers release slots exactly once)."""
        with self._lock:
            live = self._grants.pop(request_id, None) is not None
            self._caps.pop(request_id, None)
            self._ended.add(request_id)
            if len(self._ended) > 100_000:
                self._ended.clear()
            return live

    def is_live(self, request_id: str, capability: bytes | None = None) -> bool:
        """Whether ``request_id`` has a grant now (the receiver's I/O thread, per completed transfer).
        With ``capability`` (what the message carried): only if it also matches the grant's."""
        with self._lock:
            if request_id not in self._grants:
                return False
            want = self._caps.get(request_id, b"")
        return capability is None or _cap_ok(want, capability)

    def capability_ok(self, request_id: str, capability: bytes) -> bool:
        """Receiver's I/O thread, once per data message: ``capability`` (carried by the message)
        matches the grant's, or the grant has none. An unknown or ended id is True here (``check``
        refuses it on its own). False is counted in ``bad_capability``; the caller then handles
        the message as one for an unknown id but delivers no arrival for it (``check`` and
        ``is_live`` given the same capability refuse it)."""
        with self._lock:
            want = self._caps.get(request_id, b"")
        if _cap_ok(want, capability):
            return True
        with self._lock:
            self.bad_capability += 1
        return False

    def ranges_of(self, request_id: str) -> ByteRanges | None:
        """The live grant of ``request_id`` (None: none), to tell its sender what it may write."""
        with self._lock:
            return self._grants.get(request_id)

    def live(self) -> int:
        with self._lock:
            return len(self._grants)

    def reject(self, request_id: str, reason: str) -> str:
        with self._lock:
            self.rejected[Reason.of(reason).value] += 1
        log.warning("rejected write for request %s: %s", request_id, reason)
        return reason

    def check(self, request_id: str, region: np.ndarray | Sequence[int], offset: np.ndarray | Sequence[int],
              nbytes: np.ndarray | Sequence[int], capability: bytes = b"") -> str | None:
        """None when every run lies inside the request's grant and the regions; else the reason.
        Runs come as int arrays, or as lists of Python ints for a message of a few runs.
        ``capability``: what the message carried. A grant made with one refuses a message without
        it (or with another) as "unknown request", the same answer as for an id never granted."""
        with self._lock:
            ranges = self._grants.get(request_id)
            ended = request_id in self._ended
            want = self._caps.get(request_id, b"")
        if ranges is not None and not _cap_ok(want, capability):   # the same words as below: no oracle
            return self.reject(request_id, "unknown request: no grant for this request id")
        if ranges is None:
            return self.reject(request_id, "ended request: write after the request ended" if ended
                               else "unknown request: no grant for this request id")
        if not (len(region) == len(offset) == len(nbytes)):
            return self.reject(request_id, "malformed header: run arrays differ in length")
        try:   # one compiled call (lists of a few runs too: 1 run ~0.6 us of conversion)
            at = ranges.first_outside(region, offset, nbytes, self._sizes)
        except OverflowError:   # a value beyond int64: no run of any region
            return self.reject(request_id, "outside grant: a run's values do not fit int64")
        if at == -2:
            return self.reject(request_id, f"unknown region: id outside 0..{len(self._size_list) - 1}")
        if at == -3:   # a grant past its region's end: the grant is the receiver's own mistake
            return self.reject(request_id, "outside region: a granted run passes its region's end")
        if at >= 0:
            return self.reject(request_id, f"outside grant: run {at} (region {int(region[at])}, offset "
                                           f"{int(offset[at])}, {int(nbytes[at])} bytes) is not granted")
        return None
