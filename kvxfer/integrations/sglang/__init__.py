"""kvxfer as an SGLang transfer backend, through SGLang's plugin entry points.

``pip install kvxfer`` next to SGLang registers the entry point ``kvxfer`` of the group
``sglang.srt.plugins`` (``pyproject.toml``); SGLang's ``load_plugins`` runs ``register()`` in
every process, which adds the backend ``--disaggregation-transfer-backend kvxfer`` (what it
installs: ``kvxfer.integrations.sglang.plugin``). Without SGLang, ``register()`` does nothing and
nothing here imports SGLang: the modules that do (``manager``, ``sender``, ``receiver``,
``bootstrap``, and ``plugin.install``) load only when SGLang loads the plugin. The parts without
SGLang: ``layouts`` (SGLang's pool shapes as kvxfer layouts), ``pools`` (facts from SGLang's pool
objects, its metadata buffers as aux rows), ``states`` (SGLang's poll semantics), ``config``
(settings, rank topology), ``commit`` (the unified pool's prefix-valid commit). How to use it,
what the tests prove and what is not supported: ``README.md`` beside this file.
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
