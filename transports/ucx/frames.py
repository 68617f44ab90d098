"""Staged frames: the frame cut both sides compute, and one transfer's frames through a ring.

Packed runs are one byte stream (run after run, as the ANNOUNCE lists the destination runs).
A *staged* transfer moves that stream as frames of at most ``frame_bytes`` through fixed ring
slots (``kit.StagingPool(frames=...)``): the sender gathers frame ``k`` into a free slot and
tag-sends it; a CUDA receiver receives it into a free slot of its own ring and scatters it, a
host receiver too when its pieces are small, else it posts it in place (``stream_iovs``). So a
transfer of any size takes at most the rings' memory (issue #18), and over TCP the sender hands
UCX one contiguous buffer per frame instead of thousands of 512 B iov pieces (issue #17).

``cut`` is the frame cut. Both sides call it on the same input (the announced packed run
lengths and the ANNOUNCE's ``frame_bytes``), so they agree on every frame's bytes without a
word on the wire: frames hold whole runs, cut greedily; a run longer than a frame is cut into
frame-sized pieces first (the receiver merges runs that continue each other, so an announced
run may be long). ``byte_cut`` is the older cut (every ``frame_bytes`` bytes), which senders
of unstaged frames (host iov) use; the ANNOUNCE's ``staged`` flag says which one applies.

``Stream.part(lo, hi)`` is the runs of one side holding stream bytes ``[lo, hi)``: the
sender's source runs (which its own merging cut elsewhere) and the receiver's destination runs.

Who calls what: ``Planner.prepare_transfer`` (caller's thread) builds a ``Stream`` and
bounds; ``Sender.pump_frames`` (I/O thread) gathers and sends; ``Receiver.on_announce``
and ``Receiver.poll_data`` (I/O thread) do the same on the other side.
"""
from __future__ import annotations

import numpy as np
import torch

_I8 = np.int64

# Where host memory is staged (``UCXOptions.stage_host``): "network" stages packed frames
# for peers reached over the network (a peer on another host or network namespace, reached
# through the FAR_TLS worker, or any peer of a transport whose UCX_TLS has no shared memory),
# "always" stages every one, "never" none. Unstaged host frames are UCX iovs read and written
# in place: best in shared memory, where UCX copies each piece once anyway. Over TCP each
# 512 B piece costs UCX a descriptor, and one gathered buffer per frame is faster (issue #17;
# scripts/bench_hosts.py --ucx-tls tcp --ucx-stage ..., UCX over TCP between namespace hosts,
# TP 2 -> 4, 64 MiB, idle box, medians of 6-9 vs raw TCP in the same run: 0.57x not staged,
# 0.57x staged by the sender only (the receiver's iovs in place), 0.74x staged and taken
# through the receiver's ring, so a receiver takes staged host frames through its ring when its
# own pieces are small). That was with 512 B destination rows; since the sender merges the
# destination runs in stream (token-major slots: a few long runs), such a receiver posts each
# frame in place, one copy less (``Receiver.rings_host``; TP 2 -> 4 page-major -> token-major,
# UCX far, same session, interleaved: 0.72-0.81x of raw TCP in place vs 0.65-0.72x ring).
# "network" stages only pieces this small on average (on the side with more of them): over TCP
# a piece costs UCX an iov entry, cheap for pages, dear for 512 B rows. Measured the same way:
# TP 1 -> 1 (32 KiB runs) 0.85x in place vs 0.71x staged; TP 2 -> 4 (512 B rows) 0.53x vs 0.80x.
STAGE_BELOW = 8 * 1024
SHARED_MEMORY_TLS = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "all")


def small_pieces(total: int, pieces: int) -> bool:
    """Are ``pieces`` runs of ``total`` bytes small on average (below ``STAGE_BELOW``)? The rule
    both ends apply to host memory with ``stage_host="network"``: the sender stages such runs
    (``Planner.stages_host``), the receiver takes such frames through its ring
    (``Receiver.rings_host``)."""
    return total < STAGE_BELOW * pieces


def network_only(tls: str) -> bool:
    """Does a ``UCX_TLS`` value leave no shared-memory transport ("tcp", "^sm,cma")? Unset or
    one naming shared memory: False."""
    tls = tls.strip()
    if not tls:
        return False
    names = [x.strip() for x in tls.lstrip("^").split(",")]
    shm = any(x in SHARED_MEMORY_TLS for x in names)
    return shm if tls.startswith("^") else not shm


def cut(nbytes: np.ndarray, frame_bytes: int) -> np.ndarray:
    """Frame bounds of a stream of runs of ``nbytes`` (each > 0): ``b[0] = 0``, ``b[-1]`` the
    total, frame ``k`` is stream bytes ``[b[k], b[k+1])``, at most ``frame_bytes`` each. Whole
    runs, greedily; a run longer than a frame goes in frame-sized pieces (from its start; its
    last, shorter piece starts the next frame). Python steps: one per frame that holds a run
    end, one per long run (its full pieces at once), so at most ~2 per run: proportional to
    the ANNOUNCE, never to bytes / frame_bytes."""
    n = np.asarray(nbytes, _I8)
    if not len(n):
        return np.zeros(1, _I8)
    ends = np.cumsum(n)
    starts = ends - n
    total, f = int(ends[-1]), int(frame_bytes)
    out: list = [np.zeros(1, _I8)]
    at = 0
    while at < total:
        j = int(np.searchsorted(starts, at))
        if j < len(n) and int(starts[j]) == at and int(n[j]) > f:   # a long run: its full pieces
            k = int(n[j]) // f
            out.append(at + f * np.arange(1, k + 1, dtype=_I8))
            at += k * f
        else:   # the farthest run end within a frame (one exists: at starts a short run or a last piece)
            at = int(ends[np.searchsorted(ends, at + f, side="right") - 1])
            out.append(np.array([at], _I8))
    return np.concatenate(out)


def byte_cut(total: int, frame_bytes: int) -> np.ndarray:
    """Frame bounds every ``frame_bytes`` bytes (unstaged frames: ``bindings.frame_iovs``)."""
    return np.append(np.arange(0, total, frame_bytes, dtype=_I8), _I8(total))


def stream_iovs(addr: np.ndarray, n: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """The bytes of runs ``(addr, n)`` back to back, cut at stream offsets ``bounds`` (``cut``):
    one iov per frame, ``[pieces, 2]`` uint64 of (address, length) as ``ucp_dt_iov_t``. What a
    host receiver posts for staged frames: they land in place, no ring, no scatter.
    (``bindings.frame_iovs`` is the same for ``byte_cut``.)"""
    keep = n > 0
    addr, n = addr[keep], n[keep]
    ends = np.cumsum(n)
    starts, total = ends - n, int(ends[-1])
    inner = bounds[1:-1]                                              # where frames 1, 2, ... start
    k = np.minimum(np.searchsorted(starts, inner), len(starts) - 1)
    mid = inner[starts[k] != inner]                                   # ... inside a run: cut it there
    piece = np.insert(starts, np.searchsorted(starts, mid), mid) if len(mid) else starts
    run = np.searchsorted(starts, piece, side="right") - 1
    iov = np.empty((len(piece), 2), np.uint64)
    iov[:, 0] = addr[run] + (piece - starts[run])
    iov[:, 1] = np.diff(np.append(piece, total))
    return np.split(iov, np.searchsorted(piece, inner))


class Stream:
    """Runs ``(region, offset, nbytes)`` read (or written) back to back as one byte stream."""
    __slots__ = ("region", "offset", "nbytes", "start")

    def __init__(self, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray):
        self.region, self.offset, self.nbytes = (np.asarray(a, _I8) for a in (region, offset, nbytes))
        self.start = np.cumsum(self.nbytes) - self.nbytes

    def part(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs holding stream bytes ``[lo, hi)`` (0 <= lo < hi <= total), the first and
        last cut to them: (region, offset, nbytes) arrays."""
        a = int(np.searchsorted(self.start, lo, side="right")) - 1
        b = int(np.searchsorted(self.start, hi, side="left"))
        reg, off, n = self.region[a:b], self.offset[a:b].copy(), self.nbytes[a:b].copy()
        head, tail = lo - int(self.start[a]), int(self.start[b - 1] + self.nbytes[b - 1]) - hi
        off[0] += head
        n[0] -= head
        n[-1] -= tail
        return reg, off, n


def ucx_buffer(t: torch.Tensor):
    """ucxx buffer for a uint8 tensor (a ring slot): numpy for host memory, CUDA array interface otherwise."""
    from ucxx._lib.arr import Array
    return Array(t.numpy() if t.device.type == "cpu" else t)


class Completes:
    """``until`` for ``StagingPool.put``: a ring slot is free once this UCX request completed
    (a send still reads it; a receive still writes it)."""
    __slots__ = ("req",)

    def __init__(self, req):
        self.req = req

    @property
    def done(self) -> bool:
        return bool(self.req.completed)


class RingHold:
    """The frame receives of an ended transfer that still write receive-ring slots: the object
    of its ``Landing.draining`` entry (``fencing``: released once they completed, or once the sender is
    proven dead). Its slots are free again when their own receive completed, or the entry is gone."""
    __slots__ = ("reqs",)

    def __init__(self, reqs: list):
        self.reqs = reqs

    def poll(self) -> bool:
        return all(r.completed for r in self.reqs)

    @property
    def completed(self) -> bool:
        return self.poll()


class HeldSlot:
    """``until`` of one slot of a ``RingHold``: done when its receive completed or ``held()``
    (is the hold still fenced?) says no."""
    __slots__ = ("req", "held")

    def __init__(self, req, held):
        self.req, self.held = req, held

    @property
    def done(self) -> bool:
        return bool(self.req.completed) or not self.held()


class RingSpill:
    """Receive-ring capacity that held slots took away, given back (issue 35). A slot is held
    while a frame receive of an ended transfer may still write it (``receiver``):
    until the receive completes, or its sender is proven dead, or ``quarantine_timeout``. A
    sender that cannot be proven dead (alive but silent, or gone without a trace) would hold its
    slots for good, and a few such senders the whole ring. So while slots are held, frames of
    their own ("spill") stand in for them, as many in use as are held: the ring never shrinks, and
    what a silent sender keeps is its own share (the frames it had in flight, at most the ring).
    I/O thread only."""
    __slots__ = ("frame_bytes", "live", "held")

    def __init__(self, frame_bytes: int):
        self.frame_bytes = frame_bytes
        self.live: dict[int, torch.Tensor] = {}   # spill frames in use, held ones too, by address
        self.held: list = []                      # (until, spill frame or None) of held slots

    def prune(self) -> None:
        """Forget holds that ended (I/O thread, each turn while any is kept)."""
        if self.held:
            keep = []
            for until, frame in self.held:
                if not until.done:
                    keep.append((until, frame))
                elif frame is not None:
                    self.live.pop(frame.data_ptr(), None)
            self.held = keep

    def room(self) -> bool:
        """May a spill frame be taken now (the ring has none free)?"""
        self.prune()
        return len(self.live) - sum(1 for _, f in self.held if f is not None) < len(self.held)

    def get(self, device) -> torch.Tensor:
        frame = torch.empty(self.frame_bytes, dtype=torch.uint8, device=device)
        self.live[frame.data_ptr()] = frame
        return frame

    def owns(self, slot: torch.Tensor) -> bool:
        return self.live.get(slot.data_ptr()) is slot

    def put(self, frame: torch.Tensor) -> None:
        """A spill frame landed: gone."""
        self.live.pop(frame.data_ptr(), None)

    def hold(self, until, frame: torch.Tensor | None = None) -> None:
        """A slot (a ring slot, or spill ``frame``) is held until ``until.done``."""
        self.held.append((until, frame))

    def stats(self) -> dict:   # any thread: a snapshot, as of the I/O thread's last turn
        return {"spill": len(self.live), "held": len(self.held)}


class StagedFrames:
    """One transfer's staged frames: its side's ``Stream``, the bounds, the next frame to
    issue (sender), the frames in flight: ``(request, frame, slot)``, and which frames came
    (receiver: a frame sent twice is refused, so one cannot stand in for a missing one)."""
    __slots__ = ("stream", "bounds", "next", "reqs", "device", "seen")

    def __init__(self, stream: Stream, bounds: np.ndarray, device):
        self.stream, self.bounds, self.next, self.device = stream, bounds, 0, device
        self.reqs: list = []
        self.seen = np.zeros(len(bounds) - 1, bool)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def size(self, k: int) -> int:
        return int(self.bounds[k + 1] - self.bounds[k])

    def part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.stream.part(int(self.bounds[k]), int(self.bounds[k + 1]))
