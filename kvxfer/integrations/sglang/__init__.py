"""kvxfer as an SGLang transfer backend, through SGLang's plugin entry points.

``pip install kvxfer`` next to SGLang registers the entry point ``kvxfer`` of the group
``sglang.srt.plugins`` (``pyproject.toml``); SGLang's ``load_plugins`` runs ``register()`` in
every process, which adds the backend ``--disaggregation-transfer-backend kvxfer`` (what it
installs: ``kvxfer.integrations.sglang.plugin``). Without SGLang, ``register()`` does nothing and
nothing here imports SGLang: the modules that do (``manager``, ``sender``, ``receiver``,
``bootstrap``, ``plugin``) load only when SGLang loads the plugin. The pure parts:
``layouts`` (SGLang's pool shapes as kvxfer layouts), ``pools`` (facts from SGLang's pool
objects), ``states`` (SGLang's poll semantics), ``config`` (settings, rank topology).
"""
from __future__ import annotations

import importlib.util


def register() -> None:
    """SGLang's plugin entry point: install the kvxfer backend; inert when SGLang is absent."""
    if importlib.util.find_spec("sglang") is None:
        return
    from .plugin import install
    install()


__all__ = ["register"]
