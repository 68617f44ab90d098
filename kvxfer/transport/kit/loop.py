"""The I/O loop every network transport shares: typed commands from caller threads, their
dispatch on the I/O thread, the waker, and the thread itself (see ``kvxfer.transport.kit``)."""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import TransportError
from ..base import TransferHandle, peer_failed

log = logging.getLogger("kvxfer.transport")


# ------------------------------------------------------------------------------------
# Commands: caller threads -> I/O thread. One type each, read by name, never by index.
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """A transfer to start: ``work`` is the transport's own prepared form of the plan."""
    peer: str
    request_id: str
    work: Any
    handle: TransferHandle


@dataclass(frozen=True, slots=True)
class Connect:
    """Reach a peer; ``future`` gets the peer id (or the error)."""
    target: Any
    future: Future


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(*args)`` on the I/O thread; ``future`` (when given) gets its result or error."""
    fn: Callable[..., Any]
    args: tuple = ()
    future: Future | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """Stop the loop: fail what is open, free what the thread made."""


@dataclass(frozen=True, slots=True)
class Crash:
    """Fault hook for tests: the I/O thread raises ``error`` at its next turn, as a bug would."""
    error: BaseException


Command = Submit | Connect | Call | Close | Crash


class CommandQueue:
    """Commands for one I/O thread. ``put`` from any thread; ``take`` and ``fail_all`` on the
    I/O thread only. ``wake`` (given by the transport) interrupts the thread's wait."""

    def __init__(self, wake: Callable[[], None]):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = wake

    def put(self, cmd: Command) -> None:
        self._q.put(cmd)
        self._wake()

    def empty(self) -> bool:
        return self._q.empty()

    def take(self, limit: int = 1 << 30) -> list[Command]:
        """Up to ``limit`` commands, oldest first, without waiting."""
        out: list[Command] = []
        q = self._q
        while len(out) < limit and not q.empty():   # one taker (this thread): not empty, so get finds one
            out.append(q.get_nowait())
        return out

    def fail_all(self, why: str) -> None:
        """Every command still queued fails with ``why`` (after the loop ended)."""
        for cmd in self.take():
            fail_command(cmd, why)


def fail_command(cmd: Command, why: str) -> None:
    """A command the I/O thread will never run: its waiter learns why."""
    if isinstance(cmd, Submit):
        cmd.handle.finish(peer_failed(cmd.request_id, why), release=True)
    elif isinstance(cmd, (Connect, Call)) and cmd.future is not None and not cmd.future.done():
        cmd.future.set_exception(TransportError(why))


def dispatch(cmds: list[Command], *, submit: Callable[[Submit], None], close: Callable[[], None],
             connect: Callable[[Connect], None] | None = None) -> bool:
    """Run ``cmds`` on the I/O thread, in order, with the semantics the command types document.

    ``Submit``: ``submit(cmd)``. ``Connect``: ``connect(cmd)`` (a transport with no ``connect``
    handler fails the future). ``Call``: ``fn(*args)``; its future gets the result or the
    exception, and without a future an exception is logged: a ``Call`` never ends the thread.
    ``Crash``: raises its error (the fault hook: the thread dies as of a bug). ``Close``:
    ``close()``, then every command after it fails ("transport closed"). Returns False when a
    ``Close`` ran (the loop ends), else True. Exceptions of ``submit``, ``connect`` and ``close``
    are the transport's own bugs: they propagate to ``IOThread``, which fails everything.
    """
    for k, cmd in enumerate(cmds):
        if isinstance(cmd, Submit):
            submit(cmd)
        elif isinstance(cmd, Call):
            try:
                res = cmd.fn(*cmd.args)
            except Exception as e:
                if cmd.future is None:
                    log.exception("a command on the I/O thread failed")
                elif not cmd.future.done():
                    cmd.future.set_exception(e)
            else:
                if cmd.future is not None and not cmd.future.done():
                    cmd.future.set_result(res)
        elif isinstance(cmd, Connect):
            if connect is None:
                fail_command(cmd, "this transport connects no other way")
            else:
                connect(cmd)
        elif isinstance(cmd, Crash):
            raise cmd.error
        elif isinstance(cmd, Close):
            close()
            for rest in cmds[k + 1:]:
                fail_command(rest, "transport closed")
            return False
    return True


class PipeWaker:
    """A self-pipe an I/O thread polls next to its sockets: ``wake`` from any thread, ``clear`` on
    the I/O thread once woken, before it looks at what it was woken for. ``close`` after the
    thread ended. One byte per wake-up, not per call: each write hands the GIL to the woken
    thread, so a burst of ``wake`` calls costs one hand-over."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._signaled = False

    def wake(self) -> None:
        if self._signaled:   # a byte is on its way, or ``clear`` runs and the thread looks after it
            return
        self._signaled = True
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):  # full: the thread is awake already; closed: it ended
            pass

    def clear(self) -> None:
        # Drain first, then let callers write again: the other order can eat the byte of a wake
        # that saw the flag down, and leave the flag up with the pipe empty (no wake-up ever after).
        # A read that returns less than asked emptied the pipe: one system call, as a rule.
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except (BlockingIOError, OSError):
            pass
        self._signaled = False

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


# Copies on an I/O thread go one frame or message at a time; an OpenMP team of torch's would stall
# on its barrier whenever a busy core descheduled a member. With OpenMP the thread count is per
# thread: each I/O thread sets its own to 1 (the caller's threads keep theirs).
_OMP_PER_THREAD = "parallel backend: OpenMP" in torch.__config__.parallel_info()


class IOThread:
    """The one thread of a transport that owns its network state.

    ``body()`` is the transport's loop: it returns when a ``Close`` command ended it. An
    exception that escapes ``body`` is a bug (every message is validated and refused inside the
    loop): it is logged, ``broken`` says why (``error`` is the exception), and ``on_crash(reason)``
    (still on this thread) fails every transfer the thread owned. ``on_exit()`` then frees what the
    thread made, in both cases. Callers check ``broken`` before they enqueue work.
    """

    def __init__(self, name: str, body: Callable[[], None], *, on_crash: Callable[[str], None],
                 on_exit: Callable[[], None]):
        self.broken: str | None = None
        self.error: BaseException | None = None
        self._body, self._on_crash, self._on_exit = body, on_crash, on_exit
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _main(self) -> None:
        if _OMP_PER_THREAD:
            torch.set_num_threads(1)
        try:
            self._body()
        except BaseException as e:  # a bug: say so, and fail everything below instead of hanging
            self.error = e
            self.broken = f"I/O thread died: {type(e).__name__}: {e}"
            log.exception("%s: I/O thread died; the transport is broken", self.thread.name)
            try:
                self._on_crash(self.broken)
            except Exception:
                log.exception("%s: failing the open transfers after a crash", self.thread.name)
        finally:
            try:
                self._on_exit()
            except Exception:
                log.exception("%s: cleaning up", self.thread.name)
