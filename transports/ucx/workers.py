"""The UCX objects of one transport: contexts and workers, where this process runs, and the
I/O thread's sleep on the workers' event fds.

Three workers, each with its own context: the data worker (``worker``: tag, RMA, wake-up; every
peer's data endpoint but a far one), the front worker (``front_worker``: TCP only, tags only; what
``descriptor()`` names, see ``join``), and, made at the first peer on another host or network
namespace, the far worker (``far()``: ``settings.FAR_TLS``, no shared memory or cma). ``all``
lists those that exist: the loop progresses each and sleeps on their fds (``idle``).

``progress`` is the compiled helper's (``hotpath.progress``), bounded by ``PROGRESS_BUDGET``:
ucxx's own drains a worker until nothing moves, and one such call ran 5.6 s while a transfer's
puts faulted in the receiver's cold pages (no tick, no heartbeat: the receiver called the sender
silent). ucxx's progress also cancels the requests of failed endpoints; ``cancel_inflight`` does
that part, each tick, and ``settle`` both, where endpoints close.

Who calls what: ``UCXTransport`` makes ``Workers`` first (a UCX error there is mapped into the
error tree: ``ConfigError`` when UCX refuses a setting, else ``TransportError``); its
``CommandQueue`` wakes the I/O thread through ``wake`` (any thread). Everything else runs on the
I/O thread: ``Loop`` calls ``progress`` and ``idle``, setting ``sleeping`` around its last look at
the commands; ``Join`` makes endpoints (``endpoint``, ``far``) and HELLOs (``hello``); ``free``
(at the thread's exit) drops every UCX object.
"""
from __future__ import annotations

import os
import select
import threading
from typing import Any

from ucxx._lib import libucxx as ucx_api

from kvxfer.errors import ConfigError, TransportError

from . import bindings as ucp
from .frames import network_only
from .options import UCXOptions
from .protocol import Hello
from .settings import (
    FAR_TLS,
    MUST_MATCH,
    front_tls,
    host_identity,
    process_start,
    shared_memory_settings,
    tls_explicit,
    ucx_settings,
    with_tcp_defaults,
)
from .state import Peer, oldest_undrained

PROGRESS_BUDGET = 0.01   # seconds one turn's progress may take before the loop's other work runs
PROGRESS_NS = int(PROGRESS_BUDGET * 1e9)

_DATA_FEATURES = (ucx_api.Feature.TAG, ucx_api.Feature.RMA, ucx_api.Feature.WAKEUP)


def make_front(config: dict[str, str], tls: str | None) -> tuple[Any, Any]:
    """The front worker's context and worker (``tls``: the user's explicit UCX_TLS, or None)."""
    ctx = ucx_api.UCXContext({**config, "TLS": front_tls(tls)},
                             feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return ctx, worker


class Workers:
    """Contexts, workers and this process's identity (see the module docstring)."""

    def __init__(self, options: UCXOptions):
        env = os.environ
        config = with_tcp_defaults(ucx_settings(options.tls, options.ucx_config, env), env)
        self.config = config
        self.shm_settings = shared_memory_settings(config, env)   # ``MUST_MATCH`` as in effect here
        self.tls_explicit = tls_explicit(options.tls, options.ucx_config, env)
        # UCX_TLS in the environment counts too: UCX reads it where the config sets none
        self.network_only = network_only(config.get("TLS") or env.get("UCX_TLS", ""))
        self.host_id, self.pid = host_identity(), os.getpid()
        self.start_ticks = process_start(self.pid) or 0
        try:   # UCX's own errors end here, mapped into the tree
            self.ctx = ucx_api.UCXContext(config, feature_flags=_DATA_FEATURES)
            self.worker = ucx_api.UCXWorker(self.ctx)
            self.worker.init_blocking_progress_mode()  # so the idle I/O thread can sleep on the worker fd
            # The front worker: what descriptor() names; it takes one HELLO per peer (``join``).
            self.front_ctx, self.front_worker = make_front(config, config.get("TLS") if self.tls_explicit else None)
        except (ucx_api.UCXConfigError, ucx_api.UCXInvalidParamError) as e:
            raise ConfigError(f"UCX refused the settings {config} (ucx options tls and ucx_config, defaults, and "
                              f"UCX_* in the environment; UCX's log says which): {type(e).__name__}: {e}") from e
        except ucx_api.UCXError as e:
            raise TransportError(f"cannot start a UCX transport with the settings {config}: "
                                 f"{type(e).__name__}: {e}") from e
        self.whandle: Any = self.worker.handle
        self.address: bytes = self.worker.address.tobytes()
        self.front_address: bytes = self.front_worker.address.tobytes()
        # The FAR_TLS worker (no shared memory, no cma), made at the first peer on another host or
        # network namespace; the I/O thread progresses and sleeps on every worker in ``all``.
        self.far_ctx: Any = None
        self.far_worker: Any = None
        self.far_address = b""
        self.all: list = [self.worker, self.front_worker]
        self.handles: tuple[int, ...] = (self.whandle, self.front_worker.handle)   # ``all``'s, for ``progress``
        self.poller: Any = None   # select.poll over the workers' event fds (``idle``)
        self.polled = 0
        self.sleeping = False   # set by the loop around its last look at the commands (``wake``)
        self.flush_param = ucp.RequestParam()

    def wake(self) -> None:
        """Any thread, after queueing a command: signal the worker if the I/O thread sleeps (or is
        about to). The thread sets ``sleeping`` before its last look at the queue, so a command
        queued while the flag is unset is seen by that look, and one queued later sees the flag."""
        h = self.whandle
        if self.sleeping and h is not None:
            ucp.worker_signal(h)

    def far(self) -> Any:
        """The FAR_TLS worker, made on first use (its own context: its transports differ)."""
        if self.far_worker is None:
            self.far_ctx = ucx_api.UCXContext({**self.config, "TLS": FAR_TLS}, feature_flags=_DATA_FEATURES)
            w = ucx_api.UCXWorker(self.far_ctx)
            w.init_blocking_progress_mode()
            self.far_address, self.far_worker = w.address.tobytes(), w
            self.all.append(w)
            self.handles += (w.handle,)
        return self.far_worker

    @staticmethod
    def endpoint(worker: Any, addr: bytes, err: bool) -> Any:
        """An endpoint of ``worker`` to the worker address ``addr`` (``err``: UCX error handling on)."""
        return worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(addr), err)

    def hello(self, p: Peer) -> Hello:
        """The HELLO we send ``p``: our data worker's address (the far one's for a far peer), where
        we run, our shared-memory settings, and what ``p`` holds of us (secret, epoch, token, tag),
        and the lowest epoch whose endpoint may still carry puts of ours (``Rehandshake.renew``)."""
        return Hello(self.far_address if p.far else self.address, p.secret, p.my_epoch, self.host_id, self.pid,
                     self.start_ticks, p.err, eager=True, token=p.token,
                     shm=tuple(self.shm_settings[k] for k in MUST_MATCH), ctag=p.tag_in,
                     drained=p.my_epoch if (older := oldest_undrained(p)) is None else older)

    def progress(self, busy: bool, budget_ns: int = PROGRESS_NS) -> int:
        """Progress every worker until a round moves nothing, for at most ``budget_ns`` (the loop's:
        ``PROGRESS_BUDGET``); how many events moved. ``busy``: something is in flight (its first
        round runs without the GIL too: a put into cold memory can take a while)."""
        return ucp.progress(self.handles, budget_ns, not busy)

    def idle(self, ms: int, lock: threading.Lock) -> None:
        """Sleep until a worker has an event (or a command signals the main one), at most ``ms``,
        with the loop's ``lock`` released (a caller may run its own turn meanwhile).
        ``poll``, not ``select``: a process with many fds gives workers numbers past 1024."""
        if all(w.arm() for w in self.all):   # False: events pending, do not sleep
            if self.poller is None or self.polled != len(self.all):   # the FAR_TLS worker joined
                self.poller, self.polled = select.poll(), len(self.all)
                for w in self.all:
                    self.poller.register(w.epoll_file_descriptor, select.POLLIN)
            lock.release()
            try:
                self.poller.poll(ms)
            finally:
                lock.acquire()

    def settle(self) -> None:
        """What ucxx's own progress does, each step bounded: progress, cancel the requests of failed
        or closed endpoints, progress again (their cancellations complete). Closing paths call it."""
        self.progress(True)
        self.cancel_inflight()
        self.progress(True)

    def cancel_inflight(self) -> None:
        """Cancel the requests ucxx scheduled for cancelling (those of an endpoint that failed or
        closed); they complete at a later progress. Each tick, and at shutdown."""
        for w in self.all:
            w.cancel_inflight_requests()

    def free(self) -> None:
        """Drop the workers and contexts (``IOThread.on_exit``, after the endpoints went), so their fds
        and shared memory go now, cycle or no cycle."""
        self.whandle = None
        self.all, self.handles, self.far_worker, self.far_ctx, self.poller = [], (), None, None, None
        self.front_worker = self.front_ctx = None
        self.worker = self.ctx = None
