"""The I/O loop of a UCX transport: one turn runs commands, progresses the workers, reads control
and data, advances transfers, keeps time, sends, and sleeps when nothing happened.

``UCXLoop`` is a mixin of ``UCXTransport``; ``_loop`` is the body of its ``kit.IOThread``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvxfer.transport.kit import CommandQueue, dispatch

from .state import Outgoing

log = logging.getLogger("kvxfer.transport.ucx")


class UCXLoop:
    """I/O-loop half of ``UCXTransport``."""

    # Declared for the type checker only (set in ``UCXTransport.__init__`` or by the other halves).
    heartbeat: float
    commands: CommandQueue
    _stop: bool
    _acts: int
    _sleeping: bool
    _next_tick: float
    _workers: list
    _later: list[Callable[[], object]]
    _out: dict
    _in: dict
    _ctrl_recvs: list
    _fence_flushing: list
    _park_order: Any
    _closing: list
    _start_out: Callable[[Outgoing], None]
    _shutdown: Callable[[str], None]
    _poll_ctrl: Callable[[], None]
    _poll_data: Callable[[], None]
    _flush_puts: Callable[[], None]
    _advance: Callable[[], None]
    _check_fence_flushes: Callable[[], None]
    _housekeeping: Callable[[float], None]
    _unpark_due: Callable[[float], None]
    _flush_outboxes: Callable[[], None]
    _retire_closing: Callable[[], None]
    _idle: Callable[[int], None]

    # ---- I/O thread: the loop -------------------------------------------------------------
    def _loop(self) -> None:
        """Run commands, progress, read control and data, check deadlines; sleep when idle."""
        while not self._stop:
            self._acts = 0
            self._run_commands()
            if self._stop:  # closed by a command: the endpoints are gone
                break
            for w in self._workers:
                w.progress()
            self._poll_ctrl()   # after the commands: before them, one run of 1 MiB took ~15% longer
            self._poll_data()
            self._flush_puts()
            self._advance()
            if self._fence_flushing:
                self._check_fence_flushes()
            now = time.monotonic()
            if now >= self._next_tick:
                self._housekeeping(now)
                self._next_tick = now + min(self.heartbeat, 0.1)
            if self._park_order:
                self._unpark_due(now)
            self._flush_outboxes()
            if self._later:
                self._run_later()
            if self._closing:
                self._retire_closing()
            if not self._acts:
                self._sleeping = True
                if self.commands.empty():
                    busy = self._out or self._in or self._ctrl_recvs or self._fence_flushing  # wake every ms
                    self._idle(1 if busy else max(1, int((self._next_tick - now) * 1000)))
                self._sleeping = False

    def _run_later(self) -> None:
        later, self._later = self._later, []
        for fn in later:
            fn()

    def _run_commands(self) -> None:
        cmds = self.commands.take()
        self._acts += len(cmds)
        dispatch(cmds, submit=lambda cmd: self._start_out(cmd.work), close=lambda: self._shutdown("transport closed"))

