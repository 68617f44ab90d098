"""The local regions of a UCX transport: mapped for RMA once, and the forms each side reads them in.

Who calls what: ``UCXTransport.register`` runs ``register`` on the I/O thread (once: every
region mapped with ``ucp_mem_map``, its rkey packed for ``descriptor()``, one put parameter block
per region); ``Planner`` and ``Sender`` read the sources through ``tensors``, ``base`` and the
parameter tables; ``Receiver`` writes destinations through ``tensors`` and ``host_views``;
``Lifecycle.shutdown`` calls ``unmap``. ``memory_types`` (I/O thread) says what UCX registered.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvxfer.errors import TransportError
from kvxfer.grant import GrantTable

from . import bindings as ucp
from .workers import Workers


class Regions:
    """The regions given to ``register`` (ids = positions) and their UCX registrations."""

    def __init__(self, workers: Workers, grants: GrantTable):
        self.workers, self.grants = workers, grants
        self.tensors: list[torch.Tensor] = []
        self.base = np.zeros(0, np.int64)   # region addresses (and as Python ints: ``base_list``)
        self.base_list: list[int] = []
        self.sizes = np.zeros(0, np.int64)
        self.size_list: list[int] = []
        self.is_host, self.all_host = np.zeros(0, bool), True
        self.host_list: list[bool] = []
        self.host_views: list = []   # numpy view of each host region (None: CUDA): a few runs go through them
        self.cuda_devices: set[torch.device] = set()
        self.memh: list[int | None] = []
        self.params: list[ucp.RequestParam] = []
        self.put_params = self.put_params_far = ucp.EMPTY_TABLE   # see register()
        self.far_put_param = ucp.RequestParam(op_attr_mask=ucp.OP_ATTR_MULTI_SEND)
        self.rkeys_packed: list[bytes] = []

    def register(self, regions: list[torch.Tensor]) -> None:
        """I/O thread, once: map every region for RMA and pack its rkey (TransportError naming the
        region when UCX refuses it or registers it as another memory type than asked)."""
        if self.memh:
            raise TransportError("register() was already called on this UCX transport")
        ctx = self.workers.ctx
        cuda = [t.device for t in regions if t.is_cuda]
        if cuda:   # this thread makes every UCX call, CUDA copies of frames too: on the regions' device
            torch.cuda.set_device(cuda[0])
        for k, t in enumerate(regions):
            memh, buf, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
            if t.numel():
                want = ucp.memory_type_of(t.device)
                params = ucp.MemMapParams(ucp.MEMMAP_ADDR_LEN | ucp.MEMMAP_MEMORY_TYPE, t.data_ptr(), t.numel(),
                                          memory_type=want)
                st = ucp.mem_map(ctx.handle, ctypes.byref(params), ctypes.byref(memh))
                if st != 0:
                    self._unmap_all()
                    raise TransportError(f"ucp_mem_map of region {k} ({ucp.memory_type_name(want)} memory on "
                                         f"{t.device}, {t.numel()} bytes) failed: {ucp.why(st)}")
                why = ucp.registration_mismatch(k, t.device, want, ucp.registered_memory_type(memh.value))
                if why:
                    ucp.mem_unmap(ctx.handle, memh.value)
                    self._unmap_all()
                    raise TransportError(why)
                ucp.check(ucp.rkey_pack(ctx.handle, memh, ctypes.byref(buf), ctypes.byref(size)),
                          "ucp_rkey_pack")
                self.rkeys_packed.append(ctypes.string_at(buf, size.value))
                ucp.rkey_release(buf)
            else:
                self.rkeys_packed.append(b"")
            self.memh.append(memh.value)
            # One put parameter block per source region: its memh spares UCX a registration lookup;
            # MULTI_SEND: a transfer's puts are all in flight at once (bandwidth over latency), as NIXL asks.
            self.params.append(ucp.RequestParam(op_attr_mask=(ucp.OP_ATTR_MEMH if memh.value else 0) |
                                                ucp.OP_ATTR_MULTI_SEND, memh=memh.value))
        self.tensors = regions
        # post_puts' parameter block per source region: its own (near peers), or one without a memh
        # (far peers: another context, our handles are not its own)
        self.put_params = np.array([ctypes.addressof(m) for m in self.params], np.uint64)
        self.put_params_far = np.full(len(regions), ctypes.addressof(self.far_put_param), np.uint64)
        self.base_list = [t.data_ptr() for t in regions]
        self.base = np.asarray(self.base_list, np.int64)
        self.sizes = np.asarray([t.numel() for t in regions], np.int64)
        self.size_list = [t.numel() for t in regions]
        self.cuda_devices = {t.device for t in regions if t.is_cuda}
        self.is_host = np.array([not t.is_cuda for t in regions], bool)
        self.host_list, self.all_host = self.is_host.tolist(), bool(self.is_host.all())
        self.host_views = [None if t.is_cuda else t.numpy() for t in regions]
        self.grants.region_sizes = [t.numel() for t in regions]

    def _unmap_all(self) -> None:
        """Undo a register() that failed part way: nothing stays mapped or half-listed."""
        for m in self.memh:
            if m:
                ucp.mem_unmap(self.workers.ctx.handle, m)
        self.memh, self.params, self.rkeys_packed = [], [], []

    def unmap(self) -> None:
        """Shutdown (I/O thread, endpoints being closed): every region unmapped, nothing read any more."""
        for m in self.memh:
            if m:
                ucp.mem_unmap(self.workers.ctx.handle, m)
        self.memh, self.params, self.tensors, self.host_views = [], [], [], []
        self.put_params = self.put_params_far = ucp.EMPTY_TABLE

    def memory_types(self) -> list[str]:
        """I/O thread: what UCX registered each region as ("host", "cuda", ...; "" for an empty region),
        as ``ucp_mem_query`` says (``register`` already refused a region of another type than asked)."""
        return [ucp.memory_type_name(ucp.registered_memory_type(m)) if m else "" for m in self.memh]
