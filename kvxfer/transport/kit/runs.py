"""Run helpers (vectorized), what a refusal tells a peer, and peer liveness (see ``kvxfer.transport.kit``)."""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ...grant import Reason
from ...plan import merge_runs

OFF_BITS = 44
OFF_MASK = (1 << OFF_BITS) - 1


def region_key(reg: np.ndarray, off: np.ndarray) -> np.ndarray:
    """(region, offset) as one int64 that merges never carry across regions (offsets < 2**OFF_BITS)."""
    return reg << OFF_BITS | off


def region_unkey(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return key >> OFF_BITS, key & OFF_MASK


def keyable(*sizes: np.ndarray) -> bool:
    """Whether offsets in regions of these sizes fit ``region_key``."""
    return all(not len(s) or int(np.max(s)) < 1 << OFF_BITS for s in sizes)


def merge_in_stream(reg: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive runs of one byte stream that continue each other in their region, as one
    run: (region, offset, length) arrays. A head slice of token-major pages gathers 512 B rows
    that are whole pages on the other side: 16x fewer runs to check, post or scatter."""
    key, _, n = merge_runs(region_key(reg, off), np.cumsum(n) - n, n)
    return (*region_unkey(key), n)


def split_long_runs(frame: int, n: np.ndarray, moving: Sequence[np.ndarray] = (),
                    fixed: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Runs longer than ``frame`` cut into frame-sized pieces, vectorized.

    ``moving``: columns that advance with the bytes (offsets, addresses); ``fixed``: columns
    each piece keeps (region ids). Returns (lengths, moving columns, fixed columns)."""
    if not len(n) or int(n.max()) <= frame:
        return n, list(moving), list(fixed)
    pieces = np.maximum(-(-n // frame), 1)
    idx = np.repeat(np.arange(len(n)), pieces)
    step = (np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * frame
    return (np.minimum(n[idx] - step, frame), [m[idx] + step for m in moving], [f[idx] for f in fixed])


def runs_inside(reg: np.ndarray, off: np.ndarray, n: np.ndarray, sizes: np.ndarray) -> bool:
    """Every run names a region and lies inside it (non-negative offset and length). Written so
    that no sum can overflow for any int64 input."""
    if not len(n):
        return True
    if reg.min() < 0 or reg.max() >= len(sizes) or off.min() < 0 or n.min() < 0:
        return False
    return not bool((off > sizes[reg] - n).any())


def runs_inside_few(runs: Sequence[tuple[int, int, int]], sizes: Sequence[int]) -> bool:
    """``runs_inside`` for a few (region, offset, length) runs as Python ints."""
    return all(0 <= r < len(sizes) and 0 <= o and 0 <= c and o + c <= sizes[r] for r, o, c in runs)


# ------------------------------------------------------------------------------------
# What a peer is told
# ------------------------------------------------------------------------------------
REFUSED = "refused: no grant covers this transfer"
_GRANT_REASONS = frozenset(r.value for r in (Reason.UNKNOWN_REQUEST, Reason.ENDED_REQUEST, Reason.OUTSIDE_GRANT,
                                             Reason.UNKNOWN_REGION, Reason.OUTSIDE_REGION))


def peer_reason(reason: str) -> str:
    """The refusal a receiver sends back for ``reason``. No oracle: refusals because of the grant
    (unknown, ended or live request, runs outside it) all read the same, so a peer cannot probe
    which request ids are live; the local counters and arrivals keep the full reason."""
    return REFUSED if Reason.of(reason).value in _GRANT_REASONS else reason


# ------------------------------------------------------------------------------------
# Peer liveness
# ------------------------------------------------------------------------------------
class PeerClock:
    """When a peer was last heard from (or made progress). I/O thread only."""
    __slots__ = ("heard",)

    def __init__(self, now: float | None = None):
        self.heard = time.monotonic() if now is None else now

    def touch(self, now: float | None = None) -> None:
        self.heard = time.monotonic() if now is None else now

    def silent_for(self, now: float) -> float:
        return now - self.heard

    def silent(self, now: float, timeout: float) -> bool:
        return now - self.heard > timeout
