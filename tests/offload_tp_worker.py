"""One rank (or one side) of the multi-process offload tests in tests/test_offload_tp.py.

Rank scenarios read RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment, so
``step`` also runs under ``torchrun --nproc_per_node=4 tests/offload_tp_worker.py step OUT``
(the kill scenarios need plain processes: torchrun stops the survivors when a rank dies).
Scenarios separated by commas run one after the other in the same process group.
With 4 processes every rank is in a TP group of 4 and in a TP group of 2 ({0,1}, {2,3}),
and runs an MHA manager (heads sharded per rank) and an MLA manager (replicated KV) for
each, so one launch covers both sizes (torch start-up dominates these tests):

  step   requests decode in lock-step; rank 1 copies slowly. Each rank logs what it
         queued per step, when its own records were on host, when each request was
         released, and whether reload was byte-exact.
  kill   like step, but the last rank dies (os._exit, or SIGKILL with ``kill9``) in the
         middle of its first device -> host copy; the others log the error each manager
         got and what it released (the TP-2 group without the dead rank carries on).

Side scenarios (no process group; two processes talk through a real transport):

  p2h-d  decode side: per TP pairing (2->4, 4->2), d_tp host pools receive straight into
         host memory, then reload to device; bytes are checked against the global KV.
  p2h-p  prefill side: p_tp pools send each decode rank its heads (kvxfer.topology).
         Both take a comma-separated list of transports, e.g. ``zmq,ucx``.

Results go to ``OUT/<scenario>-rank<r>.json`` and ``OUT/decode-<transport>.json`` (plain
JSON); the exchange between the p2h sides is msgpack.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import msgpack
import numpy as np
import torch
import torch.distributed as dist

import kvxfer.offload.copier as copier_mod
from kvxfer import (
    ByteRanges,
    Layout,
    MHAPool,
    MLAPool,
    PageAllocator,
    get_transport,
    plan_transfer,
)
from kvxfer.errors import PeerError
from kvxfer.host import HostPool
from kvxfer.offload.manager import DecodeOffloadManager, OffloadConfig
from kvxfer.topology import heads_held, sources_for_decode_rank

H, LAYERS, HD, PAGE, STRIDE = 8, 2, 8, 4, 8
PAIRS = [(2, 4), (4, 2)]


def write(out: Path, name: str, obj) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, out / f"{name}.json")


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in pool.regions():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def snap(pool, slots) -> list[bytes]:
    return [pool.get_part(p.layer, p.kind, slots).contiguous().view(torch.uint8).numpy().tobytes()
            for p in pool.layout.parts]


# ------------------------------------------------------------------------------------
# Rank scenarios: WORLD_SIZE 4 holds one TP group of 4 and two TP groups of 2 ({0,1}, {2,3})
# ------------------------------------------------------------------------------------
def rank_scenarios(names: list[str], out: Path) -> None:
    """Run the scenarios one after the other in the same process group (a launch costs more
    than a scenario: torch start-up)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=10))
    groups = {world: dist.group.WORLD}
    if world == 4:
        pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
        groups[2] = pairs[rank // 2]
    real_copy = copier_mod.execute_plan
    for name in names:
        rank_scenario(name, out, rank, world, groups, real_copy)
    os._exit(0)   # no teardown: a peer may be dead


def rank_scenario(name: str, out: Path, rank: int, world: int, groups: dict, real_copy) -> None:
    # The whole world's group times out in 5 s; the pairs' in 20: when a rank dies, each survivor
    # finds out in its own time in the world's collectives (at most one timeout per manager, two
    # managers), so the other pair's members may reach their next collective ~10 s apart and
    # must wait for each other (stop 43: a 5 s pair timeout failed so on a loaded machine).
    cfgs = {t: OffloadConfig(stride=STRIDE, group_timeout_s=5.0 if t == world else 20.0) for t in groups}
    mgrs, pools, allocs = {}, {}, {}
    for tp, group in sorted(groups.items()):
        r = dist.get_rank(group)
        pools[f"tp{tp}/mha"] = MHAPool(layers=LAYERS, heads=H // tp, head_dim=HD, dtype="bfloat16", num_pages=64,
                                       page_size=PAGE)
        pools[f"tp{tp}/mla"] = MLAPool(layers=LAYERS, kv_lora_rank=16, rope_dim=8, dtype="bfloat16", num_pages=64,
                                       page_size=PAGE)
        fill(pools[f"tp{tp}/mha"], 100 + r)     # each rank of a group holds other heads
        fill(pools[f"tp{tp}/mla"], 7 + tp)      # MLA: identical on every rank of a group
        for k in ("mha", "mla"):
            key = f"tp{tp}/{k}"
            mgrs[key] = DecodeOffloadManager(pools[key], HostPool.for_pool(pools[key], size=256), cfgs[tp],
                                             group=group)
            allocs[key] = PageAllocator(64, PAGE)
    doomed = name.startswith("kill") and rank == world - 1

    def patched(plan, src, dst):
        if doomed:   # die in the middle of the first device -> host copy
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL) if name == "kill9" else os._exit(17)
        if rank == 1:
            time.sleep(0.03)   # a slow rank: the others must wait for it
        return real_copy(plan, src, dst)

    copier_mod.execute_plan = patched
    lengths = {"r0": (5, 30), "r1": (9, 22), "r2": (13, 40)} if name == "step" else {"r0": (3, 20)}
    release_at = {"r0": 20, "r1": 10, "r2": 29} if name == "step" else {"r0": 17}
    toks = {rid: np.arange(b) * 31 + i for i, (rid, (_, b)) in enumerate(lengths.items())}
    slots = {(k, rid): allocs[k].alloc(b) for k in mgrs for rid, (_, b) in lengths.items()}
    log = {"rank": rank, "queued": {k: [] for k in mgrs}, "released_at": {k: {} for k in mgrs},
           "ready_at": {k: {} for k in mgrs}, "error": {}, "released": [], "reload_ok": {}, "stored": {},
           "records": {}, "free_before": {k: a.free_pages for k, a in allocs.items()}}
    want = {}
    t0 = time.monotonic()
    for step in range(200):
        live = [k for k in mgrs if k not in log["error"]]
        if step > max(release_at.values()) and not any(mgrs[k]._releasing for k in live):
            break
        for k in live:
            mgr = mgrs[k]
            running = sorted(rid for rid in lengths if step <= release_at[rid])
            lens = {rid: min(lengths[rid][0] + step, lengths[rid][1]) for rid in running}
            batch = [(rid, toks[rid][:n], slots[(k, rid)][:n]) for rid, n in lens.items()]
            try:
                queued = mgr.step(batch)
                if batch:   # after the last release, ranks of other groups may run a few steps more
                    log["queued"][k].append(queued)
                for rid, t, s in batch:
                    if step == release_at[rid]:
                        want[(k, rid)] = (len(t), snap(pools[k], s))
                        mgr.release(rid, t, s)
                for rid in mgr._releasing:   # when this rank's own part of rid was on host
                    if mgr._vote(mgr._requests[rid]) == 1:
                        log["ready_at"][k].setdefault(rid, step)
                for rid in mgr.poll().released:
                    log["released_at"][k][rid] = step
                    log["released"].append(f"{k}/{rid}")
                    allocs[k].free(slots[(k, rid)])   # the engine frees the device slots now
            except PeerError as e:
                log["error"][k] = str(e)
        time.sleep(0.005)
    log["seconds"] = time.monotonic() - t0
    log["free_after"] = {k: a.free_pages for k, a in allocs.items()}
    for k, m in mgrs.items():
        log["stored"][k] = m.stats.records_offloaded
        log["records"][k] = sum(len(m._requests[r].records) for r in m._requests)
    back: dict = {}   # per manager, its released requests back in one reload_many
    for (k, rid), (n, _) in sorted(want.items()):
        if k not in log["error"] and rid in log["released_at"][k]:
            back.setdefault(k, {})[rid] = allocs[k].alloc(n)
    for k, news in back.items():
        mgrs[k].reload_many(news)          # MLA: collective, the storing rank broadcasts
        for rid, new in news.items():
            log["reload_ok"][f"{k}/{rid}"] = snap(pools[k], new) == want[(k, rid)][1]
    for (k, rid), (n, before) in sorted(want.items()):
        if k in back and rid in back[k]:
            # a new request with the same tokens finds every record again (MLA: the storers answer)
            found = mgrs[k].restore(f"{rid}-again", toks[rid][:n])
            again = allocs[k].alloc(n)
            mgrs[k].reload(f"{rid}-again", again)
            log["reload_ok"][f"{k}/{rid}-again"] = found == n and snap(pools[k], again) == before
    write(out, f"{name}-rank{rank}", log)
    for m in mgrs.values():
        if not m._tp.broken:
            m.close()


# ------------------------------------------------------------------------------------
# Direct-to-host over a real transport: prefill process -> decode process
# ------------------------------------------------------------------------------------
def global_kv(n: int) -> dict:
    g = torch.Generator().manual_seed(5)
    return {(layer, k): torch.randint(0, 256, (n, H, HD * 2), dtype=torch.uint8, generator=g)
            for layer in range(LAYERS) for k in "kv"}


def wait_for(*paths: Path, timeout: float = 60.0) -> Path:
    """The first of ``paths`` to appear."""
    deadline = time.monotonic() + timeout
    while True:
        for p in paths:
            if p.exists():
                return p
        if time.monotonic() > deadline:
            raise TimeoutError(f"none of {[str(p) for p in paths]} appeared")
        time.sleep(0.02)


def decode_side(transport: str, out: Path) -> None:
    """Per pairing: receive into d_tp host pools, commit, reload, compare with the global KV."""
    n, rid = 21, "req"
    kv, toks = global_kv(n), np.arange(n) + 9
    results = []
    for i, (p_tp, d_tp) in enumerate(PAIRS):
        ranks = []
        for _ in range(d_tp):
            dpool = MHAPool(layers=LAYERS, heads=H // d_tp, head_dim=HD, dtype="bfloat16", num_pages=16,
                            page_size=PAGE, layout=("hnd", "token_major")[i])
            host = HostPool.for_pool(dpool, layout=("page_first", "layer_first")[i], size=32)
            try:
                tr = get_transport(transport)
                tr.register(host.regions())    # the host pool is the destination, like a device pool
            except Exception as e:
                (out / f"{transport}-failed").write_bytes(b"")    # the prefill side stops waiting
                write(out, f"decode-{transport}", {"error": f"{transport} transport failed to register the host "
                                                            f"pool: {type(e).__name__}: {e}"})
                return
            mgr = DecodeOffloadManager(dpool, host, OffloadConfig(stride=STRIDE))
            grant = mgr.receive_to_host(rid, toks)
            tr.expect(rid, ByteRanges.of_slots(host.layout, grant.slots))
            ranks.append((dpool, host, tr, mgr, grant))
        tmp = out / f".{transport}-pair{i}.tmp"
        tmp.write_bytes(msgpack.packb([{"descriptor": tr.descriptor(), "layout": host.layout.to_dict(),
                                        "positions": {s: p.tolist() for s, p in g.positions.items()},
                                        "slots": {s: v.tolist() for s, v in g.slots.items()}}
                                       for _, host, tr, _, g in ranks], use_bin_type=True))
        os.replace(tmp, out / f"{transport}-pair{i}.msgpack")
        ok = []
        for d, (dpool, _host, tr, mgr, _grant) in enumerate(ranks):
            need = len(sources_for_decode_rank(num_kv_heads=H, p_tp=p_tp, d_tp=d_tp, d_rank=d, num_layers=LAYERS))
            got, deadline = [], time.monotonic() + 30
            while len(got) < need and time.monotonic() < deadline:
                got += tr.arrivals(timeout=0.1)
            landed = len(got) == need and all(a.ok for a in got)
            tr.forget(rid)
            mgr.commit_received(rid, ok=landed)
            untouched = bool(all((b == 0).all() for b in dpool.regions()))   # no device slot received
            slots = PageAllocator(16, PAGE).alloc(n + 8)[8:]
            exact = False
            if landed:
                mgr.reload(rid, slots)
                held = heads_held(H, d_tp, d)
                exact = all(torch.equal(t.contiguous().view(torch.uint8).reshape(n, -1),
                                        kv[(layer, k)][:, held.start:held.stop].reshape(n, -1))
                            for layer in range(LAYERS) for k, t in zip("kv", dpool.get_kv_buffer(layer, slots)))
            ok.append({"landed": landed, "untouched": untouched, "exact": exact, "arrivals": len(got),
                       "rejected": dict(tr.rejected)})
            mgr.close()
        results.append({"p_tp": p_tp, "d_tp": d_tp, "ranks": ok})
        wait_for(out / f"{transport}-pair{i}.sent")
        for _, _, tr, _, _ in ranks:
            tr.close()
    write(out, f"decode-{transport}", {"pairs": results})


def prefill_side(transport: str, out: Path) -> None:
    """Per pairing: p_tp page-major pools send each decode rank its heads (kvxfer.topology)."""
    n, rid = 21, "req"
    kv = global_kv(n)
    for i, (p_tp, d_tp) in enumerate(PAIRS):
        pools, trs, pslots = [], [], []
        for p in range(p_tp):
            pool = MHAPool(layers=LAYERS, heads=H // p_tp, head_dim=HD, dtype="bfloat16", num_pages=16,
                           page_size=PAGE, layout="page_major")
            s = PageAllocator(16, PAGE).alloc(n + 4)[4:]
            held = heads_held(H, p_tp, p)
            for layer in range(LAYERS):
                pool.set_kv_buffer(layer, s, *(kv[(layer, k)][:, held.start:held.stop].contiguous()
                                               .view(torch.bfloat16) for k in "kv"))
            tr = get_transport(transport)
            tr.register(pool.regions())
            pools.append(pool), trs.append(tr), pslots.append(s)
        got = wait_for(out / f"{transport}-pair{i}.msgpack", out / f"{transport}-failed")
        if got.name.endswith("failed"):
            return
        handles = []
        for d, info in enumerate(msgpack.unpackb(got.read_bytes(), raw=False)):
            layout = Layout.from_dict(info["layout"])
            pos = np.asarray(info["positions"]["token"], np.int64)
            dslots = {s: np.asarray(v, np.int64) for s, v in info["slots"].items()}
            for src in sources_for_decode_rank(num_kv_heads=H, p_tp=p_tp, d_tp=d_tp, d_rank=d, num_layers=LAYERS):
                p = src.p_tp_rank
                plan = plan_transfer(pools[p].layout, {"token": pslots[p][pos]}, layout, dslots,
                                     src_heads=src.src_heads, dst_heads=src.dst_heads, layers=src.layers)
                handles.append(trs[p].submit(trs[p].connect(info["descriptor"]), rid, plan, timeout=30))
        for h in handles:
            h.result(30)
        (out / f"{transport}-pair{i}.sent").write_bytes(b"")
        for tr in trs:
            tr.close()


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    if set(scenario.split(",")) <= {"step", "kill", "kill9"}:   # e.g. "step,kill9"
        rank_scenarios(scenario.split(","), out_dir)
    elif scenario in ("p2h-d", "p2h-p"):
        for name in sys.argv[3].split(","):   # e.g. "zmq,ucx"
            (decode_side if scenario == "p2h-d" else prefill_side)(name, out_dir)
    else:
        sys.exit(f"unknown scenario {scenario!r}")
