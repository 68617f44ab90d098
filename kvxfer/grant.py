"""Grants: the byte ranges a receiver allows a request to write, and the receiver's table of them.

``ByteRanges`` is a sorted set of (region, start, nbytes) intervals made from a layout and the
slots a request was granted; ``covers`` checks a whole run list against it, vectorized.
``GrantTable`` is what every receiving transport keeps: request id -> ranges, and the check that
runs before a single byte lands (counted under a fixed reason when it fails).
"""
from __future__ import annotations

import bisect
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
from .plan import FEW_RUNS, Planner, TransferPlan, merge_runs

# ------------------------------------------------------------------------------------
# Byte ranges: what a grant allows a peer to write.
# ------------------------------------------------------------------------------------
MAX_OFFSET = 1 << 62


# Intervals of every region live on one axis, region r at [r << _REGION_BITS, (r + 1) << _REGION_BITS),
# so a check is one searchsorted however many regions the runs name. Regions up to 1 TiB.
_REGION_BITS = 40


_FEW_INTERVALS = 4096   # grants up to this many intervals also keep them as Python ints


_SORT_KEYS_ABOVE = 4096  # covers() sorts more runs than this before searching


_FEW_PACKED = 32         # packed() / from_packed() of at most this many intervals use Python ints


_CHAIN_MIN = 32            # covers() of this many runs or more first checks chains of neighbours as one span
_CHAIN_GAP = 64 << 10      # bytes between two runs of one chain (a head slice's rows skip the other heads)


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
        self._starts, self._ends = s, s + n     # never crosses a region: ends stay <= its limit
        self._lists: tuple[list[int], list[int]] | None = None   # the same as Python ints, on first use
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
            out._lists, out.nbytes = (list(s), list(e)), sum(e) - sum(s)
            return out
        pairs = np.frombuffer(buf, "<i8").reshape(-1, 2).astype(np.int64)
        lo, hi = pairs[:, 0], pairs[:, 1]
        if not ((lo >= 0).all() and (hi > lo).all() and (hi <= MAX_OFFSET).all()
                and ((lo >> _REGION_BITS) == ((hi - 1) >> _REGION_BITS)).all() and (lo[1:] > lo[:-1]).all()):
            raise ProtocolError("byte ranges are not sorted, each inside one region")
        out._starts, out._ends, out._lists = lo, hi, None
        out.nbytes = int((hi - lo).sum())
        return out

    def intervals(self, region: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of the merged intervals in ``region``."""
        lo, hi = np.searchsorted(self._starts, [region << _REGION_BITS, (region + 1) << _REGION_BITS])
        base = region << _REGION_BITS
        return self._starts[lo:hi] - base, self._ends[lo:hi] - base

    def covers_run(self, region: int, offset: int, nbytes: int) -> bool:
        """``covers`` for one run of Python ints: a message of a few runs skips array setup."""
        limit = 1 << _REGION_BITS
        if not (0 <= region < 1 << (62 - _REGION_BITS) and 0 <= offset < limit and 0 < nbytes <= limit - offset):
            return False
        key = (region << _REGION_BITS) + offset
        if self._lists is None and len(self._starts) <= _FEW_INTERVALS:
            self._lists = (self._starts.tolist(), self._ends.tolist())
        if self._lists is None:
            i = int(np.searchsorted(self._starts, key, side="right")) - 1
            return i >= 0 and key + nbytes <= int(self._ends[i])
        starts, ends = self._lists   # bisect on ints: ~10x cheaper than one searchsorted call
        i = bisect.bisect_right(starts, key) - 1
        return i >= 0 and key + nbytes <= ends[i]

    def covers(self, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Bool per run: lies wholly inside one granted interval. Safe on hostile values."""
        region, offset, nbytes = (np.asarray(x, dtype=np.int64) for x in (region, offset, nbytes))
        limit = 1 << _REGION_BITS
        valid = ((region >= 0) & (region < 1 << (62 - _REGION_BITS)) & (offset >= 0) & (nbytes > 0)
                 & (offset < limit) & (nbytes <= limit - offset))   # no sum before both are bounded
        if not len(self._starts):
            return np.zeros(len(region), dtype=bool)
        key = np.where(valid, (region << _REGION_BITS) + np.where(valid, offset, 0), 0)
        end = key + np.where(valid, nbytes, 0)
        if len(key) < _CHAIN_MIN:
            return valid & self._inside(key, end)
        # Runs come in stream order: a page's rows one after another, ascending. A chain of runs
        # that ascend with gaps of at most _CHAIN_GAP is checked as one span [its first key, its
        # largest end): when that lies in one granted interval, so does each of its runs
        # (intervals never cross a region). Only the runs of other chains are searched one by
        # one. Where a message cuts a page does not matter: 8,192 half rows cut 7 rows into a
        # page, 95 us (534 with fixed groups of 16 neighbours, which such a cut misaligns); one
        # announce of 65,536 half rows, 0.72 ms (7.1 run by run).
        gap = key[1:] - end[:-1]
        first = np.concatenate(([0], np.flatnonzero((gap < 0) | (gap > _CHAIN_GAP)) + 1))
        ok = self._inside(key[first], np.maximum.reduceat(end, first)) & np.logical_and.reduceat(valid, first)
        out = np.repeat(ok, np.diff(np.append(first, len(key))))
        rest = np.flatnonzero(~out)
        if len(rest):
            out[rest] = valid[rest] & self._inside(key[rest], end[rest])
        return out

    def _inside(self, key: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Bool per ``[key, end)``: lies in one merged interval (keys already bounded)."""
        if len(key) > _SORT_KEYS_ABOVE:   # searches in key order stay in cache: 32768 random runs 3.4 -> 1.6 ms
            order = np.argsort(key)
            i = np.empty_like(key)
            i[order] = np.searchsorted(self._starts, key[order], side="right") - 1
        else:
            i = np.searchsorted(self._starts, key, side="right") - 1
        return (i >= 0) & (end <= self._ends[np.clip(i, 0, None)])


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
        self.region_sizes = list(region_sizes)
        self.rejected: Counter[str] = Counter()   # keys: Reason values only
        self.bad_capability = 0   # of those counted as unknown request: a live id with a wrong capability

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
        if isinstance(region, np.ndarray) and len(region) <= FEW_RUNS:   # ints beat ~20 numpy calls here
            region, offset, nbytes = region.tolist(), np.asarray(offset).tolist(), np.asarray(nbytes).tolist()
        unknown: int | np.bool_
        if isinstance(region, np.ndarray):
            unknown = len(region) and ((region < 0).any() or (region >= len(self.region_sizes)).any())
        else:
            unknown = any(not 0 <= r < len(self.region_sizes) for r in region)
        if unknown:
            return self.reject(request_id, f"unknown region: id outside 0..{len(self.region_sizes) - 1}")
        if isinstance(region, np.ndarray):
            bad = ~ranges.covers(region, np.asarray(offset), np.asarray(nbytes))
        else:
            bad = np.array([not ranges.covers_run(*run) for run in zip(region, offset, nbytes)], bool)
        if bad.any():
            i = int(np.argmax(bad))
            return self.reject(request_id, f"outside grant: run {i} (region {int(region[i])}, offset "
                                           f"{int(offset[i])}, {int(nbytes[i])} bytes) is not granted")
        return None
