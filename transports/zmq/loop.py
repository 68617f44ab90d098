"""The zmq transport's I/O loop: commands, receiving, pumping, and a tick for time.

Who calls what: ``ZMQTransport`` makes the ``Loop`` with the parts it drives and runs ``run`` as
its ``kit.IOThread`` body, with ``fail_all`` as the thread's ``on_crash`` and ``free`` as its
``on_exit``. Everything here runs on that thread.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import zmq

from kvxfer.errors import ConnectError
from kvxfer.transport.kit import CommandQueue, IOThread, PipeWaker, dispatch

from .devsync import WriteSync
from .frames import Framer
from .options import ZMQOptions
from .receiver import Receiver
from .sender import Sender
from .sockets import Sockets

_CMDS_PER_TURN = 64              # commands handled per loop turn, so a burst of submits never
                                 # keeps the loop from pumping, receiving and its silence checks
IDLE_MS = 1000                   # the longest a turn waits with nothing open: no transfer either way,
                                 # no connect waiting for its pong, no source held, no trim due (a
                                 # command or a message wakes it; issue 39: idle ranks woke 20 times
                                 # a second)


class Loop:
    """One turn: commands (``kit.dispatch``), ZAP and ended connections (``Sockets``), the ROUTER
    (``Receiver``), device copies done, each DEALER (``Sender``); a tick for deadlines, silence and
    heartbeats. ``io`` (set by the transport once its thread exists) says why it died, if it did."""

    def __init__(self, options: ZMQOptions, sockets: Sockets, sender: Sender, receiver: Receiver, framer: Framer,
                 sync: WriteSync, commands: CommandQueue, waker: PipeWaker):
        self.options, self.sockets, self.sender, self.receiver, self.framer = options, sockets, sender, receiver, framer
        self.sync, self.commands, self.waker = sync, commands, waker
        self.io: IOThread | None = None

    def run(self, ready: Future) -> None:
        """Bind, tell ``ready`` what peers are told (or why the bind failed), then loop until ``Close``."""
        try:
            self.sockets.bind()
        except (zmq.ZMQError, ValueError) as e:
            ready.set_exception(ConnectError(f"cannot bind {self.options.endpoint}: {e}"))
            return
        poller, router = self.sockets.poller, self.sockets.router
        poller.register(self.waker.fd, zmq.POLLIN)
        ready.set_result(self.sockets.advertised)
        next_tick, tick = 0.0, min(0.1, self.options.heartbeat_ivl / 2)
        while True:
            # device copies, frames zmq will free, or sources it will let go of: look again soon
            soon = self.sync.waiting or self.framer.starved or time.monotonic() < self.sender.release_soon
            self.framer.starved = False
            idle = not soon and not self.receiver.incoming and not self.sockets.trim_due() and self.sender.idle()
            events = dict(poller.poll(1 if soon else IDLE_MS if idle else 50))
            if self.waker.fd in events and not self._on_commands():
                break
            self.sockets.on_events(events)
            drained = router not in events or self.receiver.on_router()
            if self.sync.waiting:
                self.receiver.on_synced()
            self.sender.on_events(events)
            now = time.monotonic()
            if now < self.sender.release_soon:
                self.sender.reap()
            if now >= next_tick:
                self.sender.check(now)
                self.receiver.check(now, drained)
                self.sockets.tick(now)
                next_tick = now + tick
        self.fail_all("transport closed")

    def _on_commands(self) -> bool:
        """The commands queued so far (a bounded number per turn); False once a ``Close`` ran."""
        self.waker.clear()
        cmds = self.commands.take(_CMDS_PER_TURN)
        go_on = dispatch(cmds, submit=self.sender.start, connect=self.sender.connect, close=lambda: None)
        if go_on and len(cmds) == _CMDS_PER_TURN:   # more may be queued: come back after a turn of I/O
            self.waker.wake()
        return go_on

    def fail_all(self, why: str) -> None:
        """Every transfer this thread owned fails with ``why`` (close, or a crash)."""
        self.sender.fail_all(why)
        self.receiver.fail_all(why)
        self.commands.fail_all(why)   # commands that raced with close() or the crash

    def free(self) -> None:
        """After the loop (``IOThread.on_exit``): sockets and context, then the sources."""
        self.commands.fail_all((self.io.broken if self.io is not None else None) or "transport closed")
        self.sockets.close(self.sender.dealers())
        self.sender.free()
