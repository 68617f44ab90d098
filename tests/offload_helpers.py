"""What the offload tests share: a pool of every kind (``POOLS``), an ``Engine`` that fills
them with random bytes and takes slots like a serving engine, and the offload -> reload round
trip that checks the request's bytes and every other byte of the pool (the canary).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kvxfer import (
    HybridSWAPool,
    MHAPool,
    MLAPool,
    PageAllocator,
    Planner,
    StatePool,
)

PAGE = 4
POOLS = {
    "mha_token_major": lambda: MHAPool(layers=3, heads=2, head_dim=8, dtype="bfloat16", num_pages=40, page_size=PAGE),
    "mha_hnd": lambda: MHAPool(layers=3, heads=2, head_dim=8, dtype="float16", num_pages=40, page_size=PAGE,
                               layout="hnd"),
    "mha_page_major_fp8": lambda: MHAPool(layers=3, heads=2, head_dim=16, dtype="fp8_e4m3", num_pages=40,
                                          page_size=PAGE, layout="page_major", scale_block=8),
    "mla": lambda: MLAPool(layers=3, kv_lora_rank=16, rope_dim=4, dtype="bfloat16", num_pages=40, page_size=PAGE),
    "hybrid_swa": lambda: HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=8,
                                        dtype="bfloat16", num_pages=40, swa_num_pages=12, page_size=PAGE, window=6),
    "hybrid_swa_page_major": lambda: HybridSWAPool(full_layers=[0, 2], swa_layers=[1, 3], heads=2, head_dim=8,
                                                   dtype="bfloat16", num_pages=40, swa_num_pages=12,
                                                   page_size=PAGE, window=6, layout="page_major"),
    "state": lambda: StatePool(layers=2, conv_blocks=[4, 2, 2], conv_width=3, temporal_heads=2,
                               temporal_head_shape=[4, 4], num_slots=8),
}
STYLES = ("layer_first", "page_first")


# ------------------------------------------------------------------------------------
# The engine's side, as a test needs it: allocators, slot mapping, byte snapshots.
# ------------------------------------------------------------------------------------
class Engine:
    def __init__(self, pool, seed: int = 0):
        self.pool, self.gen = pool, torch.Generator().manual_seed(seed)
        self.alloc_of = {s.name: PageAllocator(s.num_pages, s.page_size) for s in pool.layout.spaces}
        self.tokens = "token" in self.alloc_of
        for a in self.alloc_of.values():   # fragment: every other page taken, so slots are not contiguous
            taken = a.alloc(a.page_size * (a.capacity // 3))
            if taken is not None:
                a.free(taken[(taken // a.page_size) % 2 == 0])
        self.randomize()

    def randomize(self):
        for b in self.pool.regions():
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=self.gen))

    def alloc(self, n: int, swa_positions=None) -> np.ndarray:
        """Engine slots of a request of ``n`` tokens (a state pool: its one state slot)."""
        if not self.tokens:
            return self.alloc_of["state"].alloc(1)
        slots = self.alloc_of["token"].alloc(n)
        if "swa" in self.alloc_of:
            pos = np.arange(max(0, n - self.pool.window), n) if swa_positions is None else swa_positions
            self.pool.map_swa(slots[pos], self.alloc_of["swa"].alloc(len(pos)))
        return slots

    def free(self, slots):
        if not self.tokens:
            return self.alloc_of["state"].free(slots)
        if "swa" in self.alloc_of:
            self.alloc_of["swa"].free(self.pool.unmap_swa(slots))
        self.alloc_of["token"].free(slots)

    def snapshot(self, slots, positions) -> dict:
        """Raw bytes of every part at the request's positions (per the part's space)."""
        out = {}
        for p in self.pool.layout.parts:
            pos = positions.get(p.space)
            if pos is not None and len(pos):
                out[p.key] = self.pool.get_part(p.layer, p.kind, slots[pos]).contiguous().view(torch.uint8).clone()
        return out

    def covered_mask(self, slots, positions) -> list[np.ndarray]:
        """Per region: True on the bytes the request owns at ``slots``."""
        lay = self.pool.layout
        dev = {s: np.asarray(self.pool.space_slots(s, slots[p]), np.int64) for s, p in positions.items() if len(p)}
        masks = [np.zeros(r.nbytes, bool) for r in lay.regions]
        r = Planner(lay, lay, kinds=[p.kind for p in lay.parts if p.space in dev], pack_below=0).plan(dev, dev).runs()
        for reg, off, n in zip(r.dst_region.tolist(), r.dst_offset.tolist(), r.nbytes.tolist()):
            masks[reg][off:off + n] = True
        return masks


def wait_released(mgr, rid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = mgr.poll()
        assert not res.failed, res.failed
        if rid in res.released:
            return
        time.sleep(0.005)
    raise AssertionError(f"{rid} not released within {timeout}s")


def decode(mgr, eng, rid, toks, slots, start: int):
    """Run the decode loop from ``start`` tokens to ``len(toks)``, one step() per token."""
    for t in range(start, len(toks) + 1):
        mgr.step([(rid, toks[:t], slots[:t] if eng.tokens else slots)])


def offload_and_reload(mgr, eng, rid, toks, slots):
    """release -> poll -> free -> reuse -> reload into other slots; check bytes and canary."""
    mgr.release(rid, toks, slots)
    wait_released(mgr, rid)
    pos = mgr.positions(rid)
    want = eng.snapshot(slots, pos)
    new = eng.alloc(len(toks), swa_positions=pos.get("swa"))   # taken while the old ones are held:
    assert not set(new.tolist()) & set(slots.tolist())           # other slots for sure
    eng.free(slots)
    eng.randomize()   # the freed slots are reused by someone else
    before = [b.numpy().copy() for b in eng.pool.regions()]
    mgr.reload(rid, new)
    got = eng.snapshot(new, pos)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"part {k} differs after reload"
    for b, after, m in zip(before, eng.pool.regions(), eng.covered_mask(new, pos)):
        assert np.array_equal(b[~m], after.numpy()[~m]), "reload wrote outside the request's slots"
    return new
