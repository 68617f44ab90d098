"""The transport layer: the contract every data plane implements (``base``), the entry-point
registry that finds them (``registry``), and the kit every network transport shares (``kit``).

Transports themselves are plugins in the ``kvxfer_transports`` package (folder ``transports/``),
found through the ``kvxfer.transports`` entry-point group; kvxfer never imports one by name.
"""
from .base import (
           DEFAULT_TIMEOUT,
           Arrival,
           TransferHandle,
           TransferStatus,
           Transport,
           drain,
           peer_failed,
)
from .registry import ENTRY_POINT_GROUP, available_transports, get_transport

__all__ = ["Transport", "TransferHandle", "TransferStatus", "Arrival", "DEFAULT_TIMEOUT", "drain", "peer_failed",
           "ENTRY_POINT_GROUP", "available_transports", "get_transport"]
