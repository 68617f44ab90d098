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
import os
import re
import socket
import subprocess
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import torch

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
CEILING_OF = {"zmq": "tcp raw", "ucx": "ucx put raw", "local": "memcpy"}
SAME_PAGES = "ucx put raw (same pages)"


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


def serve_tcp(conn, max_size: int) -> None:
    """Raw TCP sink: receive ``total`` bytes in ``size`` messages with recv_into, then ack one byte."""
    ls = socket.create_server(("127.0.0.1", 0))
    conn.send(ls.getsockname()[1])
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_size))
    while True:
        size, total = conn.recv()
        if size == 0:
            return
        left = total
        while left:
            want = min(size, left)
            got = 0
            while got < want:
                got += s.recv_into(buf[got:want], want - got)
            left -= want
        s.sendall(b"k")


def serve_zmq(conn, max_size: int) -> None:
    """Raw pyzmq sink: ROUTER, recv(copy=False) and one copy per message, ack at the end.
    With the glibc malloc tuning the zmq transport applies (else zmq faults in every message)."""
    import ctypes

    import zmq
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20), ctypes.CDLL("libc.so.6").mallopt(-1, 256 << 20)
    except OSError:
        pass
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.bind("tcp://127.0.0.1:*")
    conn.send(r.last_endpoint.decode())
    buf = np.empty(max_size, np.uint8)
    while True:
        rid, *parts = r.recv_multipart(copy=False)
        if len(parts[0]) == 1:   # the end marker
            if parts[0].bytes == b"q":
                return
            r.send_multipart([rid.bytes, b"k"])
            continue
        buf[: len(parts[0])] = np.frombuffer(parts[0].buffer, np.uint8)


# ---------------------------------------------------------------------------------------
# Ceilings. Each meter runs one repetition of a case and returns GB/s (None: not its case).
# ---------------------------------------------------------------------------------------
def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Memcpy:
    name = "memcpy"

    def __init__(self, nbytes: int):
        self.a, self.b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        self.b.copy_(self.a)

    def __call__(self, case) -> float:
        return self.a.numel() / timed(lambda: self.b.copy_(self.a)) / 1e9

    def close(self) -> None:
        pass


class Gather:
    name = "gather"

    def __init__(self, src: torch.Tensor):
        self.src = src

    def __call__(self, case) -> float | None:
        if "page" not in case:
            return None
        page = case["page"]
        rows = self.src[: self.src.numel() // page * page].view(-1, page)
        idx = torch.from_numpy(case["so"] // page)
        if "gather_out" not in case:   # warm: its pages are faulted in once, not timed
            case["gather_out"] = torch.index_select(rows, 0, idx)
        out = case["gather_out"]
        return out.numel() / timed(lambda: torch.index_select(rows, 0, idx, out=out)) / 1e9

    def close(self) -> None:
        pass


class TcpRaw:
    name = "tcp raw"

    def __init__(self, ctx, src: torch.Tensor, max_size: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_tcp, args=(child, max_size), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", self.conn.recv()))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.mv = memoryview(src.numpy())

    def __call__(self, case) -> float | None:
        if "size" not in case:
            return None
        size, tot = case["size"], case["total"]

        def once():
            self.conn.send((size, tot))
            for i in range(tot // size):
                o = (i * size) % (len(self.mv) - size + 1)
                self.sock.sendall(self.mv[o: o + size])
            self.sock.recv(1)
        return tot / timed(once) / 1e9

    def close(self) -> None:
        self.conn.send((0, 0))
        self.proc.join(10)
        self.sock.close()


class PyzmqRaw:
    name = "pyzmq raw"

    def __init__(self, ctx, src: torch.Tensor, max_size: int):
        import zmq
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_zmq, args=(child, max_size), daemon=True)
        self.proc.start()
        self.zctx = zmq.Context()
        self.d = self.zctx.socket(zmq.DEALER)
        self.d.sndhwm = 32
        self.d.connect(self.conn.recv())
        self.arr = src.numpy()

    def __call__(self, case) -> float | None:
        if "size" not in case:
            return None
        size, tot = case["size"], case["total"]

        def once():
            for i in range(tot // size):
                o = (i * size) % (len(self.arr) - size + 1)
                self.d.send(memoryview(self.arr[o: o + size]), copy=False)
            self.d.send(b"e")
            self.d.recv()
        return tot / timed(once) / 1e9

    def close(self) -> None:
        self.d.send(b"q")
        self.proc.join(10)
        self.d.close(linger=0)
        self.zctx.term()


class UcxPutRaw:
    """``ucx_perftest -t ucp_put_bw`` from the libucx wheel; ``why`` says why it gave nothing."""
    name = "ucx put raw"

    def __init__(self):
        self.why = ""
        try:
            import libucx
        except ImportError as e:
            self.exe, self.why = None, f"libucx not installed ({e})"
            return
        root = Path(libucx.__file__).parent
        self.exe = root / "bin" / "ucx_perftest"
        self.env = dict(os.environ, LD_LIBRARY_PATH=f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}")

    def __call__(self, case) -> float | None:
        if "size" not in case or self.exe is None:
            return None
        size = case["size"]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        iters = int(min(max(case["total"] // size, 50), 100_000))
        server = subprocess.Popen([str(self.exe), "-p", str(port)], env=self.env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            for _ in range(20):   # the server takes a moment to listen
                time.sleep(0.2)
                r = subprocess.run([str(self.exe), "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw", "-s", str(size),
                                    "-n", str(iters)], env=self.env, capture_output=True, text=True, timeout=120)
                m = re.search(r"^Final:\s+(.*)$", r.stdout, re.M)
                if m:
                    return float(m.group(1).split()[5]) * MiB / 1e9   # "overall" bandwidth, MB/s of MiB
                last = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["no output"]
                self.why = f"ucx_perftest failed: {last[0][:120]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            self.why = f"ucx_perftest failed: {e}"
        finally:
            server.kill()
            server.wait()
        return None

    def close(self) -> None:
        pass


class UcxPutSamePages:
    """Raw one-sided puts over the runs of a case, the transport's own mechanism without its
    protocol: an own UCX context and worker in this process, an endpoint (error handling off,
    as the transport's) to the receiver transport's worker, its rkey, one ``ucp_put_nbx`` per
    run (no callback), one ``ucp_ep_flush_nbx``, progress until it completes. The ctypes
    declarations are the transport's (``kvxfer_transports.ucx.bindings``); the put loop is this one's."""
    name = SAME_PAGES

    def __init__(self, src: torch.Tensor, descriptor: dict, tls: str | None = None):
        import ctypes

        from ucxx._lib import libucxx as u

        from kvxfer_transports.ucx import bindings as U
        from kvxfer_transports.ucx import ucx_settings
        self.U, self.ctypes, self.base = U, ctypes, src.data_ptr()
        # the transport's UCX settings: peers over shared memory must agree on its FIFO size
        self.ctx = u.UCXContext(ucx_settings(tls, None, os.environ), feature_flags=(u.Feature.TAG, u.Feature.RMA))
        self.worker = u.UCXWorker(self.ctx)
        addr = u.UCXAddress.create_from_buffer(bytes.fromhex(descriptor["address"]))
        self.ep = self.worker.create_endpoint_from_worker_address(addr, False)
        self.rbase, rkey, self.memh = int(descriptor["region_base"][0]), ctypes.c_void_p(), ctypes.c_void_p()
        U.check(U.rkey_unpack(self.ep.handle, bytes.fromhex(descriptor["rkeys"][0]), ctypes.byref(rkey)), "rkey")
        mp_ = U.MemMapParams(U.MEMMAP_ADDR_LEN, self.base, src.numel())
        U.check(U.mem_map(self.ctx.handle, ctypes.byref(mp_), ctypes.byref(self.memh)), "ucp_mem_map")
        self.rkey = rkey.value
        self.param, self.flush_param = U.RequestParam(op_attr_mask=U.OP_ATTR_MEMH, memh=self.memh.value), \
            U.RequestParam()

    def put(self, so: np.ndarray, do: np.ndarray, n: np.ndarray) -> float:
        """Seconds to put every run and see the flush complete."""
        U, ep, pr = self.U, self.ep.handle, self.ctypes.byref(self.param)
        t0 = time.perf_counter()
        for s, d, k in zip((self.base + so).tolist(), (self.rbase + do).tolist(), n.tolist()):  # one call per run
            st = U.put_nbx(ep, s, k, d, self.rkey, pr)
            if st:
                if st >= U.PTR_ERR_MIN:
                    raise RuntimeError(f"ucp_put_nbx: {U.why(st - 2**64)}")
                U.request_free(st)
        f = U.Flush(U.ep_flush(ep, self.ctypes.byref(self.flush_param)))
        while f.poll() is None:
            self.worker.progress()
        if f.status:
            raise RuntimeError(f"flush: {U.why(f.status)}")
        return time.perf_counter() - t0

    def __call__(self, case) -> float:
        self.put(case["so"], case["do"], case["n"])   # untimed pass: page faults, cold caches
        return int(case["n"].sum()) / self.put(case["so"], case["do"], case["n"]) / 1e9

    def close(self) -> None:
        self.U.rkey_destroy(self.rkey)
        self.U.mem_unmap(self.ctx.handle, self.memh.value)
        self.ep.close()


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
