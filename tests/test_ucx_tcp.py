"""UCX over TCP (what a user without shared memory or RDMA gets): the settings the transport
gives UCX's TCP transport, and packed rows that cross it as frames of many iov pieces."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from xfer_peer import raw_plan  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx.settings import TCP_DEFAULTS, ucx_settings, with_tcp_defaults  # noqa: E402


def test_tcp_sends_carry_many_iov_pieces_unless_told_otherwise():
    """UCX's TCP_MAX_IOV of 6 cut packed frames into a system call per ~5 rows (TP 2 -> 4 across
    namespaces: 0.3x of raw TCP; 128: 0.55-0.6x). The environment and the caller still win, and
    the shared-memory settings are untouched."""
    assert TCP_DEFAULTS == {"TCP_MAX_IOV": "128"}
    for tls in (None, "tcp"):
        given = ucx_settings(tls, None, {})
        assert with_tcp_defaults(given, {}) == {**given, "TCP_MAX_IOV": "128"}
    assert "TCP_MAX_IOV" not in with_tcp_defaults(ucx_settings(None, None, {}), {"UCX_TCP_MAX_IOV": "6"})
    assert with_tcp_defaults(ucx_settings(None, {"TCP_MAX_IOV": "16"}, {}), {})["TCP_MAX_IOV"] == "16"


def test_the_tcp_defaults_reach_ucx(monkeypatch):
    """The transport hands ``TCP_DEFAULTS`` to UCX itself: a value UCX refuses (1024 pieces:
    "AM Zcopy context (16416) must be <= TX segment size") fails start-up, as a ``ConfigError``
    naming the settings (UCX's own error mapped into the tree); ours starts."""
    from ucxx._lib.libucxx import UCXError

    from kvxfer.errors import ConfigError
    from kvxfer_transports.ucx import settings
    monkeypatch.delenv("UCX_TCP_MAX_IOV", raising=False)
    monkeypatch.setattr(settings, "TCP_DEFAULTS", {"TCP_MAX_IOV": "1024"})
    with pytest.raises(ConfigError, match="UCX refused the settings .*'TCP_MAX_IOV': '1024'") as e:
        get_transport("ucx", tls="tcp").close()
    assert isinstance(e.value.__cause__, UCXError)
    monkeypatch.undo()
    get_transport("ucx", tls="tcp").close()


@pytest.mark.parametrize("far", [False, True], ids=["tls-tcp", "far-worker"])
def test_packed_rows_cross_tcp_byte_exact(far):
    """2048 rows of 512 B, scattered on both sides (no two touch), 1 MiB in frames of 64 KiB:
    128 iov pieces a frame on each side, more than one TCP send carries. UCX accepts the
    setting (a value it refuses fails the context) and every byte lands where the plan says,
    nothing between the rows is touched. ``far``: through the second worker a peer in another
    network namespace gets (its own context, the same settings)."""
    opts = {"frame_bytes": 64 << 10} | ({} if far else {"tls": "tcp"})
    rx, tx = get_transport("ucx", **opts), get_transport("ucx", **opts)
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    dst = torch.full((2 << 20,), 0xA5, dtype=torch.uint8)
    rows = 2048
    so = np.random.default_rng(3).permutation(rows).astype(np.int64) * 2048   # scattered source rows
    do = np.arange(rows, dtype=np.int64) * 768                                   # 256 B gaps at the receiver
    n, z = np.full(rows, 512, np.int64), np.zeros(rows, np.int64)
    try:
        rx.register([dst])
        tx.register([src])
        desc = rx.descriptor()
        if far:   # as a peer in another network namespace of this kernel describes itself
            ids = desc["host"].split("/")
            desc = {**desc, "host": "/".join([ids[0], ids[1], str(int(ids[2]) + 1)])}
        peer = tx.connect(desc)
        zz = np.zeros(1, np.int64)
        rx.expect("tcp.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "tcp.1", raw_plan(z, so, z, do, n), timeout=20)
        assert h.wait(20), h.error
        got = dst.numpy()
        want = src.numpy()
        for s, d in zip(so.tolist(), do.tolist()):
            assert np.array_equal(got[d: d + 512], want[s: s + 512])
            assert (got[d + 512: d + 768] == 0xA5).all()
        assert (got[rows * 768:] == 0xA5).all()
    finally:
        tx.close()
        rx.close()
