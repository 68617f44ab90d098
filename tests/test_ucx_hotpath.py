"""The UCX transport's compiled helper (``transports/ucx/hotpath.c``): ``post_puts`` checks every
row before it posts any, and moves exactly the bytes of its rows, with the source region's
parameter block (its memh: near peers) or one without (far peers); its UCS log handler stops
cma's FATAL line (UCX's own handler would abort) and counts it."""
from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("ucxx")

from ucx_pair import CANARY, connected_pair  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer_transports.ucx import bindings as ucp  # noqa: E402
from kvxfer_transports.ucx import hotpath  # noqa: E402

KiB = 1 << 10
REGION = 256 * KiB


def _rows(*rows) -> bytes:
    return np.array(rows, "<i8").reshape(-1, 5).tobytes()


@pytest.fixture
def pair():
    """(receiver, sender, peer id, source, destination): one region each, connected in-process."""
    yield from connected_pair(REGION, 3, heartbeat=0.2)


@pytest.mark.parametrize("row, why", [
    ((0, 0, 4096, 2, 0), "source region 2 of 2"),     # no such source region
    ((0, 0, 4096, 0, 2), "destination region 2 of 2"),
    ((0, 0, 4096, -1, 0), "source region -1"),
    ((0, 0, 0, 0, 0), "has 0 bytes"),
    ((0, 0, 4096, 0, 1), "no rkey"),                    # region 1 had none (empty)
    ((0, 0, 4096, 1, 0), "no parameter block"),        # source region 1 has none
])
def test_a_bad_row_posts_nothing(row, why):
    """ep 0 would crash UCX if anything were posted: the check comes first, for every row."""
    good = (0, 0, 4096, 0, 0)
    with pytest.raises(ValueError, match="put 1 has") as e:
        hotpath.post_puts(0, _rows(good, row), np.array([7, 0], np.uint64), np.array([9, 0], np.uint64))
    assert why in str(e.value)


def test_tables_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match="not rows of 5"):
        hotpath.post_puts(0, b"\0" * 48, np.array([7], np.uint64), np.array([9], np.uint64))
    with pytest.raises(ValueError, match="rkeys has 12 bytes"):
        hotpath.post_puts(0, b"", b"\0" * 12, np.array([9], np.uint64))
    assert hotpath.post_puts(0, b"", ucp.EMPTY_TABLE, ucp.EMPTY_TABLE) == (0, 0)   # nothing to post


@pytest.mark.parametrize("memh", [True, False], ids=["memh", "no memh"])
def test_posted_puts_land_exactly(pair, memh):
    """Rows of both sizes (below and above the GIL-holding threshold) land byte-exact, nothing else moves."""
    rx, tx, pid, src, dst = pair
    p = tx.peers[pid]
    param = tx.regions.params[0] if memh else ucp.RequestParam()   # the region's own, or as far peers have
    params = np.array([ctypes.addressof(param)], np.uint64)
    rows = [(src.data_ptr() + s, int(p.base[0]) + d, n, 0, 0)
            for s, d, n in [(0, 4096, 100), (8192, 16384, 4096), (64 * KiB, 128 * KiB, 96 * KiB)]]

    def post():
        posted, status = hotpath.post_puts(p.ep.handle, _rows(*rows), p.rkeys, params)
        f = ucp.Flush(ucp.ep_flush(p.ep.handle, ctypes.byref(param)))
        while f.poll() is None:
            tx.workers.progress(True)
        return posted, status, f.status

    assert tx.call_io(post) == (3, 0, 0)
    want = np.full(REGION, CANARY, np.uint8)
    for s, d, n, _, _ in rows:
        want[d - int(p.base[0]): d - int(p.base[0]) + n] = src.numpy()[s - src.data_ptr(): s - src.data_ptr() + n]
    assert np.array_equal(dst.numpy(), want)


_CMA_LINE = """
import ctypes
from kvxfer_transports.ucx import bindings, hotpath
comp = ctypes.create_string_buffer(256)
ctypes.CDLL("libucs.so.0").ucs_log_dispatch(b"/src/uct/sm/scopy/cma/cma_ep.c", 123, b"uct_cma_ep_tx", 0, comp,
                                             b"process_vm_writev(pid=1) failed")
print(hotpath.take_cma_failures(), hotpath.take_cma_failures())
"""


@pytest.mark.slow   # a subprocess
def test_cma_fatal_line_is_stopped_and_counted():
    """Without the handler, UCX's own one aborts the process on this FATAL line."""
    out = subprocess.run([sys.executable, "-c", _CMA_LINE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "(1, 123) (0, 123)", out.stdout


def test_cma_failures_are_logged(caplog, monkeypatch):
    monkeypatch.setattr(hotpath, "take_cma_failures", lambda: (2, 77))
    with caplog.at_level(logging.ERROR, "kvxfer.transport.ucx"):
        ucp.log_cma_failures()
    assert "failed 2 time(s) (last at cma_ep.c:77" in caplog.text


def test_a_transfer_whose_puts_cannot_be_posted_fails_whole(pair):
    """The peer's rkeys are gone (as once it is released): the transfer fails with the reason,
    its source is released, the receiver is told (ABORT) and not a byte lands."""
    rx, tx, pid, src, dst = pair
    p = tx.peers[pid]
    keys = tx.call_io(lambda: p.rkeys)
    tx.call_io(setattr, p, "rkeys", ucp.EMPTY_TABLE)
    z = np.zeros(1, np.int64)
    plan = TransferPlan((RunGroup(z, z, z, z, np.array([0]), np.array([0]), np.array([64 * KiB]), False),))
    rx.expect("r.1", ByteRanges(z, z, np.full(1, REGION, np.int64)))
    h = tx.submit(pid, "r.1", plan, timeout=10)
    assert h.wait(10) is False and "no parameter block, or no rkey" in str(h.error), h.error
    assert h.source_released
    (arr,) = rx.arrivals(timeout=10)
    assert not arr.ok and arr.request_id == "r.1", arr
    assert bool((dst == CANARY).all())
    tx.call_io(setattr, p, "rkeys", keys)


def test_progress_checks_its_workers_and_returns_when_nothing_moves(pair):
    """``progress`` refuses a NULL worker or too many of them; over idle workers it returns 0 at
    once, whatever its budget (a bound, not a wait)."""
    rx, tx, _, _, _ = pair
    with pytest.raises(ValueError, match="worker 0 is NULL"):
        hotpath.progress((0,), 1000, True)
    with pytest.raises(ValueError, match="at most 8"):
        hotpath.progress(tuple(range(1, 10)), 1000, True)

    def idle():
        hotpath.progress(tx.workers.handles, 10**9, True)   # what is left of the connect
        t = time.monotonic()
        moved = hotpath.progress(tx.workers.handles, 10**10, False)   # 10 s: a bound, not a wait
        return moved, time.monotonic() - t
    moved, took = tx.call_io(idle)
    assert moved == 0 and took < 5, (moved, took)
