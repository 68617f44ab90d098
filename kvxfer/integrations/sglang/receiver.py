"""``KvxferKVReceiver``: SGLang's decode-side request over a kvxfer ``KVReceiver``.

Who calls what (SGLang's ``decode.py``, one object per request, on the scheduler thread):
    ``Receiver(mgr, bootstrap_addr, bootstrap_room)``  when the request reaches decode
    ``init(prefill_dp_rank)``  once the prefill instance's DP size is known: the kvxfer receiver,
        naming the prefill instance by its bootstrap address (its handshake starts on first use)
    ``poll()``  every step, MIN-reduced over the TP group (after SGLang's metadata gate):
        Bootstrapping until the prefill instance answered, then WaitingForInput (SGLang then
        allocates pages), Transferring, and Success or Failed once kvxfer released the grant
    ``expect_tokens(n)``  the plugin's hook on ``_send_kv_metadata``: the exact token count of the
        pages about to be granted (without it, whole pages)
    ``send_metadata(page_ids, aux_index, state_indices, decode_prefix_len=)``  grants the pages
        (tokens past decode's prefix), clears the metadata row (to zeros: SGLang's gate then reads
        "not landed" until kvxfer writes the row, before Success), the Mamba slot and the sliding
        window's pages
    ``failure_exception()`` raises ``SGLangTransferError``; ``abort()``; ``ensure_abort_notified()``;
    ``is_abort_release_safe()``; ``clear()``; attributes ``require_staging`` (False),
    ``abort_notified``, ``bootstrap_infos`` (the prefill ranks the request pulls from),
    ``conclude_state``, ``kv_mgr``.
Decode's prefix: kvxfer counts a request's tokens from 0 and takes the slot of every one; SGLang
hands none for the tokens its prefix cache holds, so they are given placeholder slots that are
never granted nor written (the first free ids past the padding page; see the README).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVTransferDestination

from ...endpoint.base import KVPoll
from ...errors import ConnectError, LayoutError, RequestError
from .config import bootstrap_url
from .states import SGLangPoll, SGLangTransferError, expand_pages, prefix_placeholders, state_slots, window_slots


class KvxferKVReceiver(BaseKVReceiver):
    """See the module docstring."""

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int | None = None):
        self.kv_mgr, self.bootstrap_addr, self.bootstrap_room = mgr, bootstrap_addr, bootstrap_room
        self.require_staging = False
        self.abort_notified = False
        self._poll = SGLangPoll()
        self._r: Any = None   # the kvxfer KVReceiver, from init()
        self._tokens: int | None = None
        self._granted = False
        mgr.track(bootstrap_room, self)

    @property
    def conclude_state(self) -> int | None:
        return self._poll.conclude_state

    @property
    def bootstrap_infos(self) -> list[str]:
        """The prefill ranks this request pulls from (known once its instance answered)."""
        return sorted(self._r.contacts) if self._r is not None else []

    def init(self, prefill_dp_rank: int) -> None:
        if self._r is not None or self._poll.conclude_state is not None:
            return
        try:
            self._r = self.kv_mgr.endpoint.receiver(self.bootstrap_room, bootstrap=bootstrap_url(self.bootstrap_addr),
                                                    p_dp_rank=int(prefill_dp_rank), on_release=self._released)
        except (ConnectError, RequestError, ValueError) as e:
            self._poll.fail(f"prefill at {self.bootstrap_addr}: {e}")

    def _released(self, _outcome) -> None:
        """kvxfer's thread, once no write of the request can land: the manager stops tracking it
        (an untracked room is release-safe), so its table holds only requests still running."""
        self.kv_mgr.forget(self.bootstrap_room, self)

    def expect_tokens(self, n: int) -> None:
        """The plugin's hook: the request's exact token count past decode's prefix."""
        self._tokens = int(n)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE, **_kwargs) -> None:
        if self._r is None or self._poll.conclude_state is not None:
            return
        try:
            if destination != KVTransferDestination.DEVICE:
                raise RequestError("the kvxfer backend receives into device pages only (no host destination)")
            self._grant(kv_indices, aux_index, state_indices, int(decode_prefix_len or 0))
        except (RequestError, LayoutError) as e:
            self._r.abort(f"bad metadata from decode's scheduler: {e}")

    def _grant(self, kv_indices, aux_index, state_indices, prefix: int) -> None:
        mgr, r = self.kv_mgr, self._r
        page = mgr.kv_pool.page_size
        suffix = expand_pages(kv_indices, page)
        if self._tokens is not None:
            if self._tokens > len(suffix):
                raise RequestError(f"{self._tokens} tokens but {len(suffix) // page} page(s) of {page}")
            suffix = suffix[: self._tokens]
        kv = np.concatenate([prefix_placeholders(prefix, suffix, page), suffix])
        types = getattr(mgr.kv_args, "state_types", None)
        mamba = state_slots(state_indices, types, "mamba")
        swa = None
        if mgr.description.window:
            pages = state_slots(state_indices, types, "swa")
            if pages is None:
                raise RequestError("a hybrid sliding-window pool needs the window's pages (state SWA)")
            swa = window_slots(pages, page, len(kv), prefix, mgr.description.window)
        r.init(kv, prefix_len=prefix, aux_slot=aux_index if mgr.metadata is not None else None,
                     state_slots=mamba if mamba is not None and len(mamba) else None, swa_slots=swa)
        self._granted = True

    def poll(self) -> int:
        floor = KVPoll.WaitingForInput if self._r is not None and self._r.bound else KVPoll.Bootstrapping
        if self._granted:
            floor = KVPoll.WaitingForInput
        return self._poll.show(self._r, floor)

    def failure_exception(self):
        local = self._r is not None and self._r.state == KVPoll.Failed
        reason = self._poll.reason or (self._r.reason if local else "")
        if self._r is not None and self._r.state not in (KVPoll.Success, KVPoll.Failed):
            self._r.abort("another rank of the TP group failed")
            self.abort_notified = True
        raise SGLangTransferError(self.bootstrap_room, reason or "failed on another rank of the TP group",
                                  is_from_another_rank=not (local or self._poll.reason))

    def abort(self) -> None:
        """End the request (kvxfer tells the prefill ranks); its pages stay SGLang's to free once
        ``is_abort_release_safe``."""
        if self._r is not None:
            self._r.abort("aborted by decode's scheduler")
        else:
            self._poll.fail("aborted by decode's scheduler before init")
        self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified:
            self.abort()

    def is_abort_release_safe(self) -> bool:
        """True once no write of this request can land in its pages."""
        return self._r is None or self._r.released

    released = property(is_abort_release_safe)

    def clear(self) -> None:
        if self._r is not None:
            self._r.clear()   # a running request ends (aborted); kvxfer's release then forgets it
        else:
            self.kv_mgr.forget(self.bootstrap_room, self)


__all__ = ["KvxferKVReceiver"]
