"""What the demos share to run rank processes on one machine: the rendezvous store the
launcher holds, a gloo process group per prefill or decode group, the demos' generous
timeouts, starting the two groups and the bootstrap server (``start_ranks``), a decode rank's
wait for a batch (``wait_batch``), a prefill rank's end (``finish_prefill``), reading the
ranks' reports (``collect``) and the verdict (``verdict``). ``kvxfer demo`` (its own tiny
model, ``demo.py``) and ``kvxfer demo --model llama|qwen2`` (``hf.py``) both use it.

The reports a rank puts on the shared outbox (tuples, first item the kind):
``("ready", role, rank, ...)``, ``("result", room, tokens, ok, reason, ...)`` (decode rank 0),
``("bytes", n)``, ``("decode_done", rank, slots_all_free)``,
``("prefill_done", rank, [(room, reason) failed], slots_all_free)``, ``("error", who, text)``.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEMO_TIMEOUT = 600.0


def DEMO_TIMEOUTS():
    """Prefill may run ahead of decode by the whole request list, so phases get minutes."""
    from ..endpoint.base import Timeouts
    return Timeouts(bootstrap=300.0, waiting=300.0, transfer=60.0, lease=300.0)


def rendezvous():
    """The launcher's own torch store (a ``TCPStore`` server on a port the kernel picks): it
    listens from before the ranks start until ``stop_ranks``, so no other process can take its
    port in between (picking a free port and letting rank 0 bind it later could, and did)."""
    from datetime import timedelta

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=DEMO_TIMEOUT))


def init_group(port: int, group: str, rank: int, world: int):
    """Join ``group`` ("prefill" or "decode", a prefix in the launcher's store on ``port``) as
    ``rank`` of ``world``: the default gloo process group of a rank process."""
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=DEMO_TIMEOUT))
    dist.init_process_group("gloo", store=dist.PrefixStore(group, store), rank=rank, world_size=world)


@dataclass
class Ranks:
    """The processes of one demo run: the bootstrap server, every rank process (prefill ranks
    first), one inbox per prefill rank (``"stop"`` ends it), the outbox they all report to and
    the rendezvous store the groups meet in."""
    server: Any          # BootstrapServer
    procs: list
    inboxes: list
    outbox: Any          # multiprocessing Queue
    store: Any           # torch TCPStore (the server side)


def start_ranks(cfg, prefill_rank: Callable, decode_rank: Callable) -> Ranks:
    """Start the bootstrap server, ``cfg.prefill_tp`` processes running
    ``prefill_rank(cfg, rank, port, bootstrap_url, inbox, outbox)`` and ``cfg.decode_tp``
    running ``decode_rank(cfg, rank, port, bootstrap_url, outbox)`` (spawned: each imports
    torch afresh; ``port`` is the launcher's rendezvous store, for ``init_group``)."""
    import multiprocessing as mp

    from ..control.bootstrap import BootstrapConfig, BootstrapServer
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    server = BootstrapServer(BootstrapConfig(expect=cfg.prefill_tp)).start()
    store = rendezvous()
    inboxes = [ctx.Queue() for _ in range(cfg.prefill_tp)]
    procs = [ctx.Process(target=prefill_rank, args=(cfg, r, store.port, server.url, inboxes[r], outbox), daemon=True)
             for r in range(cfg.prefill_tp)]
    procs += [ctx.Process(target=decode_rank, args=(cfg, r, store.port, server.url, outbox), daemon=True)
              for r in range(cfg.decode_tp)]
    for p in procs:
        p.start()
    return Ranks(server, procs, inboxes, outbox, store)


def collect(ranks: Ranks, cfg, on_report: Callable[[tuple], None]) -> tuple[dict[str, list], list[str]]:
    """Read the ranks' reports until every decode rank is done (or an error, a dead rank or
    ``DEMO_TIMEOUT``), tell the prefill ranks to stop and wait for their last reports. The
    "ready", "result" and "bytes" reports go to ``on_report``. Returns ``done`` ("prefill":
    the prefill_done reports, "decode": each decode rank's slots_all_free) and the errors.
    Leaves the processes running: ``stop_ranks`` ends them."""
    errors: list[str] = []
    done: dict[str, list] = {"prefill": [], "decode": []}
    deadline = time.monotonic() + DEMO_TIMEOUT

    def take(msg: tuple) -> None:
        if msg[0] == "decode_done":
            done["decode"].append(msg[2])
        elif msg[0] == "prefill_done":   # prefill may finish first: decode's "done" frees its KV early
            done["prefill"].append(msg)
        elif msg[0] == "error":
            errors.append(f"{msg[1]}: {msg[2]}")
        else:
            on_report(msg)
    while len(done["decode"]) < cfg.decode_tp and not errors and time.monotonic() < deadline:
        try:
            take(ranks.outbox.get(timeout=1.0))
        except queue.Empty:
            if not all(p.is_alive() for p in ranks.procs) and ranks.outbox.empty():
                errors.append("a rank process died: " + ", ".join(str(p.exitcode) for p in ranks.procs))
    for q in ranks.inboxes:
        q.put("stop")
    while not errors and len(done["prefill"]) < cfg.prefill_tp and time.monotonic() < deadline:
        try:
            take(ranks.outbox.get(timeout=5.0))
        except queue.Empty:
            errors.append("prefill ranks did not finish")
    return done, errors


def stop_ranks(ranks: Ranks) -> None:
    """Join every rank process (killing one still alive after 10 s), stop the server and close
    the rendezvous store."""
    for p in ranks.procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ranks.server.stop()
    ranks.store = None


def verdict(cfg, results: dict, reference: dict, done: dict[str, list], errors: list[str]) -> dict:
    """The checks of a run: ``results`` maps room -> (tokens, ok, reason, ...) as decode rank 0
    reported it, ``reference`` room -> the tokens it must have generated."""
    mismatched = [room for room, (toks, ok, *_) in results.items() if not ok or toks != reference.get(room)]
    missing = cfg.requests - len(results)
    prefill_failed = [f for m in done["prefill"] for f in m[2]]
    leaks = not all(done["decode"]) or not all(m[3] for m in done["prefill"])
    return {"requests": cfg.requests, "verified": len(results) - len(mismatched), "mismatched": mismatched,
            "missing": missing, "prefill_failed": prefill_failed, "slot_leak": leaks,
            "ok": not (mismatched or missing or errors or prefill_failed or leaks)}


def wait_batch(recv: list, group) -> tuple[list, list[float]]:
    """A demo decode rank's wait for one batch of receivers: poll them until each ended, every
    rank of ``group`` agreeing (``reduce_poll``); past ``DEMO_TIMEOUT`` abort them. Returns the
    final states and when (``perf_counter``) each one ended."""
    from ..endpoint import KVPoll, reduce_poll
    states = [KVPoll.Bootstrapping] * len(recv)
    ended: list[float] = [0.0] * len(recv)
    deadline = time.monotonic() + DEMO_TIMEOUT
    while any(st not in (KVPoll.Success, KVPoll.Failed) for st in states):
        if time.monotonic() > deadline:
            for r in recv:
                r.abort("demo deadline")
        states = reduce_poll([r.poll() for r in recv], group)
        now = time.perf_counter()
        for k, st in enumerate(states):
            if st in (KVPoll.Success, KVPoll.Failed) and not ended[k]:
                ended[k] = now
        time.sleep(0.002)
    return states, ended


def finish_prefill(senders, lock, freed: list, alloc, rank: int, outbox, inbox) -> None:
    """A demo prefill rank's end: wait until every sender's KV may be reused (``kv_releasable``),
    give the slots back, report the failures and whether every page came back, then stay up
    until decode is done."""
    from ..endpoint.base import KVPoll
    deadline = time.monotonic() + DEMO_TIMEOUT
    while not all(s.kv_releasable for s in senders) and time.monotonic() < deadline:
        time.sleep(0.01)
    with lock:
        for slots in freed:
            alloc.free(slots)
    failed = [(s.room, s.reason) for s in senders if s.poll() != KVPoll.Success]
    outbox.put(("prefill_done", rank, failed, alloc.free_pages == alloc.capacity))
    inbox.get(timeout=DEMO_TIMEOUT)    # stay up until decode is done
