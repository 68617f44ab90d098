"""What a rank tells the registry and its handshake peers: ``RankInfo`` (its ``RankSpec``, control
address, transport descriptors, layout and aux rows). A plain record, JSON/msgpack in and out,
every field checked on the way in (exact types, bounded sizes), so that a peer's record costs work
in proportion to its size and never raises anything but ValueError.

Who calls what: ``RankInfo.from_dict`` runs on every record from a peer (the HELLO handler on the
control thread, the registry's PUT handler, the client's topology read); endpoints build their own
with ``EndpointBase.info``.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

from ..addresses import check_address
from ..errors import ProtocolError, short
from ..ranks import RankSpec, int_field
from .messages import PROTOCOL
from .wire import MAX_AUX

MAX_LAYOUT_ITEMS = 1 << 13   # setting: spaces + regions + parts of one layout record (a 126-layer FP8 pool
                             # with scales has ~510 parts; a peer's record is checked per part, so this
                             # bounds what one HELLO costs a handshake thread)
MAX_AUX_BUFFERS = 64         # aux buffers of one rank (``AuxRows``)
MAX_AUX_ROW = MAX_AUX        # bytes of one request's aux rows, all buffers together


_LAYOUT_STR = frozenset({"kind", "name", "space", "dtype"})


def check_layout_record(layout: Mapping) -> None:
    """The shape of a layout description (``Layout.to_dict``): lists of flat objects whose
    fields are ints (``kind``/``name``/``space``/``dtype``: strings). Meaning is checked later
    (``Layout.from_dict``, the planner); this makes sure that check meets only ints and strings.
    A description that passed before (the same bytes, by digest) passes again without the walk:
    every HELLO and registry record carries one, most of them the same."""
    if not isinstance(layout, Mapping):
        raise ProtocolError("field 'layout' must be a layout description object")
    try:   # strict: a tuple or a subclass has no key (it is walked, and refused if it must be)
        digest = hashlib.blake2b(msgpack.packb(layout, strict_types=True), digest_size=16).digest()
    except (TypeError, ValueError, OverflowError):
        digest = None
    if digest is not None:
        with _checked_lock:
            if digest in _checked:
                return
    _walk_layout_record(layout)
    if digest is not None:
        with _checked_lock:
            _checked[digest] = None
            while len(_checked) > CHECKED:
                _checked.pop(next(iter(_checked)))


CHECKED = 64   # digests of the last layout descriptions ``check_layout_record`` passed (16 bytes each)
_checked: dict[bytes, None] = {}
_checked_lock = threading.Lock()


def _walk_layout_record(layout: Mapping) -> None:
    items = 0
    for key, v in layout.items():
        if not isinstance(key, str) or len(key) > 64:
            raise ProtocolError("field 'layout': keys must be short strings")
        if key in ("spaces", "regions", "parts"):
            if not isinstance(v, list):
                raise ProtocolError(f"field 'layout.{key}' must be a list, got {type(v).__name__}")
            items += len(v)
            if items > MAX_LAYOUT_ITEMS:
                raise ProtocolError(f"field 'layout' has more than {MAX_LAYOUT_ITEMS} spaces, regions and parts")
            for i, obj in enumerate(v):
                if not isinstance(obj, Mapping) or len(obj) > 32:
                    raise ProtocolError(f"field 'layout.{key}[{i}]' must be an object of at most 32 fields")
                for name, x in obj.items():
                    _layout_leaf(f"layout.{key}[{i}].{name}", name, x)
        else:
            _layout_leaf(f"layout.{key}", key, v)


def _layout_leaf(where: str, name, x) -> None:
    if not isinstance(name, str) or len(name) > 64:
        raise ProtocolError(f"field {where[:80]!r}: names must be short strings")
    if name in _LAYOUT_STR:
        if not isinstance(x, str) or len(x) > 128:
            raise ProtocolError(f"field {where!r} must be a string of at most 128 characters, got {short(x)}")
    elif isinstance(x, bool) or not isinstance(x, int) or not -(1 << 62) <= x <= 1 << 62:
        raise ProtocolError(f"field {where!r} must be an integer, got {short(x)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """What a rank tells the registry and its handshake peers. Round-trips through JSON/msgpack."""
    spec: RankSpec
    control: str = ""                               # "tcp://host:port" of the control ROUTER
    data: Mapping[str, Mapping] = field(default_factory=dict)   # transport name -> descriptor
    layout: Mapping = field(default_factory=dict)   # Layout.to_dict() (KV parts + state parts)
    aux_bytes: int = 0                              # bytes of one aux row (every buffer's row together)
    aux_rows: tuple[int, ...] = ()                  # bytes of one row of each aux buffer (``AuxRows``)
    protocol: int = PROTOCOL

    def to_dict(self) -> dict:
        return {**self.spec.to_dict(), "control": self.control, "data": {k: dict(v) for k, v in self.data.items()},
                "layout": dict(self.layout), "aux_bytes": self.aux_bytes, "aux_rows": list(self.aux_rows),
                "protocol": self.protocol}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RankInfo":
        """Validate a peer's record field by field; raises ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ProtocolError(f"a rank record must be an object, got {type(d).__name__}")
        names = RankSpec.__dataclass_fields__
        extra = [k for k in d if k not in names and k not in _OWN]
        if extra:
            raise ProtocolError(f"rank record: unknown field {short(extra[0])}")
        try:
            spec = RankSpec(**{k: d[k] for k in names if k in d})
        except TypeError as e:
            raise ProtocolError(f"rank record: {e}") from None
        control, data, layout = d.get("control", ""), d.get("data", {}), d.get("layout", {})
        if control != "":
            try:
                check_address(control)
            except ValueError as e:
                raise ProtocolError(f"field 'control': {e}") from None
        if not isinstance(data, Mapping) or len(data) > 16 or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, Mapping) and len(v) <= 64
                for k, v in data.items()):
            raise ProtocolError("field 'data' must map transport names to descriptor objects")
        check_layout_record(layout)
        aux_rows = d.get("aux_rows", [])
        if not isinstance(aux_rows, (list, tuple)) or len(aux_rows) > MAX_AUX_BUFFERS or not all(
                type(n) is int and 1 <= n <= MAX_AUX_ROW for n in aux_rows):
            raise ProtocolError(f"field 'aux_rows' must list at most {MAX_AUX_BUFFERS} row sizes in 1..{MAX_AUX_ROW} "
                             f"bytes, got {short(aux_rows)}")
        aux_bytes = int_field(d, "aux_bytes", 0, MAX_AUX_ROW, 0)
        if aux_rows and sum(aux_rows) != aux_bytes:
            raise ProtocolError(f"field 'aux_bytes' {aux_bytes} is not the sum of 'aux_rows' {short(aux_rows)}")
        return cls(spec=spec, control=control, data=data, layout=layout, aux_bytes=aux_bytes,
                   aux_rows=tuple(aux_rows), protocol=int_field(d, "protocol", 0, 1 << 16, PROTOCOL))


_OWN = ("control", "data", "layout", "aux_bytes", "aux_rows", "protocol")
