"""Who a rank is: ``RankSpec`` (its place in the deployment) and ``RankInfo`` (what it tells the
registry and its peers: addresses, layout, transport descriptor). Plain records, JSON in and
out, every field checked on the way in.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

PROTOCOL = 1            # bumped when RankInfo or the control messages change shape


_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


# ------------------------------------------------------------------------------------
# Plain-data records
# ------------------------------------------------------------------------------------
def _int(d: Mapping, name: str, lo: int, hi: int, default: int | None = None) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"field {name!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """Where a rank sits in its serving instance, and the model shape the topology needs."""
    role: str                   # "prefill" | "decode"
    num_kv_heads: int           # global KV heads of the model (1 for MLA)
    num_layers: int             # global layers of the model
    instance: str = "default"   # one serving instance (a P or D deployment)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    replicated: bool = False    # KV identical on every TP rank (MLA): one source per head

    def __post_init__(self):
        d = asdict(self)
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not isinstance(self.instance, str) or not _NAME.match(self.instance):
            raise ValueError(f"instance must match {_NAME.pattern}, got {self.instance!r}")
        for size in ("tp_size", "pp_size", "dp_size"):
            n = _int(d, size, 1, 1 << 16)
            _int(d, size.replace("size", "rank"), 0, n - 1)
        _int(d, "num_kv_heads", 1, 1 << 20)
        _int(d, "num_layers", 1, 1 << 20)
        if not isinstance(self.replicated, bool):
            raise ValueError(f"replicated must be a bool, got {self.replicated!r}")

    @property
    def key(self) -> str:
        """Registry key: ``instance/dp0/pp0/tp0``."""
        return f"{self.instance}/dp{self.dp_rank}/pp{self.pp_rank}/tp{self.tp_rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """What a rank tells the registry and its handshake peers. Round-trips through JSON/msgpack."""
    spec: RankSpec
    control: str = ""                               # "tcp://host:port" of the control ROUTER
    data: Mapping[str, Mapping] = field(default_factory=dict)   # transport name -> descriptor
    layout: Mapping = field(default_factory=dict)   # Layout.to_dict() (KV parts + state parts)
    aux_bytes: int = 0                              # fixed size of the aux record
    protocol: int = PROTOCOL

    def to_dict(self) -> dict:
        return {**asdict(self.spec), "control": self.control, "data": {k: dict(v) for k, v in self.data.items()},
                "layout": dict(self.layout), "aux_bytes": self.aux_bytes, "protocol": self.protocol}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RankInfo":
        """Validate a peer's record field by field; raises ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a rank record must be an object, got {type(d).__name__}")
        names = RankSpec.__dataclass_fields__
        try:
            spec = RankSpec(**{k: d[k] for k in names if k in d})
        except TypeError as e:
            raise ValueError(f"rank record: {e}") from None
        control, data, layout = d.get("control", ""), d.get("data", {}), d.get("layout", {})
        if not isinstance(control, str) or len(control) > 256 or \
                (control and not control.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"field 'control' must be a tcp:// or ipc:// address, got {control!r}")
        if not isinstance(data, Mapping) or len(data) > 16 or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in data.items()):
            raise ValueError("field 'data' must map transport names to descriptor objects")
        if not isinstance(layout, Mapping):
            raise ValueError("field 'layout' must be a layout description object")
        return cls(spec=spec, control=control, data=data, layout=layout,
                   aux_bytes=_int(d, "aux_bytes", 0, 1 << 20, 0), protocol=_int(d, "protocol", 0, 1 << 16, PROTOCOL))
