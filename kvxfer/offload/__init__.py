"""Decode-side KV offload per TP group: the manager (``manager``), its settings and results
(``config``), the byte moves and the background thread (``copier``), the TP group's
collectives (``group``), records and content keys (``records``), the host and file tiers
(``tiers``) and the file store (``store``). Host pools
(``kvxfer.host.HostPool``) are built from any device pool's layout.
"""
from ..host import HostPool
from .manager import DecodeOffloadManager, OffloadConfig

__all__ = ["DecodeOffloadManager", "OffloadConfig", "HostPool"]
