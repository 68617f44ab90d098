"""TP-group agreement: every rank of a tensor-parallel group holds only its heads of a
request, so the group may decode it only when every rank has its part.

Who calls what, and when: every rank of the group, once per scheduler step, with the same
requests in the same order, calls ``reduce_poll([r.poll() for r in requests], group)`` and
acts on the result (MIN: Success only when every rank has Success, Failed as soon as one rank
failed). It is a collective: a rank that does not call it blocks the others.

``group`` is one of
    a torch.distributed process group with a CPU backend (gloo; a mixed "cpu:gloo,cuda:nccl"
        group works too): ``dist.new_group(tp_ranks, backend="gloo")``. The states are a CPU
        tensor, so an NCCL-only group cannot carry them, and the default group (``None``) is
        the whole world, not the TP group: both are refused.
    a ``LocalGroup(n)``, for ranks that share one process (tests, small deployments): each of
        the ``n`` rank threads calls ``reduce_poll(states, group)``; or one thread that drives
        every rank calls ``group.reduce_all([states_of_rank_0, ...])``.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from ..errors import ConfigError
from .base import KVPoll

GROUP_HINT = ("pass the TP group's CPU process group, e.g. dist.new_group(tp_ranks, backend='gloo'), or a "
              "kvxfer.endpoint.LocalGroup(n) for ranks that share this process")


class LocalGroup:
    """An in-process group of ``n`` ranks with ``reduce_poll`` semantics (MIN of the states).

    Threads: each member calls ``reduce_poll(states, group)`` (or ``group.reduce(states)``); the
    call returns once all ``n`` have called, with the same result for all. A member that does not
    come within ``timeout`` seconds breaks the group (every waiting member raises RuntimeError).
    One thread for all ranks: ``group.reduce_all(per_rank_states)``, never blocks.
    """

    def __init__(self, n: int, timeout: float = 60.0):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"a LocalGroup needs n >= 1 members, got {n!r}")
        self.n, self.timeout = n, timeout
        self._lock = threading.Lock()
        self._states: list[list[int]] = []
        self._result: list[KVPoll] | ValueError = []
        self._barrier = threading.Barrier(n, action=self._combine, timeout=timeout)

    def reduce_all(self, per_rank: Sequence[Sequence[KVPoll | int]]) -> list[KVPoll]:
        """The MIN over ``n`` ranks' state lists, given all at once (one thread drives every rank)."""
        if len(per_rank) != self.n:
            raise ConfigError(f"LocalGroup of {self.n} ranks got the states of {len(per_rank)}")
        return _min_states([[int(s) for s in states] for states in per_rank])

    def reduce(self, states: Sequence[KVPoll | int]) -> list[KVPoll]:
        """One member's call (one thread per rank); blocks until all ``n`` members called."""
        with self._lock:
            self._states.append([int(s) for s in states])
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"LocalGroup: not all {self.n} members called reduce_poll within {self.timeout}s "
                               f"(a collective: every rank calls it once per step); the group is broken") from None
        result = self._result
        if isinstance(result, ValueError):
            raise ConfigError(str(result))
        return list(result)

    def _combine(self) -> None:   # the barrier's action: runs once per round, every member waiting
        with self._lock:
            states, self._states = self._states, []
        try:
            self._result = _min_states(states)
        except ValueError as e:
            self._result = e


def _min_states(per_rank: list[list[int]]) -> list[KVPoll]:
    lengths = {len(s) for s in per_rank}
    if len(lengths) > 1:
        raise ConfigError(f"reduce_poll: the ranks passed different numbers of states {sorted(lengths)}; every "
                         f"rank must pass the same requests in the same order")
    return [KVPoll(min(col)) for col in zip(*per_rank)] if per_rank and per_rank[0] else []


def check_group(group) -> None:
    """Refuse a group ``reduce_poll`` cannot use, saying what to pass (ValueError)."""
    if isinstance(group, LocalGroup):
        return
    if group is None:
        raise ConfigError(f"reduce_poll needs an explicit group (None is the whole torch.distributed world, not the "
                         f"TP group): {GROUP_HINT}")
    import torch.distributed as dist
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception as e:   # not a process group, or distributed not initialised
        raise ConfigError(f"reduce_poll: {group!r} is not a usable process group ({e}): {GROUP_HINT}") from None
    if "gloo" not in backend:
        raise ConfigError(f"reduce_poll: the group's backend is {backend!r}, which cannot all-reduce CPU tensors: "
                         f"{GROUP_HINT}")


def reduce_poll(states: Sequence[KVPoll | int], group) -> list[KVPoll]:
    """All-reduce the poll states of every rank of ``group`` with MIN: a request is Success only
    when every rank has its part, and Failed as soon as one rank failed. Collective: every rank
    calls it with the same requests in the same order, once per scheduler step. ``group``: a
    gloo process group or a ``LocalGroup`` (see the module docstring); anything else is refused."""
    check_group(group)
    if isinstance(group, LocalGroup):
        return group.reduce(states)
    if not states:
        return []
    import torch
    import torch.distributed as dist
    t = torch.tensor([int(s) for s in states], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(int(x)) for x in t.tolist()]


__all__ = ["reduce_poll", "LocalGroup", "check_group"]
