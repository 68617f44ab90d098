"""The scheduler side of the vLLM connector: ``KvxferScheduler`` (one per engine, in vLLM's engine
core process). It decides which requests load or send, hands each step's ``StepPlan`` to the
workers, and, on a prefill engine, runs the kvxfer registry. It imports no vLLM: requests are read
by attribute (``request_id``, ``prompt_token_ids``, ``kv_transfer_params``, ``status``).

Who calls what (vLLM, through ``KvxferConnector``, on its scheduler thread):
    decode  ``matched(request, n_computed)`` -> (tokens to load, True) for a request whose
            ``kv_transfer_params`` came from a kvxfer prefill; ``allocated(request, block_ids,
            n_external)`` remembers the blocks vLLM allocated for them; the next ``build_plan()``
            hands them to the workers, which grant them to kvxfer.
    prefill ``finished(request, block_ids)`` of a request asked with ``do_remote_decode``: unless it
            was aborted, it holds the blocks (delay free) and returns the ``kv_transfer_params``
            decode needs (instance, registry URL, room = the request id); the next ``build_plan()``
            has the workers send them.
    both    ``output(finished_sending, finished_recving)`` after each step (every worker reported
            them: vLLM aggregates the TP group); ``pending()`` keeps the engine stepping while kvxfer
            still moves or holds something.

Why the prefill scheduler runs the registry: vLLM has one scheduler per engine (instance), living
as long as the engine, and it is the side that tells decode where to find prefill (in the
``kv_transfer_params``); so a deployment needs no extra process, each prefill instance has its
own registry (as SGLang runs one bootstrap server per prefill instance), and a restarted prefill
engine comes back at the same address. ``bootstrap_url`` in the extra config names an external
registry (``kvxfer bootstrap``) instead.

Aborts: a load vLLM drops before the workers started it is reported finished at once (vLLM keeps a
WAITING_FOR_REMOTE_KVS request's blocks until it is); one the workers started is aborted in kvxfer
and finishes when kvxfer released its grant (no write can land any more), so vLLM reuses the
blocks only then. A prefill request is sent only once vLLM finished it, so vLLM never aborts a
send; decode may (its ABORT ends prefill's sender, which lets the KV go once no transfer reads it; a
sender decode never asked for ends at kvxfer's bootstrap deadline, ``timeouts.bootstrap``).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from ...control.bootstrap import BootstrapConfig, BootstrapServer
from ...errors import ProtocolError
from .plan import BOOTSTRAP, DO_REMOTE_DECODE, DO_REMOTE_PREFILL, INSTANCE, ROOM, TOKENS, Recv, Send, StepPlan
from .settings import Settings

log = logging.getLogger("kvxfer.vllm")

ABORTED = "FINISHED_ABORTED"


def remote_prefill(params: Mapping | None) -> tuple[str, str, str] | None:
    """(room, instance, bootstrap) of a decode request's kvxfer ``kv_transfer_params``, else None;
    ProtocolError naming a field that is there but malformed (a peer's values are checked)."""
    if not isinstance(params, Mapping) or not params.get(DO_REMOTE_PREFILL):
        return None
    out = []
    for key in (ROOM, INSTANCE, BOOTSTRAP):
        v = params.get(key)
        if not isinstance(v, str) or not 1 <= len(v) <= 256 or not v.isprintable():
            raise ProtocolError(f"kv_transfer_params[{key!r}] must be a printable string of 1..256 characters, "
                             f"got {v!r}: not from a kvxfer prefill engine")
        out.append(v)
    return out[0], out[1], out[2]


class KvxferScheduler:
    """See the module docstring. ``block_size``: vLLM's block size (tokens per block id)."""

    def __init__(self, settings: Settings, block_size: int):
        self.settings, self.block_size = settings, block_size
        self._recv: dict[str, Recv] = {}        # allocated, not yet in a plan
        self._send: dict[str, Send] = {}        # finished prefill requests, not yet in a plan
        self._loading: set[str] = set()         # in a plan, no finished_recving yet
        self._sending: set[str] = set()         # in a plan, no finished_sending yet
        self._next = StepPlan()
        self.registry: BootstrapServer | None = None
        if settings.producer and settings.serve_registry:
            cfg = BootstrapConfig(host=settings.bootstrap_host, port=settings.bootstrap_port,
                                  secret=settings.secret.encode() if settings.secret else None)
            self.registry = BootstrapServer(cfg).start()
            log.info("kvxfer registry of prefill instance %s at %s", settings.instance, self.registry.url)

    # -- decode --------------------------------------------------------------------------
    def matched(self, request, num_computed: int) -> tuple[int, bool]:
        """Tokens to load for ``request`` beyond ``num_computed`` (side-effect free)."""
        if not self.settings.consumer or self._where(request) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request, block_ids: Iterable[int], num_external: int) -> None:
        """vLLM allocated ``block_ids`` for ``request``, ``num_external`` tokens of them to load."""
        params = request.kv_transfer_params
        where = self._where(request) if self.settings.consumer else None
        if where is None:
            return
        params[DO_REMOTE_PREFILL] = False    # asked once: a second allocation must not ask again
        if num_external <= 0:
            return
        n = len(request.prompt_token_ids)
        room, instance, bootstrap = where
        self._recv[request.request_id] = Recv(request.request_id, room, instance, bootstrap, tuple(block_ids), n,
                                              n - num_external)

    @staticmethod
    def _where(request) -> tuple[str, str, str] | None:
        """The request's kvxfer prefill, or None; malformed params (a client's or a peer's) are
        logged and the request is computed here, never an exception in vLLM's scheduler."""
        try:
            return remote_prefill(request.kv_transfer_params)
        except ProtocolError as e:
            log.warning("request %s: %s; computing it here", request.request_id, e)
            return None

    # -- prefill -------------------------------------------------------------------------
    def finished(self, request, block_ids: Iterable[int]) -> tuple[bool, dict | None]:
        """vLLM's ``request_finished``: (hold the blocks?, kv_transfer_params for the response)."""
        rid = request.request_id
        if rid in self._recv:                 # a load no worker started: it ends now
            del self._recv[rid]
            self._next.cancel.append(rid)
            self._loading.add(rid)
            return False, None
        if rid in self._loading:              # a load in flight: kvxfer aborts it, vLLM keeps the blocks
            self._next.abort_recv.append(rid)
            return False, None
        params = request.kv_transfer_params
        if not self.settings.producer or not isinstance(params, Mapping) or not params.get(DO_REMOTE_DECODE):
            return False, None
        if getattr(request.status, "name", str(request.status)) == ABORTED:
            return False, None
        n = len(request.prompt_token_ids or ())
        self._send[rid] = Send(rid, rid, tuple(block_ids), n)
        return True, {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, ROOM: rid,
                      INSTANCE: self.settings.instance, BOOTSTRAP: self.settings.bootstrap_url, TOKENS: n}

    # -- every step ----------------------------------------------------------------------
    def build_plan(self) -> StepPlan:
        plan, self._next = self._next, StepPlan()
        plan.recv += self._recv.values()
        plan.send += self._send.values()
        self._loading.update(self._recv)
        self._sending.update(self._send)
        self._recv, self._send = {}, {}
        return plan

    def output(self, finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None) -> None:
        self._sending.difference_update(finished_sending or ())
        self._loading.difference_update(finished_recving or ())

    def pending(self) -> bool:
        """True while a send or load is planned or in flight: vLLM keeps stepping, so the workers
        report what kvxfer finished (``has_pending_push_work``)."""
        return bool(self._recv or self._send or self._next or self._loading or self._sending)

    def close(self) -> None:
        if self.registry is not None:
            self.registry.stop()
            self.registry = None


__all__ = ["KvxferScheduler", "remote_prefill"]
