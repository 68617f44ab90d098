"""What SGLang's sender and receiver share: its poll semantics over a kvxfer request, its error,
and the page -> slot arithmetic.

SGLang polls every request once per scheduler step, MIN-reduces the states over the attention-TP
gloo group, and acts at once on the result: on Success or Failed it frees the request's pages
(prefill: its KV; decode: the pages it granted, unless it defers the release). So
``SGLangPoll`` shows a kvxfer request's end state only once kvxfer released it (``released``:
no transfer reads the KV any more, no write can land in the grant); until then it repeats the
last state it showed, which every SGLang queue accepts. States only move forward; Failed is
final; ``failure_exception()`` raises ``SGLangTransferError`` (``is_from_another_rank`` when this
rank's request had not failed: the group's MIN did).

Who calls what: ``KvxferKVSender`` / ``KvxferKVReceiver`` own one ``SGLangPoll`` each and call
``show`` from their ``poll()``; ``expand_pages`` turns SGLang's page ids into kvxfer slots.
"""
from __future__ import annotations

import numpy as np

from ...endpoint.request import KVPoll, RequestBase
from ...errors import LayoutError, RequestError


class SGLangTransferError(RequestError):
    """A failed SGLang transfer, as SGLang's schedulers read one (``failure_reason``,
    ``is_from_another_rank``; the room is ``bootstrap_room``)."""

    def __init__(self, bootstrap_room, failure_reason: str, is_from_another_rank: bool = False):
        super().__init__(f"room {bootstrap_room}: {failure_reason}")
        self.bootstrap_room, self.failure_reason = bootstrap_room, failure_reason
        self.is_from_another_rank = is_from_another_rank


class SGLangPoll:
    """One request's state as SGLang sees it (see the module docstring)."""
    __slots__ = ("shown", "conclude_state", "reason")

    def __init__(self) -> None:
        self.shown = KVPoll.Bootstrapping
        self.conclude_state: int | None = None    # set once an end state was shown (SGLang's name)
        self.reason = ""

    def fail(self, reason: str) -> None:
        """This side failed before (or without) a kvxfer request: nothing to release."""
        if self.conclude_state is None:
            self.shown, self.conclude_state, self.reason = KVPoll.Failed, int(KVPoll.Failed), reason

    def show(self, r: RequestBase | None, floor: KVPoll = KVPoll.Bootstrapping) -> int:
        """The state to show for kvxfer request ``r`` (None: not made yet), at least ``floor``
        while it runs."""
        if self.conclude_state is not None:
            return self.conclude_state
        if r is None:
            self.shown = max(self.shown, floor)
            return int(self.shown)
        state = r.state
        if state in (KVPoll.Success, KVPoll.Failed):
            if not r.released:                 # its KV or grant may still be read or written
                return int(self.shown)
            self.shown, self.conclude_state = state, int(state)
            self.reason = r.reason
            return int(state)
        self.shown = max(self.shown, state, floor)
        return int(self.shown)


def expand_pages(pages, page_size: int) -> np.ndarray:
    """Every slot of pages ``pages`` (SGLang's page ids), page by page."""
    p = np.asarray(pages, dtype=np.int64).reshape(-1)
    return (p[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)


def host_ints(x) -> np.ndarray:
    """Indices SGLang gives as a numpy array, a list or a (CPU) tensor, as flat int64."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def state_slots(state_indices, state_types, kind: str) -> np.ndarray | None:
    """The indices SGLang passed for state ``kind`` ("mamba", "swa"), flattened; None when absent."""
    if not state_indices:
        return None
    for st, idx in zip(state_types or [], state_indices):
        if getattr(st, "value", st) == kind and idx is not None:
            parts = idx if isinstance(idx, (list, tuple)) else [idx]
            return np.concatenate([host_ints(x) for x in parts]) if parts else np.zeros(0, np.int64)
    return None


def prefix_placeholders(prefix: int, suffix: np.ndarray, page_size: int) -> np.ndarray:
    """``prefix`` distinct slots past the padding page and outside ``suffix``: the positions of the
    tokens decode already holds, which kvxfer neither grants nor writes."""
    if prefix == 0:
        return np.zeros(0, np.int64)
    candidates = np.arange(page_size, page_size + prefix + len(suffix), dtype=np.int64)
    return np.setdiff1d(candidates, suffix, assume_unique=True)[:prefix]


def window_slots(swa_pages, page_size: int, seq_len: int, prefix: int, window: int) -> np.ndarray:
    """The sliding-window slots of the request's last tokens: SGLang's window pages start at the
    page boundary at or below ``max(prefix, seq_len - window)``; kvxfer takes the last ``window``."""
    start = max(prefix, seq_len - window) // page_size * page_size
    count = seq_len - start
    slots = expand_pages(swa_pages, page_size)
    if len(slots) < count:
        raise LayoutError(f"{len(slots) // page_size} window page(s) for {count} window tokens (page {page_size})")
    return slots[:count][-min(count, window):]


__all__ = ["SGLangTransferError", "SGLangPoll", "expand_pages", "state_slots", "host_ints", "prefix_placeholders",
           "window_slots"]
