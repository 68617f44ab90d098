"""The staged frame cut (``transports/ucx/frames.py``): both sides compute the same frames from
the announced runs alone; frames hold whole runs (long runs in frame-sized pieces), never more
than ``frame_bytes``, cut greedily; ``Stream.part`` gives each side's runs of one frame."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ucxx")

from kvxfer_transports.ucx.bindings import frame_iovs  # noqa: E402
from kvxfer_transports.ucx.frames import Stream, byte_cut, cut, network_only, stream_iovs  # noqa: E402

runs = st.lists(st.integers(1, 40_000), min_size=0, max_size=300)
frames = st.integers(4096, 1 << 17)


def _reference(n: list[int], frame: int) -> list[int]:
    """A Python loop per piece: what ``cut`` computes with numpy."""
    pieces = [min(frame, k - o) for k in n for o in range(0, k, frame)]
    bounds, at, used = [0], 0, 0
    for p in pieces:
        if used + p > frame:
            bounds.append(at)
            used = 0
        at, used = at + p, used + p
    return bounds + [at] if at else bounds


@settings(max_examples=300, deadline=None)
@given(runs, frames)
def test_cut_matches_a_loop_and_keeps_its_bounds(n, frame):
    b = cut(np.array(n, np.int64), frame)
    assert b.tolist() == _reference(n, frame)
    size = np.diff(b)
    assert b[0] == 0 and b[-1] == sum(n) and (size > 0).all() and (size <= frame).all()
    # greedy: a frame and the next together never fit one frame (so frames <= 2 * total / frame + 1)
    assert (size[:-1] + size[1:] > frame).all()
    assert len(size) <= 2 * sum(n) // frame + 1
    # whole runs: every run that fits a frame starts and ends in the same frame
    ends = np.cumsum(n)
    starts = ends - np.array(n, np.int64)
    fit = np.array(n, np.int64) <= frame
    assert (np.searchsorted(b, starts[fit], "right") == np.searchsorted(b, ends[fit], "left")).all()
    assert set(b.tolist()) <= set(ends.tolist()) | {0} | {int(s + k * frame) for s, m in zip(starts, n)
                                                           for k in range(1, -(-m // frame))}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=200), st.integers(0, 10**6), frames, st.data())
def test_both_sides_find_the_same_bytes_in_a_frame(n, seed, frame, data):
    """The sender's source runs are merged differently from the destination runs the cut uses:
    ``part`` of each side still covers exactly the frame's bytes, in stream order."""
    rng = np.random.default_rng(seed)
    n = np.array(n, np.int64)
    total = int(n.sum())
    dst = Stream(np.zeros(len(n), np.int64), np.cumsum(n) - n, n)   # contiguous destination
    # source: the same stream cut at other places
    cuts = np.unique(rng.integers(1, total, min(total - 1, 50))) if total > 1 else np.zeros(0, np.int64)
    edges = np.concatenate([[0], cuts, [total]])
    src_n = np.diff(edges)
    src_off = rng.permutation(len(src_n)) * 100_000
    src = Stream(np.ones(len(src_n), np.int64), src_off, src_n)
    b = cut(n, frame)
    image = np.arange(total)   # byte k of the stream is k
    src_mem = np.empty(len(src_n) * 100_000, np.int64)
    for o, k, e in zip(src_off, src_n, edges[:-1]):
        src_mem[o: o + k] = image[e: e + k]
    for k in range(len(b) - 1):
        lo, hi = int(b[k]), int(b[k + 1])
        reg, off, m = src.part(lo, hi)
        assert (reg == 1).all() and (m > 0).all() and m.sum() == hi - lo
        got = np.concatenate([src_mem[o: o + c] for o, c in zip(off, m)])
        assert np.array_equal(got, image[lo:hi])
        _, doff, dm = dst.part(lo, hi)
        assert doff[0] == lo and dm.sum() == hi - lo


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40_000), min_size=1, max_size=100), frames)
def test_in_place_frames_hold_the_cut_bytes(n, frame):
    """What a host receiver posts for staged frames: one iov per frame of ``cut``, pieces in
    stream order, each frame exactly its bytes; for ``byte_cut`` the same as ``frame_iovs``."""
    n = np.array(n, np.int64)
    addr = np.cumsum(n) - n + 10_000_000 + np.arange(len(n)) * 64   # gaps between runs
    for b in (cut(n, frame), byte_cut(int(n.sum()), frame)):
        iovs = stream_iovs(addr, n, b)
        assert [int(v[:, 1].sum()) for v in iovs] == np.diff(b).tolist()
        flat = np.concatenate(iovs)
        stream = np.concatenate([np.arange(a, a + k) for a, k in flat.astype(np.int64).tolist()])
        assert np.array_equal(stream, np.concatenate([np.arange(a, a + k) for a, k in zip(addr, n)]))
    same = frame_iovs(addr, n, frame)
    assert all(np.array_equal(x, y) for x, y in zip(same, stream_iovs(addr, n, byte_cut(int(n.sum()), frame))))


def test_byte_cut_and_edges():
    assert byte_cut(10_000, 4096).tolist() == [0, 4096, 8192, 10_000]
    assert byte_cut(8192, 4096).tolist() == [0, 4096, 8192]
    assert cut(np.zeros(0, np.int64), 4096).tolist() == [0]
    assert cut(np.array([4096 * 3]), 4096).tolist() == [0, 4096, 8192, 12288]
    assert cut(np.array([100, 5000, 100]), 4096).tolist() == [0, 100, 4196, 5200]


def test_which_tls_leave_no_shared_memory():
    assert network_only("tcp") and network_only("^sm,cma") and network_only("tcp,self")
    assert not network_only("") and not network_only("sm,self") and not network_only("cma,tcp,self")
    assert not network_only("^tcp") and not network_only("all")


def test_the_staged_flag_on_the_wire():
    """Unstaged ANNOUNCEs keep the older 10-field wire (older peers read them); the flag is an
    exact 0 or 1 (a bool, 2 or a string is refused, answerably)."""
    from kvxfer_transports.ucx.protocol import Announce, Malformed, parse_message
    runs = np.array([[0], [0], [8192]], "<i8").tobytes()
    for staged in (False, True):
        a = Announce(1, "r", 1.0, b"", runs, 0, 4096, b"", b"", staged)
        assert len(a.wire()) == (11 if staged else 10) and parse_message(a.wire(), 1 << 20) == a
    base = Announce(1, "r", 1.0, b"", runs, 0, 4096, b"", b"").wire()
    for bad in (True, 2, -1, "1"):
        with pytest.raises(Malformed) as e:
            parse_message(base + [bad], 1 << 20)
        assert e.value.answer == (1, "r")
