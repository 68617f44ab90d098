"""SGLang's scheduler loops, re-told for the backend tests (runs in the SGLang venv): what
``prefill.py`` and ``decode.py`` do with a transfer backend's sender and receiver, step by step,
with SGLang's own collective helpers (``poll_and_all_reduce`` over the instance's gloo TP group,
with the metadata gate on decode; ``all_reduce_flags`` for deferred releases) and SGLang's page
allocator. Pages are freed exactly where SGLang frees them: prefill on Success or Failed; decode on
Failed (after a deferred release while writes may land) or when the request is finished.

``fault``: ``stall`` (prefill sends its first chunk, reports ``stalled`` and waits for the file
``resume`` before the rest), ``no_send`` (prefill never sends: the phase deadline ends it),
``abort`` (decode aborts a request once it shows Transferring, as ``abort_request`` does; ``rank``:
only on that TP rank), ``report`` (decode reports ``transferring`` when a request first shows it).
"""
from __future__ import annotations

import math
import os
import time
import types

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.utils import (
    KVClassType,
    TransferBackend,
    all_reduce_flags,
    get_kv_class,
    poll_and_all_reduce,
)
from sglang_engine import WINDOW, pattern

STEP = 0.005
DEADLINE = 60.0      # a run that takes longer is a hang: reported, never waited for


def _pages(slots: torch.Tensor, start: int, end: int, page: int) -> np.ndarray:
    """SGLang's page ids of tokens ``start .. end - 1`` (``start`` page-aligned)."""
    return (slots[start:end:page] // page).numpy().astype(np.int32)


def _metadata_row(side, room: int, idx: int) -> None:
    """Prefill: its row of every MetadataBuffers field (what ``set_buf`` writes), from the pattern."""
    ptrs, lens, items = side.meta.get_buf_infos()
    for i, (t, item) in enumerate(zip(_meta_tensors(side), items)):
        row = t[idx].view(torch.uint8)
        row.copy_(pattern(room, 1000 + i, "meta", 1, 1, item)[0, 0])
    side.meta.bootstrap_room[idx].zero_()
    side.meta.bootstrap_room[idx, 0] = room


def _meta_tensors(side):
    m = side.meta
    return [t for t in (m.output_ids, m.cached_tokens, m.output_token_logprobs_val, m.output_token_logprobs_idx,
                        m.output_top_logprobs_val, m.output_top_logprobs_idx, m.output_token_sampling_mask_len,
                        m.output_token_sampling_mask_idx, m.output_token_sampling_logprobs, m.output_topk_p,
                        m.output_topk_index, m.output_hidden_states, m.output_dsa_topk_indices, m.bootstrap_room,
                        m.kv_checksum) if t is not None]


def _state_indices(side, r) -> list | None:
    out = []
    for st in side.kv_args.state_types:
        out.append([np.array([r.mamba], np.int64)] if st.value == "mamba" else r.swa_pages)
    return out or None


def _window(side, n: int, prefix: int) -> int:
    return max(prefix, n - WINDOW) // side.page * side.page


def _allocate(side, r, prefix: int) -> None:
    """Pages for every token (SGLang's allocator), the sliding window's pages, a Mamba slot."""
    page = side.page
    r.slots = side.alloc.alloc(math.ceil(r.n / page) * page)
    if side.kind == "swa":
        start = _window(side, r.n, prefix)
        r.swa = side.swa_alloc.alloc(math.ceil((r.n - start) / page) * page)
        r.slots_swa_owner = r.slots[start:r.n]
        side.pool.full_to_swa_index_mapping[r.slots_swa_owner] = r.swa[:r.n - start]
        r.swa_pages = _pages(r.swa, 0, r.n - start, page)
        r.window_start = start
    if side.kind == "mamba":
        r.mamba = side.mamba_free.pop()


def _free(side, r) -> None:
    if getattr(r, "swa", None) is not None:
        side.pool.full_to_swa_index_mapping[r.slots_swa_owner] = 0
        side.swa_alloc.free(r.swa)
        r.swa = None
    if getattr(r, "mamba", None) is not None:
        side.mamba_free.append(r.mamba)
        r.mamba = None
    if getattr(r, "slots", None) is not None:
        side.alloc.free(r.slots)
        r.slots = None


def _rows(side, r, lo: int, hi: int):
    """(layer, kind, positions, slots) of tokens ``lo .. hi - 1`` in every attention layer (a
    sliding-window layer: the last WINDOW of them that are in the request's window)."""
    for layer in side.attn_layers:
        for kind in side.kinds(layer):
            if side.is_swa(layer):
                first = max(lo, r.n - WINDOW, r.window_start)
                pos = torch.arange(first, max(first, hi))
                yield layer, kind, pos, r.swa[pos - r.window_start]
            else:
                pos = torch.arange(lo, hi)
                yield layer, kind, pos, r.slots[pos]


def _write_state(side, r) -> None:
    for li in range(2):
        conv, temporal = side.state_expected(r.room, li)
        side.mamba.mamba_cache.conv[0][li, r.mamba] = conv
        side.mamba.mamba_cache.temporal[li, r.mamba] = temporal


def _state_ok(side, r) -> bool:
    for li in range(2):
        conv, temporal = side.state_expected(r.room, li)
        if not (torch.equal(side.mamba.mamba_cache.conv[0][li, r.mamba].view(torch.uint8), conv.view(torch.uint8))
                and torch.equal(side.mamba.mamba_cache.temporal[li, r.mamba].view(torch.uint8),
                                temporal.contiguous().view(torch.uint8))):
            return False
    return True


def _poll(side, group, pollers, drs=None):
    return poll_and_all_reduce(pollers, group, decode_reqs=drs, metadata_buffers=side.meta if drs else None)


def _why(fn) -> tuple[str, bool]:
    try:
        fn()
    except Exception as e:
        return str(e), bool(getattr(e, "is_from_another_rank", False))
    return "failure_exception() did not raise", False


# ------------------------------------------------------------------------------------------------
# prefill (prefill.py: PrefillBootstrapQueue.pop_bootstrapped, send_kv_chunk, the inflight queue)
# ------------------------------------------------------------------------------------------------
def run_prefill(side, group, reqs, fault, emit) -> dict:
    sender = get_kv_class(TransferBackend("kvxfer"), KVClassType.SENDER)
    addr = f"127.0.0.1:{side.mgr.bootstrap_port}"
    rs = []
    for q in reqs:
        r = types.SimpleNamespace(room=q["room"], n=q["n"], phase="boot", outcome=None, reason="", other=False,
                                  idx=-1, left=[], window_start=0, sent=0, told=False)
        _allocate(side, r, 0)
        for layer, kind, pos, slots in _rows(side, r, 0, r.n):
            side.write(r.room, layer, kind, pos, slots)
        if side.kind == "mamba":
            _write_state(side, r)
        r.sender = sender(side.mgr, addr, r.room)
        rs.append(r)
    before = [s.clone() for s in side.storages()]
    resume = fault.get("resume")
    deadline = time.monotonic() + DEADLINE
    while any(r.outcome is None for r in rs) and time.monotonic() < deadline:
        live = [r for r in rs if r.outcome is None]
        for r, poll in zip(live, _poll(side, group, [r.sender for r in live])):
            if poll == KVPoll.Failed:
                r.reason, r.other = _why(r.sender.failure_exception)
                r.outcome = "failed"
            elif poll == KVPoll.Success:
                r.outcome = "success"
            elif poll == KVPoll.WaitingForInput and r.phase == "boot" and not fault.get("no_send"):
                prefix = r.sender.pop_decode_prefix_len()
                r.idx = side.meta_alloc.alloc()
                r.sender.init(math.ceil((r.n - prefix) / side.page), r.idx)
                pages = _pages(r.slots, prefix, r.n, side.page)
                r.left = [pages[i:i + 2] for i in range(0, len(pages), 2)] or [pages]   # chunks of 2 pages
                r.phase = "sending"
            if r.outcome is not None:
                _free(side, r)    # SGLang frees the KV at Success or Failed
                if r.idx >= 0:
                    side.meta_alloc.free(r.idx)
        for r in rs:
            while r.left and r.phase == "sending" and r.outcome is None:
                if r.sent and fault.get("stall") and not (resume and os.path.exists(resume)):
                    if not r.told:   # the first chunk went; the rest waits: a transfer cut in the middle
                        emit(ev="stalled", room=r.room)
                        r.told = True
                    break
                last = len(r.left) == 1
                if last:
                    _metadata_row(side, r.room, r.idx)
                r.sender.send(r.left.pop(0), _state_indices(side, r) if last else None)
                r.sent += 1
        time.sleep(STEP)
    untouched = all(torch.equal(a, b) for a, b in zip(before, side.storages()))
    return {"reqs": [{"room": r.room, "outcome": r.outcome or "hung", "reason": r.reason, "other": r.other}
                     for r in rs],
            "released": all(r.sender.released for r in rs), "source_untouched": untouched, "leaks": side.leaks()}


# ------------------------------------------------------------------------------------------------
# decode (decode.py: DecodePreallocQueue._resolve_pending_reqs / pop_preallocated / _send_kv_metadata,
# DecodeTransferQueue.pop_transferred / _defer_release / resolve_deferred_releases)
# ------------------------------------------------------------------------------------------------
def _metadata_ok(side, r) -> bool:
    """The request's metadata row, every field byte for byte as prefill wrote it, room included."""
    items = side.meta.get_buf_infos()[2]
    for i, (t, item) in enumerate(zip(_meta_tensors(side), items)):
        want = pattern(r.room, 1000 + i, "meta", 1, 1, item)[0, 0].clone()
        if t is side.meta.bootstrap_room:
            want = torch.zeros(8, dtype=torch.uint64)
            want[0] = r.room
            want = want.view(torch.uint8)
        if not torch.equal(t[r.idx].contiguous().view(torch.uint8), want):
            return False
    return True


def _release(side, r) -> None:
    """``_do_release`` / the failed path: pages, metadata slot, receiver."""
    _free(side, r)
    side.meta.clear_slot(r.idx)
    side.meta_alloc.free(r.idx)
    side.mgr.clear_deferred_abort_state(r.room)
    r.receiver.clear()


def _prealloc_queue(side):
    """The parts of a ``DecodePreallocQueue`` that its ``_send_kv_metadata`` reads."""
    queue = types.SimpleNamespace(req_to_metadata_buffer_idx_allocator=side.meta_alloc,
                                  transfer_queue=types.SimpleNamespace(enable_staging=False),
                                  _num_published_destinations=0)
    queue._transfer_page_indices = lambda dr, kv, page: DecodePreallocQueue._transfer_page_indices(queue, dr, kv, page)
    return queue


def run_decode(side, group, reqs, fault, emit) -> dict:
    receiver = get_kv_class(TransferBackend("kvxfer"), KVClassType.RECEIVER)
    rs = []
    for q in reqs:
        addr = f"127.0.0.1:{q['bport']}"
        r = types.SimpleNamespace(room=q["room"], n=q["n"], prefix=q.get("prefix", 0), outcome=None, reason="",
                                  other=False, idx=-1, window_start=0, seen=set(), aborted=False, drained=None,
                                  is_rebootstrap=False, metadata_buffer_index=-1,
                                  req=types.SimpleNamespace(bootstrap_room=q["room"], bootstrap_host="127.0.0.1",
                                                            rid=str(q["room"]), time_stats=types.SimpleNamespace(
                                                                set_decode_transfer_queue_entry_time=lambda: None)))
        r.receiver, r.addr, r.kv_receiver = receiver(side.mgr, addr, r.room), addr, None
        r.kv_receiver = r.receiver
        rs.append(r)
    deadline = time.monotonic() + DEADLINE
    # _resolve_pending_reqs: the prefill instance's DP size, then init(prefill_dp_rank)
    pending = list(rs)
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if not side.mgr.try_ensure_parallel_info(r.addr)]
        time.sleep(STEP)
    for r in rs:
        r.receiver.init(0)
    # _update_handshake_waiters until every request waits for input (or failed)
    waiting = {}
    while len(waiting) < len(rs) and time.monotonic() < deadline:
        for r, poll in zip(rs, _poll(side, group, [r.receiver for r in rs])):
            r.seen.add(int(poll))
            if poll in (KVPoll.WaitingForInput, KVPoll.Failed):
                waiting.setdefault(r.room, int(poll))
        time.sleep(STEP)
    for r in rs:
        if waiting.get(r.room) == KVPoll.Failed:
            r.reason, r.other = _why(r.receiver.failure_exception)
            r.outcome = "failed"
            r.receiver.clear()
            continue
        _allocate(side, r, r.prefix)
        for layer, kind, pos, slots in _rows(side, r, 0, r.prefix):   # the prefix: decode's own cache
            side.write(r.room, layer, kind, pos, slots)
    live = [r for r in rs if r.outcome is None]
    before = [s.clone() for s in side.storages()]
    saved = {r.room: [(layer, kind, slots, side.view(layer, kind)[slots].clone())
                      for layer, kind, _, slots in _rows(side, r, r.prefix, r.n)] for r in live}
    states = {}
    for r in live:
        if side.kind == "mamba":
            r.mamba_at = r.mamba
            states[r.room] = [(li, side.mamba.mamba_cache.conv[0][li, r.mamba].clone(),
                               side.mamba.mamba_cache.temporal[li, r.mamba].clone()) for li in range(2)]
    queue = _prealloc_queue(side)
    for r in live:   # SGLang's own _send_kv_metadata, through the plugin's hook (the exact token count)
        DecodePreallocQueue._send_kv_metadata(queue, r, r.slots[r.prefix:r.n], side.page, _state_indices(side, r),
                                              decode_prefix_len=r.prefix)
        r.idx = r.metadata_buffer_index
    held = []
    while (live or held) and time.monotonic() < deadline:
        polls = _poll(side, group, [r.receiver for r in live], live) if live else []
        failed = []
        for r, poll in zip(list(live), polls):
            if poll == KVPoll.Transferring and fault.get("report") and 3 not in r.seen:
                emit(ev="transferring", room=r.room)
            r.seen.add(int(poll))
            if fault.get("abort") and fault.get("rank", side.rank) == side.rank and poll == KVPoll.Transferring \
                    and not r.aborted:
                r.receiver.abort()          # abort_request on a transfer-queue request
                r.aborted = True
                emit(ev="aborted", room=r.room)
            if poll == KVPoll.Success:     # _commit_transfer_to_req: the gate let it through
                r.meta_ok = _metadata_ok(side, r)
                r.bytes_ok = all(side.matches(r.room, layer, kind, pos, slots)
                                 for layer, kind, pos, slots in _rows(side, r, 0, r.n))
                r.bytes_ok = r.bytes_ok and (side.kind != "mamba" or _state_ok(side, r))
                r.outcome = "success"
                side.meta.clear_slot(r.idx)
                side.meta_alloc.free(r.idx)
                r.receiver.clear()
                live.remove(r)
            elif poll == KVPoll.Failed:
                r.reason, r.other = _why(r.receiver.failure_exception)
                if side.mgr.enable_deferred_decode_kv_release and not r.receiver.abort_notified:
                    r.receiver.ensure_abort_notified(force_arm=True)
                failed.append((r, r.receiver.abort_notified))
                r.outcome = "failed"
                live.remove(r)
        holds = all_reduce_flags([int(h) for _, h in failed], group, torch.distributed.ReduceOp.MAX)
        for (r, _), hold in zip(failed, holds):
            if hold:
                held.append((r, time.monotonic() + 20.0, len(r.receiver.bootstrap_infos)))
            else:
                _release(side, r)
        if held:   # resolve_deferred_releases: drained (or timed out) on every rank
            drained = [side.mgr.is_abort_release_safe(r.room, acks) for r, _, acks in held]
            ready = all_reduce_flags([int(d or time.monotonic() > t) for d, (_, t, _) in zip(drained, held)],
                                     group, torch.distributed.ReduceOp.MIN)
            keep = []
            for (r, t, acks), d, ok in zip(held, drained, ready):
                if ok:
                    r.drained = bool(d)
                    _release(side, r)
                else:
                    keep.append((r, t, acks))
            held = keep
        time.sleep(STEP)
    for r in rs:   # the request finished decoding (or failed): restore the rows, SGLang frees its pages
        for layer, kind, slots, old in saved.get(r.room, []):
            side.view(layer, kind)[slots] = old
        for li, conv, temporal in states.get(r.room, []):
            side.mamba.mamba_cache.conv[0][li, r.mamba_at] = conv
            side.mamba.mamba_cache.temporal[li, r.mamba_at] = temporal
        if r.outcome == "success":
            _free(side, r)
    untouched = all(torch.equal(a, b) for a, b in zip(before, side.storages()))
    return {"reqs": [{"room": r.room, "outcome": r.outcome or "hung", "reason": r.reason, "other": r.other,
                      "bytes_ok": getattr(r, "bytes_ok", None), "meta_ok": getattr(r, "meta_ok", None),
                      "seen": sorted(r.seen), "drained": r.drained} for r in rs],
            "released": all(r.receiver.released for r in rs) and side.mgr.tracking == 0, "untouched": untouched,
            "leaks": side.leaks()}
