"""Decode-side KV offload per TP group: the manager (``manager``), records and content keys
(``records``), the host and file tiers (``tiers``) and the file store (``store``). Host pools
(``kvxfer.pools.HostPool``) are built from any device pool's layout.
"""
from ..pools import HostPool
from .manager import DecodeOffloadManager, OffloadConfig

__all__ = ["DecodeOffloadManager", "OffloadConfig", "HostPool"]
