"""Which transports reach a peer (issue 17): a peer on another host or in another network
namespace is connected through a worker without shared memory and cma (``FAR_TLS``), unless the
user chose UCX's transports. The decision is pure (``settings.reach``, ``far_path``); the path
itself is checked in-process by a descriptor that says "another network namespace" (the netns
run itself: ``test_multihost.py::test_ucx_across_namespaces_without_a_tls_setting``)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from xfer_peer import raw_plan  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx import bindings as ucp  # noqa: E402
from kvxfer_transports.ucx.settings import far_path, reach, tls_explicit  # noqa: E402

ME = "b00t/4026531836/4026531833"


@pytest.mark.parametrize("theirs, where", [
    (ME, "same"),
    ("b00t/4026531836/4026532999", "netns"),
    ("b00t/4026532000/4026531833", "same"),      # another PID namespace, same network: shared memory reaches
    ("other-boot/4026531836/4026531833", "host"),
    ("", "unknown"), ("garbage", "unknown"), ("b00t//4026531833", "unknown"), ("a/b/c/d", "unknown"),
])
def test_reach(theirs, where):
    assert reach(ME, theirs) == where
    assert reach("", theirs) == "unknown"


def test_far_path_only_where_shared_memory_cannot_reach_and_the_user_did_not_choose():
    assert far_path("netns", False) and far_path("host", False)
    assert not far_path("same", False) and not far_path("unknown", False)
    assert not far_path("netns", True) and not far_path("host", True)   # an explicit UCX_TLS is honoured
    assert tls_explicit("tcp", None, {}) and tls_explicit(None, {"TLS": "tcp"}, {})
    assert tls_explicit(None, None, {"UCX_TLS": "tcp"}) and not tls_explicit(None, {"RNDV_THRESH": "1"}, {})


def elsewhere(desc: dict, part: int) -> dict:
    """The descriptor as a peer in another network namespace (part 2) or host (part 0) sends it."""
    ids = desc["host"].split("/")
    ids[part] = ids[part] + "0" if part == 0 else str(int(ids[part]) + 1)
    return {**desc, "host": "/".join(ids)}


@pytest.mark.parametrize("part, tls", [(2, None), (0, None), (2, "sm,self")])
def test_a_peer_elsewhere_goes_over_transports_that_reach_it(part, tls, caplog):
    opts = {"tls": tls} if tls else {}
    rx, tx = get_transport("ucx", **opts), get_transport("ucx", **opts)
    dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    try:
        rx.register([dst])
        tx.register([src])
        with caplog.at_level(logging.INFO, logger="kvxfer.transport.ucx"):
            peer = tx.connect(elsewhere(rx.descriptor(), part))
        p = tx.peers[peer]
        lanes = tx.call_io(lambda: ucp.ep_transports(p.ep.handle))
        if tls:   # the user's choice stands
            assert not p.far and tx.workers.far_worker is None
            assert {t for t, _ in lanes} <= {"sysv", "posix", "self", "cma"}, lanes
        else:
            assert p.far and lanes and {t for t, _ in lanes} == {"tcp"}, lanes
            said = [r.getMessage() for r in caplog.records if "over tcp/" in r.getMessage()]
            assert said and ("another network namespace" in said[0] if part == 2 else "another host" in said[0])
            warned = [r for r in caplog.records if r.levelno == logging.WARNING and "TCP only" in r.getMessage()]
            assert bool(warned) == (part == 0), [r.getMessage() for r in caplog.records]
        z = np.zeros(1, np.int64)
        rx.expect("r.1", ByteRanges(z, z, np.full(1, 1 << 20, np.int64)))
        h = tx.submit(peer, "r.1", TransferPlan((RunGroup(z, z, z, z, z, np.array([4096]), np.array([1 << 19]),
                                                           False),)), timeout=10)
        assert h.wait(10), h.error
        assert torch.equal(dst[4096: 4096 + (1 << 19)], src[: 1 << 19])
        assert bool((dst[:4096] == 0xA5).all()) and bool((dst[4096 + (1 << 19):] == 0xA5).all())
        # Packed runs (frames, not puts, 320 KiB: not inline): 80 runs of 4 KiB, 2 KiB apart.
        off = (1 << 19) + np.arange(80, dtype=np.int64) * 6144
        n, zz = np.full(80, 4096, np.int64), np.zeros(80, np.int64)
        rx.expect("r.2", ByteRanges(z, z, np.full(1, 1 << 20, np.int64)))
        h = tx.submit(peer, "r.2", raw_plan(zz, off, zz, off, n), timeout=10)
        assert h.wait(10), h.error
        for o in off.tolist():
            assert torch.equal(dst[o: o + 4096], src[o: o + 4096]) and bool((dst[o + 4096: o + 6144] == 0xA5).all())
    finally:
        tx.close()
        rx.close()
