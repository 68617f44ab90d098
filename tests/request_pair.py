"""One prefill and one decode endpoint in this process, with a bootstrap server: the set-up of
the in-process request tests (``test_request_contract``, ``test_request_ready``).

The prefill pool holds seeded random bytes, the decode pool a canary; ``expected`` is what the
decode pool must hold after moves, computed by the reference executor.
"""
from __future__ import annotations

import time

import numpy as np
import request_peer as rp
import torch

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.channel import Heartbeat
from kvxfer.copy import execute_plan
from kvxfer.endpoint import AuxBuffer, DecodeEndpoint, PrefillEndpoint, Timeouts
from kvxfer.plan import plan_transfer
from kvxfer.pools import MHAPool
from kvxfer.ranks import RankSpec

CANARY = 0xCD
LENIENT = Timeouts(bootstrap=20, waiting=20, transfer=20, lease=20, handshake=10,
                   heartbeat=Heartbeat(interval=0.5, timeout=5.0))


def pool(seed: int | None, layout: str = "token_major", page_size: int = 4, num_pages: int = 32,
         heads: int = 2) -> MHAPool:
    p = MHAPool(layers=2, heads=heads, head_dim=8, dtype="float16", num_pages=num_pages, page_size=page_size,
                layout=layout)
    fill(p, seed)
    return p


def fill(p: MHAPool, seed: int | None) -> None:
    """Seeded random bytes, or the canary (``seed`` None)."""
    for i, b in enumerate(p.buffers):
        if seed is None:
            b.fill_(CANARY)
        else:
            b.copy_(torch.randint(0, 256, b.shape, generator=torch.Generator().manual_seed(seed * 100 + i),
                                  dtype=torch.uint8))


class Pair:
    """Prefill and decode endpoints over ``transport`` (local, zmq or ucx), connected."""

    def __init__(self, transport: str = "local", *, timeouts: Timeouts = LENIENT, p_clock=time.monotonic,
                 d_clock=time.monotonic, p_layout: str = "token_major", d_layout: str = "token_major",
                 page_size: int = 4, instance: str = "default", connect: bool = True):
        self.server = BootstrapServer(BootstrapConfig(ttl=5.0)).start()
        options = rp.transport_options(transport, {})
        self.p_pool, self.d_pool = pool(3, p_layout, page_size), pool(None, d_layout, page_size)
        self.aux = AuxBuffer(4)
        self.pe = self.de = None
        try:
            p_opt = {} if p_clock is time.monotonic else {"clock": p_clock}   # time.monotonic is the
            d_opt = {} if d_clock is time.monotonic else {"clock": d_clock}   # endpoints' default
            self.pe = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=2, num_layers=2, instance=instance),
                                      self.p_pool, transport=transport, transport_options=options,
                                      timeouts=timeouts, **p_opt)
            self.pe.register(self.server.url, ttl=5.0)
            self.de = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2), self.d_pool,
                                     transport=transport, transport_options=options, timeouts=timeouts,
                                     aux=self.aux, **d_opt)
            if connect:
                self.de.connect(bootstrap=self.server.url, timeout=10)
        except BaseException:
            self.close()
            raise
        self.before = [b.clone() for b in self.d_pool.buffers]

    def expected(self, moves) -> list[torch.Tensor]:
        """The decode pool as it was at start plus every (prefill slots, decode slots) move."""
        ref = [b.clone() for b in self.before]
        for ps, ds in moves:
            execute_plan(plan_transfer(self.p_pool.layout, np.asarray(ps), self.d_pool.layout, np.asarray(ds)),
                         self.p_pool.buffers, ref)
        return ref

    def close(self) -> None:
        for ep in (self.de, self.pe):
            if ep is not None:
                ep.close()
        self.server.stop()
