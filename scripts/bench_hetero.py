#!/usr/bin/env python
"""Heterogeneous TP (P TP 2 -> D TP 4, 4 -> 2) next to same TP (2 -> 2): aggregate throughput
of one request's KV, moved as real bytes over a real transport between rank processes.

    .venv/bin/python scripts/bench_hetero.py [--quick] [--json PATH] [--transports zmq,ucx]
                                             [--layouts hnd:hnd,token_major:token_major]

Model: 8 KV heads, head_dim 128, bf16, page 16 (4 or 8 layers; a request of 2048 or 4096
tokens). Every rank is a process of its own, as in a deployment, with its own pool and its
own transport (the driver process runs no rank). A prefill rank plans with
``kvxfer.plan.Planner`` for each decode rank that ``targets_for_prefill_rank`` names (head
slices and layers from the topology). Pages are scattered at random on both sides, as after
some churn, and every TP rank of a side uses the same slots, as engines do.

Measured: bytes of the whole request (every rank) / wall time from the first ``submit`` on
any prefill rank to the last handle done on any (CLOCK_MONOTONIC, shared by the processes;
a handle is done when the receiver confirmed its bytes landed). After the warm-up every
decode rank checks every byte of its heads. Repetitions interleave the TP pairings, so a
burst of load from other processes hits them alike; best of N.

Ceilings measured in the same run:
  same TP      TP 2 -> 2 on the same transport and layouts (the reference)
  tcp raw      the same bytes over one loopback TCP socket (1 MiB ``sendall`` / ``recv_into``)
               from the driver to decode rank 0's process: what zmq sits on
  memcpy       one single-thread ``copy_`` of the same bytes: what shared memory (ucx) allows
  raw zmq      each TP pairing (heterogeneous and control) with pyzmq alone, no kvxfer code: what
               the shape itself costs on this box. A process per prefill rank and per decode rank
               (started as the rank processes are); each prefill process sends each decode rank it
               feeds exactly the bytes kvxfer's plans move between the two ranks (the ``Planner``'s
               nbytes per pair, printed once), in 1 MiB ``copy=False`` messages from one contiguous
               source buffer of random bytes, one DEALER per pair to a ROUTER bound on loopback TCP
               by each decode process (one I/O thread, as kvxfer's zmq); the decode process copies
               every message to its offset in its destination buffer (libzmq cannot receive into
               the caller's memory: that copy is any zmq transport's floor) and acks each prefill
               process with one byte once all its bytes are in. Timed as the kvxfer rows: from the
               first send on any prefill process (a go to every one, through the pipes, once the
               receivers listen) to the last ack on any, CLOCK_MONOTONIC; warmed by one untimed
               round, bytes checked after it and after the last repetition (which lands on zeros);
               best of N, in the repetitions of the zmq token_major group (else the first zmq
               group). "shape ceiling: raw 4->2 / raw 4->4" is that ratio with nothing but the
               shape and zmq's own copy: read kvxfer's 4->2 / its control against it, not against
               1.0. --no-raw-zmq skips it.

Control: TP 4 -> 4 is the same TP with as many ranks on the larger side as 2 -> 4 and 4 -> 2 on
the box's two cores. When it drops as much as they do, the cost is the number of ranks sharing
the cores, not heterogeneity. Issue 39's goal: each heterogeneous pairing >= 0.9x its control.

Run counts per request, per decode rank, next to what SGLang-style head slicing needs: one
descriptor per (token, layer, K/V) from each source whose heads are a slice on either side,
one per (page, layer, K/V) otherwise. "packed" counts the runs the plan marks packed (below
``PACK_BELOW``, the copying transports' threshold); UCX packs by its own ``PUT_BELOW`` and
``PUT_BELOW_MANY`` instead.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_hetero_ranks import CHUNK, DTYPE, HEAD_DIM, HEADS, PAGE, Config, pack, rank_main, request_slots, unpack
from bench_hetero_raw import plan_bytes, raw_main

from kvxfer.plan import PACK_BELOW

GOAL = 0.9   # issue 39: heterogeneous >= 0.9x its control (TP m -> m, m its larger side)
RAW = "raw zmq"   # results' and rows' name of the pyzmq-only measurement of a pairing's shape


class Rank:
    """The driver's handle on one rank process (``rank_main``; ``raw_main`` for raw zmq)."""

    def __init__(self, ctx, target=rank_main):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,), daemon=True)
        self.proc.start()
        self.tcp_port, self.tcp = None, None

    def send(self, cmd: dict) -> None:
        self.conn.send_bytes(pack(cmd))

    def reply(self, what: str = "?", timeout: float = 300) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank process did not answer {what} in {timeout} s")
        out = unpack(self.conn.recv_bytes())
        if "error" in out:
            raise RuntimeError(f"rank process, {what}: {out['error']}")
        return out

    def call(self, cmd: dict, timeout: float = 300) -> dict:
        self.send(cmd)
        return self.reply(cmd["op"], timeout)

    def close(self) -> None:
        try:
            self.call({"op": "quit"}, timeout=60)
        finally:
            if self.tcp is not None:
                self.tcp.close()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def start_ranks(ctx, n: int, target=rank_main) -> list[Rank]:
    ranks = [Rank(ctx, target) for _ in range(n)]   # all started before waiting: start-up (torch) overlaps
    for r in ranks:
        r.tcp_port = r.reply("start")["tcp_port"]
    return ranks


def on_all(ranks: list[Rank], cmds: list[dict]) -> list[dict]:
    """Send each rank its command, then collect every answer: the ranks work at the same time."""
    for r, c in zip(ranks, cmds):
        r.send(c)
    return [r.reply(c["op"]) for r, c in zip(ranks, cmds)]


def tcp_raw(rank: Rank, src: torch.Tensor) -> float:
    """Seconds to push ``src`` to a rank process through one loopback socket in CHUNK messages,
    acked at the end."""
    if rank.tcp is None:
        rank.tcp = socket.create_connection(("127.0.0.1", rank.tcp_port))
        rank.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = src.numpy().data
    rank.send({"op": "tcp", "nbytes": len(mv)})
    rank.reply("tcp")   # it is reading
    t0 = time.perf_counter()
    for o in range(0, len(mv), CHUNK):
        rank.tcp.sendall(mv[o: o + CHUNK])
    rank.tcp.recv(1)
    dt = time.perf_counter() - t0
    rank.reply("tcp")
    return dt


def memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


class RawCase:
    """One TP pairing on the raw zmq processes: receivers bind, senders connect to each decode
    rank they feed and send it what kvxfer's plans move between the two ranks."""

    def __init__(self, i: int, pair: tuple[int, int], senders: list[Rank], receivers: list[Rank],
                 per_pair: dict[tuple[int, int], int]):
        self.i, self.pair, self.per_pair = i, pair, per_pair
        self.P, self.D = senders[: pair[0]], receivers[: pair[1]]
        self.nbytes = sum(per_pair.values())
        src_len, src_off = {p: 0 for p in range(pair[0])}, {}
        for (p, d), n in sorted(per_pair.items()):   # a sender's source: its decode ranks in order
            src_off[p, d], src_len[p] = src_len[p], src_len[p] + n
        eps = on_all(self.D, [{"op": "router", "id": i,
                               "from": [[p, n, src_off[p, d], src_len[p]] for (p, dd), n in sorted(per_pair.items())
                                        if dd == d]} for d in range(pair[1])])
        on_all(self.P, [{"op": "dealer", "id": i, "rank": p,
                         "to": [[eps[d]["endpoint"], n] for (pp, d), n in sorted(per_pair.items()) if pp == p]}
                        for p in range(pair[0])])

    def transfer(self, clear: bool = False) -> tuple[float, str]:
        """Receivers listen, then a go to every sender: (seconds from the first send on any sender
        to the last ack on any, why it failed)."""
        for r in self.D:
            r.send({"op": "recv", "id": self.i, "clear": clear})
        for r in self.D:
            r.reply("raw recv (listening)")
        spans = on_all(self.P, [{"op": "send", "id": self.i}] * len(self.P))
        whys = [r.reply("raw recv") for r in self.D]
        return (max(s["t1"] for s in spans) - min(s["t0"] for s in spans),
                "; ".join(w["why"] for w in spans + whys if w["why"]))

    def verify(self) -> str:
        return "; ".join(w["why"] for w in on_all(self.D, [{"op": "verify", "id": self.i}] * len(self.D)) if w["why"])


def raw_name(pair: tuple[int, int]) -> str:
    return f"{RAW} TP {pair[0]}->{pair[1]}"


def raw_cases(senders: list[Rank], receivers: list[Rank], base: Config, pairs: list[tuple[int, int]], p_slots,
              d_slots, kvxfer: dict, out: dict) -> dict[int, RawCase]:
    """Set up a raw case per pairing, warm it and check its bytes; a result (or its error) per
    pairing in ``out``."""
    cases: dict[int, RawCase] = {}
    for i, pair in enumerate(pairs):
        name = raw_name(pair)
        res: dict = {"raw": "zmq", "pair": list(pair),
                     "interleaved_with": f"{base.transport} {base.p_layout}->{base.d_layout}"}
        out[name] = res
        try:
            per_pair = plan_bytes(Config(**{**base.to_dict(), "p_tp": pair[0], "d_tp": pair[1]}), p_slots, d_slots)
            res["per_pair_bytes"] = {f"{p}->{d}": n for (p, d), n in sorted(per_pair.items())}
            print(f"  {name} bytes per prefill -> decode rank (kvxfer's plans): "
                  + ", ".join(f"{k} {n:,}" for k, n in res["per_pair_bytes"].items())
                  + f"; total {sum(per_pair.values()):,}", flush=True)
            moved = kvxfer.get(base_name(base, pair), {}).get("nbytes")
            if moved is not None and moved != sum(per_pair.values()):
                raise RuntimeError(f"the plans' {sum(per_pair.values()):,} bytes differ from kvxfer's {moved:,}")
            case = RawCase(i, pair, senders, receivers, per_pair)
            _, why = case.transfer()   # warm-up: connections, first touch of every buffer
            why = why or case.verify()
            if why:
                raise RuntimeError(why)
            res.update(seconds=[], nbytes=case.nbytes)
            cases[i] = case
        except Exception as e:   # one broken case is a row with its reason
            res["error"] = f"{type(e).__name__}: {e}"[:300]
    return cases


def base_name(base: Config, pair: tuple[int, int]) -> str:
    return Config(**{**base.to_dict(), "p_tp": pair[0], "d_tp": pair[1]}).name


class Case:
    """One TP pairing set up on the rank processes: decode ranks first (their descriptors),
    then the prefill ranks, which connect and plan."""

    def __init__(self, i: int, cfg: Config, prefill: list[Rank], decode: list[Rank], p_slots, d_slots):
        self.i, self.cfg = i, cfg
        self.P, self.D = prefill[: cfg.p_tp], decode[: cfg.d_tp]
        desc = on_all(self.D, [{"op": "decode", "id": i, "cfg": cfg.to_dict(), "slots": d_slots.tobytes(), "rank": r}
                               for r in range(cfg.d_tp)])
        descriptors = {r: d["descriptor"] for r, d in enumerate(desc)}
        made = on_all(self.P, [{"op": "prefill", "id": i, "cfg": cfg.to_dict(), "p_slots": p_slots.tobytes(),
                                "d_slots": d_slots.tobytes(), "descriptors": descriptors, "rank": r}
                               for r in range(cfg.p_tp)])
        self.nbytes = sum(m["nbytes"] for m in made)
        self.plan_ms = sum(m["plan_ms"] for m in made)
        self.per_decode: dict[int, dict] = {}
        for m in made:
            for d, c in m["per_decode"].items():
                acc = self.per_decode.setdefault(int(d), {k: 0 for k in c})
                for k, v in c.items():
                    acc[k] += v

    def transfer(self, rid: str) -> tuple[float, str]:
        """Grant on every decode rank, send from every prefill rank at once, collect: (seconds
        from the first submit on any rank to the last handle done on any rank, why it failed)."""
        on_all(self.D, [{"op": "expect", "id": self.i, "rid": rid}] * len(self.D))
        spans = on_all(self.P, [{"op": "send", "id": self.i, "rid": rid}] * len(self.P))
        whys = on_all(self.D, [{"op": "drain", "id": self.i, "rid": rid}] * len(self.D))
        return max(s["t1"] for s in spans) - min(s["t0"] for s in spans), "; ".join(w["why"] for w in whys if w["why"])

    def verify(self) -> str:
        return "; ".join(w["why"] for w in on_all(self.D, [{"op": "verify", "id": self.i}] * len(self.D)) if w["why"])


def bench_group(prefill: list[Rank], decode: list[Rank], base: Config, pairs: list[tuple[int, int]], reps: int,
                seed: int, raw: tuple[list[Rank], list[Rank]] | None = None) -> dict:
    """One transport and layout pairing, every TP pairing interleaved; returns results by name.
    ``raw``: (senders, receivers) of raw zmq, measured in this group's repetitions too."""
    p_slots, d_slots = request_slots(base.tokens, seed), request_slots(base.tokens, seed + 1)
    cases: dict[int, Case] = {}
    rcases: dict[int, RawCase] = {}
    out: dict[str, dict] = {}
    try:
        for i, (p_tp, d_tp) in enumerate(pairs):
            cfg = Config(**{**base.to_dict(), "p_tp": p_tp, "d_tp": d_tp})
            try:
                case = Case(i, cfg, prefill, decode, p_slots, d_slots)
                _, why = case.transfer("warm")
                why = why or case.verify()
                if why:
                    raise RuntimeError(why)
                cases[i] = case
                out[cfg.name] = {"config": cfg.to_dict(), "seconds": [], "nbytes": case.nbytes}
            except Exception as e:   # one broken case is a row with its reason
                out[cfg.name] = {"config": cfg.to_dict(), "error": f"{type(e).__name__}: {e}"[:300]}
        if raw:
            rcases = raw_cases(*raw, base, pairs, p_slots, d_slots, out, out)
        nbytes = max((c.nbytes for c in cases.values()), default=0)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        ceil: dict[str, list[float]] = {"tcp raw": [], "memcpy": []}
        for rep in range(reps):
            for case in cases.values():
                dt, why = case.transfer(f"r{rep}")
                if why:
                    out[case.cfg.name]["error"] = why
                out[case.cfg.name]["seconds"].append(dt)
            if nbytes:
                ceil["tcp raw"].append(tcp_raw(decode[0], src))
                ceil["memcpy"].append(memcpy(src, dst))
            last = rep == reps - 1
            for i, rc in list(rcases.items()):   # the last repetition lands on zeros and is checked
                try:
                    dt, why = rc.transfer(clear=last)
                    why = why or (rc.verify() if last else "")
                except Exception as e:   # the raw processes' state is unknown: no more raw rounds
                    out[raw_name(rc.pair)]["error"] = f"{type(e).__name__}: {e}"[:300]
                    rcases.clear()
                    break
                out[raw_name(rc.pair)]["seconds"].append(dt)
                if why:
                    out[raw_name(rc.pair)]["error"] = why
                    del rcases[i]
        ref = out[base_name(base, pairs[0])].get("seconds") if 0 in cases else None
        for case in cases.values():
            r = out[case.cfg.name]
            r.update(gbps=case.nbytes / min(r["seconds"]) / 1e9,
                     gbps_median=case.nbytes / statistics.median(r["seconds"]) / 1e9, plan_ms=case.plan_ms,
                     per_decode_rank={str(k): v for k, v in sorted(case.per_decode.items())})
            if ref:   # against the same-TP run of the same repetition: robust to load that comes and goes
                r["x_same_paired_median"] = statistics.median(a / b for a, b in zip(ref, r["seconds"]))
        raw_ref = out.get(raw_name(pairs[0]), {}).get("seconds")
        for pair in pairs if raw else []:
            r = out[raw_name(pair)]
            if not r.get("seconds"):
                continue
            r.update(gbps=r["nbytes"] / min(r["seconds"]) / 1e9,
                     gbps_median=r["nbytes"] / statistics.median(r["seconds"]) / 1e9)
            m = max(pair)
            for key, other in (("x_same_paired_median", raw_ref),
                               ("x_control_paired_median", out.get(raw_name((m, m)), {}).get("seconds"))):
                if other and len(other) == len(r["seconds"]):   # same repetitions: paired
                    r[key] = statistics.median(a / b for a, b in zip(other, r["seconds"]))
        for name, secs in ceil.items():
            if secs:
                out[f"{base.transport} {base.p_layout}->{base.d_layout} ceiling {name}"] = {
                    "ceiling": name, "gbps": nbytes / min(secs) / 1e9, "nbytes": nbytes}
    finally:
        procs = prefill + decode + (raw[0] + raw[1] if raw else [])
        on_all(procs, [{"op": "teardown"}] * len(procs))
    return out


def rows_of(results: dict, transports: list[str], layouts: list[tuple[str, str]], pairs) -> list[dict]:
    """The aggregator's rows: same TP against its raw ceiling, hetero against same TP, and (once
    per layout pairing: they do not depend on the transport) runs against SGLang's descriptors."""
    rows, counts = [], []
    same = f"TP {pairs[0][0]}->{pairs[0][1]}"
    for t in transports:
        for pl, dl in layouts:
            key = f"{t} {pl}->{dl}"
            ceil_name = "tcp raw" if t == "zmq" else "memcpy"
            ceil = results.get(f"{key} ceiling {ceil_name}", {}).get("gbps")
            ref = results.get(f"{key} {same}", {})
            for p_tp, d_tp in pairs:
                r = results.get(f"{key} TP {p_tp}->{d_tp}", {})
                row = {"name": f"hetero {key} TP {p_tp}->{d_tp}", "unit": "GB/s", "value": r.get("gbps")}
                if "error" in r:
                    row["error"] = r["error"]
                m = max(p_tp, d_tp)
                control = results.get(f"{key} TP {m}->{m}", {}) if (m, m) in pairs else {}
                if (p_tp, d_tp) == pairs[0]:
                    row.update(ceiling=ceil, ceiling_name=ceil_name)
                elif p_tp == d_tp:   # a control: same TP with more ranks sharing the cores; no goal
                    row.update(ceiling=ref.get("gbps"), ceiling_name=f"same {same} (control)")
                elif control:   # issue 39's goal: against the control (the same TP on the larger side)
                    row.update(ceiling=control.get("gbps"), ceiling_name=f"control TP {m}->{m}",
                               goal=f">= {GOAL}x")
                else:   # no control measured: against the reference, for information
                    row.update(ceiling=ref.get("gbps"), ceiling_name=f"same {same}")
                if row["value"] and row.get("ceiling"):
                    row["ratio"] = row["value"] / row["ceiling"]
                    if "goal" in row:
                        row["ok"] = row["ratio"] >= GOAL
                rows.append(row)
                d0 = r.get("per_decode_rank", {}).get("0")
                if d0 and t == transports[0]:
                    counts.append({"name": f"hetero runs/request/decode rank, {pl}->{dl} TP {p_tp}->{d_tp} "
                                           f"({d0['packed_runs']:,} packed)", "unit": "runs", "value": d0["runs"],
                                   "ceiling": d0["sglang_descriptors"], "ceiling_name": "SGLang-style descriptors",
                                   "ratio": d0["runs"] / d0["sglang_descriptors"]})
    return rows + raw_rows(results, pairs) + counts


def raw_rows(results: dict, pairs) -> list[dict]:
    """Raw zmq per pairing: a heterogeneous one against the raw control, its shape's ceiling on
    this box (no goal: it says what kvxfer's ratio to its control can reach)."""
    rows = []
    ref = results.get(raw_name(pairs[0]), {})
    for pair in pairs:
        if raw_name(pair) not in results:
            continue
        r = results[raw_name(pair)]
        row = {"name": f"hetero {raw_name(pair)}", "unit": "GB/s", "value": r.get("gbps")}
        if "error" in r:
            row["error"] = r["error"]
        m = max(pair)
        control = results.get(raw_name((m, m)), {}) if (m, m) in pairs else {}
        if pair == pairs[0]:
            pass
        elif pair[0] == pair[1]:
            row.update(ceiling=ref.get("gbps"), ceiling_name=f"same {raw_name(pairs[0])} (control)")
        elif control:
            row.update(ceiling=control.get("gbps"), ceiling_name=f"control {raw_name((m, m))}", shape_ceiling=True)
        else:
            row.update(ceiling=ref.get("gbps"), ceiling_name=f"same {raw_name(pairs[0])}")
        if row["value"] and row.get("ceiling"):
            row["ratio"] = row["value"] / row["ceiling"]
        rows.append(row)
    return rows


def print_table(results: dict, pairs) -> None:
    print("\nGB/s (1 GB = 1e9 bytes), best of the repetitions. x same: best against best of the same-TP row;"
          "\npaired: median over repetitions of same-TP time / this time, each against the same-TP run of its"
          "\nrepetition. plan ms: every (prefill, decode) pair's plan. Runs per request for decode rank 0."
          + (f"\n{RAW} rows: against {raw_name(pairs[0])}, the same way." if raw_name(pairs[0]) in results else ""))
    head = (f"{'case':46s} {'GB/s':>6s} {'median':>7s} {'x same':>7s} {'paired':>7s} {'plan ms':>8s} {'runs':>8s} "
            f"{'packed':>8s} {'unpacked':>8s} {'SGLang':>9s}")
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        if "ceiling" in r:
            print(f"{name:46s} {r['gbps']:6.2f}")
            continue
        if "gbps" not in r:
            print(f"{name:46s} not measured: {r.get('error')}")
            continue
        if "raw" in r:   # no plan, no runs: the bytes of each (prefill, decode) pair in 1 MiB messages
            same = results.get(raw_name(pairs[0]), {}).get("gbps")
            ratio = f"{r['gbps'] / same:6.2f}x" if same else ""
            paired = f"{r['x_same_paired_median']:6.2f}x" if "x_same_paired_median" in r else ""
            print(f"{name:46s} {r['gbps']:6.2f} {r['gbps_median']:7.2f} {ratio:>7s} {paired:>7s}"
                  + (f"  ERROR {r['error']}" if "error" in r else ""))
            continue
        key = name.rsplit(" TP ", 1)[0]
        same = results.get(f"{key} TP {pairs[0][0]}->{pairs[0][1]}", {}).get("gbps")
        ratio = f"{r['gbps'] / same:6.2f}x" if same else ""
        paired = f"{r['x_same_paired_median']:6.2f}x" if "x_same_paired_median" in r else ""
        d0 = r["per_decode_rank"]["0"]
        print(f"{name:46s} {r['gbps']:6.2f} {r['gbps_median']:7.2f} {ratio:>7s} {paired:>7s} {r['plan_ms']:8.2f} "
              f"{d0['runs']:8,d} {d0['packed_runs']:8,d} {d0['runs'] - d0['packed_runs']:8,d} "
              f"{d0['sglang_descriptors']:9,d}" + (f"  ERROR {r['error']}" if "error" in r else ""))


def usable_transports(names: list[str]) -> tuple[list[str], dict[str, str]]:
    from kvxfer.transport.registry import get_transport
    ok, why = [], {}
    for n in names:
        try:
            get_transport(n).close()
            ok.append(n)
        except Exception as e:
            why[n] = f"{type(e).__name__}: {e}"[:200]
    return ok, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers, 2048 tokens, 3 repetitions")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--transports", default="zmq,ucx")
    ap.add_argument("--layouts", default="hnd:hnd,token_major:token_major",
                    help="prefill:decode layout pairs (token_major, hnd, page_major)")
    ap.add_argument("--pairs", default="2:2,2:4,4:2,4:4",
                    help="P TP:D TP; the first is the reference, other equal pairs are controls")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--pack-below", type=int, default=PACK_BELOW, help="the planner's packing threshold (bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-raw-zmq", action="store_true",
                    help="skip raw zmq (each pairing's bytes with pyzmq alone: the shape's ceiling)")
    args = ap.parse_args(argv)
    layers = args.layers or (4 if args.quick else 8)
    tokens = args.tokens or (2048 if args.quick else 4096)
    reps = args.reps or (3 if args.quick else 5)
    if tokens % PAGE:
        ap.error(f"--tokens must be a multiple of the page size {PAGE}")
    layouts = [(a, b) for a, b in (x.split(":") for x in args.layouts.split(","))]
    pairs = [(int(a), int(b)) for a, b in (x.split(":") for x in args.pairs.split(","))]
    torch.set_num_threads(1)   # two cores, shared: one compute thread per process, like a transport's I/O
    transports, missing = usable_transports(args.transports.split(","))
    print(f"model: {layers} layers x K/V, {HEADS} KV heads, head_dim {HEAD_DIM}, {DTYPE}, page {PAGE}; "
          f"request {tokens} tokens = {tokens * layers * 2 * HEADS * HEAD_DIM * 2 / 2**20:.0f} MiB "
          f"(all ranks); best of {reps}", flush=True)
    for n, why in missing.items():
        print(f"{n}: not measured: {why}")
    results: dict[str, dict] = {}
    ctx = mp.get_context("spawn")
    groups = [(t, pl, dl) for t in transports for pl, dl in layouts]
    # raw zmq: once, in the repetitions of the group it is read against (zmq token_major if run)
    raw_group = None if args.no_raw_zmq else next(
        (g for g in groups if g == ("zmq", "token_major", "token_major")),
        next((g for g in groups if g[0] == "zmq"), groups[0] if groups else None))
    prefill = start_ranks(ctx, max(p for p, _ in pairs))
    decode = start_ranks(ctx, max(d for _, d in pairs))
    raw = None
    try:
        if raw_group:
            raw = (start_ranks(ctx, max(p for p, _ in pairs), raw_main), start_ranks(ctx, max(d for _, d in pairs),
                                                                                     raw_main))
        for g in groups:
            t, pl, dl = g
            base = Config(transport=t, p_layout=pl, d_layout=dl, p_tp=1, d_tp=1, layers=layers, tokens=tokens,
                          pack_below=args.pack_below)
            print(f"{t} {pl} -> {dl} ..." + (f" (and {RAW})" if g == raw_group else ""), flush=True)
            results.update(bench_group(prefill, decode, base, pairs, reps, args.seed, raw if g == raw_group else None))
            if raw is not None and g == raw_group:   # read: gone before the next group (idle, they slowed UCX 4x)
                for proc in raw[0] + raw[1]:
                    proc.close()
                raw = None
    finally:
        for proc in prefill + decode + (raw[0] + raw[1] if raw else []):
            proc.close()
    print_table(results, pairs)
    rows = rows_of(results, transports, layouts, pairs)
    for n, why in missing.items():
        rows.append({"name": f"hetero {n}", "error": why})
    worst = min((r["ratio"] for r in rows if "goal" in r and "ratio" in r), default=None)
    if worst is not None:
        met = "met" if worst >= GOAL else "MISSED"
        print(f"\nworst heterogeneous / its control: {worst:.2f}x (goal >= {GOAL}x: {met})")
    for row in rows:
        if "(control)" in row.get("ceiling_name", "") and row.get("ratio") is not None:
            print(f"control {row['name'][7:]}: {row['ratio']:.2f}x of {pairs[0][0]}->{pairs[0][1]} "
                  f"(same TP: the heterogeneous pairings' control)")
    for p_tp, d_tp in pairs:   # the shape's ceiling, next to kvxfer's zmq ratios of the same pairing
        m = max(p_tp, d_tp)
        r, c = results.get(raw_name((p_tp, d_tp)), {}), results.get(raw_name((m, m)), {})
        if p_tp == d_tp or not r.get("gbps") or not c.get("gbps"):
            continue
        paired = f" (paired median {r['x_control_paired_median']:.2f})" if "x_control_paired_median" in r else ""
        kv = [f"{row['name'][7:].rsplit(' TP ', 1)[0]} {row['ratio']:.2f}x" for row in rows
              if "goal" in row and row.get("ratio") is not None and row["name"].startswith("hetero zmq ")
              and row["name"].endswith(f" TP {p_tp}->{d_tp}")]
        print(f"shape ceiling: raw {p_tp}->{d_tp} / raw {m}->{m} = {r['gbps'] / c['gbps']:.2f}{paired}"
              + (f"; kvxfer {p_tp}->{d_tp} / its control: {', '.join(kv)}" if kv else ""))
    if args.json:
        args.json.write_text(json.dumps({"bench": "hetero", "rows": rows, "results": results,
                                         "model": {"layers": layers, "kv_heads": HEADS, "head_dim": HEAD_DIM,
                                                   "dtype": DTYPE, "page_size": PAGE, "tokens": tokens},
                                         "repetitions": reps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
