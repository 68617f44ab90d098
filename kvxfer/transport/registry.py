"""Transports are plugins found through the ``kvxfer.transports`` entry-point group: kvxfer never
imports one by name, and a third party adds one by declaring an entry point.
"""
from __future__ import annotations

import threading
from importlib.metadata import entry_points

from ..errors import ConnectError
from .base import Transport

# ------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------
ENTRY_POINT_GROUP = "kvxfer.transports"
# Transport classes loaded so far, by name: reading the entry points scans every installed
# distribution's metadata (~10-30 ms here), once per endpoint before. A name not found is looked
# for again (a transport installed since), and a class is never dropped (its module stays imported).
_loaded: dict[str, type[Transport]] = {}
_loading = threading.Lock()


def available_transports() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def get_transport(name: str, **options) -> Transport:
    """Instantiate the transport registered under ``name`` (e.g. "local", "zmq", "ucx")."""
    cls = _loaded.get(name)
    if cls is None:
        with _loading:
            cls = _loaded.get(name) or _load(name)
            _loaded[name] = cls
    return cls(**options)


def _load(name: str) -> type[Transport]:
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in eps:
        raise ConnectError(f"unknown transport {name!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    try:
        return eps[name].load()
    except ImportError as e:
        raise ConnectError(f"transport {name!r} is installed but its dependency is missing ({e}); "
                           f"for ucx: pip install 'kvxfer[ucx]'. Installed: {', '.join(sorted(eps))}") from e
