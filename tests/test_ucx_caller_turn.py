"""A caller's turn (``transports/ucx/loop.py``): while a UCX transport's I/O thread sleeps, ``submit``,
``expect`` and ``forget`` do its work on the caller's thread, holding the loop's lock; while it is busy
(the lock held), or a command waits, they queue a command as before.

In-process pairs check the bytes that arrived and on which thread each part ran; a bare ``Loop``
with stand-in parts checks each rule of ``caller_turn`` alone.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

try:
    import ucxx  # noqa: F401
    _NO_UCX = ""
except Exception as e:  # ImportError, or a missing libucx underneath
    _NO_UCX = f"import ucxx failed: {type(e).__name__}: {e}"
pytestmark = pytest.mark.skipif(bool(_NO_UCX), reason=_NO_UCX or "ucxx imports")

import torch  # noqa: E402
from ucx_pair import CANARY, connected_pair  # noqa: E402
from waiting import arrivals_of, until  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.base import TransferStatus  # noqa: E402
from kvxfer.transport.kit import Call, CommandQueue, Crash  # noqa: E402

REGION = 4 << 20
RUN = 1 << 20


@pytest.fixture
def pair():
    """(receiver, sender, peer id, source, destination), connected in-process; eager writes (the default)."""
    yield from connected_pair(REGION, 7, heartbeat=0.5)


def threads_of(obj, name: str) -> list[str]:
    """Wrap method ``name`` of ``obj``: the names of the threads that called it, in order."""
    seen: list[str] = []
    orig = getattr(obj, name)

    def wrapped(*args):
        seen.append(threading.current_thread().name)
        return orig(*args)
    setattr(obj, name, wrapped)
    return seen


def one_run(k: int) -> tuple[TransferPlan, ByteRanges, int]:
    """The plan of one 1 MiB run (the same place on both sides), its grant, and where it is."""
    lo = k % (REGION // RUN) * RUN
    z, off, n = np.zeros(1, np.int64), np.array([lo], np.int64), np.array([RUN], np.int64)
    return TransferPlan((RunGroup(z, z, z, z, off, off, n, False),)), ByteRanges(z, off, n), lo


def move(rx, tx, pid, src, dst, rid: str, k: int, arrived: list) -> None:
    """One eager transfer of 1 MiB, its PREGRANT waited for; the bytes checked, the rest canary.
    ``arrived``: (thread, arrival) of each arrival, from ``rx``'s callback."""
    plan, ranges, lo = one_run(k)
    dst.fill_(CANARY)
    rx.expect(rid, ranges)
    assert until(lambda: rid in tx.peers[pid].pregranted, 10.0), "no PREGRANT reached the sender"
    time.sleep(0.05)   # both I/O threads back asleep
    assert tx.submit(pid, rid, plan, timeout=10).result() is None
    assert until(lambda: any(a.request_id == rid for _, a in arrived), 10.0)
    assert [a.ok for _, a in arrived if a.request_id == rid] == [True]
    assert torch.equal(dst[lo:lo + RUN], src[lo:lo + RUN])
    assert bool((dst[:lo] == CANARY).all()) and bool((dst[lo + RUN:] == CANARY).all())
    rx.forget(rid)
    assert until(lambda: not rx.writes_pending(rid), 10.0)


@pytest.mark.slow
def test_an_idle_transport_works_on_the_callers_thread(pair):
    """The I/O threads sleep: the sender's transfer starts (and is put) on the caller's thread,
    the receiver's PREGRANT and FENCE leave from its caller's; arrivals stay on its I/O thread."""
    rx, tx, pid, src, dst = pair
    starts, pregrants = threads_of(tx.sender, "start_out"), threads_of(rx.pregrants, "pregrant")
    drops = threads_of(rx.receiver, "drop_request")
    arrived: list = []
    rx.set_arrival_callback(lambda a: arrived.append((threading.current_thread().name, a)))
    me = threading.current_thread().name
    for k in range(6):
        move(rx, tx, pid, src, dst, f"c{k}", k, arrived)
    # a ping or heartbeat may have the I/O thread awake at one call; not at all six
    assert me in starts and me in pregrants and me in drops, (starts, pregrants, drops)
    assert {name for name, _ in arrived} == {rx.io.thread.name}   # callbacks: never a caller's thread


@pytest.mark.slow
def test_a_busy_io_thread_gets_a_command(pair):
    """The lock is held (as by the I/O thread in a turn): nothing runs on the caller's thread,
    the commands wait for the I/O thread, and the transfer completes there, bytes checked."""
    rx, tx, pid, src, dst = pair
    starts, pregrants = threads_of(tx.sender, "start_out"), threads_of(rx.pregrants, "pregrant")
    me = threading.current_thread().name
    plan, ranges, lo = one_run(1)
    assert rx.loop.lock.acquire(timeout=10)
    try:
        rx.expect("b0", ranges)   # queued: returns with the lock still ours
    finally:
        rx.loop.lock.release()
    assert until(lambda: "b0" in tx.peers[pid].pregranted, 10.0)
    assert tx.loop.lock.acquire(timeout=10)
    try:
        h = tx.submit(pid, "b0", plan, timeout=10)
        assert h.poll() == TransferStatus.PENDING   # queued, not started: the I/O thread cannot take it yet
    finally:
        tx.loop.lock.release()
    assert h.result() is None
    assert [a.ok for a in arrivals_of(rx, "b0")] == [True]
    assert torch.equal(dst[lo:lo + RUN], src[lo:lo + RUN])
    assert starts == [tx.io.thread.name] and pregrants == [rx.io.thread.name] and me not in starts + pregrants


# ---- caller_turn's rules, on a bare Loop ------------------------------------------------------------

loop_budgets: list[int] = []   # each step's progress budget, of the latest bare loop


def bare_loop(in_flight: bool = False):
    """A ``Loop`` with stand-in parts that count what ``step`` and ``caller_turn`` call."""
    from kvxfer_transports.ucx.loop import Loop
    from kvxfer_transports.ucx.turn import Turn
    calls: list[str] = []
    loop_budgets.clear()
    loop = Loop.__new__(Loop)
    loop.lock, loop.turn, loop.callers = threading.Lock(), Turn(), True
    loop.commands = CommandQueue(lambda: calls.append("signal"))
    loop.workers = SimpleNamespace(progress=lambda busy, budget_ns: (calls.append("progress"),
                                                                    loop_budgets.append(budget_ns)),
                                   wake=lambda: calls.append("wake"))
    loop.inbox = SimpleNamespace(poll=lambda: calls.append("inbox"), recvs=[])
    loop.receiver = SimpleNamespace(poll_data=lambda: calls.append("data"), incoming={})
    loop.sender = SimpleNamespace(flush_puts=lambda: calls.append("flush"), advance=lambda: calls.append("advance"),
                                  outgoing={1: "o"} if in_flight else {}, unpark_due=lambda now: None)
    loop.eager = SimpleNamespace(flushing=[], park_order=[])
    loop.outbox = SimpleNamespace(flush=lambda: calls.append("send"))
    return loop, calls


def test_a_caller_turn_runs_start_steps_and_sends():
    """start, a step and one more while ``more()``, the sends; each step's progress within the
    caller's budget, not the loop's (a submit on an engine's thread)."""
    from kvxfer_transports.ucx.loop import CALLER_BUDGET
    loop, calls = bare_loop()
    steps = iter([True, False])
    assert loop.caller_turn(lambda: calls.append("start"), lambda: next(steps))
    assert calls == ["start", *["progress", "inbox", "data", "flush", "advance"] * 2, "send"]
    assert loop_budgets == [int(CALLER_BUDGET * 1e9)] * 2
    assert loop.lock.acquire(blocking=False)   # let go


def test_no_caller_turn_while_the_lock_is_held():
    loop, calls = bare_loop()
    loop.lock.acquire()
    assert not loop.caller_turn(lambda: calls.append("start"))
    assert calls == []


def test_a_queued_command_goes_first():
    """Commands keep their order: with one waiting, the caller queues too."""
    loop, calls = bare_loop()
    loop.commands.put(Call(lambda: None, ()))
    calls.clear()
    assert not loop.caller_turn(lambda: calls.append("start"))
    assert calls == [] and loop.lock.acquire(blocking=False)


def test_no_caller_turn_with_cuda_regions():
    """A transport with a CUDA region (``callers`` off at ``register``) queues every command."""
    loop, calls = bare_loop()
    loop.callers = False
    assert not loop.caller_turn(lambda: calls.append("start"))
    assert calls == [] and loop.lock.acquire(blocking=False)


def test_no_caller_turn_once_stopped():
    loop, calls = bare_loop()
    loop.turn.stopped = True
    assert not loop.caller_turn(lambda: calls.append("start"))
    assert calls == []


def test_a_bug_in_a_callers_turn_ends_the_io_thread():
    """An exception there is the transport's bug: the I/O thread raises it (``Crash``), the lock
    is let go, and the caller's call returns (its handle fails with the transport)."""
    loop, calls = bare_loop()

    def bug():
        raise RuntimeError("a bug")
    assert loop.caller_turn(bug)
    (cmd,) = loop.commands.take()
    assert isinstance(cmd, Crash) and str(cmd.error) == "a bug"
    assert loop.lock.acquire(blocking=False)


def test_work_left_in_flight_wakes_the_io_thread():
    loop, calls = bare_loop(in_flight=True)
    assert loop.caller_turn(lambda: None)
    assert calls[-2:] == ["send", "wake"]
    loop, calls = bare_loop()
    loop.turn.later.append(lambda: None)   # an arrival to deliver: the I/O thread's
    assert loop.caller_turn(lambda: None)
    assert calls[-2:] == ["send", "wake"]
    loop, calls = bare_loop()
    assert loop.caller_turn(lambda: None)
    assert calls == ["send"]


def test_steps_end_at_the_budget():
    """``more()`` never false: the steps end once ``CALLER_BUDGET`` passed (the I/O thread goes on)."""
    loop, calls = bare_loop()
    assert loop.caller_turn(lambda: None, lambda: True)
    assert calls.count("progress") >= 1 and calls[-1] == "send"


def test_a_control_send_on_a_closed_endpoint_fails_without_a_call():
    """``send_tagged`` on endpoint 0 (ucxx closed it) is a request already failed, never a call
    into UCX on NULL."""
    from kvxfer_transports.ucx import bindings as ucp
    req = ucp.send_tagged(0, b"batch", 1)
    assert req.completed and req.poll() == ucp.UCS_ERR_NOT_CONNECTED
