"""kvxfer: move KV cache between prefill and decode ranks, and offload decode KV to host.

The public surface is ``__all__``; see README.md for a tour of the modules.
"""
from .allocator import PageAllocator
from .copy import execute_plan
from .errors import (
    CompatibilityError,
    ConfigError,
    ConnectError,
    KVXferError,
    LayoutError,
    PeerError,
    PlanError,
    ProtocolError,
    RejectedWrite,
    RequestError,
    TransferTimeout,
    TransportError,
)
from .grant import ByteRanges
from .layout import (
    Layout,
    Part,
    Region,
    Space,
    hnd_layout,
    host_layout,
    hybrid_swa_layout,
    mla_layout,
    page_major_layout,
    state_layout,
    token_major_layout,
)
from .memory import EnginePool, RawMemory
from .plan import WHOLE, HeadSlice, Planner, TransferPlan, plan_transfer
from .pools import HybridSWAPool, KVPool, MHAPool, MLAPool, StatePool
from .topology import heads_held, sources_for_decode_rank, targets_for_prefill_rank
from .transport.base import Arrival, TransferHandle, Transport
from .transport.registry import available_transports, get_transport

__all__ = [
    # errors
    "KVXferError", "LayoutError", "PlanError", "CompatibilityError", "TransportError", "ConnectError",
    "TransferTimeout", "PeerError", "RejectedWrite", "RequestError", "ConfigError", "ProtocolError",
    # layouts
    "Layout", "Part", "Region", "Space", "token_major_layout", "hnd_layout", "page_major_layout",
    "mla_layout", "state_layout", "hybrid_swa_layout", "host_layout",
    # planning
    "HeadSlice", "WHOLE", "Planner", "plan_transfer", "TransferPlan", "ByteRanges", "execute_plan",
    # pools
    "KVPool", "MHAPool", "MLAPool", "StatePool", "HybridSWAPool", "PageAllocator", "EnginePool", "RawMemory",
    # transports
    "Transport", "TransferHandle", "Arrival", "get_transport", "available_transports",
    # control plane and offload (loaded on first use: they bring pyzmq and aiohttp)
    "heads_held", "sources_for_decode_rank", "targets_for_prefill_rank",
    "RankSpec", "RankInfo", "BootstrapConfig", "BootstrapServer", "BootstrapClient",
    "KVPoll", "Timeouts", "AuxRecord", "AuxBuffer", "AuxRows",
    "PrefillEndpoint", "DecodeEndpoint", "KVSender", "KVReceiver", "reduce_poll", "Outcome", "LocalGroup",
    "HostPool", "DecodeOffloadManager",
]

_LAZY = {
    "RankSpec": "ranks", "BootstrapServer": "control.bootstrap", "BootstrapClient": "control.client",
    "KVPoll": "endpoint", "Timeouts": "endpoint", "AuxRecord": "endpoint", "AuxBuffer": "endpoint",
    "AuxRows": "endpoint",
    "reduce_poll": "endpoint", "Outcome": "endpoint", "LocalGroup": "endpoint", "PrefillEndpoint": "endpoint",
    "KVSender": "endpoint", "BootstrapConfig": "control.bootstrap", "RankInfo": "control.records",
    "DecodeEndpoint": "endpoint", "KVReceiver": "endpoint", "HostPool": "host", "DecodeOffloadManager": "offload",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
