"""The worker side of the vLLM connector: ``KvxferWorker`` (one per vLLM worker, i.e. per TP rank).
It owns the pool over vLLM's KV tensors, the kvxfer endpoints, and the per-request kvxfer objects;
it imports no vLLM (the facade reads vLLM's config into ``Settings`` and ``ModelShape``).

Who calls what (vLLM, through ``KvxferConnector``, on the worker's thread):
    once    ``register(kv_caches)``: the pool over the engine's tensors (a ``layouts`` builder),
            a ``PrefillEndpoint`` (producer; registered with the prefill instance's registry on a
            thread, retrying until ``register_timeout``: the registry starts with the scheduler,
            after the workers) and/or a ``DecodeEndpoint`` (consumer).
    a step  ``run_plan(plan)``: receivers granted on the blocks decode's scheduler allocated, senders
            for the requests prefill finished (their KV was written by an earlier step's forward,
            whose output vLLM has already read back, so it is complete: no ready event), aborts;
            ``idle_wait()`` on steps without a forward while kvxfer still works (a short block, so
            vLLM's loop does not spin on the GIL that kvxfer's threads need);
            ``take()``: what finished since, and the blocks of loads that failed.
kvxfer's threads call the ``on_release`` callbacks made here: a load is reported finished (and its
blocks as load errors unless it succeeded) only once kvxfer released its grant, i.e. once no write
can land in those blocks; a send is reported finished once prefill may reuse its blocks.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping

import torch

from ...endpoint.base import Outcome
from ...endpoint.decode import DecodeEndpoint, KVReceiver
from ...endpoint.prefill import KVSender, PrefillEndpoint
from ...errors import ConfigError, KVXferError
from ...ranks import RankSpec
from .layouts import VllmKV, cpu_kv, flash_kv, mla_kv, paged_kv
from .plan import Recv, Send, StepPlan
from .settings import ModelShape, Settings

log = logging.getLogger("kvxfer.vllm")


def describe_kv(kv_caches: Mapping[str, torch.Tensor], settings: Settings, shape: ModelShape,
                packing: str | None) -> VllmKV:
    """The builder for this engine's tensors: ``settings.kv_layout``, or by shape ("auto"): MLA
    for an MLA model, the 5-D FlashAttention/FlashInfer shape, the CPU backend when vLLM chose a CPU
    attention ISA (``packing``), else vLLM's paged views."""
    kind = settings.kv_layout
    first = next(iter(kv_caches.values()))
    if kind == "auto":
        kind = "mla" if shape.use_mla else ("flash" if first.shape[0] == 2 else "flashinfer") if first.dim() == 5 \
            else "cpu" if packing else "paged"
    if kind == "mla":
        return mla_kv(kv_caches)
    if kind in ("flash", "flashinfer"):
        return flash_kv(kv_caches, kv_axis=0 if kind == "flash" else 1)
    if kind == "cpu":
        if not packing:
            raise ConfigError("kv_layout 'cpu' needs the CPU attention ISA vLLM chose; none was found")
        return cpu_kv(kv_caches, head_size=shape.head_size, packing=packing)
    return paged_kv(kv_caches, head_size=shape.head_size)


class KvxferWorker:
    """See the module docstring."""

    def __init__(self, settings: Settings, shape: ModelShape, packing: str | None = None):
        self.settings, self.shape, self.packing = settings, shape, packing
        self.kv: VllmKV | None = None
        self.prefill: PrefillEndpoint | None = None
        self.decode: DecodeEndpoint | None = None
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._recvs: dict[str, KVReceiver] = {}   # req_id -> its receiver, until released
        self._sends: dict[str, KVSender] = {}     # req_id -> its sender, until released
        self._aborted: set[str] = set()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._errors: set[int] = set()
        self._registration: threading.Thread | None = None
        self._closing = False

    # -- start-up ----------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        s, m = self.settings, self.shape
        self.kv = describe_kv(kv_caches, s, m, self.packing)
        pool = self.kv.pool()
        heads = 1 if m.use_mla else m.num_kv_heads
        log.info("kvxfer %s rank %d/%d: %s, %d layers, %d slot(s) of %d token(s)", s.instance, m.tp_rank, m.tp_size,
                 self.kv.layout.kind, len(self.kv.layers), self.kv.layout.spaces[0].num_slots,
                 self.kv.tokens_per_slot)
        if s.producer:
            spec = RankSpec(role="prefill", instance=s.instance, num_kv_heads=heads, num_layers=m.num_layers,
                            tp_size=m.tp_size, tp_rank=m.tp_rank, replicated=m.use_mla)
            self.prefill = PrefillEndpoint(spec, pool, transport=s.transport,
                                           transport_options=dict(s.transport_options), timeouts=s.timeouts,
                                           secret=s.secret, aux_bytes=0, host=s.host)
            self._registration = threading.Thread(target=self._register, name="kvxfer-vllm-register", daemon=True)
            self._registration.start()
        if s.consumer:
            spec = RankSpec(role="decode", instance=s.decode_instance, num_kv_heads=heads,
                            num_layers=m.num_layers, tp_size=m.tp_size, tp_rank=m.tp_rank, replicated=m.use_mla)
            self.decode = DecodeEndpoint(spec, pool, transport=s.transport, transport_options=dict(s.transport_options),
                                         timeouts=s.timeouts, secret=s.secret, aux_bytes=0)

    def _register(self) -> None:
        """Registration thread: the registry starts with the scheduler, after the workers: retry."""
        deadline = time.monotonic() + self.settings.register_timeout
        while True:
            try:
                self.prefill.register(self.settings.bootstrap_url)
                log.info("kvxfer prefill rank %s registered at %s", self.prefill.spec.key, self.settings.bootstrap_url)
                return
            except KVXferError as e:
                if time.monotonic() > deadline or self.prefill.broken or self._closing:
                    log.error("kvxfer prefill rank %s could not register at %s: %s", self.prefill.spec.key,
                              self.settings.bootstrap_url, e)
                    return
                time.sleep(0.2)

    # -- per step ------------------------------------------------------------------------------
    def run_plan(self, plan: StepPlan) -> None:
        for rid in plan.cancel:
            with self._lock:
                self._received.add(rid)
        for rid in plan.abort_recv:
            with self._lock:
                r = self._recvs.get(rid)
                if r is not None:   # else it was released already (and reported)
                    self._aborted.add(rid)
            if r is not None:
                r.abort("the request was aborted in vLLM")
        for recv in plan.recv:
            self._start_recv(recv)
        for send in plan.send:
            self._start_send(send)

    def _start_recv(self, recv: Recv) -> None:
        kv = self.kv
        first = recv.prefix // kv.block_size
        released = functools.partial(self._recv_released, recv.req_id, recv.block_ids[first:])
        try:
            if self.decode is None:
                raise KVXferError("this engine's kv_role is not a consumer (kv_consumer or kv_both)")
            slots = kv.slots(recv.block_ids, recv.num_tokens)
            r = self.decode.receiver(recv.room, instance=recv.instance, bootstrap=recv.bootstrap, on_release=released)
            with self._lock:
                self._recvs[recv.req_id] = r
            r.init(slots, prefix_len=kv.slot_prefix(recv.prefix))
        except (KVXferError, ValueError) as e:
            log.warning("request %s: the load could not start: %s", recv.req_id, e)
            with self._lock:
                r = self._recvs.get(recv.req_id)
            if r is not None:
                r.abort(f"could not start: {e}")   # on_release reports it, once the grant is gone
            else:
                released(Outcome.Failed)

    def _recv_released(self, rid: str, blocks, outcome: Outcome) -> None:
        """kvxfer thread: the grant of load ``rid`` ended and no write can land any more."""
        with self._lock:
            self._recvs.pop(rid, None)
            if outcome != Outcome.Success and rid not in self._aborted:
                self._errors.update(int(b) for b in blocks)
            self._aborted.discard(rid)
            self._received.add(rid)
        self._changed.set()
        if outcome != Outcome.Success:
            log.info("request %s: load ended %s", rid, outcome.value)

    def _start_send(self, send: Send) -> None:
        done = functools.partial(self._send_released, send.req_id)
        try:
            if self.prefill is None:
                raise KVXferError("this engine's kv_role is not a producer (kv_producer or kv_both)")
            s = self.prefill.sender(send.room, on_release=done)
            with self._lock:
                self._sends[send.req_id] = s
            s.send(self.kv.slots(send.block_ids, send.num_tokens), last=True)
        except (KVXferError, ValueError) as e:
            log.warning("request %s: the send could not start: %s", send.req_id, e)
            with self._lock:
                s = self._sends.get(send.req_id)
            if s is not None:
                s.abort(f"could not start: {e}")
            else:
                done(Outcome.Failed)

    def _send_released(self, rid: str, outcome: Outcome) -> None:
        """kvxfer thread: prefill may reuse the blocks of send ``rid``."""
        with self._lock:
            self._sends.pop(rid, None)
            self._sent.add(rid)
        self._changed.set()

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """(sends finished, loads finished, blocks of failed loads) since the last call, at once."""
        with self._lock:
            out = (self._sent, self._received, self._errors)
            self._sent, self._received, self._errors = set(), set(), set()
            self._changed.clear()
        return out

    def receivers(self) -> list[tuple[str, KVReceiver]]:
        """The loads kvxfer still moves or holds: (vLLM request id, receiver); for diagnostics."""
        with self._lock:
            return list(self._recvs.items())

    def busy(self) -> bool:
        with self._lock:
            return bool(self._recvs or self._sends)

    def idle_wait(self, seconds: float = 0.002) -> None:
        """On a step without a forward while kvxfer works: block up to ``seconds`` for an end."""
        if self.busy():
            self._changed.wait(seconds)

    def close(self) -> None:
        self._closing = True
        for ep in (self.decode, self.prefill):
            if ep is not None:
                ep.close()


__all__ = ["KvxferWorker", "describe_kv"]
