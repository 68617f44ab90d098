"""A torchrun program: one prefill group and one decode group move real KV over real transports.

``torchrun --nproc_per_node=N tests/hetero_tp_worker.py --config JSON``

The config holds several launches (``launches``: name -> P_TP, P_PP, D_TP and sub-configurations),
run one after the other in one world of N = the largest P_TP*P_PP+D_TP ranks (one interpreter
and torch start-up per rank for the whole matrix, not one per launch). In a launch, world ranks
``[0, P_TP*P_PP)`` are prefill ranks (``pp = r // P_TP``, ``tp = r % P_TP``), the next D_TP decode
ranks, the rest wait at the barriers. Rank 0 embeds the bootstrap server. For each sub-configuration
(model x layouts x page sizes x transport) every prefill rank fills its pool with the
full-model KV values of the heads and layers it holds, registers, and streams three
requests in chunks; every decode rank grants slots, waits for its whole TP group
(``reduce_poll``), then checks every byte of its heads against the full-model KV and
that every byte outside the grant still holds the canary. Writes ``out_dir/rank<r>.json``: per
sub-configuration a rank took part in, its launch, role and result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.endpoint import KVPoll, Timeouts, reduce_poll
from kvxfer.endpoint.decode import DecodeEndpoint
from kvxfer.endpoint.prefill import PrefillEndpoint
from kvxfer.grant import ByteRanges
from kvxfer.pools import MHAPool, MLAPool, PageAllocator
from kvxfer.ranks import RankSpec
from kvxfer.topology import heads_held, stage_layers

LAYERS, HEAD_DIM, CANARY = 4, 8, 0xA5
KV_HEADS = {"mha8": 8, "gqa2": 2, "mla": 1}
# Slack for a loaded 2-core machine (5-6 processes of one launch share it): a HELLO waits 40 s for
# its answer and a prefill rank's UCX connect to decode 30 s (decode's HELLO to one of four UCX
# prefill ranks went unanswered for 10 s, the default of both, once in a fresh-clone run).
TIMEOUTS = Timeouts(bootstrap=60, waiting=60, transfer=30, lease=60, handshake=40)


def options(transport: str) -> dict:
    return {"connect_timeout": 30.0} if transport == "ucx" else {}


def value(layer: int, kind: str, token, head, dim):
    """Full-model KV of (layer, kind, token position, global head, dim); exact in float32."""
    k = 0 if kind in ("k", "kv") else 1
    return (((layer * 2 + k) * 200 + token) * 10 + head) * 64.0 + dim


def make_pool(model: str, tp: int, layout: str, page_size: int, layers, num_pages: int = 64):
    if model == "mla":
        return MLAPool(layers=layers, kv_lora_rank=12, rope_dim=4, dtype="float32", num_pages=num_pages,
                       page_size=page_size, layout=layout)
    return MHAPool(layers=layers, heads=len(heads_held(KV_HEADS[model], tp, 0)), head_dim=HEAD_DIM,
                   dtype="float32", num_pages=num_pages, page_size=page_size, layout=layout)


def global_heads(model: str, pool, tp: int, tp_rank: int) -> np.ndarray:
    return np.zeros(1, np.int64) if model == "mla" else np.asarray(heads_held(KV_HEADS[model], tp, tp_rank))


def expected(model, pool, tp, tp_rank, layer, kind, n_tokens) -> torch.Tensor:
    p = pool.layout.part(layer, kind)
    t, h, d = np.meshgrid(np.arange(n_tokens), global_heads(model, pool, tp, tp_rank), np.arange(p.head_dim),
                          indexing="ij")
    return torch.from_numpy(value(layer, kind, t, h, d)).float()


def requests(page_size: int) -> list[tuple[int, int]]:
    return [(1, 5), (2, 2 * page_size + 3), (3, 3 * page_size)]


def run_prefill(sub: dict, cfg: dict, rank: int, url: str, instance: str) -> dict:
    p_tp, p_pp = cfg["p_tp"], cfg.get("p_pp", 1)
    pp_rank, tp_rank = divmod(rank, p_tp)
    layers = stage_layers(LAYERS, p_pp, pp_rank)
    ps = sub["p_page"]
    pool = make_pool(sub["model"], p_tp, sub["p_layout"], ps, layers)
    spec = RankSpec(role="prefill", num_kv_heads=KV_HEADS[sub["model"]], num_layers=LAYERS, instance=instance,
                    tp_rank=tp_rank, tp_size=p_tp, pp_rank=pp_rank, pp_size=p_pp, replicated=sub["model"] == "mla")
    alloc = PageAllocator(pool.layout.spaces[0].num_pages, ps)
    alloc.alloc(3 * ps)                      # so prefill slots differ from decode's
    ep = PrefillEndpoint(spec, pool, transport=sub["transport"],
                        transport_options=options(sub["transport"]), timeouts=TIMEOUTS)
    ep.register(url)
    senders = []
    for room, n in requests(ps):
        slots = alloc.alloc(n)
        for layer in layers:
            for kind in pool.kv_kinds:
                pool.set_parts(layer, slots, [(kind, expected(sub["model"], pool, p_tp, tp_rank, layer, kind, n))])
        s = ep.sender(room)
        cut = (n // 2) // ps * ps            # chunks are whole pages except the last
        if cut:
            s.send(slots[:cut])
        s.send(slots[cut:], last=True)
        senders.append(s)
    deadline = time.monotonic() + 60
    while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders) and time.monotonic() < deadline:
        time.sleep(0.005)
    bad = [f"room {s.room}: {s.poll().name} {s.reason}" for s in senders if s.poll() != KVPoll.Success]
    return {"ep": ep, "ok": not bad, "why": "; ".join(bad)}


def run_decode(sub: dict, cfg: dict, rank: int, url: str, instance: str, group) -> dict:
    d_tp = cfg["d_tp"]
    d_rank = rank - cfg["p_tp"] * cfg.get("p_pp", 1)
    ps = sub["d_page"]
    pool = make_pool(sub["model"], d_tp, "token_major", ps, LAYERS)
    for b in pool.buffers:
        b.fill_(CANARY)
    spec = RankSpec(role="decode", num_kv_heads=KV_HEADS[sub["model"]], num_layers=LAYERS, instance=instance,
                    tp_rank=d_rank, tp_size=d_tp, replicated=sub["model"] == "mla")
    ep = DecodeEndpoint(spec, pool, transport=sub["transport"],
                        transport_options=options(sub["transport"]), timeouts=TIMEOUTS)
    ep.connect(bootstrap=url, instance=instance, timeout=60)
    alloc = PageAllocator(pool.layout.spaces[0].num_pages, ps)
    recvs, slots = [], []
    for room, n in requests(sub["p_page"]):
        s = alloc.alloc(n)
        r = ep.receiver(room)
        r.init(s)
        recvs.append(r)
        slots.append(s)
    states = [KVPoll.Bootstrapping] * len(recvs)
    deadline = time.monotonic() + 60
    while any(st not in (KVPoll.Success, KVPoll.Failed) for st in states):
        if time.monotonic() > deadline:
            for r in recvs:
                r.abort("test deadline")
        states = reduce_poll([r.poll() for r in recvs], group)
        time.sleep(0.002)
    bad = [f"room {r.room}: {st.name} {r.reason}" for r, st in zip(recvs, states) if st != KVPoll.Success]
    if not bad:
        for (room, n), s in zip(requests(sub["p_page"]), slots):
            for layer in range(LAYERS):
                for kind in pool.kv_kinds:
                    got = pool.get_part(layer, kind, s)
                    want = expected(sub["model"], pool, d_tp, d_rank, layer, kind, n)
                    if not torch.equal(got, want):
                        bad.append(f"room {room} layer {layer} {kind}: bytes differ from the full-model KV")
        granted = ByteRanges.of_slots(pool.layout, np.concatenate(slots))
        for rid, buf in enumerate(pool.buffers):
            outside = np.ones(buf.numel(), bool)
            starts, ends = granted.intervals(rid)
            for a, b in zip(starts.tolist(), ends.tolist()):   # few merged ranges per region
                outside[a:b] = False
            if (buf.numpy()[outside] != CANARY).any():
                bad.append(f"region {rid}: a byte outside the grant changed")
    return {"ep": ep, "ok": not bad, "why": "; ".join(bad[:5])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg_all = json.loads(ap.parse_args().config)
    launches = cfg_all["launches"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {name: cfg["p_tp"] * cfg.get("p_pp", 1) + cfg["d_tp"] for name, cfg in launches.items()}
    assert world == max(sizes.values()), f"world {world} != the largest launch, {max(sizes.values())} ranks"
    server = BootstrapServer(BootstrapConfig(port=cfg_all["bootstrap_port"])).start() if rank == 0 else None
    dist.barrier()
    url = f"http://127.0.0.1:{cfg_all['bootstrap_port']}"
    results = []
    for j, (name, cfg) in enumerate(launches.items()):
        n_p, n = cfg["p_tp"] * cfg.get("p_pp", 1), sizes[name]
        d_group = dist.new_group(list(range(n_p, n)), backend="gloo")   # every world rank calls new_group
        for i, sub in enumerate(cfg["subs"]):
            t0 = time.monotonic()
            out = None
            if rank < n:
                try:
                    out = run_prefill(sub, cfg, rank, url, f"l{j}c{i}") if rank < n_p else \
                        run_decode(sub, cfg, rank, url, f"l{j}c{i}", d_group)
                except Exception as e:
                    out = {"ep": None, "ok": False, "why": f"{type(e).__name__}: {e} {traceback.format_exc()[-800:]}"}
            dist.barrier()        # every rank finished this sub-configuration before endpoints close
            if out is None:
                continue
            if out["ep"] is not None:
                out["ep"].close()
            results.append({"launch": name, "name": sub["name"], "role": "prefill" if rank < n_p else "decode",
                            "ok": out["ok"], "why": out["why"], "seconds": round(time.monotonic() - t0, 2)})
    dist.barrier()
    if server is not None:
        server.stop()
    with open(os.path.join(cfg_all["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "results": results}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
