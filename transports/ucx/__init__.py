"""UCX transport: one-sided put for runs, tagged iov frames for packed runs, tagged control.

Mechanism, by measurement (scripts/bench_transport.py, scripts/bench_ucx.py): runs are written
with ``ucp_put_nbx`` through the ``libucp`` bundled with ``ucxx`` (ctypes, on the worker and
endpoint handles ucxx creates): one call on the sender, nothing posted by the receiver. Runs
shorter than ``PUT_BELOW`` are packed instead: their bytes, back to back, travel as tagged
frames of ``frame_bytes``. In host memory a frame is a UCX iov on both sides
(``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx`` with ``ucp_dt_make_iov``): the sender sends from
the source runs and the receiver posts its receive into the granted destination runs, so
neither gathers nor scatters, and the receiver alone says where bytes land. CUDA memory gathers
into a staging block on the device, and the receiver scatters from one. UCX decides all this
itself (the plan's ``RunGroup.packed`` is the threshold of a copying transport). Control
messages are msgpack lists, batched per peer and loop turn into one tagged message.

One transfer (S sender, R receiver, each on its own I/O thread)::

    S -> R  ANNOUNCE  request id, deadline, every destination run (one int64 array; packed
                      runs that continue each other at R as one), and
                      the packed bytes inline when they are few (< INLINE_BELOW: no frames)
    R       GrantTable.check + region bounds; refused: FAIL to S, Arrival(ok=False);
            inline bytes land now; nothing else to come (no puts, no frames): ACK at once
    R -> S  GO        a data tag for the packed frames (host: R has posted their receives)
    S       puts (big runs cut in frames), packed frames, one ep flush per peer and turn
    S -> R  DONE      after the flush, so every put is visible at R
    R       every frame received (host: in place; CUDA: re-checks the grant and scatters
            the staging block), Arrival(ok=True)
    R -> S  ACK       only now is the handle DONE

A receiver that ends a transfer early cancels its posted receives; one that matched a frame
already still lands, so ``writes_pending`` holds the request's memory until all are done.

Transfers that meet in a turn of the I/O thread share one control message per peer, one
flush and one wake-up. Plans of a few runs are handled with Python ints (a numpy call costs
more than such a loop); bigger ones stay vectorized.

Trust model: R checks every announced run before it answers GO, so an honest sender (even one
with a wrong plan) never writes outside a grant. A *malicious* peer holding the rkeys of our
``descriptor()`` can put anywhere inside the regions given to ``register()`` (nothing else)
without announcing: give descriptors only to peers trusted with the whole pool, as with NIXL
or any RDMA transport. S issues no put after the deadline, but issued puts cannot be recalled.

Liveness: endpoints have error handling OFF (on, it excludes shared memory: ~10x slower), so
a dead peer raises nothing. Each side pings its peers every ``heartbeat`` s; a peer silent for
``peer_timeout`` s fails its transfers; every transfer also fails at its deadline, on both
sides. Without error handling UCX's single-copy shared-memory transport (cma) abort()s the
process when it touches a dead peer: the UCS log hook below turns that into a failed call.

Threads: one I/O thread per transport owns the worker and makes every UCX call. It loops
while something happens and sleeps on the worker's event fd otherwise (busy polling was
3-40x slower on this 2-core machine whenever other processes ran). ``register``, ``connect``
and ``close`` hand work to it and wait; ``submit`` plans and gathers in the caller's thread,
enqueues, and never waits on the network; it signals the worker only when the I/O thread
sleeps (a signal is a syscall and, for a busy thread, a wasted turn).
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import ucxx  # noqa: F401  (loads the bundled libucx / libucxx)
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.copy import byte_view, copy_runs, gather_runs
from kvxfer.errors import (
    ConnectError,
    PeerError,
    PlanError,
    RejectedWrite,
    TransferTimeout,
    TransportError,
)
from kvxfer.grant import GrantTable
from kvxfer.plan import FEW_RUNS, Runs, TransferPlan, merge_runs
from kvxfer.transport.base import DEFAULT_TIMEOUT, Arrival, TransferHandle, Transport

log = logging.getLogger("kvxfer.transport.ucx")

# ---- libucp through ctypes (ucxx exposes no RMA); structs as in UCX 1.21's ucp.h ---------
_ucp, _ucs = ctypes.CDLL("libucp.so.0"), ctypes.CDLL("libucs.so.0")  # the copies ucxx loaded
_vp, _sz, _u64, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
_status_t = ctypes.c_int8  # ucs_status_t is a packed (one-byte) enum


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t
    _fields_ = [("field_mask", _u64), ("address", _vp), ("length", _sz), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", _int), ("exported_memh_buffer", _vp)]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", _vp), ("cb", _vp),
                ("datatype", _u64), ("user_data", _vp), ("reply_buffer", _vp), ("memory_type", _int),
                ("recv_info", _vp), ("memh", _vp)]


def _fn(lib, name, res, *args):
    f = getattr(lib, name)
    f.restype, f.argtypes = res, list(args)
    return f


_P = ctypes.POINTER
_mem_map = _fn(_ucp, "ucp_mem_map", _status_t, _vp, _P(_MemMapParams), _P(_vp))
_mem_unmap = _fn(_ucp, "ucp_mem_unmap", _status_t, _vp, _vp)
_rkey_pack = _fn(_ucp, "ucp_rkey_pack", _status_t, _vp, _vp, _P(_vp), _P(_sz))
_rkey_release = _fn(_ucp, "ucp_rkey_buffer_release", None, _vp)
_rkey_unpack = _fn(_ucp, "ucp_ep_rkey_unpack", _status_t, _vp, ctypes.c_char_p, _P(_vp))
_rkey_destroy = _fn(_ucp, "ucp_rkey_destroy", None, _vp)
_put = _fn(_ucp, "ucp_put_nbx", _vp, _vp, _vp, _sz, _u64, _vp, _P(_RequestParam))
_put_nbi = _fn(_ucp, "ucp_put_nbi", _status_t, _vp, _vp, _sz, _u64, _vp)
_flush = _fn(_ucp, "ucp_ep_flush_nbx", _vp, _vp, _P(_RequestParam))
_req_status = _fn(_ucp, "ucp_request_check_status", _status_t, _vp)
_req_free = _fn(_ucp, "ucp_request_free", None, _vp)
_req_cancel = _fn(_ucp, "ucp_request_cancel", None, _vp, _vp)
_tag_send = _fn(_ucp, "ucp_tag_send_nbx", _vp, _vp, _vp, _sz, _u64, _P(_RequestParam))
_tag_recv = _fn(_ucp, "ucp_tag_recv_nbx", _vp, _vp, _vp, _sz, _u64, _u64, _P(_RequestParam))
_signal = _fn(_ucp, "ucp_worker_signal", _status_t, _vp)
_status_str = _fn(_ucs, "ucs_status_string", ctypes.c_char_p, _int)
_MEMMAP_ADDR_LEN, _OP_ATTR_MEMH, _INPROGRESS = 0b11, 1 << 8, 1
_OP_ATTR_DATATYPE, _OP_ATTR_RECV_INFO, _DT_IOV = 1 << 3, 1 << 7, 2   # ucp_dt_make_iov()
_TRUNCATED = -9   # UCS_ERR_MESSAGE_TRUNCATED: a frame longer than its posted receive


class _TagRecvInfo(ctypes.Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", _u64), ("length", _sz)]


_tag_recv_test = _fn(_ucp, "ucp_tag_recv_request_test", _status_t, _vp, _P(_TagRecvInfo))
_PTR_ERR_MIN = 2**64 - 100  # UCS_PTR_IS_ERR: status pointers -100..-1
_LOG_HANDLER_T = ctypes.CFUNCTYPE(_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p, _int, _vp,
                                  ctypes.c_char_p, _vp)


@_LOG_HANDLER_T
def _ucs_log_hook(file, line, function, level, comp, fmt, ap) -> int:
    """UCS log handler, called before UCX's default one (which abort()s on FATAL lines).

    cma logs a failed ``process_vm_writev/readv`` to a dead pid as FATAL when the endpoint has
    no error handler; the same call returns UCS_ERR_IO_ERROR when the line does not abort.
    """
    if level == 0 and file and file.rsplit(b"/", 1)[-1] == b"cma_ep.c":
        log.error("UCX shared-memory copy failed at cma_ep.c:%d (peer gone?): failing the operation "
                  "instead of aborting", line)
        return 0  # UCS_LOG_FUNC_RC_STOP
    return 1      # UCS_LOG_FUNC_RC_CONTINUE


_fn(_ucs, "ucs_log_push_handler", None, _LOG_HANDLER_T)(_ucs_log_hook)


def _why(status: int) -> str:
    return _status_str(status).decode()


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ConnectError(f"{what} failed: {_why(status)}")


class _Flush:
    """One ``ucp_ep_flush_nbx`` (shared by the transfers whose puts it covers)."""
    __slots__ = ("ptr", "status")

    def __init__(self, st: int | None):
        self.ptr, self.status = (None, 0) if not st else (None, st - 2**64) if st >= _PTR_ERR_MIN else (st, None)

    def poll(self) -> int | None:
        """None while in progress, else the UCS status (0 = every put is remotely visible)."""
        if self.ptr is not None and (s := _req_status(self.ptr)) != _INPROGRESS:
            _req_free(self.ptr)
            self.ptr, self.status = None, s
        return self.status

    @property
    def completed(self) -> bool:
        return self.poll() is not None


class _IovFrames:
    """The packed frames of one transfer, read from (sender) or written into (receiver) the
    runs themselves: one UCX iov per frame, so neither side gathers nor scatters. Frame ``k``
    holds the same bytes as the ``k``-th frame of a staging block (``_frame_iovs``), so either
    side may use staging instead (CUDA regions do). Raw ucp requests, polled and freed here."""
    __slots__ = ("iovs", "sizes", "reqs", "error", "receiving", "_info")

    def __init__(self, iovs: list[np.ndarray]):
        self.iovs, self.sizes = iovs, [int(v[:, 1].sum()) for v in iovs]
        self.reqs: list[tuple[int, int]] = []   # (request pointer, frame) still in flight
        self.error, self.receiving, self._info = "", False, _TagRecvInfo()

    def send(self, ep: int, tag: int) -> None:
        for k, v in enumerate(self.iovs):
            self._track(_tag_send(ep, v.ctypes.data, len(v), tag | k, _IOV_SEND), k)

    def recv(self, worker: int, tag: int) -> None:
        """Post a receive per frame (before GO): every frame lands where this side said."""
        self.receiving = True
        for k, v in enumerate(self.iovs):
            info = _TagRecvInfo()
            param = _RequestParam(op_attr_mask=_OP_ATTR_DATATYPE | _OP_ATTR_RECV_INFO, datatype=_DT_IOV,
                                  recv_info=ctypes.addressof(info))
            st = _tag_recv(worker, v.ctypes.data, len(v), tag | k, 2**64 - 1, ctypes.byref(param))
            if st == 0:   # completed at once (the frame was already here): its length is in info
                self._check_length(k, info.length)
            self._track(st, k)

    def _track(self, st: int | None, k: int) -> None:
        if st and st >= _PTR_ERR_MIN:
            self._fail(k, st - 2**64)
        elif st:
            self.reqs.append((st, k))

    def _fail(self, k: int, status: int) -> None:
        if not self.error:
            self.error = f"malformed frame: frame {k} is longer than its {self.sizes[k]} bytes" \
                if status == _TRUNCATED else f"frame {k}: {_why(status)}"

    def _check_length(self, k: int, length: int) -> None:
        if length != self.sizes[k] and not self.error:
            self.error = f"malformed frame: frame {k} has {length} bytes, {self.sizes[k]} expected"

    def poll(self) -> bool:
        """True once no request is in flight (then ``error`` says whether all went well)."""
        left = []
        for ptr, k in self.reqs:
            st = _tag_recv_test(ptr, ctypes.byref(self._info)) if self.receiving else _req_status(ptr)
            if st == _INPROGRESS:
                left.append((ptr, k))
                continue
            if st != 0:
                self._fail(k, st)
            elif self.receiving:
                self._check_length(k, self._info.length)
            _req_free(ptr)
        self.reqs = left
        return not left

    @property
    def completed(self) -> bool:   # as ucxx requests have it (``_zombies``)
        return self.poll()

    def cancel(self, worker: int) -> None:
        """Cancel posted receives not matched yet; a matched one still lands (poll until done)."""
        for ptr, _ in self.reqs:
            _req_cancel(worker, ptr)


_IOV_SEND_PARAM = _RequestParam(op_attr_mask=_OP_ATTR_DATATYPE, datatype=_DT_IOV)
_IOV_SEND = ctypes.byref(_IOV_SEND_PARAM)


def _frame_iovs(addr: np.ndarray, n: np.ndarray, frame: int) -> list[np.ndarray]:
    """The bytes of runs ``(addr, n)`` back to back, cut every ``frame`` bytes: one iov per
    frame, ``[pieces, 2]`` uint64 of (address, length) as ``ucp_dt_iov_t``."""
    keep = n > 0
    addr, n = addr[keep], n[keep]
    ends = np.cumsum(n)
    starts, total = ends - n, int(ends[-1])
    bounds = np.arange(frame, total, frame)                          # where frames 1, 2, ... start
    k = np.minimum(np.searchsorted(starts, bounds), len(starts) - 1)
    mid = bounds[starts[k] != bounds]                                # ... inside a run: cut it there
    iov = np.empty((len(n) + len(mid), 2), np.uint64)
    if len(mid):
        piece = np.insert(starts, np.searchsorted(starts, mid), mid)     # piece starts, in stream order
        run = np.searchsorted(starts, piece, side="right") - 1
        iov[:, 0] = addr[run] + (piece - starts[run])
        iov[:, 1] = np.diff(np.append(piece, total))
    else:   # every frame starts with a run (equal runs that divide the frame): the runs as they are
        piece, iov[:, 0], iov[:, 1] = starts, addr, n
    return np.split(iov, np.searchsorted(piece, bounds))


# ---- wire ----------------------------------------------------------------------------
CTRL_TAG, DATA_BIT, KIND_MASK = 1 << 63, 1 << 62, 3 << 62
FRAME_BITS = 24  # data tag = DATA_BIT | dtag << FRAME_BITS | frame index
HELLO, ANNOUNCE, GO, DONE, ACK, FAIL, ABORT, PING, BYE = range(9)
_REFUSALS = ("outside", "unknown", "ended", "malformed")  # GrantTable reasons: RejectedWrite
_I8 = np.dtype("<i8")
# Runs shorter than PUT_BELOW are packed, longer ones put; in a plan of more than FEW_RUNS runs,
# runs shorter than PUT_BELOW_MANY are packed too. Measured (bench_transport.py, bench_hetero.py,
# bench_request.py; shared memory on the 2-core box): 4 KiB pages go 1.6x faster packed than put.
# A request of a few 8-16 KiB runs is faster put (1-page request 2.0 vs 2.35 ms packed): a frame
# costs a rendezvous. Many such runs are faster packed, once the receiver's FIFO is large enough
# (UCX_DEFAULTS): TP 2 -> 2 with 16 KiB runs 2.4 -> 3.3 GB/s, HND TP 2 -> 4 / 4 -> 2 with 8 KiB
# runs 1.5 -> 2.3 / 1.9 -> 2.2; a put costs the sender a system call per run.
PUT_BELOW = 8 * 1024
PUT_BELOW_MANY = 32 * 1024
INLINE_BELOW = 256 * 1024   # packed bytes below this travel inside the ANNOUNCE
_OFF_BITS = 44              # merge keys: region id above the offset bits (regions < 16 TiB)
_OFF_MASK = (1 << _OFF_BITS) - 1
# UCX settings this transport changes unless ``ucx_config`` or the environment (UCX_<name>) sets
# them. SYSV_FIFO_SIZE: packed frames cross shared memory through the receiver's FIFO of 8 KiB
# segments; UCX's 256 (2 MiB) fills in well under a millisecond, and a sender whose FIFO is full
# waits for the receiver's thread to be scheduled and drain it. With six rank processes on two
# cores (bench_hetero.py, token-major head slices) 4096 took TP 4 -> 2 from 0.75 to 1.4 GB/s and
# 2 -> 4 from 1.2 to 1.4 (medians), same TP and one-sender transfers unchanged; it costs ~33 MB
# of resident shared memory per transport (61 MiB of sysv segments reserved).
UCX_DEFAULTS = {"SYSV_FIFO_SIZE": "4096"}
# Shared-memory settings both peers must agree on: a sender indexes the receiver's FIFO with its
# own size, so a mismatch hangs the pair silently. Descriptors carry them; connect() compares.
_MUST_MATCH = ("SYSV_FIFO_SIZE", "SYSV_SEG_SIZE", "POSIX_FIFO_SIZE", "POSIX_SEG_SIZE")


def ucx_settings(tls: str | None, ucx_config: dict | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings a transport hands UCX (names without ``UCX_``): ``UCX_DEFAULTS`` the
    environment does not set, then ``ucx_config``, then ``tls``."""
    return {**{k: v for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in environ},
            **(ucx_config or {}), **({"TLS": tls} if tls else {})}


def _shared_memory_settings(config: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The ``_MUST_MATCH`` settings in effect ("" for UCX's own default)."""
    return {k: str(config.get(k, environ.get(f"UCX_{k}", ""))) for k in _MUST_MATCH}


def _run_array(b) -> np.ndarray:
    """The announced runs: int64 bytes of three rows (destination region, offset, length)."""
    if not isinstance(b, bytes) or len(b) % 24:
        raise ValueError("run array is not 3 rows of int64")
    return np.frombuffer(b, _I8).reshape(3, -1)


def _ucx_buf(t: torch.Tensor) -> Array:
    """ucxx buffer for a uint8 tensor: numpy for host memory, CUDA array interface otherwise."""
    return Array(t.numpy() if t.device.type == "cpu" else t)


class _Staging:
    """Reused staging blocks for packed runs: a fresh 64 MiB block costs 16k page faults and a
    kernel memset each time. Keeps at most ``keep`` spare blocks. Thread-safe."""

    def __init__(self, keep: int = 4):
        self._lock, self._spare, self._keep = threading.Lock(), [], keep

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            fits = [k for k, b in enumerate(self._spare) if b.device == device and nbytes <= b.numel() <= 4 * nbytes]
            if fits:
                return self._spare.pop(min(fits, key=lambda k: self._spare[k].numel()))[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, block: torch.Tensor | None) -> None:
        if block is not None:
            with self._lock:
                self._spare = (self._spare + [block])[-self._keep:]


@dataclass(eq=False)
class _Peer:
    id: str
    ep: object                       # ucx_api.UCXEndpoint, error handling off
    last_seen: float
    base: np.ndarray | None = None   # remote region addresses, sizes, rkeys: set by connect()
    sizes: np.ndarray | None = None
    base_list: list = field(default_factory=list)   # the same as Python ints (few-runs path)
    sizes_list: list = field(default_factory=list)
    rkeys: list = field(default_factory=list)
    gone: bool = False               # silent past peer_timeout; cleared when it speaks again
    outbox: list = field(default_factory=list)
    last_send: object = None         # the latest control send to it
    next_ping: float = 0.0


@dataclass(eq=False)
class _Out:
    """An outgoing transfer (sender side), owned by the I/O thread once enqueued."""
    xid: int
    peer: _Peer
    handle: TransferHandle
    announce: list
    puts: list                       # (src addr, dst addr, nbytes, src region, dst region) per put
    staging: torch.Tensor | None     # gathered packed runs (CUDA sources, or inline in the announce)
    frame_bytes: int
    iov: _IovFrames | None = None    # or the packed runs' frames, read in place (host sources)
    state: str = "queued"            # queued -> wait_go -> flushing -> wait_ack
    reqs: list = field(default_factory=list)
    flush: _Flush | None = None
    abort: str = ""                  # why it failed, for the ABORT sent once its puts are flushed


@dataclass(eq=False)
class _In:
    """An incoming transfer (receiver side)."""
    peer: _Peer
    xid: int
    rid: str
    deadline: float
    nbytes: int
    notify: bytes
    packed: tuple | None             # region, offset, nbytes arrays of the packed runs; None once landed
    staging: torch.Tensor | None     # their frames (CUDA destinations)
    frame_bytes: int
    frames: int
    iov: _IovFrames | None = None    # or receives posted into the runs themselves (host destinations)
    dtag: int = 0                    # tag of the frames (0: no GO sent)
    puts: int = 0                    # announced runs the sender puts (one-sided) after GO
    got: int = 0
    done: bool = False
    reqs: list = field(default_factory=list)


class UCXTransport(Transport):
    """UCX data plane of one rank. Options (keyword only, via ``get_transport("ucx", ...)``):

    tls           ``UCX_TLS`` of this transport ("tcp", "sm,self", ...); None: UCX's choice
                  (shared memory on one host). Both peers must share a transport.
    frame_bytes   big runs are put in pieces of this size; packed blocks go in frames of it.
    put_below     runs shorter than this are packed, longer ones put (``PUT_BELOW``)
    put_below_many  the same for plans of more than FEW_RUNS runs (``PUT_BELOW_MANY``)
    heartbeat     seconds between pings to each peer; ``peer_timeout`` seconds of silence
                  fail a peer's transfers (a dead peer is silent: error handling is off).
    ucx_config    more UCX settings, e.g. ``{"RNDV_THRESH": "8192"}``; they replace
                  ``UCX_DEFAULTS`` (the environment's UCX_* settings do too).
    """
    name = "ucx"

    def __init__(self, *, tls: str | None = None, frame_bytes: int = 4 << 20, put_below: int = PUT_BELOW,
                 put_below_many: int = PUT_BELOW_MANY,
                 heartbeat: float = 0.5, peer_timeout: float = 5.0, ucx_config: dict | None = None):
        if not 4096 <= frame_bytes < 1 << 32:
            raise TransportError(f"frame_bytes must be in 4 KiB..4 GiB, got {frame_bytes}")
        config = ucx_settings(tls, ucx_config, os.environ)
        self._shm_settings = _shared_memory_settings(config, os.environ)
        self.id = uuid.uuid4().hex
        self.frame_bytes, self.put_below, self.put_below_many = int(frame_bytes), int(put_below), int(put_below_many)
        self.heartbeat, self.peer_timeout = heartbeat, peer_timeout
        self._ctx = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.RMA,
                                                              ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()  # so the idle I/O thread can sleep on the worker fd
        self._whandle, self._address = self._worker.handle, self._worker.address.tobytes()
        self.grants = GrantTable()
        self._regions: list[torch.Tensor] = []
        self._base, self._base_list, self._region_sizes = np.zeros(0, np.int64), [], np.zeros(0, np.int64)
        self._is_host, self._host_list, self._all_host = np.zeros(0, bool), [], True
        self._cuda_devices: set[torch.device] = set()
        self._memh: list[int | None] = []
        self._params: list[_RequestParam] = []
        self._param_refs: list = []  # ctypes.byref of each, made once
        self._rkeys_packed: list[bytes] = []
        self._peers: dict[str, _Peer] = {}
        self._out: dict[int, _Out] = {}
        self._in: dict[tuple[str, int], _In] = {}
        self._by_dtag: dict[int, _In] = {}
        self._unflushed: dict[str, list[_Out]] = {}  # puts issued this turn, per peer
        self._flushing: list[_Out] = []              # flushed, DONE not sent yet
        self._holding: list[_Out] = []               # failed with puts maybe in flight: source not released
        self._ctrl_sends: list = []  # (request, buffer): buffers live until sent
        self._ctrl_recvs: list = []  # (request, buffer, length) in arrival order
        self._zombies: list = []     # requests of ended transfers that still own buffers
        # Receiver: ended transfers whose sender had GO, so puts of theirs may still land, until
        # its DONE or ABORT (sent once its puts are flushed) or it is gone: (peer, xid) -> rid.
        self._landing: dict[tuple[str, int], str] = {}
        self._landing_rids: collections.Counter = collections.Counter()
        # Receiver: ended transfers whose posted frame receives may still land: (peer, rid, frames).
        self._draining: list[tuple[str, str, _IovFrames]] = []
        self._xids, self._dtags = itertools.count(1), itertools.count(1)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._flush_param = _RequestParam()
        self._staging = _Staging()
        self._closed = self._stop = self._sleeping = False
        self._next_tick, self._acts = 0.0, 0
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-ucx-{self.id[:6]}", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ---- called from user threads ---------------------------------------------------------
    def _call(self, fn: Callable, *args):
        """Run ``fn`` on the I/O thread and wait for it (start-up and shutdown only)."""
        if self._stop:
            raise TransportError("UCX transport is closed")
        fut: Future = Future()
        self._cmds.put((fn, args, fut))
        self._wake()
        return fut.result(timeout=60)

    def _wake(self) -> None:
        """After queueing a command: signal the worker if the I/O thread sleeps (or is about to).

        The thread sets ``_sleeping`` before its last look at the queue, so a command queued
        while the flag is unset is seen by that look, and one queued later sees the flag."""
        if self._sleeping:
            _signal(self._whandle)

    def register(self, regions: Sequence[torch.Tensor]) -> None:
        """Both sides, once, before descriptor(): map every region for RMA (blocks briefly)."""
        self._call(self._do_register, [byte_view(t) for t in regions])

    def descriptor(self) -> dict:
        """Plain JSON-safe data a peer needs: worker address, region addresses, sizes, rkeys."""
        return {"transport": self.name, "id": self.id, "address": self._address.hex(),
                "region_base": [int(b) for b in self._base], "region_sizes": list(self.grants.region_sizes),
                "rkeys": [k.hex() for k in self._rkeys_packed], "shm_settings": self._shm_settings}

    def connect(self, descriptor: dict) -> str:
        """Sender, once per receiver: an endpoint to its worker (error handling off), its rkeys."""
        try:
            peer_id, addr = str(descriptor["id"]), bytes.fromhex(descriptor["address"])
            base, sizes = (np.asarray(descriptor[k], np.int64) for k in ("region_base", "region_sizes"))
            rkeys = [bytes.fromhex(k) for k in descriptor["rkeys"]]
            theirs = {k: str(descriptor.get("shm_settings", {}).get(k, "")) for k in _MUST_MATCH}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConnectError(f"not a UCX transport descriptor ({type(e).__name__}: {e})") from e
        differ = [f"UCX_{k} {self._shm_settings[k] or 'unset'} here, {theirs[k] or 'unset'} at the peer"
                  for k in _MUST_MATCH if theirs[k] != self._shm_settings[k]]
        if differ:
            raise ConnectError("UCX shared-memory settings differ from the peer's (a mismatch would hang "
                               f"transfers): {'; '.join(differ)}. Give both sides the same settings.")
        if not len(base) == len(sizes) == len(rkeys):
            raise ConnectError("UCX descriptor region lists differ in length")
        return self._call(self._do_connect, peer_id, addr, base, sizes, rkeys)

    def submit(self, peer: str, request_id: str, plan: TransferPlan, *, timeout: float = DEFAULT_TIMEOUT,
               notify: bytes = b"") -> TransferHandle:
        """Sender, per chunk: plans runs and gathers packed ones here; never waits on the network."""
        handle = TransferHandle(request_id, plan.nbytes, timeout, holds_source=True)
        p = self._peers.get(peer)
        why = ("transport closed" if self._closed else f"peer {peer!r} is not connected" if p is None or
               p.sizes is None else f"peer {peer} is silent (dead or stalled)" if p.gone else None)
        if why:
            handle.finish(PeerError(f"request {request_id}: {why}"), release=True)
            return handle
        try:
            if not self._regions and plan.num_runs:
                raise TransportError("register(regions) must be called before submit")
            puts, runs, nput, packed = (self._prepare_few if plan.num_runs <= FEW_RUNS else self._prepare)(p, plan)
            staging = iov = None
            inline = b""
            if packed is not None:
                sr, so, n = packed
                total = int(n.sum())
                if total < INLINE_BELOW:               # in the announce: no GO wait, no frames
                    inline = gather_runs(self._regions, sr, so, n).cpu().numpy().tobytes()
                elif self._all_host or self._is_host[sr].all():   # frames read straight from the source runs
                    iov = _IovFrames(_frame_iovs(self._base[sr] + so, n, self.frame_bytes))
                else:                                  # CUDA: gather on the device, frames from there
                    staging = self._staging.get(total, self._regions[int(sr[0])].device)
                    gather_runs(self._regions, sr, so, n, out=staging)
            if staging is not None and staging.is_cuda:  # UCX reads it right after GO
                torch.cuda.current_stream(staging.device).synchronize()
        except (PlanError, TransportError) as e:
            handle.finish(e, release=True)
            return handle
        xid = next(self._xids)
        announce = [ANNOUNCE, xid, request_id, float(timeout), bytes(notify), runs, nput, self.frame_bytes, inline]
        self._cmds.put((None, (_Out(xid, p, handle, announce, puts, staging, self.frame_bytes, iov),), None))
        self._wake()
        return handle

    def _prepare(self, p: _Peer, plan: TransferPlan) -> tuple:
        """Bounds-check the runs: (puts, announced runs, put count, packed runs as
        (source region, offset, length) arrays or None)."""
        r = plan.runs()
        sr, so, dr, do, n = r[:5]
        if len(n) and n.min() <= 0:
            raise PlanError("a run of the plan is empty or negative")
        for side, reg, off, lim in (("source", sr, so, self.grants.region_sizes), ("destination", dr, do, p.sizes)):
            lim = np.asarray(lim, np.int64)
            if len(reg) and (reg.min() < 0 or reg.max() >= len(lim) or off.min() < 0
                             or (off + n > lim[reg]).any()):
                raise PlanError(f"a {side} run leaves its region (the {side} has {len(lim)} regions)")
        # Runs below put_below_many travel packed, whatever the plan says: this bounds the put loop
        # (one Python step per put) by bytes / put_below_many, and a small put costs more than packing.
        pk = n < self.put_below_many
        npk = int(np.count_nonzero(pk))
        put = slice(None) if npk == 0 else slice(0) if npk == len(n) else ~pk
        keyed = max(self._region_sizes.max(), p.sizes.max()) < 1 << _OFF_BITS
        packed = announced = None
        if npk:
            psr, pso, pdr, pdo, pn = (sr, so, dr, do, n) if npk == len(n) else (sr[pk], so[pk], dr[pk], do[pk], n[pk])
            # Packed runs are one byte stream: runs that continue each other on one side are one
            # iov piece there. A head slice of token-major pages is 512 B rows on the strided side
            # and whole pages on the other: the receiver checks and posts 16x fewer runs (TP 2 -> 4).
            packed = _merge_in_stream(psr, pso, pn) if keyed else (psr, pso, pn)
            announced = _merge_in_stream(pdr, pdo, pn) if keyed else (pdr, pdo, pn)
        # Runs adjacent on both sides go as one put (announced as the plan has them: the grant
        # check does not care). Put runs come first in the announce.
        ps, pso, pd, pdo, pn = sr[put], so[put], dr[put], do[put], n[put]
        if npk < len(n):
            announced = (pd, pdo, pn) if announced is None else \
                tuple(np.concatenate(c) for c in zip((pd, pdo, pn), announced))
        if len(pn) > 1 and keyed:
            ks, kd, pn = merge_runs(_key(ps, pso), _key(pd, pdo), pn)
            (ps, pso), (pd, pdo) = _unkey(ks), _unkey(kd)
        puts = _split(self._base[ps] + pso, p.base[pd] + pdo, pn, ps, pd, self.frame_bytes)
        return puts, np.stack(announced).astype(_I8, copy=False).tobytes(), len(n) - npk, packed

    def _prepare_few(self, p: _Peer, plan: TransferPlan) -> tuple:
        """``_prepare`` for a plan of at most FEW_RUNS runs, with Python ints."""
        sides = (("source", self.grants.region_sizes), ("destination", p.sizes_list))
        put_runs, packed_runs, puts, frame = [], [], [], self.frame_bytes
        for g in plan.groups:
            for sr, so, dr, do, n in g.run_tuples():
                for (side, sizes), reg, off in zip(sides, (sr, dr), (so, do)):
                    if not (0 <= reg < len(sizes) and 0 <= off and 0 < n and off + n <= sizes[reg]):
                        raise PlanError(f"a {side} run leaves its region (the {side} has {len(sizes)} regions)")
                (packed_runs if n < self.put_below else put_runs).append((sr, so, dr, do, n))
        for sr, so, dr, do, n in put_runs:
            src, dst = self._base_list[sr] + so, p.base_list[dr] + do
            puts += [(src + k, dst + k, min(frame, n - k), sr, dr) for k in range(0, n, frame)]
        packed = None
        if packed_runs:
            sr, so, _, _, n = (np.array(c, np.int64) for c in zip(*packed_runs))
            packed = (sr, so, n)
        runs = put_runs + packed_runs
        return puts, np.array([[r[2] for r in runs], [r[3] for r in runs], [r[4] for r in runs]], _I8).tobytes(), \
            len(put_runs), packed

    def forget(self, request_id: str) -> bool:
        """Receiver: the request ended; its transfers in flight fail, later writes are dropped."""
        live = self.grants.forget(request_id)
        if not self._closed:
            self._cmds.put((self._drop_request, (request_id,), None))
            self._wake()
        return live

    def close(self) -> None:
        """Fail what is in flight, say BYE, release UCX resources. Idempotent."""
        if self._closed:
            return
        self._closed = True  # submit() refuses from here on
        try:
            self._call(self._do_close)
        finally:
            self._stop = True
            _signal(self._whandle)
            self._thread.join(timeout=10)
            while not self._cmds.empty():  # a submit that raced with close
                fn, args, _ = self._cmds.get_nowait()
                if fn is None:
                    args[0].handle.finish(PeerError(f"request {args[0].handle.request_id}: transport closed"),
                                          release=True)
            for o in self._holding:   # endpoints closed: no put of theirs is in flight any more
                o.handle.release_source()
            self._holding = []
            # Endpoints were closed without a flush in _do_close: dropping them cannot block.
            self._peers, self._out, self._in, self._by_dtag, self._zombies, self._flushing = {}, {}, {}, {}, [], []
            self._ctrl_sends, self._ctrl_recvs = [], []
            _LIVE.discard(self)

    def __del__(self):
        if not getattr(self, "_closed", True):
            log.warning("UCXTransport %s was garbage-collected without close()", self.id[:8])

    # ---- I/O thread: start-up and shutdown ------------------------------------------------
    def _do_register(self, regions: list[torch.Tensor]) -> None:
        if self._memh:
            raise TransportError("register() was already called on this UCX transport")
        for t in regions:
            memh, buf, size = _vp(), _vp(), _sz()
            if t.numel():
                params = _MemMapParams(_MEMMAP_ADDR_LEN, t.data_ptr(), t.numel())  # host or device: UCX detects
                _check(_mem_map(self._ctx.handle, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
                _check(_rkey_pack(self._ctx.handle, memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
                self._rkeys_packed.append(ctypes.string_at(buf, size.value))
                _rkey_release(buf)
            else:
                self._rkeys_packed.append(b"")
            self._memh.append(memh.value)
            # One put parameter block per source region: its memh spares UCX a registration lookup.
            self._params.append(_RequestParam(op_attr_mask=_OP_ATTR_MEMH if memh.value else 0, memh=memh.value))
            self._param_refs.append(ctypes.byref(self._params[-1]))
        self._regions = regions
        self._base_list = [t.data_ptr() for t in regions]
        self._base = np.asarray(self._base_list, np.int64)
        self._region_sizes = np.asarray([t.numel() for t in regions], np.int64)
        self._cuda_devices = {t.device for t in regions if t.is_cuda}
        self._is_host = np.array([not t.is_cuda for t in regions], bool)
        self._host_list, self._all_host = self._is_host.tolist(), bool(self._is_host.all())
        self.grants.region_sizes = [t.numel() for t in regions]

    def _do_connect(self, peer_id, addr, base, sizes, rkeys) -> str:
        p = self._peers.get(peer_id) or self._add_peer(peer_id, addr)
        if p.sizes is None:
            handles = []
            for k in rkeys:
                h = _vp()
                if k:
                    _check(_rkey_unpack(p.ep.handle, k, ctypes.byref(h)), "ucp_ep_rkey_unpack")
                handles.append(h.value)
            p.base, p.sizes, p.rkeys = base, sizes, handles
            p.base_list, p.sizes_list = base.tolist(), sizes.tolist()
            self._send(p, [HELLO, self._address])
        return peer_id

    def _add_peer(self, peer_id: str, addr: bytes) -> _Peer:
        ep = self._worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(addr), False)
        p = self._peers[peer_id] = _Peer(peer_id, ep, time.monotonic())
        return p

    def _do_close(self) -> None:
        for o in list(self._out.values()):
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: transport closed"), tell=False)
        for i in list(self._in.values()):
            self._fail_in(i, "transport closed before the transfer finished", tell=False)
        for p in self._peers.values():
            self._send(p, [BYE])
        self._flush_outboxes()
        end = time.monotonic() + 0.2  # let BYE leave; a dead peer never takes it
        while self._ctrl_sends and time.monotonic() < end:
            self._worker.progress()
            self._ctrl_sends = [s for s in self._ctrl_sends if not s[0].completed]
        self._worker.cancel_inflight_requests()
        for p in self._peers.values():
            for h in p.rkeys:
                if h:
                    _rkey_destroy(h)
            p.rkeys = []
        for m in self._memh:
            if m:
                _mem_unmap(self._ctx.handle, m)
        self._memh, self._params, self._param_refs, self._regions = [], [], [], []
        # Close endpoints now, without a flush: ucxx's destructor would flush-close them and
        # spin forever on a dead peer (error handling is off).
        for p in self._peers.values():
            p.ep.close()
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            self._worker.progress()
        self._reap_draining()   # cancelled receives: free their requests
        self._stop = True

    # ---- I/O thread: the loop -------------------------------------------------------------
    def _loop(self) -> None:
        """Run commands, progress, read control and data, check deadlines; sleep when idle."""
        while not self._stop:
            try:
                self._acts = 0
                self._run_commands()
                if self._stop:  # closed by a command: the endpoints are gone
                    break
                self._worker.progress()
                self._poll_ctrl()
                self._poll_data()
                self._flush_puts()
                self._advance()
                now = time.monotonic()
                if now >= self._next_tick:
                    self._housekeeping(now)
                    self._next_tick = now + min(self.heartbeat, 0.1)
                self._flush_outboxes()
                if not self._acts:
                    self._sleeping = True
                    if self._cmds.empty():
                        busy = self._out or self._in or self._ctrl_recvs  # then wake at least every ms
                        self._worker.progress_worker_event(1 if busy else max(1, int((self._next_tick - now) * 1000)))
                    self._sleeping = False
            except Exception:  # the loop must outlive anything one peer or message does
                log.exception("UCX transport %s: error in the I/O loop", self.id[:8])

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._acts += 1
            if fn is None:
                self._start_out(*args)
                continue
            try:
                res = fn(*args)
            except Exception as e:
                if fut is None:
                    log.exception("UCX transport command failed")
                else:
                    fut.set_exception(e)
            else:
                if fut is not None:
                    fut.set_result(res)

    def _send(self, p: _Peer, msg: list) -> None:
        """Queue a control message; each peer's queue leaves as one tagged message per turn."""
        if not p.outbox:
            self._acts += 1
        p.outbox.append(msg)

    def _flush_outboxes(self) -> None:
        for p in self._peers.values():
            if p.outbox:
                buf = np.frombuffer(msgpack.packb([self.id, p.outbox], use_bin_type=True), np.uint8)
                p.outbox, p.last_send = [], p.ep.tag_send(Array(buf), ucx_api.UCXXTag(CTRL_TAG))
                self._ctrl_sends.append((p.last_send, buf))
        self._ctrl_sends = [s for s in self._ctrl_sends if not s[0].completed]

    def _poll_ctrl(self) -> None:
        while (res := self._worker.tag_probe(ucx_api.UCXXTag(CTRL_TAG), ucx_api.UCXXTagMask(KIND_MASK),
                                             remove=True)).matched:
            buf = np.empty(max(res.length, 1), np.uint8)
            self._ctrl_recvs.append((self._worker.tag_recv_with_handle(Array(buf), res), buf, res.length))
        # In arrival order: an ANNOUNCE still streaming in must not be overtaken by its DONE.
        while self._ctrl_recvs and self._ctrl_recvs[0][0].completed:
            req, buf, length = self._ctrl_recvs.pop(0)
            self._acts += 1
            try:
                req.check_error()
                sender, msgs = msgpack.unpackb(buf[:length].tobytes(), raw=False, strict_map_key=True)
                if not isinstance(sender, str) or not isinstance(msgs, list):
                    raise ValueError("not [sender, [messages]]")
            except Exception as e:
                self.grants.reject("?", f"malformed message: {type(e).__name__}: {e}"[:200])
                continue
            for m in msgs:
                try:
                    self._handle(sender, m)
                except Exception as e:
                    self.grants.reject("?", f"malformed message: {type(e).__name__}: {e}"[:200])

    def _handle(self, sender: str, m: list) -> None:
        kind = m[0]
        p = self._peers.get(sender)
        if kind == HELLO and p is None:
            p = self._add_peer(sender, bytes(m[1]))
        if p is None:
            self.grants.reject("?", f"unknown peer: message {kind!r} from {sender[:40]!r} before HELLO")
            return
        p.last_seen, p.gone = time.monotonic(), False
        if kind == ANNOUNCE:
            self._on_announce(p, m)
        elif kind in (GO, ACK, FAIL):
            o = self._out.get(m[1])
            if o is None or o.peer is not p:
                return  # a late answer for a transfer that already ended here
            if kind == GO and o.state == "wait_go":
                self._start_puts(o, int(m[2]))
            elif kind == ACK and (o.state == "wait_ack" or o.state == "wait_go" and not o.puts and o.staging is None
                                  and o.iov is None):
                del self._out[o.xid]
                o.handle.finish(release=True)   # puts flushed before DONE, or there were none
            elif kind == FAIL:
                why = str(m[2])
                self._fail_out(o, (RejectedWrite if why.startswith(_REFUSALS) else PeerError)(
                    f"request {o.handle.request_id}: receiver refused the transfer: {why}"), tell=False)
        elif kind in (DONE, ABORT) and (rid := self._landing.pop((sender, m[1]), None)) is not None:
            self._landed(rid)   # its puts are flushed: nothing more of it lands
        elif kind in (DONE, ABORT) and (i := self._in.get((sender, m[1]))) is not None:
            if kind == ABORT:   # sent once no put of it is left: nothing more lands
                self._fail_in(i, f"aborted by the sender: {m[2]}", tell=False, puts_left=False)
            else:
                i.done = True
                self._try_finish(i)
        elif kind == BYE:
            self._peer_gone(p, "peer closed its transport")

    # ---- receiver -------------------------------------------------------------------------
    def _on_announce(self, p: _Peer, m: list) -> None:
        xid, rid = int(m[1]), str(m[2])
        try:
            timeout, notify, runs, nput, frame_bytes, inline = float(m[3]), bytes(m[4]), _run_array(m[5]), \
                int(m[6]), int(m[7]), m[8]
            if not 0 <= nput <= runs.shape[1] or not isinstance(inline, bytes):
                raise ValueError(f"{nput} put runs of {runs.shape[1]}, inline {type(inline).__name__}")
            if not 4096 <= frame_bytes < 1 << 32 or not 0 <= timeout <= 86400:  # NaN fails too
                raise ValueError(f"frame size {frame_bytes} or timeout {timeout}")
        except (ValueError, TypeError, IndexError) as e:
            return self._refuse(p, xid, rid, 0, b"", self.grants.reject(rid, f"malformed header: {e}"))
        reg, off, n = runs
        reason = self.grants.check(rid, reg, off, n)
        # A granted run lies inside the grant: non-negative and below 2**62, so the sums below hold.
        if reason is None and len(n) and (off + n > self._region_sizes[reg]).any():
            # GrantTable trusts the grant to lie inside the regions; a grant past the end is ours to catch.
            reason = self.grants.reject(rid, "outside region: a granted run ends past its region")
        if reason is None and (p.id, xid) in self._in:
            reason = self.grants.reject(rid, f"malformed header: transfer {xid} announced twice")
        packed = runs[:, nput:]
        total = int(packed[2].sum()) if reason is None else 0
        if reason is None and inline and len(inline) != total:
            reason = self.grants.reject(rid, f"malformed header: {len(inline)} inline bytes for {total} packed")
        if reason is not None:
            ok = len(n) and (n > 0).all() and (n < 1 << 40).all()
            return self._refuse(p, xid, rid, int(n.sum()) if ok else 0, notify, reason)
        i = _In(p, xid, rid, time.monotonic() + timeout, int(n.sum()), notify, tuple(packed), None, frame_bytes,
                0 if inline else -(-total // frame_bytes), puts=nput)
        self._in[(p.id, xid)] = i
        if inline:  # checked a moment ago: lands now, with no re-check and no frames
            self._land(i.packed, torch.frombuffer(bytearray(inline), dtype=torch.uint8))
            i.packed = None
        elif total and (self._all_host or self._is_host[packed[0]].all()):   # frames land in the runs themselves
            i.iov = _IovFrames(_frame_iovs(self._base[packed[0]] + packed[1], packed[2], frame_bytes))
        elif total:
            i.staging = self._staging.get(total, self._regions[int(packed[0, 0])].device)
        if nput == 0 and not i.frames:  # all here already: ACK without GO and DONE
            i.done = True
            return self._try_finish(i)
        i.dtag = next(self._dtags)
        if i.iov is not None:   # posted before GO: no frame of it can arrive unexpected
            i.iov.recv(self._whandle, DATA_BIT | i.dtag << FRAME_BITS)
            if i.iov.error:
                return self._fail_in(i, f"posting receives failed: {i.iov.error}")
        elif i.frames:
            self._by_dtag[i.dtag] = i
        self._send(p, [GO, xid, i.dtag])

    def _refuse(self, p: _Peer, xid: int, rid: str, nbytes: int, notify: bytes, reason: str) -> None:
        self._deliver(Arrival(rid, nbytes, False, reason, notify))
        self._send(p, [FAIL, xid, reason])

    def _poll_data(self) -> None:
        while (res := self._worker.tag_probe(ucx_api.UCXXTag(DATA_BIT), ucx_api.UCXXTagMask(KIND_MASK),
                                             remove=True)).matched:
            self._acts += 1
            tag = res.sender_tag.value
            i, k = self._by_dtag.get((tag & ~KIND_MASK) >> FRAME_BITS), tag & ((1 << FRAME_BITS) - 1)
            want = -1 if i is None or k >= i.frames else min(i.frame_bytes, i.staging.numel() - k * i.frame_bytes)
            if res.length != want:  # a frame of an ended transfer, or one that does not fit: drop it
                if i is not None:
                    self._fail_in(i, self.grants.reject(i.rid, f"malformed frame: {k} of {res.length} bytes"))
                junk = np.empty(max(res.length, 1), np.uint8)
                self._zombies.append((self._worker.tag_recv_with_handle(Array(junk), res), junk))
                continue
            view = i.staging[k * i.frame_bytes: k * i.frame_bytes + want]
            i.reqs.append(self._worker.tag_recv_with_handle(_ucx_buf(view), res))
        for i in [i for i in self._in.values() if i.iov is not None and i.got < i.frames]:
            done = i.iov.poll()
            if i.iov.error:   # at once: the frames still posted are cancelled
                self._acts += 1
                self._fail_in(i, self.grants.reject(i.rid, i.iov.error) if i.iov.error.startswith("malformed")
                              else f"peer failed: receiving packed frames: {i.iov.error}")
            elif done:
                self._acts += 1
                i.got, i.packed = i.frames, None   # landed in place
                self._try_finish(i)
        if self._draining:
            self._reap_draining()
        for i in [i for i in self._in.values() if i.reqs and all(r.completed for r in i.reqs)]:
            try:
                for r in i.reqs:
                    r.check_error()
            except Exception as e:
                self._fail_in(i, f"peer failed: receiving packed frames: {e}")
                continue
            i.got, i.reqs = i.got + len(i.reqs), []
            self._acts += 1
            self._try_finish(i)
        self._zombies = [z for z in self._zombies if not z[0].completed]

    def _try_finish(self, i: _In) -> None:
        if not i.done or i.got < i.frames or i.reqs:
            return
        if i.packed is not None and len(i.packed[2]):
            # The request may have ended while the frames were on their way: check before landing them.
            if (reason := self.grants.check(i.rid, *i.packed)) is not None:
                return self._fail_in(i, reason)
            self._land(i.packed, i.staging)
        self._forget_in(i)
        self._staging.put(i.staging)
        self._deliver(Arrival(i.rid, i.nbytes, True, "", i.notify))
        self._send(i.peer, [ACK, i.xid])

    def _land(self, packed: tuple, data: torch.Tensor) -> None:
        """Write consecutive bytes of ``data`` to the packed runs (region, offset, length arrays)
        with copy_runs, which sees the staging rows as evenly spaced (~1.5x scatter_runs here)."""
        region, offset, nbytes = packed
        copy_runs([data], self._regions, Runs(np.zeros_like(nbytes), np.cumsum(nbytes) - nbytes, region, offset,
                                              nbytes, np.ones(len(nbytes), bool)))
        for dev in self._cuda_devices:  # "arrived" means in place, not queued on a stream
            torch.cuda.current_stream(dev).synchronize()

    def _forget_in(self, i: _In) -> None:
        self._in.pop((i.peer.id, i.xid), None)
        self._by_dtag.pop(i.dtag, None)
        self._zombies.extend((r, i.staging) for r in i.reqs)  # posted receives still own the staging block
        if i.iov is not None and not i.iov.poll():   # receives posted into the grant's memory
            i.iov.cancel(self._whandle)
            self._draining.append((i.peer.id, i.rid, i.iov))
            self._landing_rids[i.rid] += 1   # writes_pending until they are all done

    def _reap_draining(self) -> None:
        """Ended transfers whose posted receives are all done: nothing more of them lands."""
        left = []
        for entry in self._draining:
            if entry[2].poll():
                self._landed(entry[1])
            else:
                left.append(entry)
        self._draining = left

    def _fail_in(self, i: _In, reason: str, tell: bool = True, puts_left: bool = True) -> None:
        self._forget_in(i)
        if puts_left and i.dtag and i.puts and not i.done and not i.peer.gone:   # GO went out: puts may come
            self._landing[(i.peer.id, i.xid)] = i.rid
            self._landing_rids[i.rid] += 1
        self._deliver(Arrival(i.rid, i.nbytes, False, reason, i.notify))
        if tell:
            self._send(i.peer, [FAIL, i.xid, reason])

    def _landed(self, rid: str) -> None:
        self._landing_rids[rid] -= 1
        if self._landing_rids[rid] <= 0:
            del self._landing_rids[rid]

    def writes_pending(self, request_id: str) -> bool:
        """After ``forget``: True while a sender that had GO for this request has not said that
        its puts are flushed (DONE or ABORT), unless it went silent past ``peer_timeout`` (taken
        as dead). Until then its puts can land in the grant's memory."""
        return request_id in self._landing_rids

    def _drop_request(self, rid: str) -> None:
        for i in [i for i in self._in.values() if i.rid == rid]:
            self._fail_in(i, self.grants.reject(rid, "ended request: the receiver forgot it mid-transfer"))

    # ---- sender ---------------------------------------------------------------------------
    def _start_out(self, o: _Out) -> None:
        if o.handle.poll() != 0:  # failed or timed out while queued: nothing read its source
            o.handle.release_source()
            return
        self._out[o.xid] = o
        o.announce[3] = max(o.handle.deadline - time.monotonic(), 0.0)  # relative: clocks differ across hosts
        self._send(o.peer, o.announce)
        o.state = "wait_go"

    def _start_puts(self, o: _Out, dtag: int) -> None:
        """GO came: issue every put and packed frame at once (all in flight); the turn flushes."""
        ep, rkeys, params, host = o.peer.ep.handle, o.peer.rkeys, self._param_refs, self._host_list
        # One ctypes call per put: a Python loop, bounded by bytes / put_below (see _prepare).
        for s, d, n, sr, dr in o.puts:
            if host[sr]:   # frees its request in C: one call per put instead of two (64 KiB: 22 vs 25 us)
                if (status := _put_nbi(ep, s, n, d, rkeys[dr])) >= 0:
                    continue
            else:          # the memh spares UCX a registration lookup of device memory
                st = _put(ep, s, n, d, rkeys[dr], params[sr])  # no callback: NULL (done) or a request
                if not st or st < _PTR_ERR_MIN:
                    if st:
                        _req_free(st)  # its completion is covered by the flush
                    continue
                status = st - 2**64
            return self._fail_issued(o, f"put failed: {_why(status)}")
        if o.iov is not None:
            o.iov.send(ep, DATA_BIT | dtag << FRAME_BITS)
            if o.iov.error:
                return self._fail_issued(o, f"sending frames failed: {o.iov.error}")
        if o.staging is not None:
            for k in range(-(-o.staging.numel() // o.frame_bytes)):  # one step per frame (MiBs)
                view = o.staging[k * o.frame_bytes: (k + 1) * o.frame_bytes]
                o.reqs.append((o.peer.ep.tag_send(_ucx_buf(view), ucx_api.UCXXTag(DATA_BIT | dtag << FRAME_BITS | k)),
                               view))
        o.state = "flushing"
        self._unflushed.setdefault(o.peer.id, []).append(o)

    def _fail_issued(self, o: _Out, why: str) -> None:
        """Fail ``o`` part way through ``_start_puts``: what it issued (puts, frames) still reads
        the source, so the turn's flush covers it before the source is released."""
        o.state = "flushing"
        self._unflushed.setdefault(o.peer.id, []).append(o)
        self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"))

    def _flush_puts(self) -> None:
        """One ep flush per peer covers every put issued to it this turn."""
        for outs in self._unflushed.values():
            f = _Flush(_flush(outs[0].peer.ep.handle, ctypes.byref(self._flush_param)))
            for o in outs:
                o.flush = f
            self._flushing += outs
        self._unflushed.clear()

    def _advance(self) -> None:
        """DONE for every flushed transfer whose packed frames left too (in the turn of its flush
        when that completes at once, as it does for shared-memory puts)."""
        waiting = []
        for o in self._flushing:
            if o.state != "flushing":  # failed meanwhile
                continue
            if (st := o.flush.poll()) is None or not all(r.completed for r, _ in o.reqs) or \
                    (o.iov is not None and not o.iov.poll()):
                waiting.append(o)
            elif st != 0:
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: flush failed: {_why(st)}"))
            elif o.iov is not None and o.iov.error:
                self._fail_out(o, PeerError(f"request {o.handle.request_id}: sending frames failed: {o.iov.error}"))
            else:
                self._staging.put(o.staging)
                o.handle.release_source()   # every put is remotely visible: the source is read
                o.reqs, o.staging, o.state = [], None, "wait_ack"
                self._send(o.peer, [DONE, o.xid])
        self._flushing = waiting

    def _fail_out(self, o: _Out, err: Exception, tell: bool = True) -> None:
        """End ``o``. Once GO came, the receiver holds the grant's memory until ABORT says that
        no put of ours is still on its way: sent after the flush, whoever failed the transfer."""
        self._out.pop(o.xid, None)
        o.handle.finish(err)
        if o.state == "flushing":
            o.abort = str(err)
            if self._puts_settled(o):
                self._release_and_abort(o)
            else:
                self._holding.append(o)   # puts issued, not flushed: they still read the source
        else:
            o.handle.release_source()
            if tell:
                self._send(o.peer, [ABORT, o.xid, str(err)])
        o.state = "failed"
        self._zombies.extend(o.reqs)  # frames still being sent read the staging block
        if o.iov is not None and o.iov.reqs:
            self._zombies.append((o.iov, None))   # their requests are freed as they complete
        if o.flush is not None and o.flush.ptr is not None:
            self._zombies.append((o.flush, None))
        o.reqs = []

    # ---- deadlines and heartbeats ---------------------------------------------------------
    @staticmethod
    def _puts_settled(o: _Out) -> bool:
        """No put or frame of ``o`` reads its source any more: the flush ended and the frames
        left, or the peer is gone (a dead peer takes nothing; a stalled one is past every deadline
        when it wakes)."""
        return o.peer.gone or (o.flush is not None and o.flush.completed and (o.iov is None or o.iov.poll()))

    def _release_and_abort(self, o: _Out) -> None:
        """No put of failed ``o`` reads its source or lands any more: release it, tell the receiver."""
        o.handle.release_source()
        if not o.peer.gone:
            self._send(o.peer, [ABORT, o.xid, o.abort])

    def _housekeeping(self, now: float) -> None:
        for o in self._holding:
            if self._puts_settled(o):
                self._release_and_abort(o)
        self._holding = [o for o in self._holding if not o.handle.source_released]
        for o in [o for o in self._out.values() if now > o.handle.deadline]:
            self._fail_out(o, TransferTimeout(f"transfer for request {o.handle.request_id} passed its deadline "
                                              f"({o.state.replace('_', ' ')})"))
        for i in [i for i in self._in.values() if now > i.deadline]:
            self._fail_in(i, self.grants.reject(i.rid, "deadline passed: the sender did not finish in time"))
        for p in list(self._peers.values()):
            if not p.gone and now - p.last_seen > self.peer_timeout:
                self._peer_gone(p, f"peer silent for {now - p.last_seen:.1f}s (dead or stalled)")
            # Ping only once the last message left: sends to a dead peer may never complete.
            if now >= p.next_ping and (p.last_send is None or p.last_send.completed):
                p.next_ping = now + self.heartbeat
                self._send(p, [PING])

    def _peer_gone(self, p: _Peer, why: str) -> None:
        p.gone = True
        for key in [k for k in self._landing if k[0] == p.id]:
            self._landed(self._landing.pop(key))
        for entry in [e for e in self._draining if e[0] == p.id]:   # its frames will not come (see puts)
            self._draining.remove(entry)
            self._zombies.append((entry[2], None))
            self._landed(entry[1])
        for o in [o for o in self._out.values() if o.peer is p]:
            self._fail_out(o, PeerError(f"request {o.handle.request_id}: {why}"), tell=False)
        for i in [i for i in self._in.values() if i.peer is p]:
            self._fail_in(i, self.grants.reject(i.rid, f"peer failed: {why}"), tell=False)


def _key(reg: np.ndarray, off: np.ndarray) -> np.ndarray:
    """(region, offset) as one int64 that merges never carry across regions (offsets < 2**_OFF_BITS)."""
    return reg << _OFF_BITS | off


def _unkey(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return key >> _OFF_BITS, key & _OFF_MASK


def _merge_in_stream(reg: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive runs of one byte stream that continue each other in their region, as one
    run: (region, offset, length) arrays."""
    key, _, n = merge_runs(_key(reg, off), np.cumsum(n) - n, n)
    return (*_unkey(key), n)


def _split(src: np.ndarray, dst: np.ndarray, n: np.ndarray, sreg: np.ndarray, dreg: np.ndarray,
           frame: int) -> list[tuple]:
    """Cut runs longer than ``frame`` into frame-sized puts (vectorized); tuples of ints for the put loop."""
    pieces = np.maximum(-(-n // frame), 1)
    if len(n) and pieces.max() > 1:
        idx = np.repeat(np.arange(len(n)), pieces)
        off = (np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * frame
        src, dst, n, sreg, dreg = src[idx] + off, dst[idx] + off, np.minimum(frame, n[idx] - off), sreg[idx], dreg[idx]
    return list(zip(src.tolist(), dst.tolist(), n.tolist(), sreg.tolist(), dreg.tolist()))


_LIVE: "weakref.WeakSet[UCXTransport]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Close transports the program forgot: ucxx's destructors could spin on a dead peer at exit."""
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:
            log.exception("closing a UCX transport at exit")
