"""Page-locked host memory: plain allocations, zeroed in pieces, registered with the CUDA driver.

Never a ``pin_memory=True`` tensor: the caching host allocator rounds those up to a power of
two (a 300 GiB pinned tensor asks it for 512 GiB). ``KVPool`` builds its host regions with
``host_buffer`` and unregisters them with ``unregister_all``.
"""
from __future__ import annotations

import torch

from .errors import LayoutError

# Host memory is zero-filled (first touch) and registered with the CUDA driver in pieces of
# this many bytes: bounded work per call, and no caching-allocator rounding (a 300 GiB pinned
# tensor from ``pin_memory=True`` asks the caching host allocator for 512 GiB).
HOST_CHUNK = 1 << 30


def register_host_memory(ptr: int, nbytes: int) -> None:
    """Page-lock ``[ptr, ptr + nbytes)`` with the CUDA driver (``cudaHostRegister``), as engines
    in the field do for their host KV pools. Called by ``host_buffer`` once per region."""
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        raise LayoutError(f"cudaHostRegister of {nbytes} bytes failed (error {int(rc)}): lower the HostPool size "
                          f"or raise the locked-memory limit (ulimit -l)")


def unregister_host_memory(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A zeroed host byte buffer from a plain allocation (no rounding), touched in
    ``HOST_CHUNK`` pieces, then registered with the driver as one range when ``pin`` (so one
    copy may span the whole region). The caller unregisters (``HostPool.close``)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    for a in range(0, nbytes, HOST_CHUNK):
        t[a: a + HOST_CHUNK].zero_()
    if pin and nbytes:
        register_host_memory(t.data_ptr(), nbytes)
    return t


def unregister_all(ptrs: list[int]) -> None:
    for ptr in ptrs:
        unregister_host_memory(ptr)


__all__ = ["HOST_CHUNK", "host_buffer", "register_host_memory", "unregister_host_memory", "unregister_all"]
