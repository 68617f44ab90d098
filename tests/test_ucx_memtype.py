"""Registration with a memory type (issue 18): each region is mapped with the memory type of its
device (cuda -> UCS_MEMORY_TYPE_CUDA, cpu -> HOST), and what UCX made of it is read back
(``ucp_mem_query``). A CUDA region that UCX registered as host memory (a UCX without CUDA
support) is refused with an error that names the region. CPU only: the mismatch is injected by
replacing what the query answers; the device check itself is in ``scripts/gpu_check_ucx.py``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from kvxfer.errors import TransportError  # noqa: E402
from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.plan import RunGroup, TransferPlan  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx import bindings as ucp  # noqa: E402


def test_device_to_memory_type():
    assert ucp.memory_type_of(torch.device("cpu")) == ucp.MEMORY_HOST == 0
    assert ucp.memory_type_of(torch.device("cuda", 3)) == ucp.MEMORY_CUDA == 1
    assert ucp.memory_type_of("cuda:0") == ucp.MEMORY_CUDA
    with pytest.raises(TransportError, match="meta"):
        ucp.memory_type_of(torch.device("meta"))
    assert [ucp.memory_type_name(n) for n in (0, 1, None, 99)] == ["host", "cuda", "unknown", "type 99"]


def test_mismatch_names_the_region():
    assert ucp.registration_mismatch(2, "cuda:1", ucp.MEMORY_CUDA, ucp.MEMORY_CUDA) is None
    assert ucp.registration_mismatch(2, "cuda:1", ucp.MEMORY_CUDA, None) is None   # UCX could not say
    why = ucp.registration_mismatch(2, "cuda:1", ucp.MEMORY_CUDA, ucp.MEMORY_HOST)
    assert why and "region 2 on cuda:1 as host memory, not cuda" in why and "CUDA support" in why


def test_host_regions_register_as_host_and_still_move_byte_exact():
    rx, tx = get_transport("ucx"), get_transport("ucx")
    dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    try:
        rx.register([dst, torch.zeros(0, dtype=torch.uint8)])
        tx.register([src])
        assert tx.memory_types() == ["host"] and rx.memory_types() == ["host", ""]
        peer = tx.connect(rx.descriptor())
        z = np.zeros(1, np.int64)
        rx.expect("m.1", ByteRanges(z, z, np.full(1, 1 << 20, np.int64)))
        h = tx.submit(peer, "m.1", TransferPlan((RunGroup(z, z, z, z, z, np.array([64]), np.array([1 << 19]),
                                                           False),)), timeout=10)
        assert h.wait(10), h.error
        assert torch.equal(dst[64: 64 + (1 << 19)], src[: 1 << 19])
        assert bool((dst[:64] == 0xA5).all()) and bool((dst[64 + (1 << 19):] == 0xA5).all())
    finally:
        tx.close()
        rx.close()


def test_a_region_registered_as_another_memory_type_is_refused(monkeypatch):
    """UCX answers "cuda" for a host region here (injected): register() refuses, naming region 1,
    and leaves nothing mapped."""
    real = ucp.registered_memory_type
    seen = []

    def query(memh):
        seen.append(memh)
        return ucp.MEMORY_CUDA if len(seen) == 2 else real(memh)
    monkeypatch.setattr(ucp, "registered_memory_type", query)
    t = get_transport("ucx")
    try:
        with pytest.raises(TransportError, match="region 1 on cpu as cuda memory, not host"):
            t.register([torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)])
        assert t.regions.memh == [] and t.regions.rkeys_packed == [] and t.regions.tensors == []
    finally:
        t.close()


def test_a_region_ucx_cannot_map_is_named(monkeypatch):
    """ucp_mem_map refuses region 1 (injected: as a UCX without CUDA refuses a CUDA type):
    register() says which region, of what memory type, and leaves nothing mapped."""
    real, calls = ucp.mem_map, []

    def mem_map(ctx, params, memh):
        calls.append(1)
        return -3 if len(calls) == 2 else real(ctx, params, memh)   # UCS_ERR_NO_MEMORY... any error
    monkeypatch.setattr(ucp, "mem_map", mem_map)
    t = get_transport("ucx")
    try:
        with pytest.raises(TransportError, match=r"ucp_mem_map of region 1 \(host memory on cpu, 4096 bytes\)"):
            t.register([torch.zeros(8192, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)])
        assert t.regions.memh == [] and t.regions.rkeys_packed == []
    finally:
        t.close()
