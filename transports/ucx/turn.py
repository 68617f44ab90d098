"""What the parts of one UCX transport share about its I/O thread, and how caller threads reach it.

* ``Turn``: the loop's turn (I/O thread only): ``acts`` counts what happened (the loop sleeps on
  the workers' event fds only after a turn of none), ``later`` holds calls that run after the
  turn's sends (arrivals: a woken reader would take the GIL first), ``stopped`` is set once
  ``Lifecycle.shutdown`` freed the endpoints.
* ``Leftovers``: UCX requests of ended work that still own a buffer (kept until they complete,
  then dropped at a turn: ``prune``), and the messages dropped unread by why (``junk``).
* ``Calls``: caller threads -> the I/O thread: ``call`` runs a function there and waits for its
  result (start-up, connect, disconnect, shutdown; tests and diagnostics too); ``post`` queues one
  without waiting.

The transport makes one of each and hands them to the parts that need them.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
from ucxx._lib.arr import Array

from kvxfer.errors import TransportError
from kvxfer.transport.kit import Call, CommandQueue, IOThread


class Turn:
    """The I/O loop's turn, shared by the parts that act in it (see the module docstring)."""

    def __init__(self) -> None:
        self.acts = 0
        self.later: list[Callable[[], object]] = []
        self.stopped = False

    def run_later(self) -> None:
        later, self.later = self.later, []
        for fn in later:
            fn()


class Leftovers:
    """UCX requests that still own buffers, and what was dropped unread (I/O thread).

    ``zombies``: ``(request, buffer or None)`` of ended work (an ended transfer's frames, flushes,
    posted receives, dropped messages): the buffer lives until the request completed. ``junk``:
    messages received into one byte and dropped, by why ("unknown peer", "too large", "flood",
    "front", "stray", "quiet", "frame"; ``Inbox.rejected`` names them)."""

    def __init__(self) -> None:
        self.zombies: list = []
        self.junk: collections.Counter = collections.Counter()

    def keep(self, req: Any, buf: Any = None) -> None:
        """Keep ``buf`` alive (and ``req`` referenced) until ``req`` completed."""
        self.zombies.append((req, buf))

    def drop(self, w, res, why: str) -> None:
        """Receive a probed message on worker ``w`` into one byte (UCX drops the rest) and count
        it under ``why``."""
        junk = np.empty(1, np.uint8)
        self.zombies.append((w.tag_recv_with_handle(Array(junk), res), junk))
        self.junk[why] += 1

    def prune(self) -> None:
        """Forget the requests that completed (each turn)."""
        self.zombies = [z for z in self.zombies if not z[0].completed]


class Calls:
    """Caller threads -> the I/O thread ``io`` (through ``commands``)."""

    def __init__(self, commands: CommandQueue, io: IOThread, turn: Turn):
        self.commands, self.io, self.turn = commands, io, turn

    def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(*args)`` on the I/O thread and wait for it (start-up and shutdown only, and tests
        and diagnostics). TransportError once the transport is closed or broken."""
        if self.turn.stopped or self.io.broken:
            raise TransportError(f"UCX transport is {'broken: ' + self.io.broken if self.io.broken else 'closed'}")
        fut: Future = Future()
        self.commands.put(Call(fn, args, fut))
        return fut.result(timeout=60)

    def post(self, fn: Callable[..., Any], *args) -> None:
        """Queue ``fn(*args)`` for the I/O thread without waiting (nothing when it stopped)."""
        if not self.turn.stopped and not self.io.broken:
            self.commands.put(Call(fn, args))
