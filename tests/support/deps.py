"""Skips, honestly: a test is skipped only when an optional dependency is missing (an ImportError of
the module a transport or an engine needs), never because the code under test misbehaves: a broken
transport must fail the suite, not skip it."""
from __future__ import annotations

import importlib

import pytest

# what each transport needs beyond kvxfer's own dependencies
OPTIONAL = {"ucx": "ucxx"}


def missing(name: str) -> str | None:
    """Why transport ``name``'s optional dependency cannot be imported here, or None (also for a
    transport that needs none)."""
    module = OPTIONAL.get(name)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"the {name} transport needs {module} (pip install 'kvxfer[{name}]'): {e}"
    return None


def need(name: str) -> None:
    """Skip the calling test when transport ``name``'s optional dependency is missing."""
    why = missing(name)
    if why:
        pytest.skip(why)


def pregrants(name: str) -> bool:
    """Does transport ``name``'s receiver pregrant its requests by default (UCX's eager writes), so
    that its senders put without waiting for it: into a stopped receiver too, and a stopped sender
    may still put into what it was pregranted?"""
    if name != "ucx":
        return False
    from kvxfer_transports.ucx.options import UCXOptions
    return UCXOptions().eager_writes
