"""Aux rows: the bytes per request that travel with the last chunk, besides the KV (an engine's
first output token, its logprobs, hidden states for speculative decoding, the request's room...).
Their format is the engine's: it registers its own buffers (``AuxRows``), and kvxfer moves a
request's row of every buffer byte for byte. ``AuxRecord`` / ``AuxBuffer`` are one such format
(the first token, its logprob and a top-k), for engines without their own.

Who calls what, and when:
    start-up: the engine makes ``AuxRows([t0, t1, ...])`` over its tensors (row ``i`` of every
        tensor is request ``i``'s) and hands it to its endpoint (``PrefillEndpoint(aux=...)``,
        ``DecodeEndpoint(aux=...)``); both sides' row sizes are in their rank records.
    decode scheduler: ``init(..., aux_slot=i)`` clears row ``i`` (every byte ``clear_value``) before
        the request is granted; the decode endpoint writes the row when the last chunk arrives,
        before the receiver reaches Success. So after Success row ``i`` holds this request's
        bytes; before it, or after a failure, it reads as cleared, never as an earlier request's.
    prefill scheduler: ``send(..., last=True, aux_row=j)`` (the bytes of row ``j`` of the prefill
        endpoint's ``AuxRows``, read at that call) or ``aux=bytes`` / ``aux=AuxRecord(...)``.
A request whose aux rows differ in size between the two sides fails with both sizes in words.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..control.records import MAX_AUX_BUFFERS, MAX_AUX_ROW
from ..errors import LayoutError, ProtocolError

AUX_BYTES = 64


# ------------------------------------------------------------------------------------
# AuxRecord: one fixed-size format (first output token, its logprob, top-k)
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
            raise ProtocolError(f"aux record of {size} bytes holds at most {room} top logprobs, got {len(self.top)}")
        body = _AUX_HEAD.pack(self.first_token, self.logprob, len(self.top)) + b"".join(
            _AUX_TOP.pack(int(t), float(lp)) for t, lp in self.top)
        return body.ljust(size, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> "AuxRecord":
        if len(raw) < _AUX_HEAD.size:
            raise ProtocolError(f"aux record of {len(raw)} bytes is shorter than its {_AUX_HEAD.size}-byte head")
        token, lp, k = _AUX_HEAD.unpack_from(raw)
        if not 0 <= k <= (len(raw) - _AUX_HEAD.size) // _AUX_TOP.size:
            raise ProtocolError(f"aux record claims {k} top logprobs in {len(raw)} bytes")
        top = tuple(_AUX_TOP.unpack_from(raw, _AUX_HEAD.size + i * _AUX_TOP.size) for i in range(k))
        return cls(token, lp, top)


CLEARED = 0xFF   # a cleared row: every byte 0xFF (for AuxRecord: first_token -1, an impossible top-k count)


# ------------------------------------------------------------------------------------
# AuxRows: the engine's buffers
# ------------------------------------------------------------------------------------
class AuxRows:
    """An engine's aux buffers: ``buffers[b]`` is ``[rows, ...]`` (any dtype, any device; each row's
    bytes contiguous, e.g. a contiguous tensor); row ``i`` of every buffer together is request
    ``i``'s aux bytes, ``sum(row_bytes)`` of them, moved byte for byte. Nothing is copied: rows are
    read from and written into the engine's tensors. ``clear_value``: the byte a cleared row holds."""

    def __init__(self, buffers: Sequence[torch.Tensor], *, clear_value: int = CLEARED):
        buffers = list(buffers)
        if not 1 <= len(buffers) <= MAX_AUX_BUFFERS:
            raise LayoutError(f"AuxRows takes 1..{MAX_AUX_BUFFERS} buffers, got {len(buffers)}")
        if not isinstance(clear_value, int) or not 0 <= clear_value <= 255:
            raise LayoutError(f"clear_value must be a byte (0..255), got {clear_value!r}")
        rows = {int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() >= 1 else -1 for t in buffers}
        self.views: list[torch.Tensor] = []   # [rows, row_bytes] uint8 over each buffer's memory
        for b, t in enumerate(buffers):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise LayoutError(f"aux buffer {b} must be a tensor of at least one dimension (rows first), "
                                  f"got {type(t).__name__}")
            if len(rows) != 1:
                raise LayoutError(f"aux buffers must have the same number of rows, got {sorted(rows)}")
            view = _row_bytes(t)
            if view is None:
                raise LayoutError(f"aux buffer {b} (shape {tuple(t.shape)}, strides {tuple(t.stride())}): the bytes "
                                  f"of each row must be contiguous (e.g. a contiguous tensor, rows first)")
            if not 1 <= view.shape[1] <= MAX_AUX_ROW:
                raise LayoutError(f"aux buffer {b}: a row of {view.shape[1]} bytes, must be 1..{MAX_AUX_ROW}")
            self.views.append(view)
        self.num_rows = rows.pop()
        self.row_bytes = tuple(int(v.shape[1]) for v in self.views)
        self.record_bytes = sum(self.row_bytes)
        if self.record_bytes > MAX_AUX_ROW:
            raise LayoutError(f"aux rows of {self.record_bytes} bytes in all; at most {MAX_AUX_ROW}")
        self.clear_value = clear_value
        self.buffers = buffers

    def __len__(self) -> int:
        return self.num_rows

    def check_row(self, row: int) -> int:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.num_rows:
            raise LayoutError(f"aux row {row!r} is not a row of these aux buffers (0..{self.num_rows - 1})")
        return row

    def clear(self, row: int) -> None:
        """Mark row ``row`` of every buffer as holding no record (decode's endpoint, at each grant)."""
        for v in self.views:
            v[row].fill_(self.clear_value)

    def read_bytes(self, row: int) -> bytes:
        """Row ``row`` of every buffer, concatenated (a device buffer is copied to the host: a sync)."""
        return b"".join(v[row].cpu().numpy().tobytes() for v in self.views)

    def cleared(self, row: int) -> bool:
        return self.read_bytes(row) == bytes([self.clear_value]) * self.record_bytes

    def write(self, row: int, raw: bytes) -> None:
        """Write ``raw`` (``record_bytes`` long) into row ``row``, buffer by buffer."""
        if len(raw) != self.record_bytes:
            raise LayoutError(f"aux bytes of length {len(raw)} for rows of {self.record_bytes} bytes "
                              f"({list(self.row_bytes)} per buffer)")
        at = 0
        for v, n in zip(self.views, self.row_bytes):
            v[row].copy_(torch.frombuffer(bytearray(raw[at:at + n]), dtype=torch.uint8), non_blocking=False)
            at += n


def _row_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``[rows, ...]`` of any dtype -> ``[rows, row bytes]`` uint8 over the same memory; None when a
    row's bytes are not contiguous."""
    rows = t.shape[0]
    if rows and not t[0].is_contiguous():
        return None
    n = (t[0].numel() if rows else 0) * t.element_size()
    step = t.stride(0) * t.element_size() if rows > 1 else n
    if step < n:   # rows overlap each other
        return None
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (rows, n), (step, 1))


class AuxBuffer(AuxRows):
    """``AuxRecord`` rows: ``tensor`` is ``[num_slots, record_bytes]`` uint8, one row per request in
    flight; a cleared row is all 0xFF (``CLEARED``). ``read(i)`` parses row ``i``."""

    def __init__(self, num_slots: int, record_bytes: int = AUX_BYTES):
        if record_bytes < AUX_MIN_BYTES:
            raise LayoutError(f"record_bytes must be >= {AUX_MIN_BYTES} (an AuxRecord's head), got {record_bytes}")
        self.tensor = torch.full((int(num_slots), int(record_bytes)), CLEARED, dtype=torch.uint8)
        super().__init__([self.tensor])

    def read(self, slot: int) -> AuxRecord | None:
        """Row ``slot``'s record; None while it is cleared (its request has not delivered one)."""
        raw = self.read_bytes(slot)
        if raw == bytes([CLEARED]) * len(raw):
            return None
        return AuxRecord.unpack(raw)


__all__ = ["AuxRows", "AuxBuffer", "AuxRecord", "AUX_BYTES", "AUX_MIN_BYTES", "CLEARED"]
