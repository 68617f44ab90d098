"""The machinery every network transport shares, so a transport file holds only what is its own.

Who uses what, and when
-----------------------
Caller threads (``submit``, ``connect``, ``close``, ``forget`` of a transport):
    ``CommandQueue.put(cmd)``   hand one typed command (``Submit``, ``Connect``, ``Call``,
                                ``Close``, ``Crash``) to the transport's I/O thread and wake it
                                (``PipeWaker``: one byte per wake-up, however many calls).
The I/O thread (one per transport; it alone touches sockets, workers and in-flight state):
    ``dispatch(cmds, ...)``     runs the commands it took, each as its type says (a ``Call``'s
                                future gets its result or error; nothing a ``Call`` raises ends
                                the thread); False once a ``Close`` ran.
    ``IOThread``                runs the transport's loop; an exception that escapes the loop is
                                a bug: it is logged, the transport is marked ``broken`` and the
                                transport's ``on_crash`` fails every transfer the thread owned.
    ``CommandQueue.take(n)``    the commands queued so far (at most ``n`` per loop turn).
    ``CommandQueue.fail_all``   on the way out: every command still queued fails (no waiter hangs).
    ``StagingPool``             a fixed ring of staging frames for packed runs, allocated up front
                                (pinned for device regions), never growing: exhausted, the I/O
                                path waits; a frame handed to the network is reused only once the
                                network let go of it (``until.done``). Counted in kvxfer.metrics.
    ``split_long_runs``         runs cut into pieces of at most one frame (vectorized).
    ``merge_in_stream``         runs of one byte stream that continue each other, as one run.
    ``runs_inside``             bounds of runs against region sizes, before a byte is read or sent.
    ``PeerClock``               when a peer was last heard from; silence past a timeout fails its
                                transfers (a dead peer is silent; a slow one may come back).
    ``peer_reason``             what a refusal tells the peer (grant refusals read alike: no oracle).
Files: ``loop`` (commands, dispatch, waker, thread), ``staging`` (the ring), ``runs`` (run
helpers, refusals, peer clock); this package exports them all.
Tests (and ``kvxfer_transports.faulty``): ``CommandQueue.put(Crash(error))`` makes the I/O thread
raise ``error`` at its next turn, as a bug would.
"""
from __future__ import annotations

from .loop import (
    Call,
    Close,
    Command,
    CommandQueue,
    Connect,
    Crash,
    IOThread,
    PipeWaker,
    Submit,
    dispatch,
    fail_command,
)
from .runs import (
    OFF_BITS,
    OFF_MASK,
    REFUSED,
    PeerClock,
    keyable,
    merge_in_stream,
    peer_reason,
    region_key,
    region_unkey,
    runs_inside,
    runs_inside_few,
    split_long_runs,
)
from .staging import StagingExhausted, StagingPool

__all__ = ["Call", "Close", "Command", "CommandQueue", "Connect", "Crash", "IOThread", "PipeWaker", "Submit",
           "dispatch", "fail_command", "OFF_BITS", "OFF_MASK", "REFUSED", "PeerClock", "keyable", "merge_in_stream",
           "peer_reason", "region_key", "region_unkey", "runs_inside", "runs_inside_few", "split_long_runs",
           "StagingExhausted", "StagingPool"]
