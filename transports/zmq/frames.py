"""An outgoing transfer's runs cut into messages, made lazily as zmq takes them.

Runs of at least ``zero_copy_min`` bytes in CPU regions go out as zero-copy views of the region
(split into ``frame_bytes`` parts, ``frames_per_message`` parts per message); shorter runs, and
every run of a CUDA region, are gathered into staging frames of ~``frame_bytes *
frames_per_message`` (host regions: one compiled call per frame, ``kvxfer.copy.gather_runs``;
CUDA: ``rows.gather_rows`` on the device), sorted by region pair, so that runs back to back
in the frame and at the receiver travel as one run. Staging frames come from the transport's ring
(``kit.StagingPool``) and are reused once zmq has sent them; when none is free the transfer waits.

Who calls what: the sender (``sender.py``, I/O thread) calls ``Framer.frames`` or
``Framer.frames_few`` once per transfer it starts and takes messages from the iterator one at a
time as zmq accepts them. Each message is (runs bytes, parts, staging buffer or None, last?);
None instead of a message means "no staging frame free yet, ask again" (``starved`` is then set,
so the loop looks again soon).
"""
from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch

from kvxfer.copy import gather_runs
from kvxfer.plan import merge_runs
from kvxfer.transport.kit import StagingPool, split_long_runs

from .options import ZMQOptions
from .protocol import MAX_PARTS, RUN_BYTES
from .regions import Regions
from .rows import gather_rows, region_spans

Message = tuple[bytes, list, "torch.Tensor | None", bool]


def pack_runs(runs: list[tuple[int, int, int, int, int]]) -> bytes:
    """The header's runs field for (src region, src offset, dst region, dst offset, nbytes) runs."""
    return struct.pack(f"<{3 * len(runs)}q", *[r[2] for r in runs], *[r[3] for r in runs], *[r[4] for r in runs])


def pairs_in_order(sr: np.ndarray, dr: np.ndarray) -> bool:
    """Do the runs come sorted by (destination region, source region) already, as a plan's runs do
    (so no sort is needed to bring each region pair's runs together)?"""
    change = np.flatnonzero((sr[1:] != sr[:-1]) | (dr[1:] != dr[:-1]))
    if not len(change):
        return True
    before, after = (dr[change], sr[change]), (dr[change + 1], sr[change + 1])
    return bool(((after[0] > before[0]) | ((after[0] == before[0]) & (after[1] > before[1]))).all())


def fill_messages(runs: list[tuple], budget: int, overhead: int) -> list[list[tuple]]:
    """Runs in order, cut into messages of at most ``budget`` bytes (each run costing its
    length plus ``overhead``) and ``MAX_PARTS`` runs; a longer run gets a message of its own."""
    out: list[list[tuple]]
    cur: list[tuple]
    out, cur, used = [], [], 0
    for run in runs:
        cost = run[4] + overhead
        if cur and (used + cost > budget or len(cur) == MAX_PARTS):
            out.append(cur)
            cur, used = [], 0
        cur.append(run)
        used += cost
    return out + [cur] if cur else out


class Framer:
    """Makes the messages of outgoing transfers (I/O thread). ``starved``: a transfer waited for a
    staging frame since the loop last looked (the loop clears it)."""

    def __init__(self, options: ZMQOptions, regions: Regions, staging: StagingPool):
        self.frame_bytes, self.per_message = options.frame_bytes, options.frames_per_message
        self.zero_copy_min = options.zero_copy_min
        self.regions, self.staging = regions, staging
        self.starved = False

    def frames(self, sr, so, dr, do, n) -> Iterator[Message | None]:
        """The messages of runs given as int64 arrays (any regions)."""
        fb, host, is_host = self.frame_bytes, self.regions.host, self.regions.is_host
        n, (so, do), (sr, dr) = split_long_runs(fb, n, (so, do), (sr, dr))
        zc = (n >= self.zero_copy_min) & is_host[sr] if len(n) and int(n.max()) >= self.zero_copy_min else None

        def runs(dr, do, n) -> bytes:
            return np.concatenate((dr, do, n)).astype("<i8").tobytes()

        def views(sr, so, n) -> list[memoryview]:
            return [memoryview(host[r][o: o + c]) for r, o, c in zip(sr.tolist(), so.tolist(), n.tolist())]

        # Zero-copy runs: messages of at most fb * per_message bytes and MAX_PARTS parts.
        zmsgs: list[np.ndarray] = []
        if zc is not None and (zsel := np.flatnonzero(zc)).size:
            cost = n[zsel]
            frame_of = (np.cumsum(cost) - cost) // (fb * self.per_message) * len(zsel) \
                + np.arange(len(zsel)) // MAX_PARTS
            zmsgs = np.split(zsel, np.flatnonzero(np.diff(frame_of)) + 1)
        # Packed runs, as contiguous columns (the plan's own arrays when that is every run, in
        # order: no copy), sorted by region pair, so that runs back to back in the frame and at
        # the receiver travel as one run; then cut into messages of ~fb * per_message bytes
        # (header bytes count), as slices [a, b) of the columns.
        cols = (sr, so, dr, do, n) if zc is None or not zc.any() else tuple(c[~zc] for c in (sr, so, dr, do, n))
        k = len(cols[4])
        if k > 1 and not pairs_in_order(cols[0], cols[2]):
            order = np.lexsort((cols[0], cols[2]))   # stable: plan order within a region pair
            cols = tuple(c[order] for c in cols)
        pos = np.concatenate(([0], np.cumsum(cols[4])))   # each packed run's place in their byte stream
        packed = fb * self.per_message   # measured: packed frames gain from size, zero-copy parts do not
        cuts = [0, k] if k else [0]
        if k > 1 and pos[-1] + RUN_BYTES * k > packed:
            start = pos[:-1] + RUN_BYTES * np.arange(k)   # a frame's bytes: its runs and their headers
            cuts = [0, *np.unique(np.searchsorted(start, packed * np.arange(1, start[-1] // packed + 1))).tolist(), k]
        smsgs = list(zip(cuts[:-1], cuts[1:]))
        left = len(zmsgs) + len(smsgs)          # messages still to make: 1 is the last
        if not left:
            yield b"", [], None, True   # an empty transfer still sends its totals
        for sel in zmsgs:
            left -= 1
            yield runs(dr[sel], do[sel], n[sel]), views(sr[sel], so[sel], n[sel]), None, not left
        for a, b in smsgs:
            left -= 1
            part = tuple(c[a:b] for c in cols)
            if b - a == 1 and is_host[part[0][0]]:     # a lone run needs no staging
                yield runs(*part[2:]), views(part[0], part[1], part[4]), None, not left
                continue
            while (base := self._stage()) is None:
                yield None   # the staging ring is exhausted: asked again once zmq freed a frame
            size = int(pos[b] - pos[a])
            try:
                msg = self._gather(pos[a: b + 1] - pos[a], base, *part)
            except BaseException:
                self.staging.put(base)   # never handed to zmq: free again at once
                raise
            yield msg, [memoryview(base[:size].numpy())], base, not left  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only

    def _gather(self, pos, base, sr, so, dr, do, n) -> bytes:
        """A packed frame: the runs (column slices) gathered into ``base`` at ``pos``; returns the
        header's runs. Host sources: one compiled call for the whole frame
        (``kvxfer.copy.gather_runs``: a memmove per run, 1.1-1.8x ``index_select`` of the same rows
        from a cold pool)."""
        host = self.regions.all_host or bool(self.regions.is_host[sr].all())
        if host:
            gather_runs(self.regions.tensors, sr, so, n, out=base[: pos[-1]])
        header = []
        for a, b in region_spans(sr, dr):         # loop per region pair in the frame
            if not host:   # a frame with CUDA regions: each region pair's runs in one indexed copy
                region = self.regions.tensors[sr[a]]
                out = base[pos[a]: pos[b]] if region.is_cpu else torch.empty(
                    int(pos[b] - pos[a]), dtype=torch.uint8, device=region.device)
                gather_rows(region, so[a:b], n[a:b], out)
                if not region.is_cpu:   # gathered on the device, then one copy to pinned host memory
                    base[pos[a]: pos[b]].copy_(out)
            # Runs back to back in the frame and at the receiver are one run there: a head
            # slice of token-major pages gathers 512 B rows into 8 KiB destination runs.
            start, _, length = merge_runs(do[a:b], pos[a:b], n[a:b])
            header.append((np.full(len(start), dr[a]), start, length))
        return np.concatenate([np.concatenate(c) for c in zip(*header)]).astype("<i8").tobytes()

    def frames_few(self, runs: list[tuple[int, int, int, int, int]]) -> Iterator[Message | None]:
        """``frames`` for a few runs in CPU regions, as ``TransferPlan.run_tuples`` gives them."""
        fb, budget, host = self.frame_bytes, self.frame_bytes * self.per_message, self.regions.host
        views: list[tuple[int, int, int, int, int]]
        small: list[tuple[int, int, int, int, int]]
        views, small = [], []
        for r, o, d, e, c in runs:
            for x in range(0, c, fb):   # runs longer than a frame go in frame-sized chunks
                (views if c >= self.zero_copy_min else small).append((r, o + x, d, e + x, min(fb, c - x)))
        vmsgs, smsgs = fill_messages(views, budget, 0), fill_messages(small, budget, RUN_BYTES)
        left = len(vmsgs) + len(smsgs)
        if not left:
            yield b"", [], None, True
        for msg in vmsgs:
            left -= 1
            yield pack_runs(msg), [memoryview(host[r][o: o + c]) for r, o, _, _, c in msg], None, not left
        for msg in smsgs:
            left -= 1
            if len(msg) == 1:   # a lone run needs no staging
                r, o, _, _, c = msg[0]
                yield pack_runs(msg), [memoryview(host[r][o: o + c])], None, not left
                continue
            while (base := self._stage()) is None:
                yield None   # the staging ring is exhausted: asked again once zmq freed a frame
            stage, p = base.numpy(), 0
            for r, o, _, _, c in msg:   # host regions, checked in bounds: nothing here raises
                stage[p: p + c] = host[r][o: o + c]
                p += c
            yield pack_runs(msg), [memoryview(stage[:p])], base, not left  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on Python >= 3.12 only

    def _stage(self) -> torch.Tensor | None:
        """A frame of the staging ring for a packed message, or None (counted as a wait) while
        every frame is still in zmq: the I/O thread never allocates one, it waits."""
        if not self.staging.available():
            self.starved = True   # the loop looks again soon
            return None
        return self.staging.get(self.frame_bytes * (self.per_message + 1))
