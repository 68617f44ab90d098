"""Start-up, disconnect and shutdown of a UCX transport, on its I/O thread (connect: ``join``).

``UCXLifecycle`` is a mixin of ``UCXTransport``: ``_do_register`` maps the regions for RMA,
``_do_disconnect`` and ``_retire_closing`` end one peer, ``_shutdown`` fails what is open, says BYE and frees every UCX
resource, ``_free`` drops the objects themselves.

Disconnect (one peer; the transport lives on). Its transfers fail at once, with a reason, and
the peer hears BYE. Its resources go only once the fencing rules allow: sources of ours that a
put of it may still read stay held until their flush completes (then ABORT; to a receiver that
pregranted us, FENCED-all once none is left: its eager writes of ours are over); memory of ours it
may still write (it was a sender to us) stays held until its DONE, ABORT, re-handshake or proven
death. Then our endpoint to it is flushed (bounded by ``peer_timeout``, so the ABORTs and BYE
leave), closed, its rkeys destroyed and the ``Peer`` dropped; only its channel secret and epoch
are kept (a bounded table), so a later connect() to the same transport re-handshakes with a
higher epoch, which the peer may still be waiting for.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api

from kvxfer.errors import PeerError, TransportError
from kvxfer.grant import GrantTable
from kvxfer.transport.kit import CommandQueue, IOThread, StagingPool

from . import bindings as ucp
from .protocol import Abort, Bye, Fail
from .state import Outgoing, Peer

if TYPE_CHECKING:
    from .protocol import Message

log = logging.getLogger("kvxfer.transport.ucx")


def close_endpoint(p: Peer) -> None:
    """Close our endpoint to ``p`` (I/O thread), unless UCX reported it failed: ucxx closed that
    one itself, and closing it again crashes the process (SIGSEGV in ucxx 0.52, measured: see
    ``tests/ucx_fence_peer.py``); dropping it is safe. Its state changes only inside a worker
    progress call, which this thread makes, so nothing changes between the check and the close.
    Error handling on (``Peer.err``): ucxx closes in force mode (no flush); off: a flush-close
    that does not wait for a dead peer here, as ucxx runs it."""
    if p.err and not p.ep.alive:
        p.eph = 0
        return
    p.ep.close()
    p.eph = 0   # as ucxx's handle reads once closed


def failure_of(ep) -> str:
    """What UCX says an endpoint's failure was (I/O thread): "reset" when the connection was
    reset or closed by the other side (its process is gone, or its transport closed the
    connection), else the error's name (``UCXEndpointTimeoutError``: a partition, the peer may
    be alive), or "" when UCX reports none."""
    try:
        ep.raise_on_error()
    except ucx_api.UCXConnectionResetError:
        return "reset"
    except Exception as e:
        return type(e).__name__ or "error"
    return ""


class UCXLifecycle:
    """Start-up and shutdown half of ``UCXTransport`` (I/O thread)."""

    # Declared for the type checker only: set in ``UCXTransport.__init__`` or defined by the
    # other halves. Annotations, no values, so nothing here shadows the real attributes.
    id: str
    grants: GrantTable
    peer_timeout: float
    max_peers: int
    commands: CommandQueue
    io: IOThread
    _ctx: Any                          # ucx_api.UCXContext
    _worker: Any                       # ucx_api.UCXWorker
    _whandle: Any
    _address: bytes
    _config: dict[str, str]
    _tls_explicit: bool
    _far_ctx: Any
    _far_worker: Any
    _far_address: bytes
    _front_ctx: Any
    _front_worker: Any
    _shm_settings: dict[str, str]
    _by_tag: dict[int, Peer]
    _workers: list
    _poller: Any                       # select.poll over the workers' event fds (``_idle``)
    _polled: int
    _host_id: str
    _pid: int
    _start_ticks: int
    _closed: bool
    _stop: bool
    _regions: list[torch.Tensor]
    _base: np.ndarray
    _base_list: list[int]
    _region_sizes: np.ndarray
    _is_host: np.ndarray
    _host_list: list[bool]
    _host_views: list
    _all_host: bool
    _cuda_devices: set[torch.device]
    _memh: list[int | None]
    _params: list[ucp.RequestParam]
    _put_params: np.ndarray
    _put_params_far: np.ndarray
    _rkeys_packed: list[bytes]
    _peers: dict[str, Peer]
    _out: dict
    _fenced_all: Callable[[], None]   # UCXEager
    _say_fenced_all: Callable[[Peer], bool]
    _call: Callable[..., Any]         # UCXTransport
    _run_later: Callable[[], None]
    _in: dict
    _by_dtag: dict
    _unflushed: dict
    _flushing: list
    _holding: list[Outgoing]
    _ctrl_sends: list
    _ctrl_recvs: list
    _zombies: list
    _draining: list
    _open_rids: Any
    _staging: StagingPool
    _flush_param: ucp.RequestParam
    _far_put_param: ucp.RequestParam
    _closing: list[Peer]
    _retired: collections.OrderedDict[str, tuple[bytes, int]]
    _landing: dict
    _failed_eps: collections.deque
    _rehello: Callable[[Peer], None]
    _bind_tag: Callable[[Peer], None]           # UCXJoin
    _drop_peer: Callable[[Peer], None]
    _landed: Callable[[str], None]
    _send: Callable[[Peer, Message], None]
    _flush_outboxes: Callable[[], None]
    _fail_out: Callable[..., None]            # UCXSender._fail_out(o, err, tell=True)
    _fail_in: Callable[..., None]             # UCXReceiver._fail_in(i, reason, tell=True, puts_left=True)
    _puts_settled: Callable[[Outgoing], bool]
    _release_and_abort: Callable[[Outgoing], None]
    _reap_draining: Callable[[], None]

    def _do_register(self, regions: list[torch.Tensor]) -> None:
        if self._memh:
            raise TransportError("register() was already called on this UCX transport")
        cuda = [t.device for t in regions if t.is_cuda]
        if cuda:   # this thread makes every UCX call, CUDA copies of frames too: on the regions' device
            torch.cuda.set_device(cuda[0])
        for k, t in enumerate(regions):
            memh, buf, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
            if t.numel():
                want = ucp.memory_type_of(t.device)
                params = ucp.MemMapParams(ucp.MEMMAP_ADDR_LEN | ucp.MEMMAP_MEMORY_TYPE, t.data_ptr(), t.numel(),
                                          memory_type=want)
                st = ucp.mem_map(self._ctx.handle, ctypes.byref(params), ctypes.byref(memh))
                if st != 0:
                    self._unmap_all()
                    raise TransportError(f"ucp_mem_map of region {k} ({ucp.memory_type_name(want)} memory on "
                                         f"{t.device}, {t.numel()} bytes) failed: {ucp.why(st)}")
                why = ucp.registration_mismatch(k, t.device, want, ucp.registered_memory_type(memh.value))
                if why:
                    ucp.mem_unmap(self._ctx.handle, memh.value)
                    self._unmap_all()
                    raise TransportError(why)
                ucp.check(ucp.rkey_pack(self._ctx.handle, memh, ctypes.byref(buf), ctypes.byref(size)),
                          "ucp_rkey_pack")
                self._rkeys_packed.append(ctypes.string_at(buf, size.value))
                ucp.rkey_release(buf)
            else:
                self._rkeys_packed.append(b"")
            self._memh.append(memh.value)
            # One put parameter block per source region: its memh spares UCX a registration lookup;
            # MULTI_SEND: a transfer's puts are all in flight at once (bandwidth over latency), as NIXL asks.
            self._params.append(ucp.RequestParam(op_attr_mask=(ucp.OP_ATTR_MEMH if memh.value else 0) |
                                                 ucp.OP_ATTR_MULTI_SEND, memh=memh.value))
        self._regions = regions
        # post_puts' parameter block per source region: its own (near peers), or one without a memh
        # (far peers: another context, our handles are not its own)
        self._put_params = np.array([ctypes.addressof(m) for m in self._params], np.uint64)
        self._put_params_far = np.full(len(regions), ctypes.addressof(self._far_put_param), np.uint64)
        self._base_list = [t.data_ptr() for t in regions]
        self._base = np.asarray(self._base_list, np.int64)
        self._region_sizes = np.asarray([t.numel() for t in regions], np.int64)
        self._cuda_devices = {t.device for t in regions if t.is_cuda}
        self._is_host = np.array([not t.is_cuda for t in regions], bool)
        self._host_list, self._all_host = self._is_host.tolist(), bool(self._is_host.all())
        # numpy views of host regions (None: CUDA): a few packed runs are read and written through them
        self._host_views = [None if t.is_cuda else t.numpy() for t in regions]
        self.grants.region_sizes = [t.numel() for t in regions]

    def _unmap_all(self) -> None:
        """Undo a register() that failed part way: nothing stays mapped or half-listed."""
        for m in self._memh:
            if m:
                ucp.mem_unmap(self._ctx.handle, m)
        self._memh, self._params, self._rkeys_packed = [], [], []

    def _do_disconnect(self, peer_id: str) -> None:
        """Fail ``peer_id``'s transfers, say BYE, and free it once the fencing rules allow
        (``_retire_closing``). Unknown or already disconnecting: nothing to do."""
        p = self._peers.get(peer_id)
        if p is None or p.closing:
            return
        if p.joining:   # never welcomed: nothing of it here, nothing of ours there
            self._drop_peer(p)
            close_endpoint(p)
            return
        p.closing, p.closing_since = True, time.monotonic()
        why = "the peer was disconnected"
        for o in [o for o in self._out.values() if o.peer is p]:
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"))   # ABORT once flushed
        for o in p.waiting:
            o.handle.finish(PeerError(f"request {o.handle.request_id}: {why}"), release=True)
        p.waiting = []
        for i in [i for i in self._in.values() if i.peer is p]:
            self._fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"))
        self._send(p, Bye())
        self._closing.append(p)
        self._retire_closing()

    def _retire_closing(self) -> None:
        """Free disconnected peers that hold nothing any more: flush the endpoint (bounded), close
        it, destroy the rkeys, keep only the channel secret and epoch."""
        now, left = time.monotonic(), []
        for p in self._closing:
            if self._peers.get(p.id) is not p:   # released meanwhile (proven dead)
                continue
            if any(o.peer is p for o in (*self._out.values(), *self._holding, *self._flushing)) \
                    or p.id in self._unflushed or p.rehello is not None or p.outbox \
                    or any(k[0] == p.id for k in (*self._in, *self._landing)) \
                    or any(e[0] == p.id for e in self._draining):
                left.append(p)   # a put may still read our source, or one of its may still land here
                continue
            if p.close_flush is None and self._say_fenced_all(p):   # eager: nothing of ours is on its way
                left.append(p)   # the close flush next turn, once the FENCED left with the outbox
                continue
            if p.close_flush is None:   # nothing of ours reads a source: flush so ABORTs and BYE leave
                p.close_flush = ucp.Flush(ucp.ep_flush(p.eph, ctypes.byref(self._flush_param)))
            if p.close_flush.poll() is None and now - p.closing_since < self.peer_timeout:
                left.append(p)
                continue
            if p.close_flush.ptr is not None:
                self._zombies.append((p.close_flush, None))
            self._drop_peer(p)
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys, p.close_flush = ucp.EMPTY_TABLE, None
            close_endpoint(p)   # flushed, or the peer is silent: no put of ours is in flight to it
            self._retired[p.id] = (p.secret, p.my_epoch)
            self._retired.move_to_end(p.id)
            while len(self._retired) > self.max_peers:
                self._retired.popitem(last=False)
        self._closing = left

    def _idle(self, ms: int) -> None:
        """Sleep until a worker has an event (or a command signals the main one), at most ``ms``.
        ``poll``, not ``select``: a process with many fds gives workers numbers past 1024."""
        if all(w.arm() for w in self._workers):   # False: events pending, do not sleep
            if self._poller is None or self._polled != len(self._workers):   # the FAR_TLS worker joined
                self._poller, self._polled = select.poll(), len(self._workers)
                for w in self._workers:
                    self._poller.register(w.epoll_file_descriptor, select.POLLIN)
            self._poller.poll(ms)

    def memory_types(self) -> list[str]:
        """What UCX registered each region as ("host", "cuda", ...; "" for an empty region), as
        ``ucp_mem_query`` says (register() already refused a region of another type than asked)."""
        return self._call(lambda: [ucp.memory_type_name(ucp.registered_memory_type(m)) if m else ""
                                   for m in self._memh])

    def _progress(self) -> None:
        for w in self._workers:
            w.progress()

    def _crashed(self, why: str) -> None:
        """The loop died of a bug (``IOThread.on_crash``): every transfer it owned fails."""
        self._closed = True
        self._shutdown(why)

    def _shutdown(self, why: str) -> None:
        """Fail what is open, say BYE, free UCX state (I/O thread; close, or after a crash)."""
        for o in list(self._out.values()):
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"), tell=False)
        for i in list(self._in.values()):
            self._fail_in(i, f"{why} before the transfer finished", tell=False)
        self.commands.fail_all(why)
        # Give held transfers a bounded chance to flush, so their ABORTs (sent after the flush)
        # release the receiver's memory; a peer that cannot take it keeps it fenced.
        end = time.monotonic() + min(1.0, self.peer_timeout)
        while self._holding and time.monotonic() < end:
            self._progress()
            for o in self._holding:
                if self._puts_settled(o):
                    self._release_and_abort(o)
            self._holding = [o for o in self._holding if not o.handle.source_released]
        for p in self._peers.values():
            p.outbox = [m for m in p.outbox if isinstance(m, (Abort, Fail))]
        self._fenced_all()   # eager: nothing of ours in flight any more, if so
        for p in self._peers.values():
            if not p.joining:   # a joining one's endpoint goes to its front worker, which takes HELLOs only
                self._send(p, Bye())
        self._flush_outboxes()
        self._run_later()   # the arrivals of what failed here
        end = time.monotonic() + 0.2  # let BYE leave; a dead peer never takes it
        while self._ctrl_sends and time.monotonic() < end:
            self._progress()
            self._ctrl_sends = [s for s in self._ctrl_sends if not s[0].completed]
        for w in self._workers:
            w.cancel_inflight_requests()
        for p in self._peers.values():
            ucp.destroy_rkeys(p.rkeys)
            p.rkeys = ucp.EMPTY_TABLE
        for m in self._memh:
            if m:
                ucp.mem_unmap(self._ctx.handle, m)
        self._memh, self._params, self._regions, self._host_views = [], [], [], []
        self._put_params = self._put_params_far = ucp.EMPTY_TABLE
        # Close endpoints now, without a flush: ucxx's destructor would flush-close them and
        # spin forever on a dead peer (error handling is off).
        for p in self._peers.values():
            close_endpoint(p)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            self._progress()
        self._reap_draining()   # cancelled receives: free their requests
        for o in self._holding:   # endpoints closed: no put of theirs is in flight any more
            o.handle.release_source()
        self._stop = True

    def _free(self) -> None:
        """Drop every UCX object (``IOThread.on_exit``): endpoints, requests, then the worker and
        context themselves, so their fds and shared memory go now, cycle or no cycle."""
        self.commands.fail_all(self.io.broken or "transport closed")
        self._peers, self._out, self._in, self._by_dtag, self._zombies, self._flushing = {}, {}, {}, {}, [], []
        self._holding, self._unflushed, self._draining, self._closing = [], {}, [], []
        self._open_rids.clear()   # nothing lands after close: the endpoints are closed
        self._ctrl_sends, self._ctrl_recvs = [], []
        self._staging.clear()
        self._whandle = None
        self._by_tag = {}
        self._workers, self._far_worker, self._far_ctx, self._poller = [], None, None, None
        self._front_worker = self._front_ctx = None
        self._worker = self._ctx = None
