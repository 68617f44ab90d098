#!/usr/bin/env python
"""Throughput of every registered transport between two processes on 127.0.0.1, next to
ceilings measured in the same run.

    .venv/bin/python scripts/bench_transport.py [--quick] [--json PATH] [--transports zmq,ucx]
                                                [--opt zmq.frame_bytes=2097152 ...]

Cases: one run per request (4 KiB .. 256 MiB, many requests in flight), and one request of
scattered pages of a pool (64 KiB and 4 KiB pages, and 512 B rows as token-major head slices
make them; random on both sides). The sender is this process; the receiver is a child process
(the "local" transport runs both in this process).

Ceilings, measured here and now (this box is shared; numbers move +-30% between runs):
  memcpy        single-thread torch ``copy_`` of a large buffer
  tcp raw       loopback TCP socket, ``sendall`` / ``recv_into`` messages of the run size
  pyzmq raw     DEALER -> ROUTER, zero-copy send, ``recv(copy=False)`` + one copy (for reference;
                with the same malloc tuning as the zmq transport)
  ucx put raw   ``ucx_perftest -t ucp_put_bw`` from the libucx wheel
  ucx put raw (same pages)
                ``ucp_put_nbx`` through ctypes, one put per run of the case (the same source
                and destination offsets as the transport), all in flight, one flush; no
                protocol. Kept next to perftest because perftest re-sends one cache-hot buffer
                while the cases move runs at random places of a big pool: perftest flatters
                UCX, this one does not (measured with the ucx transport only)
  gather        single-process ``torch.index_select`` of the same pages

Each transport is shown as GB/s and as a ratio to its ceiling: zmq to tcp raw, ucx to ucx put
raw (and to ucx put raw (same pages)), local to memcpy; scattered cases to the gather ceiling
(ucx: and to the same-pages put). Best of N repetitions.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import torch
from bench_transport_ceilings import SAME_PAGES, Gather, Memcpy, PyzmqRaw, TcpRaw, UcxPutRaw, UcxPutSamePages

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
CEILING_OF = {"zmq": "tcp raw", "ucx": "ucx put raw", "local": "memcpy"}


def _pack(obj) -> bytes:
    return msgpack.packb(obj, default=lambda a: a.astype("<i8").tobytes())


def _arr(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<i8").astype(np.int64)


def _plan(so: np.ndarray, do: np.ndarray, n: np.ndarray):
    """Raw runs in region 0 on both sides, as a TransferPlan (one row per run)."""
    from kvxfer.plan import PACK_BELOW, RunGroup, TransferPlan
    z = np.zeros(1, np.int64)
    groups = []
    for packed in (False, True):
        m = (n < PACK_BELOW) == packed
        if m.any():
            groups.append(RunGroup(z, z, z, z, so[m], do[m], n[m], packed))
    return TransferPlan(tuple(groups))


def _crc(pool: torch.Tensor, off: np.ndarray, n: np.ndarray) -> int:
    """crc32 of the runs' bytes in run order (for the correctness check after each case)."""
    from kvxfer.copy import gather_runs
    data = gather_runs([pool], np.zeros(len(off), np.int64), off, n)
    return zlib.crc32(data.numpy())


# ---------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------
def serve_transport(conn, name: str, options: dict, pool_bytes: int) -> None:
    """Receiver: grant, drain arrivals, check bytes, as the driver asks (msgpack over a pipe)."""
    from kvxfer.grant import ByteRanges
    from kvxfer.transport.registry import get_transport
    torch.set_num_threads(1)
    t = get_transport(name, **options)
    pool = torch.zeros(pool_bytes, dtype=torch.uint8)
    t.register([pool])
    conn.send_bytes(_pack({"descriptor": t.descriptor()}))
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes())
        if cmd["op"] == "expect":
            do, n = _arr(cmd["do"]), _arr(cmd["n"])
            for rid, a, b in zip(cmd["rids"], cmd["cuts"][:-1], cmd["cuts"][1:]):
                t.expect(rid, ByteRanges(np.zeros(b - a, np.int64), do[a:b], n[a:b]))
            conn.send_bytes(_pack({}))
        elif cmd["op"] == "drain":
            want, got, bad = set(cmd["rids"]), 0, []
            limit = time.monotonic() + cmd["timeout"]
            while got < len(want) and time.monotonic() < limit:
                for a in t.arrivals(timeout=0.5):
                    got += 1
                    if not a.ok:
                        bad.append(f"{a.request_id}: {a.reason}")
            for rid in want:
                t.forget(rid)
            conn.send_bytes(_pack({"got": got, "bad": bad[:3]}))
        elif cmd["op"] == "crc":
            conn.send_bytes(_pack({"crc": _crc(pool, _arr(cmd["do"]), _arr(cmd["n"]))}))
        else:
            t.close()
            conn.send_bytes(_pack({}))
            return


# ---------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------
class Receiver:
    """The receiving side of one transport: a child process, or in-process for "local"."""

    def __init__(self, ctx, name: str, options: dict, pool_bytes: int):
        self.name, self.local = name, name == "local"
        if self.local:
            from kvxfer.transport.registry import get_transport
            self.t = get_transport(name, **options)
            self.pool = torch.zeros(pool_bytes, dtype=torch.uint8)
            self.t.register([self.pool])
            self.descriptor = self.t.descriptor()
            return
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_transport, args=(child, name, options, pool_bytes), daemon=True)
        self.proc.start()
        self.descriptor = self.call(None)["descriptor"]

    def call(self, cmd: dict | None, timeout: float = 300) -> dict:
        if cmd is not None:
            self.conn.send_bytes(_pack(cmd))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} receiver did not answer {cmd and cmd['op']}")
        return msgpack.unpackb(self.conn.recv_bytes())

    def expect(self, rids, do, n, cuts) -> None:
        if self.local:
            from kvxfer.grant import ByteRanges
            for rid, a, b in zip(rids, cuts[:-1], cuts[1:]):
                self.t.expect(rid, ByteRanges(np.zeros(b - a, np.int64), do[a:b], n[a:b]))
        else:
            self.call({"op": "expect", "rids": rids, "do": do, "n": n, "cuts": list(cuts)})

    def drain(self, rids) -> None:
        if self.local:
            bad = [a for a in self.t.arrivals() if not a.ok]
            for rid in rids:
                self.t.forget(rid)
        else:
            r = self.call({"op": "drain", "rids": rids, "timeout": 120.0})
            if r["got"] != len(rids):
                raise RuntimeError(f"{r['got']} of {len(rids)} arrivals")
            bad = r["bad"]
        if bad:
            raise RuntimeError(f"failed arrivals: {bad}")

    def crc(self, do, n) -> int:
        return _crc(self.pool, do, n) if self.local else self.call({"op": "crc", "do": do, "n": n})["crc"]

    def close(self) -> None:
        if self.local:
            self.t.close()
        else:
            try:
                self.call({"op": "close"}, timeout=30)
            finally:
                self.proc.join(10)
                if self.proc.is_alive():
                    self.proc.kill()


class TransportMeter:
    """One transport: this process sends, a ``Receiver`` receives. One call = one repetition:
    the case's runs as len(n) / per_request requests, all in flight, timed until every
    handle is done. The receiver's bytes are checked (crc) after each case's last call."""

    def __init__(self, ctx, name: str, options: dict, src: torch.Tensor):
        from kvxfer.transport.registry import get_transport
        self.name, self.src, self.reps = name, src, {}
        self.rx = Receiver(ctx, name, options, src.numel())
        try:
            self.tx = get_transport(name, **options)
            self.tx.register([src])
            self.peer = self.tx.connect(self.rx.descriptor)
        except BaseException:
            self.rx.close()
            raise

    def __call__(self, case) -> float:
        so, do, n, per = case["so"], case["do"], case["n"], case["per_request"]
        if "plans" not in case:
            case["cuts"] = list(range(0, len(n) + 1, per))
            case["plans"] = [_plan(so[a:b], do[a:b], n[a:b]) for a, b in zip(case["cuts"][:-1], case["cuts"][1:])]
        rep = self.reps[case["label"]] = self.reps.get(case["label"], -1) + 1
        rids = [f"{case['label']}-{rep}-{i}" for i in range(len(case["plans"]))]
        self.rx.expect(rids, do, n, case["cuts"])
        t0 = time.perf_counter()
        handles = [self.tx.submit(self.peer, rid, p, timeout=120) for rid, p in zip(rids, case["plans"])]
        for h in handles:
            h.result()
        took = time.perf_counter() - t0
        self.rx.drain(rids)
        return int(n.sum()) / took / 1e9

    def verify(self, case) -> None:
        if self.rx.crc(case["do"], case["n"]) != _crc(self.src, case["so"], case["n"]):
            raise RuntimeError(f"{case['label']}: bytes at the receiver differ from the source")

    def close(self) -> None:
        try:
            self.tx.close()
        finally:
            self.rx.close()


def make_cases(pool_bytes: int, total: int, rng) -> list[dict]:
    cases = []
    for size in SIZES:
        if size > pool_bytes // 2:
            continue
        count = int(min(max(total // size, 1), 1024))
        slots = pool_bytes // size
        so = (rng.permutation(slots)[:count] if count <= slots else np.arange(count) % slots) * size
        do = rng.permutation(slots)[:count] * size
        cases.append({"label": f"one run {_fmt(size)}", "size": size, "total": count * size, "so": so.astype(np.int64),
                      "do": do.astype(np.int64), "n": np.full(count, size, np.int64), "per_request": 1})
    # 512 B: the head slice of one token-major row (TP 2 -> 4 of 8 heads x 128 x bf16)
    for page, count in ((64 * KiB, 1000), (4 * KiB, 16000), (512, 32768)):
        slots = pool_bytes // page
        so = rng.choice(slots, count, replace=False).astype(np.int64) * page
        do = rng.choice(slots, count, replace=False).astype(np.int64) * page
        cases.append({"label": f"scattered {_fmt(page)} x{count}", "page": page, "so": so, "do": do,
                      "n": np.full(count, page, np.int64), "per_request": count})
    return cases


def _option_value(text: str) -> int | float | str:
    """``--opt`` values: numbers where they parse (``frame_bytes=2097152``), else text (``tls=sysv,self``)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _fmt(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB" if n >= KiB else f"{n} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller pool and fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--transports", help="comma-separated names (default: every registered one)")
    ap.add_argument("--opt", action="append", default=[], help="transport option, e.g. zmq.frame_bytes=2097152")
    args = ap.parse_args()
    torch.set_num_threads(1)   # ceilings single-threaded, like a transport's I/O thread
    from kvxfer.transport.registry import available_transports
    pool_bytes = (512 if args.quick else 1024) * MiB
    total, reps = (64 if args.quick else 256) * MiB, (2 if args.quick else 3)
    names = args.transports.split(",") if args.transports else available_transports()
    options: dict[str, dict] = {}
    for o in args.opt:
        key, value = o.split("=", 1)
        tname, opt = key.split(".", 1)
        options.setdefault(tname, {})[opt] = _option_value(value)
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    src = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8)
    cases = make_cases(pool_bytes, total, rng)
    max_size = max(c["size"] for c in cases if "size" in c)

    ucx_put = UcxPutRaw()
    ceilings = [Memcpy(min(256 * MiB, pool_bytes // 2)), TcpRaw(ctx, src, max_size), PyzmqRaw(ctx, src, max_size),
                ucx_put, Gather(src)]
    meters, errors = {}, {}
    for name in names:
        try:
            meters[name] = TransportMeter(ctx, name, options.get(name, {}), src)
        except Exception as e:  # a transport that does not start is a row with its reason
            errors[name] = f"{type(e).__name__}: {e}"[:200]
    if "ucx" in meters:
        try:
            ceilings.append(UcxPutSamePages(src, meters["ucx"].rx.descriptor, options.get("ucx", {}).get("tls")))
        except Exception as e:
            errors[SAME_PAGES] = f"{type(e).__name__}: {e}"[:200]
    print(f"pool {pool_bytes // MiB} MiB, {total // MiB} MiB per case, best of {reps}; ceilings and transports "
          f"measured in turn, case by case", flush=True)
    ceil: dict[str, dict] = {m.name: {} for m in ceilings}
    ceil.setdefault(SAME_PAGES, {})   # a column even where it could not start
    results: dict[str, dict] = {name: {} for name in meters}
    for case in cases:
        lab = case["label"]
        for _ in range(reps):
            for m in ceilings:
                v = m(case)
                if v is not None:
                    ceil[m.name][lab] = max(v, ceil[m.name].get(lab, 0.0))
            for name, m in list(meters.items()):
                try:
                    results[name][lab] = max(m(case), results[name].get(lab, 0.0))
                except Exception as e:  # a transport failing mid-run: keep what it measured, and why
                    errors[name] = f"{lab}: {type(e).__name__}: {e}"[:200]
                    results[name].pop(lab, None)
                    try:
                        meters.pop(name).close()
                    except Exception:
                        pass
        for name, m in list(meters.items()):
            try:
                m.verify(case)
            except Exception as e:
                errors[name] = f"{lab}: {type(e).__name__}: {e}"[:200]
                results[name].pop(lab, None)
                meters.pop(name).close()
        print(f"  {lab:24s} " + "  ".join(f"{k} {v[lab]:.2f}" for k, v in {**ceil, **results}.items() if lab in v),
              flush=True)
    for m in [*ceilings, *meters.values()]:
        m.close()
    ucx_why = ucx_put.why

    cols = ["memcpy", "tcp raw", "pyzmq raw", "ucx put raw", SAME_PAGES, "gather"]
    head = f"| case | {' | '.join(cols)} | " + " | ".join(f"{n} (x ceiling)" for n in results) + " |"
    lines = [head, "|" + "---|" * (1 + len(cols) + len(results))]
    for c in cases:
        lab = c["label"]
        row = [f"{ceil[k][lab]:.2f}" if lab in ceil[k] else "" for k in cols]
        for name, res in results.items():
            cks = ["gather" if "page" in c else CEILING_OF.get(name, "tcp raw")] + [SAME_PAGES] * (name == "ucx")
            ratio = "".join(f" ({res[lab] / ceil[ck][lab]:.2f}x {ck})" for ck in cks if ceil[ck].get(lab))
            row.append(f"{res[lab]:.2f}{ratio}" if lab in res else "")
        lines.append(f"| {lab} | " + " | ".join(row) + " |")
    print("\nGB/s (1 GB = 1e9 bytes)\n" + "\n".join(lines))
    for name, res in results.items():
        one_mib, small = res.get("one run 1 MiB"), res.get("scattered 4 KiB x16000")
        if one_mib and small:
            print(f"{name}: scattered 4 KiB pages / one run 1 MiB = {small / one_mib:.2f}x")
    for name, why in errors.items():
        print(f"{name}: not measured: {why}")
    if ucx_why:
        print(f"ucx put raw: not measured: {ucx_why}")
    if args.json:
        args.json.write_text(json.dumps({"ceilings": ceil, "transports": results, "errors": errors,
                                         "ucx_put_error": ucx_why, "pool_bytes": pool_bytes,
                                         "bytes_per_case": total, "repetitions": reps}, indent=1))


if __name__ == "__main__":
    main()
