"""The ceilings of ``bench_transport.py``, measured in the same run as the transports: memcpy,
raw TCP and raw pyzmq (each with a sink in a child process), ``ucx_perftest`` put bandwidth,
raw UCX puts of the case's own runs, and a single-process gather of the same pages.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

KiB, MiB = 1 << 10, 1 << 20
SAME_PAGES = "ucx put raw (same pages)"


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive the bench: the kernel kills it when the
    bench dies, however it dies (a SIGTERM runs no ``finally``). A ``ucx_perftest`` server left
    behind spins a core, waiting for a client, until someone kills it (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, ctypes.c_ulong(int(signal.SIGKILL)))   # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------------
# Child processes: the sinks of the raw TCP and pyzmq ceilings
# ---------------------------------------------------------------------------------------
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
                                  stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
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
