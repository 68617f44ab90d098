"""Aux records: the few bytes per request that travel with the last chunk (the first output
token and its log-probability), written into a row of the decode rank's ``AuxBuffer``.

Who calls what, and when: prefill passes ``send(..., last=True, aux=AuxRecord(...))``; decode
passes ``init(..., aux_slot=i)``, which clears row i (``AuxBuffer.clear``) before the request
is granted, and the endpoint writes the record into row i when the last chunk arrives, before
the receiver reaches Success. So after Success, ``AuxBuffer.read(i)`` (or ``KVReceiver.aux``)
is this request's record; before it, or after a failure, the row reads as cleared (None), never
as an earlier request's token.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

AUX_BYTES = 64


# ------------------------------------------------------------------------------------
# Aux record: a fixed-size record per request (first output token, its logprob, top-k)
# ------------------------------------------------------------------------------------
_AUX_HEAD = struct.Struct("<ifi")


AUX_MIN_BYTES = _AUX_HEAD.size   # the smallest aux record that holds a token
_AUX_TOP = struct.Struct("<if")


@dataclass(frozen=True, slots=True)
class AuxRecord:
    first_token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()     # (token id, logprob) pairs

    def pack(self, size: int = AUX_BYTES) -> bytes:
        room = (size - _AUX_HEAD.size) // _AUX_TOP.size
        if len(self.top) > room:
            raise ValueError(f"aux record of {size} bytes holds at most {room} top logprobs, got {len(self.top)}")
        body = _AUX_HEAD.pack(self.first_token, self.logprob, len(self.top)) + b"".join(
            _AUX_TOP.pack(int(t), float(lp)) for t, lp in self.top)
        return body.ljust(size, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> "AuxRecord":
        if len(raw) < _AUX_HEAD.size:
            raise ValueError(f"aux record of {len(raw)} bytes is shorter than its {_AUX_HEAD.size}-byte head")
        token, lp, k = _AUX_HEAD.unpack_from(raw)
        if not 0 <= k <= (len(raw) - _AUX_HEAD.size) // _AUX_TOP.size:
            raise ValueError(f"aux record claims {k} top logprobs in {len(raw)} bytes")
        top = tuple(_AUX_TOP.unpack_from(raw, _AUX_HEAD.size + i * _AUX_TOP.size) for i in range(k))
        return cls(token, lp, top)


CLEARED = 0xFF   # a cleared row: every byte 0xFF (first_token -1, an impossible top-k count)


class AuxBuffer:
    """Decode-side aux records. ``tensor``: ``[num_slots, record_bytes]`` uint8, one row per
    request in flight; ``KVReceiver.init(aux_slot=i)`` clears row i and the last chunk fills it.
    An engine may read ``tensor`` itself: a cleared row is all 0xFF (``CLEARED``)."""

    def __init__(self, num_slots: int, record_bytes: int = AUX_BYTES):
        self.record_bytes = int(record_bytes)
        self.tensor = torch.full((int(num_slots), self.record_bytes), CLEARED, dtype=torch.uint8)

    def clear(self, slot: int) -> None:
        """Mark row ``slot`` as holding no record (the decode endpoint does it at each grant)."""
        self.tensor[slot].fill_(CLEARED)

    def read(self, slot: int) -> AuxRecord | None:
        """Row ``slot``'s record; None while it is cleared (its request has not delivered one)."""
        raw = self.tensor[slot].cpu().numpy().tobytes()
        if raw == bytes([CLEARED]) * len(raw):
            return None
        return AuxRecord.unpack(raw)
