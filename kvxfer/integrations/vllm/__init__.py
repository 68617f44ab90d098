"""kvxfer as a vLLM KV connector: ``KvxferConnector`` (``kv_connector_module_path:
"kvxfer.integrations.vllm"``; see ``connector`` and README.md beside this file).

Importing this package imports no vLLM: ``layouts``, ``plan``, ``settings``, ``scheduler`` and
``worker`` are plain kvxfer. ``KvxferConnector`` (vLLM's own base class) is loaded when first
asked for; without vLLM that raises ImportError saying what to install.
"""
from __future__ import annotations

__all__ = ["KvxferConnector"]


def __getattr__(name: str):
    if name in ("KvxferConnector", "KvxferMeta"):
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module 'kvxfer.integrations.vllm' has no attribute {name!r}")
