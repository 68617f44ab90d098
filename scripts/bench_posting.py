#!/usr/bin/env python
"""Posting cost per run: one plan of ~1.3 M scattered runs, sender CPU time / runs, kvxfer UCX
next to NIXL (UCX backend) for the same descriptors, between two processes on 127.0.0.1.

    .venv/bin/python scripts/bench_posting.py [--quick] [--json PATH] [--peers] [--runs N] [--run-bytes B]

The plan: ``--runs`` runs (default 1,310,720: a 128k-token token-major request whose 512 B
head-slice rows sit in scattered pages) of ``--run-bytes`` each, at distinct random
run-aligned places of the source pool -> distinct random places of the destination pool
(pools 1.6x the plan's bytes: ``pool_bytes``). ``--quick``: 131,072 runs.

Peers, the same descriptors for each (``make_plan``):
  kvxfer ucx        one ``submit`` of one ``TransferPlan`` (runs this small travel packed: iov
                    tag frames straight from the runs, no gather); done when the receiver acked
  kvxfer ucx puts   the same with ``put_below=1, put_below_many=1``: one ``ucp_put_nbx`` per run,
                    all posted by one call of the compiled helper (``post_puts``)
  nixl ucx          ``prep_xfer_dlist`` of both sides once (one descriptor per run), then per
                    transfer ``make_prepped_xfer`` (all indices) + ``transfer`` + polling
                    ``check_xfer_state`` until DONE (no progress thread, as in bench_peers.py)

Measured on the sender per transfer (``time.process_time``: every thread of the process, so an
I/O thread's posting counts; CPU time, which load from other processes distorts much less
than wall time; ``getrusage`` for the system-call share):
  kvxfer  plan (building the ``TransferPlan``), submit (the caller's thread: bounds, merges,
          iovs), io (the transport's I/O thread: announce, posting, flush, DONE), cpu (all)
  NIXL    setup (one-time: both ``prep_xfer_dlist``), make (``make_prepped_xfer``), post (the
          ``transfer`` call, which issues every put), wait (polling to DONE), cpu (all but setup)
and the receiver's process CPU from its grant to the arrival, and the wall time. The headline
is the sender's CPU per transfer / runs (us per run), one-time setup reported apart. Who moves
the bytes differs, so sender + receiver is a row too: a NIXL put is one ``process_vm_writev``
per run by the sender (cma); kvxfer's packed frames (iov tag sends) cross UCX's sysv shared
memory copy-in/copy-out, the receiver unpacking (UCX_PROTO_INFO=y: "rendezvous data send from
iov ... fragmented copy-in copy-out, sysv/memory").

Every transfer is checked: the target zeroes its pool before each one, and after it the
BLAKE2 digest of the destination runs (in plan order) must equal the initiator's digest of
the source runs. Peers take turns, one transfer each per round, after a checked warm-up;
medians of ``--reps`` rounds. NIXL runs from its own venv (``bench_peers.ensure_venv``) with
``--peers``. Run with ``--worker`` only by this script itself.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_peers import PeerPair, ensure_venv
from bench_peers_workers import Ctl, KvxferPeer, MiB, NixlPeer, Peer, pattern

RUNS, QUICK_RUNS = 1_310_720, 131_072
SLOW = ("kvxfer ucx puts",)   # left out of --quick unless --only names it
CHUNK_RUNS = 1 << 16   # runs per step when filling or digesting (bounds the temporaries)


# ---------------------------------------------------------------------------------------
# The plan, its bytes and its digest (numpy only: the NIXL worker runs in NIXL's venv)
# ---------------------------------------------------------------------------------------
def pool_bytes(runs: int, run_bytes: int) -> int:
    """Pools hold the plan's bytes 1.6x over (a KV pool mostly in use), at least 16 MiB."""
    return max(16 * MiB, -(-runs * run_bytes * 8 // 5 // MiB) * MiB)


def make_plan(spec: dict) -> dict:
    """The case: ``runs`` distinct run-aligned offsets on each side, in random order."""
    rng = np.random.default_rng(spec["seed"])
    n, slots = spec["run_bytes"], spec["pool_bytes"] // spec["run_bytes"]
    return {"name": f"{spec['runs']:,} runs of {n} B", "nbytes": n,
            "so": rng.choice(slots, spec["runs"], replace=False).astype(np.int64) * n,
            "do": rng.choice(slots, spec["runs"], replace=False).astype(np.int64) * n}


def _rows(pool: np.ndarray, n: int) -> np.ndarray:
    return pool[: pool.size // n * n].reshape(-1, n)


def fill_source(pool: np.ndarray, case: dict) -> None:
    """The pattern of ``bench_peers_workers`` at every source run (every word differs)."""
    n, words = case["nbytes"], pool[: pool.size // 8 * 8].view(np.uint64)
    for i in range(0, len(case["so"]), CHUNK_RUNS):
        w0 = case["so"][i: i + CHUNK_RUNS] // 8
        idx = w0[:, None] + np.arange(n // 8)
        words[idx] = pattern(idx)


def digest(pool: np.ndarray, offsets: np.ndarray, n: int) -> str:
    """BLAKE2 of the runs at ``offsets`` (each ``n`` bytes), in that order."""
    h, rows = hashlib.blake2b(digest_size=16), _rows(pool, n)
    for i in range(0, len(offsets), CHUNK_RUNS):
        h.update(np.ascontiguousarray(rows[offsets[i: i + CHUNK_RUNS] // n]))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Peers: kvxfer (packed or one put per run) and NIXL (prepped descriptor lists)
# ---------------------------------------------------------------------------------------
class _Clock:
    """CPU seconds of the process (all threads; user and system apart), its page faults (the
    system share moves with them) and wall seconds."""

    def __init__(self):
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu, self.user, self.sys, self.wall = time.process_time(), ru.ru_utime, ru.ru_stime, time.perf_counter()
        self.faults = ru.ru_minflt + ru.ru_majflt

    def since(self) -> dict:
        now = _Clock()
        return {"cpu": now.cpu - self.cpu, "user_cpu": now.user - self.user, "sys_cpu": now.sys - self.sys,
                "wall": now.wall - self.wall, "faults": now.faults - self.faults}


class PostingKvxfer(KvxferPeer):
    options: dict = {}

    def __init__(self, role: str, pool: np.ndarray, spec: dict):
        import torch

        from kvxfer.transport.registry import get_transport
        torch.set_num_threads(1)
        self.t = get_transport("ucx", **self.options)
        self.t.register([torch.from_numpy(pool)])

    def transfer(self, case: dict, tag: str) -> dict:
        from kvxfer.plan import PACK_BELOW, RunGroup, TransferPlan
        io = self.t.io.thread
        io_clock = time.pthread_getcpuclockid(io.ident)
        io0, clock = time.clock_gettime(io_clock), _Clock()
        t0 = time.thread_time()
        z, so, do, n = self._runs(case)
        plan = TransferPlan((RunGroup(z[:1], z[:1], z[:1], z[:1], so, do, n, bool(n[0] < PACK_BELOW)),))
        t1 = time.thread_time()
        h = self.t.submit(self.peer, tag, plan, timeout=600)
        t2 = time.thread_time()
        h.result()
        return {**clock.since(), "plan_cpu": t1 - t0, "submit_cpu": t2 - t1,
                "io_cpu": time.clock_gettime(io_clock) - io0}


class PostingKvxferPuts(PostingKvxfer):
    # peer_timeout: the I/O thread posts the 1.3 M puts in one Python loop, seconds without a
    # heartbeat; under load that passed the default 5 s and the receiver failed the transfer
    options = {"put_below": 1, "put_below_many": 1, "peer_timeout": 60.0}


class PostingNixl(NixlPeer):
    def transfer(self, case: dict, tag: str) -> dict:
        setup = {}
        if getattr(self, "prepped", None) is None:   # once: both sides' descriptor lists
            clock = _Clock()
            k, n = len(case["so"]), case["nbytes"]

            def descs(base: int, offs: np.ndarray) -> np.ndarray:   # [runs, (address, length, device)]
                return np.stack([np.uint64(base) + offs.astype(np.uint64), np.full(k, n, np.uint64),
                                 np.zeros(k, np.uint64)], axis=1)
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(self.base, case["so"]), "DRAM")
            remote = self.agent.prep_xfer_dlist(self.remote, descs(self.remote_base, case["do"]), "DRAM")
            self.prepped = (local, remote, np.arange(k, dtype=np.int32))
            setup = {f"setup_{key}": v for key, v in clock.since().items()}
        local, remote, idx = self.prepped
        clock = _Clock()
        t0 = time.process_time()
        h = self.agent.make_prepped_xfer("WRITE", local, idx, remote, idx)
        t1 = time.process_time()
        state = self.agent.transfer(h)
        t2 = time.process_time()
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        out = {**clock.since(), **setup, "make_cpu": t1 - t0, "post_cpu": t2 - t1, "wait_cpu": time.process_time() - t2}
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")
        return out


PEERS: dict[str, type[Peer]] = {"kvxfer ucx": PostingKvxfer, "kvxfer ucx puts": PostingKvxferPuts,
                                "nixl ucx": PostingNixl}


def worker(peer: str, role: str, spec: dict, say: Callable[[str, dict], None]) -> None:
    """One side of one peer (``bench_peers_workers.worker`` with measured transfers and a
    digest check of every transfer)."""
    case = make_plan(spec)
    pool = np.zeros(spec["pool_bytes"], np.uint8)
    if role == "initiator":
        fill_source(pool, case)
    p = PEERS[peer](role, pool, spec)
    try:
        if role == "target":
            ls = socket.create_server(("127.0.0.1", 0))
            say("READY", {**p.info(), "ctl": ls.getsockname()[1]})
            ctl = Ctl(ls.accept()[0])
            p.accept()
            while (cmd := ctl.recv())["op"] != "quit":
                pool.fill(0)   # what the check finds came with this transfer
                c0 = time.process_time()
                p.prepare(case, cmd["tag"])
                ctl.send({"ready": True})
                p.receive(case, cmd["tag"], ctl.readable)
                ctl.recv()   # "end": the initiator saw its transfer complete
                cpu = time.process_time() - c0
                got = digest(pool, case["do"], case["nbytes"])
                p.finish(cmd["tag"])
                ctl.send({"digest": got, "target_cpu": cpu})
            return
        ctl = Ctl(socket.create_connection(("127.0.0.1", spec["target"]["ctl"])))
        p.connect(spec["target"])
        want = digest(pool, case["so"], case["nbytes"])
        say("READY", {})
        for k, line in enumerate(sys.stdin):
            if json.loads(line)["op"] == "quit":
                break
            tag = f"t{k}"
            ctl.send({"op": "begin", "tag": tag})
            ctl.recv()
            m = p.transfer(case, tag)
            ctl.send({"op": "end"})
            r = ctl.recv()
            why = "" if r["digest"] == want else f"{case['name']}: the destination runs' digest differs from the source"
            say("DONE", {"seconds": m["wall"], "why": why, "target_cpu": r["target_cpu"], **m})
        ctl.send({"op": "quit"})
    finally:
        p.close()


# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS:,} runs, 2 rounds, without {', '.join(SLOW)}")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--peers", action="store_true", help="include NIXL (creates its venv)")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--run-bytes", type=int, default=512)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per step of a peer")
    ap.add_argument("--only", help=f"comma-separated subset of: {','.join(PEERS)}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        proto = os.fdopen(os.dup(1), "w", buffering=1)   # stdout: our lines only; libraries print to stderr
        os.dup2(2, 1)
        worker(args.worker, args.role, spec, lambda what, obj: proto.write(f"@@{what} {json.dumps(obj)}\n"))
        return 0
    runs = args.runs or (QUICK_RUNS if args.quick else RUNS)
    if args.run_bytes % 8 or args.run_bytes < 8:
        ap.error("--run-bytes must be a multiple of 8")
    reps = args.reps or (2 if args.quick else 3)
    spec = {"runs": runs, "run_bytes": args.run_bytes, "pool_bytes": pool_bytes(runs, args.run_bytes), "seed": 0,
            "cases": []}
    name = f"{runs:,} runs of {args.run_bytes} B"
    print(f"posting: {name} ({runs * args.run_bytes / MiB:,.0f} MiB) scattered over pools of "
          f"{spec['pool_bytes'] // MiB} MiB; a checked warm-up, then {reps} rounds, peers in turn", flush=True)
    order = [p for p in PEERS if (p in args.only.split(",") if args.only else not (args.quick and p in SLOW))]
    errors: dict[str, str] = {}
    pairs: dict[str, PeerPair] = {}
    got: dict[str, list[dict]] = {}
    first: dict[str, dict] = {}

    def fail(peer: str, e: Exception) -> None:   # a peer that cannot run is a row with its reason
        errors[peer] = str(e)[:300]
        print(f"  {peer}: {errors[peer]}", flush=True)
        if peer in pairs:
            pairs.pop(peer).close()

    with tempfile.TemporaryDirectory() as tmp:
        try:
            for peer in order:   # every target, then every initiator, side by side: imports take seconds
                python, why = sys.executable, ""
                if peer == "nixl ucx":
                    if not args.peers:
                        errors[peer] = "skipped: pass --peers"
                        continue
                    python, why = ensure_venv("nixl")
                elif importlib.util.find_spec("ucxx") is None:
                    why = "ucxx not installed: pip install 'kvxfer[ucx]'"
                if why:
                    fail(peer, RuntimeError(why))
                    continue
                print(f"  starting {peer}", flush=True)
                try:
                    pairs[peer] = PeerPair(peer, python, spec, Path(tmp), args.timeout,
                                           script=Path(__file__).resolve(), wait=False)
                except OSError as e:
                    fail(peer, e)
            def warm_up(pair: PeerPair) -> None:   # checked, like every transfer; gives NIXL's one-time setup
                first[pair.peer] = pair.run_measured(0, verify=True)

            for step in (PeerPair.launch_initiator, PeerPair.ready, warm_up):
                for peer, pair in list(pairs.items()):
                    try:
                        step(pair)
                    except Exception as e:
                        fail(peer, e)
            for _ in range(reps):
                for peer, pair in list(pairs.items()):
                    try:
                        got.setdefault(peer, []).append(pair.run_measured(0, verify=True))
                    except Exception as e:
                        fail(peer, e)
        finally:
            for pair in pairs.values():   # they end side by side (closing a transport takes a while)
                pair.quit()
            for pair in pairs.values():
                pair.close()
    med = {peer: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
           for peer, rs in got.items() if peer not in errors}
    for peer, m in med.items():   # one-time setup comes from the warm-up
        m.update({k: v for k, v in first[peer].items() if k.startswith("setup_")})
    us = lambda s: s / runs * 1e6   # noqa: E731
    print(f"\n{name}; medians of {reps} rounds; CPU in us per run (sender unless said)")
    cols = ["cpu", "user_cpu", "sys_cpu", "plan_cpu", "submit_cpu", "io_cpu", "make_cpu", "post_cpu", "wait_cpu",
            "setup_cpu", "target_cpu"]
    print("| peer | " + " | ".join(cols) + " | sender page faults | wall ms | GB/s |\n|---|" + "---|" * (len(cols) + 3))
    for peer in order:
        if peer in errors:
            print(f"| {peer} | {errors[peer]} |")
            continue
        m = med[peer]
        print(f"| {peer} | " + " | ".join(f"{us(m[c]):.3f}" if c in m else "" for c in cols)
              + f" | {m['faults']:,.0f} | {m['wall'] * 1e3:.0f} | {runs * args.run_bytes / m['wall'] / 1e9:.2f} |")
    nixl = med.get("nixl ucx")
    rows = []
    for peer in order:
        base = f"posting {peer}, {name}"
        if peer in errors:
            rows.append({"name": base, "error": errors[peer]})
            continue
        m = med[peer]
        ceil = us(nixl["cpu"]) if nixl and peer != "nixl ucx" else None
        rows.append({"name": f"{base}: sender CPU per run", "value": us(m["cpu"]), "unit": "us/run",
                     "ceiling": ceil, "ceiling_name": "nixl ucx" if ceil else "",
                     "ratio": us(m["cpu"]) / ceil if ceil else None})
        if "setup_cpu" in m:
            rows.append({"name": f"{base}: one-time prep_xfer_dlist per run", "value": us(m["setup_cpu"]),
                         "unit": "us/run"})
        rows.append({"name": f"{base}: receiver CPU per run", "value": us(m["target_cpu"]), "unit": "us/run"})
        # who copies differs (a put: the sender; kvxfer's packed frames: both sides, through shared memory)
        both = [us(r["cpu"] + r["target_cpu"]) for r in got[peer]]
        ceil_both = statistics.median(us(r["cpu"] + r["target_cpu"]) for r in got["nixl ucx"]) \
            if nixl and peer != "nixl ucx" else None
        rows.append({"name": f"{base}: sender + receiver CPU per run", "value": statistics.median(both),
                     "unit": "us/run", "ceiling": ceil_both, "ceiling_name": "nixl ucx" if ceil_both else "",
                     "ratio": statistics.median(both) / ceil_both if ceil_both else None})
        rows.append({"name": f"{base}: wall", "value": runs * args.run_bytes / m["wall"] / 1e9, "unit": "GB/s"})
    if args.json:
        args.json.write_text(json.dumps({"bench": "posting", "rows": rows, "runs": runs, "run_bytes": args.run_bytes,
                                         "pool_bytes": spec["pool_bytes"], "rounds": reps, "medians": med,
                                         "samples": got, "warmup": first, "errors": errors}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
