"""UCX transport pieces that need no peer process: settings, descriptor checks at connect,
the contract's edges, iov framing, and a clean start-up log (moved out of ``test_ucx.py``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from kvxfer.errors import PeerError, TransportError  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.base import TransferStatus  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402


def plan_of(groups) -> TransferPlan:
    """``groups``: (src offsets, dst offsets, lengths, packed) in region 0 on both sides."""
    z = np.zeros(1, np.int64)
    return TransferPlan(tuple(RunGroup(z, z, z, z, np.asarray(s, np.int64), np.asarray(d, np.int64),
                                       np.broadcast_to(np.asarray(n, np.int64), np.shape(s)).copy(), p)
                              for s, d, n, p in groups))


def test_frame_iovs_carry_the_bytes_of_staging_frames():
    """Frame k of an iov transfer holds the bytes frame k of a staging block would: the runs
    back to back, cut every frame_bytes (runs cut where a boundary falls inside them)."""
    from kvxfer_transports.ucx import frame_iovs as _frame_iovs
    rng = np.random.default_rng(7)
    for trial in range(300):
        k = int(rng.integers(1, 30))
        n = rng.integers(0, 3000, k).astype(np.int64)
        n[rng.integers(0, k)] += 1   # at least one byte
        addr = rng.integers(0, 1 << 40, k).astype(np.int64)
        frame = int(rng.integers(1, 2500))
        if trial % 3 == 0:           # equal runs that divide the frame: no run is cut
            n[:], frame = 64, 64 * int(rng.integers(1, 8))
        frames = _frame_iovs(addr, n, frame)
        stream = np.concatenate([a + np.arange(c) for a, c in zip(addr, n)])
        assert len(frames) == -(-int(n.sum()) // frame)
        got = [np.concatenate([int(a) + np.arange(int(c)) for a, c in f]) for f in frames]
        assert [len(g) for g in got] == [min(frame, len(stream) - i * frame) for i in range(len(frames))]
        assert np.array_equal(np.concatenate(got), stream) and all((f[:, 1] > 0).all() for f in frames)


def test_ucx_settings_defaults_give_way_to_environment_and_caller():
    from kvxfer_transports.ucx import UCX_DEFAULTS, ucx_settings
    assert ucx_settings(None, None, {}) == UCX_DEFAULTS
    assert "SYSV_FIFO_SIZE" not in ucx_settings(None, None, {"UCX_SYSV_FIFO_SIZE": "256"})
    assert ucx_settings("tcp", {"SYSV_FIFO_SIZE": "64", "RNDV_THRESH": "8192"}, {}) == {
        "SYSV_FIFO_SIZE": "64", "RNDV_THRESH": "8192", "TLS": "tcp"}


def test_peers_with_different_shared_memory_settings_refuse_to_connect(monkeypatch):
    """A sender indexes the receiver's shared-memory FIFO with its own size: a pair that
    disagrees would hang, so connect() refuses it and names the setting."""
    monkeypatch.delenv("UCX_SYSV_FIFO_SIZE", raising=False)
    a = get_transport("ucx")
    b = get_transport("ucx", ucx_config={"SYSV_FIFO_SIZE": "256"})
    try:
        for t in (a, b):
            t.register([torch.zeros(4096, dtype=torch.uint8)])
        with pytest.raises(TransportError, match="UCX_SYSV_FIFO_SIZE 4096 here, 256 at the peer"):
            a.connect(b.descriptor())
        old = {k: v for k, v in b.descriptor().items() if k != "shm_settings"}   # a peer that does not say
        with pytest.raises(TransportError, match="UCX_SYSV_FIFO_SIZE 256 here, unset at the peer"):
            b.connect(old)
        assert a.connect(a.descriptor()) == a.id   # the same settings connect
    finally:
        a.close()
        b.close()


def test_contract_edges():
    t = get_transport("ucx", tls="tcp")
    t.register([torch.zeros(4096, dtype=torch.uint8)])
    h = t.submit("nobody", "r", plan_of([([0], [0], [16], False)]), timeout=1)
    assert h.poll() == TransferStatus.FAILED and isinstance(h.error, PeerError)
    with pytest.raises(TransportError):
        t.connect({"id": "x"})
    t.close()
    t.close()  # idempotent
    h = t.submit("nobody", "r", plan_of([([0], [0], [16], False)]), timeout=1)
    assert h.poll() == TransferStatus.FAILED


@pytest.mark.slow   # seconds
def test_no_ucx_warning_noise_at_start_up():
    """ucxx sets UCX_MEMTYPE_CACHE for old UCX releases; the bundled UCX warns about it at every
    context unless the transport drops it: a rank's log starts clean."""
    import subprocess
    import sys
    code = "import kvxfer; t = kvxfer.get_transport('ucx'); t.close(); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "UCX  WARN" not in r.stderr, r.stderr[-2000:]
