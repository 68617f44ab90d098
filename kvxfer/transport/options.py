"""What every transport's options dataclass shares: building it from an endpoint's
``transport_options`` mapping, and the two checks its ``__post_init__`` runs per field.

Who calls what: ``UCXOptions.of`` / ``ZMQOptions.of`` call ``options_of`` (through the transport's
constructor); their ``__post_init__`` calls ``check_kind`` and ``check_within``. Everything raises
``ConfigError`` naming the transport, the option and what to give instead.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


def options_of(cls: type[T], transport: str, options: Mapping[str, Any]) -> T:
    """``cls(**options)``; ConfigError names an unknown key and lists the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown {transport} option(s) {unknown}; known: {sorted(known)}")
    return cls(**options)


def check_kind(transport: str, name: str, value: Any, *types: type) -> None:
    """``value``'s type is exactly one of ``types`` (a bool is no int)."""
    if type(value) not in types:
        allowed = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{transport} option {name}={value!r:.200}: give {allowed}, not {type(value).__name__}")


def check_within(transport: str, name: str, value: float, low: float, high: float, allowed: str,
                 low_open: bool = False) -> None:
    """``low <= value <= high`` (``low < value`` with ``low_open``); ``allowed`` says it in words."""
    if not (low < value <= high if low_open else low <= value <= high):
        raise ConfigError(f"{transport} option {name}={value!r:.200}: must be {allowed}")
