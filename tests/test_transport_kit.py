"""The shared transport kit: run helpers against plain loops, bounds without overflow, staging
reuse, the command queue's drain, command dispatch (a ``Call``'s future gets its result or error,
on every transport), the waker, the I/O thread's crash path, the fixed counter keys, and a
handle's completion: one winner whatever the threads."""
from __future__ import annotations

import sys
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import TransportError
from kvxfer.grant import GrantTable, Reason
from kvxfer.transport.base import TransferHandle, TransferStatus
from kvxfer.transport.kit import (
    Call,
    Close,
    CommandQueue,
    Connect,
    Crash,
    IOThread,
    PeerClock,
    PipeWaker,
    StagingPool,
    Submit,
    dispatch,
    merge_in_stream,
    runs_inside,
    runs_inside_few,
    split_long_runs,
)

I64 = st.integers(-(1 << 63), (1 << 63) - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20), st.integers(1, 4096))
def test_split_long_runs_matches_a_loop(lengths, frame):
    n = np.asarray(lengths, np.int64)
    off = np.cumsum(n) * 3 + 7
    reg = np.arange(len(n), dtype=np.int64)
    got_n, (got_off,), (got_reg,) = split_long_runs(frame, n, (off,), (reg,))
    want = [(r, o + k, min(frame, c - k)) for r, o, c in zip(reg.tolist(), off.tolist(), n.tolist())
            for k in (range(0, c, frame) if c else [0])]
    assert list(zip(got_reg.tolist(), got_off.tolist(), got_n.tolist())) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 4), I64, I64), max_size=6))
def test_runs_inside_never_overflows_and_both_forms_agree(runs):
    sizes = [100, 0, 1 << 40]
    want = all(0 <= r < 3 and o >= 0 and c >= 0 and o + c <= sizes[r] for r, o, c in runs)
    assert runs_inside_few(runs, sizes) == want
    arr = [np.asarray(c, np.int64) for c in zip(*runs)] if runs else [np.zeros(0, np.int64)] * 3
    assert runs_inside(*arr, np.asarray(sizes, np.int64)) == want


def test_merge_in_stream_joins_only_runs_that_continue_each_other():
    reg = np.array([0, 0, 0, 1, 1])
    off = np.array([0, 10, 30, 40, 50])
    n = np.array([10, 10, 5, 10, 5])
    r, o, c = merge_in_stream(reg, off, n)
    assert list(zip(r.tolist(), o.tolist(), c.tolist())) == [(0, 0, 20), (0, 30, 5), (1, 40, 15)]


class _Busy:
    done = False


def test_staging_reuses_a_block_only_once_the_network_let_go():
    pool = StagingPool(keep=2)
    a = pool.get(1000)
    busy = _Busy()
    pool.put(a, until=busy)
    b = pool.get(1000)
    assert b.data_ptr() != a.data_ptr()          # still being sent: not handed out
    busy.done = True
    assert pool.get(1000).data_ptr() == a.data_ptr()
    pool.put(torch.empty(10_000, dtype=torch.uint8))
    assert pool.get(1000).numel() == 1000 and len(pool._spare) == 1   # 10x too big: kept, not used


def test_command_queue_fails_what_is_left():
    woken = []
    q = CommandQueue(lambda: woken.append(1))
    h = TransferHandle("r", 10, 5.0, holds_source=True)
    fut: Future = Future()
    q.put(Submit("p", "r", None, h))
    q.put(Connect("tcp://x", fut))
    q.put(Call(print, (), None))
    assert len(woken) == 3
    q.fail_all("transport closed")
    assert h.poll() == TransferStatus.FAILED and h.source_released and "transport closed" in str(h.error)
    assert isinstance(fut.exception(), TransportError)
    assert q.empty()


def test_a_handle_has_one_finisher_whatever_the_threads():
    """The I/O thread finishing a transfer DONE and a caller's poll() timing it out at once:
    exactly one finish() completes it, and what it said stays. With a check-then-set on a
    threading.Event, this failed 6 runs of 6 (a handle with two winners, its status overwritten)."""
    handles = [TransferHandle("r", 10, 5.0) for _ in range(5000)]
    wins: list[list[int]] = [[] for _ in handles]
    barrier = threading.Barrier(6)

    def finisher(i: int) -> None:   # every thread finishes every handle, all at once
        for h, won in zip(handles, wins):
            barrier.wait()
            if h.finish(None if i % 2 else RuntimeError(f"finisher {i}")):
                won.append(i)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # threads switch as often as they can
    try:
        threads = [threading.Thread(target=finisher, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    for h, won in zip(handles, wins):
        assert len(won) == 1
        done = won[0] % 2 == 1
        assert h.poll() == (TransferStatus.DONE if done else TransferStatus.FAILED)
        assert h.wait(0) == done and (h.error is None) == done


def test_a_handle_wakes_every_waiter_and_times_out_alone():
    h = TransferHandle("r", 10, 5.0)
    assert not h.wait(0.01) and h.poll() == TransferStatus.PENDING   # not done: the wait ends at its timeout
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(h.wait(5.0))) for _ in range(3)]
    for t in waiters:
        t.start()
    h.finish()
    for t in waiters:
        t.join(5.0)
    assert woke == [True, True, True] and h.wait(0) and h.wait(0)
    late = TransferHandle("r", 10, 0.05)
    assert not late.wait() and late.poll() == TransferStatus.FAILED   # its deadline failed it
    assert "deadline" in str(late.error)


def test_io_thread_crash_reports_and_cleans_up():
    seen = []

    def body():
        raise KeyError("bug")
    t = IOThread("test-io", body, on_crash=seen.append, on_exit=lambda: seen.append("exit"))
    t.start()
    t.join(5)
    assert not t.alive and t.broken and "KeyError" in t.broken
    assert seen == [t.broken, "exit"]


def test_io_thread_clean_exit_is_not_broken():
    done = threading.Event()
    t = IOThread("test-io", lambda: None, on_crash=lambda why: None, on_exit=done.set)
    t.start()
    t.join(5)
    assert done.is_set() and t.broken is None


def test_peer_clock():
    c = PeerClock(now=10.0)
    assert not c.silent(14.0, 5.0) and c.silent(15.5, 5.0) and c.silent_for(12.0) == 2.0
    c.touch(20.0)
    assert not c.silent(24.0, 5.0)


def test_rejection_counters_have_fixed_keys():
    g = GrantTable([100])
    for reason in ("outside grant: run 1", "malformed header: x", "you-choose-this: x", "\x00" * 50, ""):
        g.reject("r", reason)
    assert set(g.rejected) <= {r.value for r in Reason}
    assert g.rejected == {"outside grant": 1, "malformed header": 1, "other": 3}


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_counts_under_itself(reason):
    assert Reason.of(f"{reason.value}: details") is reason


def test_dispatch_keeps_the_documented_command_semantics():
    ran: list = []
    good, bad, after = Future(), Future(), Future()
    handle = TransferHandle("r", 0, 10)
    late = TransferHandle("late", 0, 10)

    def boom():
        raise ValueError("a bug in a call")
    cmds = [Submit("p", "r", "work", handle), Call(lambda x: x * 2, (21,), good), Call(boom, (), bad),
            Call(boom), Connect("somewhere", Future()), Close(), Call(ran.append, (1,), after),
            Submit("p", "late", None, late)]
    go_on = dispatch(cmds, submit=lambda c: ran.append(c.request_id), close=lambda: ran.append("closed"))
    assert go_on is False and ran == ["r", "closed"], ran
    assert good.result(0) == 42 and isinstance(bad.exception(0), ValueError)
    assert isinstance(cmds[4].future.exception(0), TransportError)        # no connect handler here
    assert isinstance(after.exception(0), TransportError) and late.poll() == TransferStatus.FAILED
    with pytest.raises(RuntimeError, match="injected"):
        dispatch([Crash(RuntimeError("injected"))], submit=ran.append, close=ran.clear)


@pytest.mark.parametrize("name", ["zmq", "ucx"])
def test_a_call_that_raises_never_ends_a_transports_io_thread(name):
    """Before: zmq ran ``cmd.fn(*cmd.args)`` unguarded, so a raising ``Call`` killed its I/O thread."""
    from kvxfer.transport.registry import get_transport
    if name == "ucx":
        pytest.importorskip("ucxx")
    t = get_transport(name)
    try:
        fut: Future = Future()
        t.commands.put(Call(lambda: 1 / 0, (), fut))
        assert isinstance(fut.exception(10), ZeroDivisionError)
        again: Future = Future()
        t.commands.put(Call(lambda: "alive", (), again))
        assert again.result(10) == "alive" and t.broken is None
    finally:
        t.close()


def test_a_waker_writes_one_byte_per_wake_up():
    import os
    w = PipeWaker()
    try:
        for _ in range(1000):
            w.wake()
        assert len(os.read(w.fd, 4096)) == 1
        w.clear()
        w.wake()
        assert len(os.read(w.fd, 4096)) == 1, "after clear, the next wake writes again"
    finally:
        w.close()


def test_a_wake_that_races_with_clear_is_never_lost(monkeypatch):
    """zmq's loop looks at its commands only when the waker's fd is readable, so a ``wake`` that
    races with ``clear`` must either leave its byte in the pipe or leave the waker ready to write
    the next one. Here a caller wakes while ``clear`` drains the pipe. (Resetting the flag before
    draining lost it: the drain ate the racing byte, the flag stayed set, and every later ``wake``
    wrote nothing: the I/O thread never looked at its commands again.)"""
    import os
    import select
    import types

    import kvxfer.transport.kit.loop as loop_mod
    w = PipeWaker()
    raced: list = []

    def read(fd, n):
        if not raced:   # during this clear's drain, a caller on another thread wakes
            raced.append(1)
            w.wake()
        return os.read(fd, n)
    monkeypatch.setattr(loop_mod, "os", types.SimpleNamespace(read=read, write=os.write, close=os.close))
    try:
        w.wake()          # a command came; the I/O thread wakes and clears
        w.clear()
        assert raced
        w.wake()          # the next command
        assert select.select([w.fd], [], [], 0.5)[0], "a wake-up was lost: the I/O thread would never look again"
    finally:
        w.close()


def test_an_io_thread_copies_on_one_torch_thread_and_leaves_the_callers_alone():
    """Every transport's I/O thread (``IOThread``) runs torch's CPU copies on itself alone: an
    OpenMP team would stall on its barrier whenever a busy core descheduled a member. The
    count is per thread with OpenMP: the caller's stays as it was."""
    from kvxfer.transport.kit import IOThread
    openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    before, seen = torch.get_num_threads(), []
    t = IOThread("kvxfer-test-io", lambda: seen.append(torch.get_num_threads()), on_crash=lambda why: None,
                 on_exit=lambda: None)
    t.start()
    t.join(10)
    assert seen == [1 if openmp else before]
    assert torch.get_num_threads() == before
