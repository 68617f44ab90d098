"""libucp through ctypes: what ``ucxx`` does not expose (RMA, iov tag messages, raw requests);
a transfer's puts go through the compiled helper (``hotpath.c``: ``post_puts``), which also
holds the UCS log handler.

``ucxx`` loads the bundled ``libucx``; this module binds the same ``libucp.so.0`` /
``libucs.so.0`` it loaded, with structs as in UCX 1.21's ``ucp.h``. Only the thread that holds
the transport's loop calls these (its I/O thread, or a caller's turn: ``loop.Loop.lock``), one
at a time, except ``worker_signal``, which wakes that thread from any other.

Also here: ``Flush`` (one ``ucp_ep_flush_nbx``; ``send_tagged``'s requests too), ``IovFrames``
(packed runs sent or received as one iov per frame, in place) and ``frame_iovs`` (runs cut into
those frames).
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import ucxx  # noqa: F401  (loads the bundled libucx / libucxx)

from kvxfer.errors import ConnectError, TransportError

try:
    from . import hotpath
except ImportError as e:   # an install that did not build it
    raise ImportError(f"the UCX transport's compiled helper (transports/ucx/hotpath.c) is not built: {e}. "
                      "Run scripts/setup, or pip install -e . (needs a C compiler and the Python headers)") from e

log = logging.getLogger("kvxfer.transport.ucx")

_ucp, _ucs = ctypes.CDLL("libucp.so.0"), ctypes.CDLL("libucs.so.0")  # the copies ucxx loaded
# The same library, for short calls that keep the GIL (ctypes.PyDLL): releasing it costs a thread
# switch whenever another thread wants it, up to sys.getswitchinterval() (5 ms) while a caller's
# thread is busy in Python. Safe since the log handler is C (``hotpath``): UCX's async thread may log
# while it holds a lock such a call waits for, and a handler that needed the GIL would deadlock.
_ucp_held = ctypes.PyDLL("libucp.so.0")
_vp, _sz, _u64, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
_status_t = ctypes.c_int8  # ucs_status_t is a packed (one-byte) enum


def ucp_version() -> tuple[int, int, int]:
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    _ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    return major.value, minor.value, release.value


if ucp_version() >= (1, 21, 0):
    # ucxx sets UCX_MEMTYPE_CACHE=n (for old UCX releases) when it is imported; UCX 1.21 has no such
    # setting and warns "unused environment variable" at every context it makes.
    os.environ.pop("UCX_MEMTYPE_CACHE", None)


class MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t
    _fields_ = [("field_mask", _u64), ("address", _vp), ("length", _sz), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", _int), ("exported_memh_buffer", _vp)]


class MemAttr(ctypes.Structure):  # ucp_mem_attr_t
    _fields_ = [("field_mask", _u64), ("address", _vp), ("length", _sz), ("mem_type", _int)]


class RequestParam(ctypes.Structure):  # ucp_request_param_t
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("request", _vp), ("cb", _vp),
                ("datatype", _u64), ("user_data", _vp), ("reply_buffer", _vp), ("memory_type", _int),
                ("recv_info", _vp), ("memh", _vp)]


class TransportEntry(ctypes.Structure):  # ucp_transport_entry_t
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class Transports(ctypes.Structure):  # ucp_transports_t
    _fields_ = [("entries", ctypes.POINTER(TransportEntry)), ("num_entries", ctypes.c_uint), ("entry_size", _sz)]


class EpAttr(ctypes.Structure):  # ucp_ep_attr_t (sockaddr_storage: 128 bytes, 8-aligned)
    _fields_ = [("field_mask", _u64), ("name", ctypes.c_char * 32), ("local_sockaddr", _u64 * 16),
                ("remote_sockaddr", _u64 * 16), ("transports", Transports), ("user_data", _vp)]


EP_ATTR_TRANSPORTS = 1 << 3


def _fn(lib, name, res, *args):
    f = getattr(lib, name)
    f.restype, f.argtypes = res, list(args)
    return f


_P = ctypes.POINTER
mem_map = _fn(_ucp, "ucp_mem_map", _status_t, _vp, _P(MemMapParams), _P(_vp))
mem_unmap = _fn(_ucp, "ucp_mem_unmap", _status_t, _vp, _vp)
rkey_pack = _fn(_ucp, "ucp_rkey_pack", _status_t, _vp, _vp, _P(_vp), _P(_sz))
rkey_release = _fn(_ucp, "ucp_rkey_buffer_release", None, _vp)
rkey_unpack = _fn(_ucp, "ucp_ep_rkey_unpack", _status_t, _vp, ctypes.c_char_p, _P(_vp))
rkey_destroy = _fn(_ucp, "ucp_rkey_destroy", None, _vp)
put_nbx = _fn(_ucp, "ucp_put_nbx", _vp, _vp, _vp, _sz, _u64, _vp, _P(RequestParam))
ep_flush = _fn(_ucp_held, "ucp_ep_flush_nbx", _vp, _vp, _P(RequestParam))
request_status = _fn(_ucp_held, "ucp_request_check_status", _status_t, _vp)
request_free = _fn(_ucp_held, "ucp_request_free", None, _vp)
request_cancel = _fn(_ucp_held, "ucp_request_cancel", None, _vp, _vp)
tag_send = _fn(_ucp_held, "ucp_tag_send_nbx", _vp, _vp, _vp, _sz, _u64, _P(RequestParam))
tag_recv = _fn(_ucp_held, "ucp_tag_recv_nbx", _vp, _vp, _vp, _sz, _u64, _u64, _P(RequestParam))
worker_signal = _fn(_ucp_held, "ucp_worker_signal", _status_t, _vp)
mem_query = _fn(_ucp, "ucp_mem_query", _status_t, _vp, _P(MemAttr))
ep_query = _fn(_ucp, "ucp_ep_query", _status_t, _vp, ctypes.POINTER(EpAttr))
_status_str = _fn(_ucs, "ucs_status_string", ctypes.c_char_p, _int)
MEMMAP_ADDR_LEN, OP_ATTR_MEMH, OP_ATTR_MULTI_SEND, INPROGRESS = 0b11, 1 << 8, 1 << 19, 1
MEMMAP_MEMORY_TYPE, MEM_ATTR_MEM_TYPE = 1 << 4, 1 << 2
# ucs_memory_type_t
MEMORY_TYPES = ("host", "cuda", "cuda-managed", "rocm", "rocm-managed", "rdma", "ze-host", "ze-device", "ze-managed")
MEMORY_HOST, MEMORY_CUDA = 0, 1
OP_ATTR_DATATYPE, OP_ATTR_RECV_INFO, DT_IOV = 1 << 3, 1 << 7, 2   # ucp_dt_make_iov()
TRUNCATED = -9   # UCS_ERR_MESSAGE_TRUNCATED: a frame longer than its posted receive


class TagRecvInfo(ctypes.Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", _u64), ("length", _sz)]


tag_recv_test = _fn(_ucp_held, "ucp_tag_recv_request_test", _status_t, _vp, _P(TagRecvInfo))
PTR_ERR_MIN = 2**64 - 100  # UCS_PTR_IS_ERR: status pointers -100..-1
UCS_ERR_NOT_CONNECTED = -29


def _address(lib, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


# The compiled helper calls these itself, and installs a UCS log handler that needs no GIL:
# before UCX's default one (which abort()s on FATAL lines), it stops the FATAL line cma logs for a
# failed process_vm_writev/readv to a dead pid (the call then returns UCS_ERR_IO_ERROR instead).
hotpath.set_calls(_address(_ucp, "ucp_put_nbx"), _address(_ucp, "ucp_request_free"),
                  _address(_ucp, "ucp_worker_progress"), _address(_ucs, "ucs_log_push_handler"))
post_puts = hotpath.post_puts
progress = hotpath.progress
EMPTY_TABLE: np.ndarray = np.zeros(0, np.uint64)   # rkeys / put parameter blocks of none (``post_puts``)


def unpack_rkeys(ep: int, packed: list[bytes]) -> np.ndarray:
    """Unpack a peer's packed rkeys on our endpoint ``ep`` to it (b"": an empty region, none):
    uint64 handles, one per region (rkeys are per endpoint)."""
    handles = []
    try:
        for k in packed:
            h = ctypes.c_void_p()
            if k:
                check(rkey_unpack(ep, k, ctypes.byref(h)), "ucp_ep_rkey_unpack")
            handles.append(h.value or 0)
    except ConnectError:
        destroy_rkeys(np.array(handles, np.uint64))
        raise
    return np.array(handles, np.uint64)


def destroy_rkeys(handles: np.ndarray) -> None:
    """Destroy unpacked rkeys (0: an empty region had none); nothing may put with them after."""
    for h in handles.tolist():
        if h:
            rkey_destroy(h)


def log_cma_failures() -> None:
    """Log the cma copy failures the log handler stopped since the last call (I/O thread, each tick)."""
    count, line = hotpath.take_cma_failures()
    if count:
        log.error("UCX shared-memory copy failed %d time(s) (last at cma_ep.c:%d; peer gone?): failed the "
                  "operations instead of aborting", count, line)


def why(status: int) -> str:
    return _status_str(status).decode()


def check(status: int, what: str) -> None:
    if status != 0:
        raise ConnectError(f"{what} failed: {why(status)}")


def flush(eph: int, param: RequestParam) -> Flush:
    """One ``ucp_ep_flush_nbx`` on ``eph``. An endpoint already closed (``eph`` 0: ucxx closes an
    error-handling endpoint itself when its connection fails) has nothing left to flush: a Flush
    already failed with ``UCS_ERR_NOT_CONNECTED``, never a call on NULL (SIGSEGV inside UCX;
    measured: a prefill rank whose TCP connection the kernel gave up on during a partition,
    after it had disconnected that decode rank)."""
    if not eph:
        return Flush(2**64 + UCS_ERR_NOT_CONNECTED)
    return Flush(ep_flush(eph, ctypes.byref(param)))


class Flush:
    """One ``ucp_ep_flush_nbx`` (shared by the transfers whose puts it covers), or any other raw
    request polled the same way (``send_tagged``)."""
    __slots__ = ("ptr", "status")
    ptr: int | None       # the request while in progress
    status: int | None    # the UCS status once complete

    def __init__(self, st: int | None):
        self.ptr, self.status = (None, 0) if not st else (None, st - 2**64) if st >= PTR_ERR_MIN else (st, None)

    def poll(self) -> int | None:
        """None while in progress, else the UCS status (0 = every put is remotely visible)."""
        if self.ptr is not None and (s := request_status(self.ptr)) != INPROGRESS:
            request_free(self.ptr)
            self.ptr, self.status = None, s
        return self.status

    @property
    def completed(self) -> bool:
        return self.poll() is not None


_CONTIG_SEND = ctypes.byref(RequestParam())


def send_tagged(eph: int, buf: bytes, tag: int) -> Flush:
    """One ``ucp_tag_send_nbx`` of ``buf`` (kept alive by the caller until it completed) on
    ``eph``, as a request polled like a flush (``completed``); on a closed endpoint (``eph`` 0), one
    already failed. A third of what ucxx's ``tag_send`` costs: 63 bytes, 1 MiB eager transfers,
    medians 48 -> 33 us, packing included 68 -> 43."""
    if not eph:
        return Flush(2**64 + UCS_ERR_NOT_CONNECTED)
    return Flush(tag_send(eph, buf, len(buf), tag, _CONTIG_SEND))


class IovFrames:
    """The packed frames of one transfer, read from (sender) or written into (receiver) the
    runs themselves: one UCX iov per frame, so neither side gathers nor scatters. Frame ``k``
    holds the same bytes as the ``k``-th frame of a staging block (``frame_iovs``), so either
    side may use staging instead (CUDA regions do). Raw ucp requests, polled and freed here."""
    __slots__ = ("iovs", "sizes", "reqs", "error", "receiving", "_info")

    def __init__(self, iovs: list[np.ndarray]):
        self.iovs, self.sizes = iovs, [int(v[:, 1].sum()) for v in iovs]
        self.reqs: list[tuple[int, int]] = []   # (request pointer, frame) still in flight
        self.error, self.receiving, self._info = "", False, TagRecvInfo()

    def send(self, ep: int, tag: int) -> None:
        for k, v in enumerate(self.iovs):
            self._track(tag_send(ep, v.ctypes.data, len(v), tag | k, _IOV_SEND), k)

    def recv(self, worker: int, tag: int) -> None:
        """Post a receive per frame (before GO): every frame lands where this side said."""
        self.receiving = True
        for k, v in enumerate(self.iovs):
            info = TagRecvInfo()
            param = RequestParam(op_attr_mask=OP_ATTR_DATATYPE | OP_ATTR_RECV_INFO, datatype=DT_IOV,
                                  recv_info=ctypes.addressof(info))
            st = tag_recv(worker, v.ctypes.data, len(v), tag | k, 2**64 - 1, ctypes.byref(param))
            if st == 0:   # completed at once (the frame was already here): its length is in info
                self._check_length(k, info.length)
            self._track(st, k)

    def _track(self, st: int | None, k: int) -> None:
        if st and st >= PTR_ERR_MIN:
            self._fail(k, st - 2**64)
        elif st:
            self.reqs.append((st, k))

    def _fail(self, k: int, status: int) -> None:
        if not self.error:
            self.error = f"malformed frame: frame {k} is longer than its {self.sizes[k]} bytes" \
                if status == TRUNCATED else f"frame {k}: {why(status)}"

    def _check_length(self, k: int, length: int) -> None:
        if length != self.sizes[k] and not self.error:
            self.error = f"malformed frame: frame {k} has {length} bytes, {self.sizes[k]} expected"

    def poll(self) -> bool:
        """True once no request is in flight (then ``error`` says whether all went well)."""
        left = []
        for ptr, k in self.reqs:
            st = tag_recv_test(ptr, ctypes.byref(self._info)) if self.receiving else request_status(ptr)
            if st == INPROGRESS:
                left.append((ptr, k))
                continue
            if st != 0:
                self._fail(k, st)
            elif self.receiving:
                self._check_length(k, self._info.length)
            request_free(ptr)
        self.reqs = left
        return not left

    @property
    def completed(self) -> bool:   # as ucxx requests have it (``_zombies``)
        return self.poll()

    def cancel(self, worker: int) -> None:
        """Cancel posted receives not matched yet; a matched one still lands (poll until done)."""
        for ptr, _ in self.reqs:
            request_cancel(worker, ptr)


_IOV_SEND_PARAM = RequestParam(op_attr_mask=OP_ATTR_DATATYPE, datatype=DT_IOV)
_IOV_SEND = ctypes.byref(_IOV_SEND_PARAM)


def frame_iovs(addr: np.ndarray, n: np.ndarray, frame: int) -> list[np.ndarray]:
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


def ep_transports(ep: int) -> list[tuple[str, str]]:
    """(transport, device) of each lane of endpoint ``ep`` (``ucp_ep_query``), e.g.
    ``[("tcp", "eth0"), ("sysv", "memory")]``; [] when UCX cannot say."""
    entries = (TransportEntry * 16)()
    attr = EpAttr(field_mask=EP_ATTR_TRANSPORTS)
    attr.transports = Transports(ctypes.cast(entries, ctypes.POINTER(TransportEntry)), 16,
                                 ctypes.sizeof(TransportEntry))
    if ep_query(ep, ctypes.byref(attr)) != 0:
        return []
    out = []
    for e in entries[:min(attr.transports.num_entries, 16)]:
        name = (e.transport_name or b"?").decode(errors="replace")
        dev = (e.device_name or b"?").decode(errors="replace")
        if (name, dev) not in out:
            out.append((name, dev))
    return out


def memory_type_of(device) -> int:
    """The ``ucs_memory_type_t`` of memory on a torch device: cuda -> CUDA, cpu -> HOST."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        return MEMORY_CUDA
    if kind == "cpu":
        return MEMORY_HOST
    raise TransportError(f"UCX cannot register memory on a {kind!r} device (only cpu and cuda)")


def memory_type_name(n: int | None) -> str:
    return "unknown" if n is None else MEMORY_TYPES[n] if 0 <= n < len(MEMORY_TYPES) else f"type {n}"


def registered_memory_type(memh: int) -> int | None:
    """What UCX made of a registration (``ucp_mem_query``), or None when it cannot say."""
    attr = MemAttr(field_mask=MEM_ATTR_MEM_TYPE)
    return int(attr.mem_type) if mem_query(memh, ctypes.byref(attr)) == 0 else None


def registration_mismatch(index: int, device, want: int, got: int | None) -> str | None:
    """Why registered region ``index`` (on ``device``) cannot be used, or None: UCX registered it
    as another memory type than asked (a CUDA region as host memory: a UCX without CUDA support,
    whose puts would read device pointers as host ones)."""
    if got is None or got == want:
        return None
    hint = " (this UCX has no CUDA support, or its cuda module did not load: check `ucx_info -d`; a system " \
           "UCX built with CUDA: RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)" if want == MEMORY_CUDA else ""
    return (f"UCX registered region {index} on {device} as {memory_type_name(got)} memory, not "
            f"{memory_type_name(want)}{hint}")
