"""``KvxferKVSender``: SGLang's prefill-side request over a kvxfer ``KVSender``.

Who calls what (SGLang's ``prefill.py``, one object per request, all on the scheduler thread):
    ``Sender(mgr, bootstrap_addr, bootstrap_room)``   when the request reaches prefill: the kvxfer
        sender for the room (decode's request for it may come before or after)
    ``poll()`` / ``poll_pp_consensus()``  every step, MIN-reduced over the TP group: Bootstrapping
        until every decode rank of the request granted it, then WaitingForInput, Transferring;
        Success or Failed only once kvxfer released the KV (``kv_releasable``): SGLang frees it then
    ``pop_decode_prefix_len()``  after WaitingForInput: the tokens decode already holds (its grant)
    ``init(num_pages, aux_index)``  how many pages will be sent, and the request's metadata row
    ``send(page_ids, state_indices, num_kv_tokens=)``  per chunk as prefill computes it (whole
        pages but the last); the last chunk is the one that reaches ``num_pages``: it carries the
        metadata row (kvxfer reads it when the chunk is submitted) and the Mamba state slot.
        A chunk waits for SGLang's ``_early_send_wait_event`` when the scheduler set one.
    ``failure_exception()`` raises ``SGLangTransferError``; ``abort()``; ``clear()``
Token positions: kvxfer counts a request's tokens from 0 on both sides; the first chunk starts
at decode's prefix (``pop_decode_prefix_len``). The last chunk's tokens end where decode's grant
ends: whole pages on both sides when SGLang's hook could not tell decode the exact count (then
prefill's last page fills decode's, and different page sizes are refused in words).
"""
from __future__ import annotations

import time

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVTransferMetric

from ...endpoint.base import KVPoll
from ...errors import LayoutError, RequestError
from .states import SGLangPoll, SGLangTransferError, expand_pages, state_slots


class KvxferKVSender(BaseKVSender):
    """See the module docstring."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr, self.bootstrap_room, self.bootstrap_server_url = mgr, bootstrap_room, bootstrap_addr
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self._early_send_wait_event = None      # set by SGLang's scheduler before an early send
        self._poll = SGLangPoll()
        self._pages = self._tokens = 0
        self._started: float | None = None
        self._metric = KVTransferMetric()
        try:
            self._s = mgr.endpoint.sender(bootstrap_room)
        except RequestError as e:   # a live sender of the same room: a duplicate
            self._s = None
            self._poll.fail(str(e))

    # -- the grant -------------------------------------------------------------------------------
    def _grant(self) -> tuple[int, int | None] | None:
        """(decode's prefix, the tokens decode granted past it; None when this rank feeds no decode
        rank of the request, only dummies), once decode's requests came; None before."""
        if self._s is None:
            return None
        targets = list(self._s.targets.values())
        if not targets:
            return None
        prefixes = {t.prefix for t in targets}
        counts = {len(t.kv) - t.prefix for t in targets if not t.dummy}
        if len(prefixes) > 1 or len(counts) > 1:
            raise RequestError(f"decode ranks granted different requests (prefixes {sorted(prefixes)}, "
                               f"tokens {sorted(counts)})")
        return prefixes.pop(), (counts.pop() if counts else None)

    def pop_decode_prefix_len(self) -> int:
        try:
            grant = self._grant()
        except RequestError as e:
            self._abort(str(e))
            return 0
        return grant[0] if grant else 0

    @property
    def conclude_state(self) -> int | None:
        return self._poll.conclude_state

    @property
    def released(self) -> bool:
        """kvxfer let go of the request's KV: no transfer reads it any more (or none was made)."""
        return self._s is None or self._s.released

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk   # an empty last chunk still carries the metadata row

    # -- sending -----------------------------------------------------------------------------------
    def send(self, kv_indices, state_indices=None, num_kv_tokens: int | None = None, **_kwargs) -> None:
        if self._s is None or self._poll.conclude_state is not None:
            return
        if self.num_kv_indices is None:
            self._abort("send() before init(): SGLang's scheduler calls init(num_pages, aux_index) first")
            return
        try:
            self._send(kv_indices, state_indices)
        except (RequestError, LayoutError) as e:
            self._abort(str(e))

    def _send(self, kv_indices, state_indices) -> None:
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        self._pages += len(pages)
        last = self._pages >= self.num_kv_indices
        slots = expand_pages(pages, self.kv_mgr.kv_pool.page_size)
        grant = self._grant()
        prefix, granted = grant if grant else (0, None)
        if granted is not None:
            room = granted - self._tokens
            if last:
                if len(slots) < room:
                    raise RequestError(f"decode granted {granted} tokens past its prefix but prefill's pages hold "
                                       f"{self._tokens + len(slots)}: page sizes that do not tile (prefill "
                                       f"{self.kv_mgr.kv_pool.page_size}) without the plugin's exact token count")
                slots = slots[:room]
            elif len(slots) > room:
                raise RequestError(f"a chunk reaches token {self._tokens + len(slots)} past the prefix, but decode "
                                   f"granted {granted}")
        state = state_slots(state_indices, getattr(self.kv_mgr.kv_args, "state_types", None), "mamba") \
            if last else None
        ready, self._early_send_wait_event = self._early_send_wait_event, None
        if self._started is None:
            self._started = time.perf_counter()
        aux_row = self.aux_index if last and self.kv_mgr.metadata is not None else None
        self._s.send(slots, start=prefix + self._tokens, last=last, aux_row=aux_row, ready=ready,
                     state_slots=state if state is not None and len(state) else None)
        self._tokens += len(slots)

    # -- state -------------------------------------------------------------------------------------
    def poll(self) -> int:
        state = self._poll.show(self._s)
        if state == KVPoll.Success and self._started is not None and self._metric.transfer_latency_s is None:
            self._metric.transfer_latency_s = time.perf_counter() - self._started
        return state

    def poll_pp_consensus(self) -> int:
        """Under pipeline parallelism SGLang polls stage 0 only and hands its state to the other
        stages. kvxfer's stage-0 sender ends Success only when decode confirmed the whole request
        (every stage's bytes landed), so its Success holds for every stage; see the README for
        the Failed case."""
        return self.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        return self._metric

    def failure_exception(self):
        local = self._s is not None and self._s.state == KVPoll.Failed
        reason = self._poll.reason or (self._s.reason if local else "")
        if self._s is not None and self._s.state not in (KVPoll.Success, KVPoll.Failed):
            self._s.abort("another rank of the TP group failed")
        raise SGLangTransferError(self.bootstrap_room, reason or "failed on another rank of the TP group",
                                  is_from_another_rank=not (local or self._poll.reason))

    def _abort(self, why: str) -> None:
        if self._s is not None:
            self._s.abort(why)

    def abort(self) -> None:
        self._abort("aborted by prefill's scheduler")

    def clear(self) -> None:
        if self._s is not None:
            self._s.clear()


__all__ = ["KvxferKVSender"]
