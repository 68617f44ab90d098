"""UCX receiving side: check an ANNOUNCE whole, answer GO, land packed frames, ACK after DONE.

``UCXReceiver`` is a mixin of ``UCXTransport``; its methods run on the I/O thread, except
``writes_pending`` (any thread). ``_on_announce`` checks every announced run against the grant
and the regions before GO; ``_poll_data`` receives packed frames (in place for host memory,
into staging for CUDA); ``_try_finish`` lands and acknowledges; ``_fail_in`` ends a transfer and
keeps the grant's memory marked (``writes_pending``) while puts or posted receives may land.

No oracle: the FAIL a peer gets for a refusal because of the grant (unknown, ended or live
request, runs outside it) reads the same; only the local counters and arrivals tell them apart.
"""
from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from kvxfer.copy import copy_runs
from kvxfer.plan import Runs
from kvxfer.transport.base import Arrival
from kvxfer.transport.kit import peer_reason

from . import bindings as ucp
from .protocol import DATA_BIT, FRAME_BITS, KIND_MASK, Ack, Announce, Fail, Go
from .sender import ucx_buffer
from .state import Incoming, Peer

if TYPE_CHECKING:
    from kvxfer.grant import GrantTable
    from kvxfer.transport.kit import StagingPool

    from .protocol import Message






class UCXReceiver:
    """Receiver half of ``UCXTransport`` (see the module docstring)."""

    # Declared for the type checker only: set in ``UCXTransport.__init__`` or defined by the
    # other halves (``UCXControl``, ``UCXSender``, ``UCXTransport``). Annotations, no values,
    # so nothing here shadows the real attributes at run time.
    grants: GrantTable
    max_incoming: int
    max_incoming_per_peer: int
    _worker: Any                      # ucx_api.UCXWorker
    _whandle: int                     # its ucp_worker_h (None once freed)
    _regions: list[torch.Tensor]
    _base: np.ndarray
    _region_sizes: np.ndarray
    _is_host: np.ndarray
    _all_host: bool
    _cuda_devices: set[torch.device]
    _in: dict[tuple[str, int], Incoming]
    _by_dtag: dict[int, Incoming]
    _landing: dict[tuple[str, int], tuple[str, int, float]]
    _landing_rids: collections.Counter
    _open_rids: collections.Counter
    _draining: list
    _zombies: list
    _dtags: itertools.count[int]
    _staging: StagingPool
    _acts: int
    _send: Callable[[Peer, Message], None]
    _deliver: Callable[[Arrival], None]

    def _on_announce(self, p, m: Announce) -> None:
        xid, rid = m.xid, m.request_id
        runs, nput, inline = m.run_array(), m.nput, m.inline
        reg, off, n = runs
        # Without the grant's capability: handled exactly as an ANNOUNCE for an unknown id (the same
        # answer: no oracle; grants.check and is_live refuse it) but with no arrival: it never
        # fails or completes the request.
        quiet = not self.grants.capability_ok(rid, m.cap)
        if len(self._in) >= self.max_incoming or p.open_in >= self.max_incoming_per_peer:
            return self._refuse(p, xid, rid, 0, m.notify, self.grants.reject(
                rid, f"too many transfers: {len(self._in)} open, {p.open_in} from this peer"), quiet)
        # An empty transfer writes nothing: acknowledged whatever its request id (no oracle)
        reason = self.grants.check(rid, reg, off, n, m.cap) if len(n) else None
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
            return self._refuse(p, xid, rid, int(n.sum()) if ok else 0, m.notify, reason, quiet)
        i = Incoming(p, xid, rid, time.monotonic() + m.timeout, int(n.sum()), m.notify, tuple(packed), None,
                     m.frame_bytes, 0 if inline else -(-total // m.frame_bytes), puts=nput, cap=m.cap)
        self._open_rids[rid] += 1   # writes_pending until _forget_in (forget() fails it asynchronously)
        self._in[(p.id, xid)] = i
        p.open_in += 1
        if inline:  # checked a moment ago: lands now, with no re-check and no frames
            self._land(i.packed, torch.frombuffer(bytearray(inline), dtype=torch.uint8))
            i.packed = None
        elif total and (self._all_host or self._is_host[packed[0]].all()):   # frames land in the runs themselves
            i.iov = ucp.IovFrames(ucp.frame_iovs(self._base[packed[0]] + packed[1], packed[2], m.frame_bytes))
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
        self._send(p, Go(xid, i.dtag))

    def _refuse(self, p, xid: int, rid: str, nbytes: int, notify: bytes, reason: str, quiet: bool = False) -> None:
        if not quiet:   # quiet: a wrong capability, which must not touch the request
            self._deliver(Arrival(rid, nbytes, False, reason, notify))
        self._send(p, Fail(xid, peer_reason(reason)))

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
                junk = np.empty(1, np.uint8)   # a 1-byte receive: UCX truncates and drops the rest
                self._zombies.append((self._worker.tag_recv_with_handle(Array(junk), res), junk))
                continue
            view = i.staging[k * i.frame_bytes: k * i.frame_bytes + want]
            i.reqs.append(self._worker.tag_recv_with_handle(ucx_buffer(view), res))
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

    def _try_finish(self, i: Incoming) -> None:
        if not i.done or i.got < i.frames or i.reqs:
            return
        if i.packed is not None and len(i.packed[2]):
            # The request may have ended while the frames were on their way: check before landing them.
            if (reason := self.grants.check(i.rid, *i.packed, i.cap)) is not None:
                return self._fail_in(i, reason)
            self._land(i.packed, i.staging)
        self._forget_in(i)
        self._staging.put(i.staging)
        if i.nbytes or self.grants.is_live(i.rid, i.cap):   # an empty transfer of no live request: ACK only
            self._deliver(Arrival(i.rid, i.nbytes, True, "", i.notify))
        self._send(i.peer, Ack(i.xid))

    def _land(self, packed: tuple, data: torch.Tensor) -> None:
        """Write consecutive bytes of ``data`` to the packed runs (region, offset, length arrays)
        with copy_runs, which sees the staging rows as evenly spaced (~1.5x scatter_runs here)."""
        region, offset, nbytes = packed
        copy_runs([data], self._regions, Runs(np.zeros_like(nbytes), np.cumsum(nbytes) - nbytes, region, offset,
                                              nbytes, np.ones(len(nbytes), bool)))
        for dev in self._cuda_devices:  # "arrived" means in place, not queued on a stream
            torch.cuda.current_stream(dev).synchronize()

    def _forget_in(self, i: Incoming) -> None:
        """End ``i`` here. Whatever may still land of it is marked (``_draining``) before it stops
        counting as open, so ``writes_pending`` (any thread) never sees a gap."""
        self._by_dtag.pop(i.dtag, None)
        self._zombies.extend((r, i.staging) for r in i.reqs)  # posted receives still own the staging block
        if i.iov is not None and not i.iov.poll():   # receives posted into the grant's memory
            i.iov.cancel(self._whandle)
            self._draining.append((i.peer.id, i.rid, i.iov, int(i.packed[2].sum()) if i.packed is not None else 0,
                                   time.monotonic()))
            self._landing_rids[i.rid] += 1   # writes_pending until they are all done
        if self._in.pop((i.peer.id, i.xid), None) is not None:
            i.peer.open_in -= 1
            self._open_rids[i.rid] -= 1
            if self._open_rids[i.rid] <= 0:
                del self._open_rids[i.rid]

    def _reap_draining(self) -> None:
        """Ended transfers whose posted receives are all done: nothing more of them lands."""
        left = []
        for entry in self._draining:
            if entry[2].poll():
                self._landed(entry[1])
            else:
                left.append(entry)
        self._draining = left

    def _fail_in(self, i: Incoming, reason: str, tell: bool = True, puts_left: bool = True) -> None:
        if puts_left and i.dtag and i.puts and not i.done and (i.peer.id, i.xid) in self._in \
                and (i.peer.id, i.xid) not in self._landing:   # GO went out: puts may come, silent peer or not
            self._landing[(i.peer.id, i.xid)] = (i.rid, i.nbytes, time.monotonic())
            self._landing_rids[i.rid] += 1
        self._forget_in(i)   # after: writes_pending stays True throughout
        self._deliver(Arrival(i.rid, i.nbytes, False, reason, i.notify))
        if tell:
            self._send(i.peer, Fail(i.xid, peer_reason(reason)))

    def _landed(self, rid: str) -> None:
        self._landing_rids[rid] -= 1
        if self._landing_rids[rid] <= 0:
            del self._landing_rids[rid]

    def writes_pending(self, request_id: str) -> bool:
        """Decode's endpoint, any thread, after ``forget``: True while a sender that had GO for this
        request has not proven its puts flushed (DONE or ABORT after its flush, or a re-handshake),
        or frames posted into the grant are not done, and the sender is not proven dead. A silent
        sender keeps it True (silence is not death); see ``fencing()``. Until it is False the
        grant's memory must not be reused. Transfers of the request still open here count too:
        ``forget`` fails them on the I/O thread a moment later."""
        return request_id in self._landing_rids or (request_id in self._open_rids
                                                    and not self.grants.is_live(request_id))

    def _drop_request(self, rid: str) -> None:
        for i in [i for i in self._in.values() if i.rid == rid]:
            self._fail_in(i, self.grants.reject(rid, "ended request: the receiver forgot it mid-transfer"))
