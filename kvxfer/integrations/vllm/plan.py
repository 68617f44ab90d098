"""What vLLM's scheduler-side connector hands its workers each step (plain data, no vLLM import):
``StepPlan`` with the loads to start (``Recv``), the sends to start (``Send``) and the requests to
abort. vLLM carries it to every worker inside the connector metadata; each worker of a TP group
acts on the same plan.

Who calls what: ``KvxferScheduler.build_plan`` makes one per step; ``KvxferWorker.run_plan`` acts
on it (``kvxfer.integrations.vllm.connector`` wraps it in vLLM's ``KVConnectorMetadata``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# kv_transfer_params keys: what prefill's request_finished returns and decode's request carries
DO_REMOTE_PREFILL, DO_REMOTE_DECODE = "do_remote_prefill", "do_remote_decode"
ROOM, INSTANCE, BOOTSTRAP, TOKENS = "kvxfer_room", "kvxfer_instance", "kvxfer_bootstrap", "kvxfer_tokens"


@dataclass(frozen=True, slots=True)
class Recv:
    """Decode: load tokens ``prefix .. num_tokens`` of request ``req_id`` into its ``block_ids``
    from prefill ``instance`` (registry ``bootstrap``), kvxfer room ``room``."""
    req_id: str
    room: str
    instance: str
    bootstrap: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prefix: int


@dataclass(frozen=True, slots=True)
class Send:
    """Prefill: send the first ``num_tokens`` tokens of request ``req_id`` (in ``block_ids``) as
    room ``room``, holding the blocks until kvxfer releases them."""
    req_id: str
    room: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(slots=True)
class StepPlan:
    """One step's work for every worker. ``cancel``: loads vLLM dropped before any worker started
    them (reported finished at once, so vLLM frees their blocks); ``abort_recv``: loads vLLM aborted
    while kvxfer moves them (they finish when kvxfer released their grant). A prefill request is
    only sent after vLLM finished it, so no send is ever aborted by vLLM (decode may abort it)."""
    recv: list[Recv] = field(default_factory=list)
    send: list[Send] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    abort_recv: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.recv or self.send or self.cancel or self.abort_recv)


__all__ = ["Recv", "Send", "StepPlan", "DO_REMOTE_PREFILL", "DO_REMOTE_DECODE", "ROOM", "INSTANCE", "BOOTSTRAP",
           "TOKENS"]
