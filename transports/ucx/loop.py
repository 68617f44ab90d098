"""The I/O loop of a UCX transport: one turn runs commands, progresses the workers, reads control
and data, advances transfers, keeps time, sends, and sleeps when nothing happened.

Who calls what: ``UCXTransport`` makes the ``Loop`` with the parts it drives and runs ``run`` as
the body of its ``kit.IOThread``, ``free`` as the thread's ``on_exit``. Everything here runs on
that thread, or on a caller's thread holding ``lock`` (``caller_turn``). ``tick`` (a few times a
second; once a second while ``quiet``) fails transfers past their deadline, pings peers, ends
those silent past ``peer_timeout``, looks at what fenced peers hold (``Fencing``) and, once a
second, caps TCP's retransmit backoff on new UCX connections (``rto``); the turn of a tick also
sends the lazy control messages (FENCE, FENCED) that no batch took along (``Outbox``).

A caller's turn: the I/O thread holds ``lock`` through its turns and lets it go only while it
sleeps. ``submit``, ``expect`` and ``forget`` try it: when they get it, and no command waits, the
caller starts its transfer (or sends its PREGRANT, its FENCEs) itself and, for a transfer, runs
``step`` (progress, control, data, flushes) until it is done or ``CALLER_BUDGET`` passed, as the
I/O thread would; then sends the turn's control messages and lets the lock go (waking the thread
for what it left). One thread at a time still owns every part, so nothing about fencing changes;
what goes is two thread hops a transfer (the command to the I/O thread, the handle back), each a
wake-up on a loaded 2-core machine. Commands, ``tick``, arrivals (``Turn.later``: the receiver's
callbacks) and closing stay on the I/O thread. Without the lock (the thread is busy), the call
queues a command, as before. Not once a CUDA region is registered (``callers``): a step there
gathers staged frames on the calling thread's current stream and synchronizes it (an engine's
compute stream), and none of it ever ran on a GPU; the I/O thread does all of it, as before.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvxfer.transport.kit import CommandQueue, Crash, StagingPool, dispatch

from . import bindings as ucp
from .eager import EagerSends
from .fencing import Fencing
from .inbox import Inbox
from .landing import Landing
from .lifecycle import Lifecycle
from .options import UCXOptions
from .outbox import Outbox
from .peers import Peers
from .protocol import Ping
from .receiver import Receiver
from .rehandshake import Rehandshake
from .rto import RtoCap
from .sender import Sender
from .turn import Calls, Leftovers, Turn
from .workers import PROGRESS_NS, Workers

log = logging.getLogger("kvxfer.transport.ucx")
RTO_EVERY = 1.0   # seconds between looks for new UCX connections to cap (``rto``)
# Seconds between ticks of a transport with nothing a tick looks after (``Loop.quiet``: no peer,
# nothing in flight, held or landing). Issue 39: an idle UCX transport woke ~20 times a second, 1.7
# ms of CPU a second, more than the rest of its rank. A connect, a command or a worker event wakes
# the loop at once, and the next turn that is not quiet brings the tick back to its pace.
IDLE_TICK = 1.0
# Seconds after which a caller's turn starts no more steps (``caller_turn``), and the most one of
# its steps progresses: what is left goes on on the I/O thread. A submit on an engine's thread
# spends at most about this much moving bytes (one UCX call past it: a cma copy of one run).
CALLER_BUDGET = 0.002
_CALLER_NS = int(CALLER_BUDGET * 1e9)   # and its progress, each step (the loop's: ``workers.PROGRESS_BUDGET``)


class Loop:
    """The I/O thread's turn over the parts (see the module docstring)."""

    def __init__(self, options: UCXOptions, commands: CommandQueue, calls: Calls, turn: Turn, workers: Workers,
                 peers: Peers, outbox: Outbox, inbox: Inbox, sender: Sender, eager: EagerSends, receiver: Receiver,
                 landing: Landing, rehandshake: Rehandshake, fencing: Fencing, lifecycle: Lifecycle,
                 leftovers: Leftovers, rings: tuple[StagingPool, StagingPool]):
        self.options, self.commands, self.calls, self.turn, self.workers = options, commands, calls, turn, workers
        self.peers, self.outbox, self.inbox, self.sender, self.eager = peers, outbox, inbox, sender, eager
        self.receiver, self.landing, self.rehandshake, self.fencing = receiver, landing, rehandshake, fencing
        self.lifecycle, self.leftovers, self.rings = lifecycle, leftovers, rings
        self.next_tick = self.next_rto = 0.0
        self.rto = None if options.tcp_rto_max is None else RtoCap(options.tcp_rto_max)
        self.lock = threading.Lock()   # the I/O thread's, but while it sleeps (``caller_turn``)
        self.callers = True   # caller's turns allowed: no region in CUDA memory (``UCXTransport.register``)

    def run(self) -> None:
        """Run commands, progress, read control and data, check deadlines; sleep when idle."""
        turn, workers, sender, eager, lifecycle = self.turn, self.workers, self.sender, self.eager, self.lifecycle
        tick_every = min(self.options.heartbeat, 0.1)
        self.lock.acquire()   # kept once the loop ended (closed or crashed): no caller's turn after it
        while not turn.stopped:
            turn.acts = 0
            self._run_commands()
            if turn.stopped:  # closed by a command: the endpoints are gone
                break
            self.step()   # after the commands: progress before them took one run of 1 MiB ~15% longer
            now = time.monotonic()
            ticked = now >= self.next_tick
            if ticked:
                self.tick(now)
                self.next_tick = now + (IDLE_TICK if self.quiet() else tick_every)
            elif self.next_tick > now + tick_every and not self.quiet():   # dozed: back to the pace
                self.next_tick = now + tick_every
            if eager.park_order:
                sender.unpark_due(now)
            self.outbox.flush(lazy=ticked)   # lazy messages (FENCE, FENCED) at the tick, if nothing took them
            if turn.later:
                turn.run_later()
            if lifecycle.closing:
                lifecycle.retire_closing()
            if not turn.acts:
                workers.sleeping = True
                if self.commands.empty():   # every ms while something is in flight
                    workers.idle(1 if self._in_flight() else max(1, int((self.next_tick - now) * 1000)), self.lock)
                workers.sleeping = False

    def step(self, budget_ns: int = PROGRESS_NS) -> None:
        """Progress the workers (for at most ``budget_ns``: a caller's), read control and data,
        flush this turn's puts, advance transfers (a turn's middle: the I/O thread's, or a caller's)."""
        sender, eager = self.sender, self.eager
        self.workers.progress(self._in_flight(), budget_ns)
        self.inbox.poll()
        self.receiver.poll_data()
        sender.flush_puts()
        sender.advance()
        if eager.flushing:
            eager.check_flushes()

    def caller_turn(self, start: Callable[[], object], more: Callable[[], bool] | None = None) -> bool:
        """A caller's thread, while the I/O thread sleeps with no command queued (see the module
        docstring): ``start()``, then (given ``more``) ``step`` once and again while ``more()``,
        until ``CALLER_BUDGET`` passed; send the turn's control messages. False (nothing done):
        the I/O thread is busy, or a command waits (it goes first): queue a command instead."""
        if not self.callers or not self.lock.acquire(blocking=False):
            return False
        try:
            if self.turn.stopped or not self.commands.empty():
                return False
            start()
            until = time.monotonic() + CALLER_BUDGET
            while more is not None:
                self.step(_CALLER_NS)
                if self.eager.park_order:
                    self.sender.unpark_due(time.monotonic())
                if not more() or time.monotonic() > until:
                    break
            self.outbox.flush()
        except BaseException as e:   # a bug: the I/O thread dies of it, as of one of its own
            self.commands.put(Crash(e))
        finally:
            left = bool(self.turn.later) or self._in_flight()
            self.lock.release()
            if left:   # arrivals to deliver, transfers to advance: the I/O thread's
                self.workers.wake()
        return True

    def quiet(self) -> bool:
        """Nothing for a tick to look after (the loop dozes, ``IDLE_TICK``): no peer (so no ping, no
        silence, no lazy message), no transfer either way, no source held, no memory held for a
        fence or a landing (quarantined), no UCX request still owning a buffer, nothing queued for
        later or closing."""
        return not (self.peers.by_id or self.peers.failed or self._in_flight() or self.sender.holding
                    or self.landing.busy() or self.fencing.pregrants.fences or self.leftovers.zombies
                    or self.turn.later or self.lifecycle.closing or self.eager.park_order)

    def _in_flight(self) -> bool:
        return bool(self.sender.outgoing or self.receiver.incoming or self.inbox.recvs or self.eager.flushing)

    def _run_commands(self) -> None:
        cmds = self.commands.take()
        self.turn.acts += len(cmds)
        dispatch(cmds, submit=lambda cmd: self.sender.start_out(cmd.work),
                 close=lambda: self.lifecycle.shutdown("transport closed"))

    def tick(self, now: float) -> None:
        """Deadlines, heartbeats and fencing, a few times a second."""
        ucp.log_cma_failures()
        self.workers.cancel_inflight()   # what ucxx's own progress would cancel (``Workers.progress``)
        fencing, options = self.fencing, self.options
        fencing.check_failed(now)
        self.sender.settle_held()
        self.sender.check_deadlines(now)
        self.receiver.check_deadlines(now)
        # peers that memory here waits for: their death is looked for every tick, silent or not
        # (a killed sender on this kernel is proven dead by its pid a tick later, not after peer_timeout)
        waited = self.landing.waited()
        for p in list(self.peers.values()):
            if p.rehello is not None:
                self.rehandshake.check(p)
            if p.old:
                self.rehandshake.check_old(p)
            if not p.gone and p.clock.silent(now, options.peer_timeout):
                fencing.peer_gone(p, f"peer silent for {p.clock.silent_for(now):.1f}s (dead or stalled)")
            if p.gone or p.fenced or p.id in waited:
                fencing.fence_check(p, now)
            # Ping only once the last message left: sends to a dead peer may never complete.
            if now >= p.next_ping and (p.last_send is None or p.last_send.completed) and not p.closing \
                    and not p.joining:   # joining: its front worker takes our HELLO only
                p.next_ping = now + options.heartbeat
                self.outbox.send(p, Ping())
        if options.quarantine_timeout is not None:
            fencing.expire_quarantine(now)
        fencing.drop_closed_peers(now)
        if self.rto is not None and now >= self.next_rto:
            self.next_rto = now + RTO_EVERY
            self.cap_rto()

    def cap_rto(self) -> None:
        """Cap TCP's retransmit backoff on the UCX connections made since the last look
        (``rto``), while any peer is reached over TCP. Never fails the thread: a look that
        raises turns the cap off, logged."""
        w, peers, rto = self.workers, list(self.peers.values()), self.rto
        if rto is None or not (w.network_only or any(p.far or p.err for p in peers)):   # err: a far sender
            return
        try:
            rto.apply((w.address, w.far_address, w.front_address), [a for p in peers for a in (p.addr, p.front_addr)])
        except Exception:
            log.exception("UCX transport: capping TCP's retransmit backoff failed; not trying again")
            self.rto = None

    def free(self) -> None:
        """Drop every UCX object (``IOThread.on_exit``): endpoints, requests, then the worker and
        context themselves, so their fds and shared memory go now, cycle or no cycle; then the
        receive ring."""
        self.commands.fail_all(self.calls.io.broken or "transport closed")
        self.peers.clear()
        self.sender.clear()
        self.receiver.clear()
        self.leftovers.zombies = []
        self.landing.clear()
        self.fencing.pregrants.clear()
        self.lifecycle.closing = []
        self.outbox.sends = []
        self.inbox.clear()
        send_ring, recv_ring = self.rings
        send_ring.clear()
        self.workers.free()
        recv_ring.clear()
