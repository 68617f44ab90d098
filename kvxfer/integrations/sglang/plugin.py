"""What ``register()`` installs into SGLang, through SGLang's own plugin mechanism.

SGLang loads the entry points of ``sglang.srt.plugins`` in every process before it parses its
command line (``sglang.srt.plugins.load_plugins``), runs each plugin's function, then applies the
hooks the plugins registered with its ``HookRegistry``. kvxfer's plugin:

1. adds "kvxfer" to ``--disaggregation-transfer-backend``'s choices
   (``add_disagg_transfer_backend_choices``);
2. replaces the ``TransferBackend`` enum with one that has every member it had plus ``KVXFER``
   (class REPLACE: the registry re-binds every module that imported the enum);
3. wraps ``get_kv_class`` (AROUND): the kvxfer member resolves to kvxfer's manager, sender,
   receiver and bootstrap server; every other backend goes to SGLang's own function;
4. wraps ``PrefillBootstrapQueue._init_kv_manager`` and ``DecodePreallocQueue._init_kv_manager``
   (AROUND): hands the rank's pool objects to the manager made inside (``pools.engine_context``)
   — ``KVArgs`` alone cannot say where heads sit inside a unified pool's entries;
5. wraps ``DecodePreallocQueue._send_kv_metadata`` (AROUND): tells a kvxfer receiver the exact
   token count of the pages it grants (``expect_tokens``), so pools of different page sizes pair;
6. gives ``UnifiedMHATokenToKVPool.set_kv_buffer_prefix_valid`` (which raises in SGLang 0.5.23)
   an implementation over kvxfer's pool (``kvxfer.integrations.sglang.commit``).

Every hook but 6 acts only on kvxfer's own objects; a hook whose target SGLang renamed is logged
by SGLang's registry and skipped (then the backend falls back to ``KVArgs`` and whole pages).
"""
from __future__ import annotations

import enum
import logging
from typing import Any

log = logging.getLogger("kvxfer.sglang")

NAME = "kvxfer"
UTILS = "sglang.srt.disaggregation.utils"
_installed = False


def extended_backends(old: type[enum.Enum]) -> type[enum.Enum]:
    """``old`` (SGLang's ``TransferBackend``) with ``KVXFER = "kvxfer"`` added; ``old`` itself when
    it has it already."""
    if any(m.value == NAME for m in old):
        return old
    members = {m.name: m.value for m in old}
    members["KVXFER"] = NAME
    make: Any = enum.Enum   # the functional API, with the original's name and module (pickles, reprs)
    return make(old.__name__, members, module=old.__module__, qualname=old.__qualname__)


def kvxfer_class(class_type):
    """kvxfer's class for one of SGLang's ``KVClassType`` members (KVARGS: SGLang's own)."""
    from .bootstrap import KvxferKVBootstrapServer
    from .manager import KvxferKVManager
    from .receiver import KvxferKVReceiver
    from .sender import KvxferKVSender
    return {"manager": KvxferKVManager, "sender": KvxferKVSender, "receiver": KvxferKVReceiver,
            "bootstrap_server": KvxferKVBootstrapServer}.get(getattr(class_type, "value", class_type))


def around_get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) == NAME and getattr(class_type, "value", "") != "kvargs":
        return kvxfer_class(class_type)
    return original(transfer_backend, class_type)


def around_init_kv_manager(original, queue, *args, **kwargs):
    from .pools import EngineContext, engine_context
    scheduler = getattr(queue, "scheduler", None)
    model_config = getattr(scheduler, "model_config", None)
    heads = getattr(model_config, "get_total_num_kv_heads", None)
    ctx = EngineContext(kv_pool=getattr(queue, "token_to_kv_pool", None),
                        req_to_token_pool=getattr(scheduler, "req_to_token_pool", None),
                        num_layers=getattr(model_config, "num_hidden_layers", None),
                        sliding_window=getattr(scheduler, "sliding_window_size", None),
                        num_kv_heads=heads() if callable(heads) else None)
    with engine_context(ctx):
        return original(queue, *args, **kwargs)


def around_send_kv_metadata(original, queue, decode_req, kv_indices, *args, **kwargs):
    from .receiver import KvxferKVReceiver
    receiver = getattr(decode_req, "kv_receiver", None)
    if isinstance(receiver, KvxferKVReceiver):
        receiver.expect_tokens(len(kv_indices))
    return original(queue, decode_req, kv_indices, *args, **kwargs)


def install() -> None:
    """Register the choice and the hooks (once per process); SGLang's ``load_plugins`` applies them."""
    global _installed
    if _installed:
        return
    _installed = True
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .commit import prefix_valid_commit
    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    new = extended_backends(TransferBackend)
    if new is not TransferBackend:
        HookRegistry.register(f"{UTILS}.TransferBackend", new, HookType.REPLACE)
    HookRegistry.register(f"{UTILS}.get_kv_class", around_get_kv_class, HookType.AROUND)
    for target in ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
                   "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"):
        HookRegistry.register(target, around_init_kv_manager, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
                          around_send_kv_metadata, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.unified_memory_pool.UnifiedMHATokenToKVPool."
                          "set_kv_buffer_prefix_valid", prefix_valid_commit, HookType.REPLACE)
    log.info("kvxfer: transfer backend %r registered with SGLang", NAME)


__all__ = ["install", "extended_backends", "kvxfer_class", "around_get_kv_class", "around_init_kv_manager",
           "around_send_kv_metadata", "NAME"]
