"""What the demos share to start rank processes on one machine: a free port, a gloo process
group per prefill or decode group, and the demos' generous timeouts. ``kvxfer demo`` (its own
tiny model, ``demo.py``) and ``kvxfer demo --model llama|qwen2`` (``hf.py``) both use it."""
from __future__ import annotations

import socket
import time

DEMO_TIMEOUT = 600.0


def DEMO_TIMEOUTS():
    """Prefill may run ahead of decode by the whole request list, so phases get minutes."""
    from ..endpoint.base import Timeouts
    return Timeouts(bootstrap=300.0, waiting=300.0, transfer=60.0, lease=300.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(port: int, rank: int, world: int):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


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
