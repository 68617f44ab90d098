"""The TP group of the offload managers: agreement by MIN all-reduce, broadcasts, and a group
that stays broken once a collective failed (a rank died or stalled)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import LayoutError, PeerError

T = TypeVar("T")


def group_min(values: Sequence[int], group, timeout_s: float) -> list[int]:
    """Element-wise MIN of ``values`` over ``group`` (gloo); raises RuntimeError on a dead or
    stalled peer within ``timeout_s``."""
    t = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    return t.tolist()


def check_cpu_group(group, who: str) -> None:
    """Refuse a process group whose collectives cannot take CPU tensors (NCCL): agreement and
    offload all-reduce small CPU tensors. ``None`` (a single rank) passes."""
    if group is None:
        return
    try:
        backend = str(dist.get_backend(group))
    except Exception as e:   # not a process group at all
        raise LayoutError(f"{who}: group {group!r} is not a torch.distributed process group ({e}): pass "
                          f"group=torch.distributed.new_group(tp_ranks, backend='gloo')") from None
    if "gloo" not in backend.lower():
        raise LayoutError(f"{who}: the TP group's backend is {backend!r}, which cannot reduce CPU tensors: pass "
                          f"a CPU-capable group, group=torch.distributed.new_group(tp_ranks, backend='gloo')")


class TPGroup:
    """Collectives of one manager over its TP group (``group`` None: a single rank). ``broken``
    says why the group is unusable; once set, every collective raises ``PeerError``."""

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        self.broken: str | None = None

    def min(self, values: Sequence[int], what: str) -> list[int]:
        """(collective) Element-wise MIN of ``values`` over the group."""
        return self.collective(lambda: group_min(values, self.group, self.timeout_s), what)

    def bcast(self, t: torch.Tensor, src: int, what: str) -> None:
        """(collective) ``t`` from group rank ``src`` to every rank, in place."""
        self.collective(lambda: dist.broadcast(t, group=self.group, group_src=src, async_op=True).wait(
            timeout=timedelta(seconds=self.timeout_s)), what)

    def collective(self, fn: Callable[[], T], what: str) -> T:
        if self.broken:
            raise PeerError(f"the TP group is broken ({self.broken}); no device slots were released")
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError on a dead peer and on its timeout
            self.broken = f"{what} failed: {type(e).__name__}: {e}"
            raise PeerError(f"offload {what} over the TP group failed ({e}); no device slots were "
                            f"released") from e


__all__ = ["group_min", "check_cpu_group", "TPGroup"]
