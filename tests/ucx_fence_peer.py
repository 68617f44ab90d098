"""One side of the fencing experiment of ``tests/test_ucx_close_fence.py``: raw UCX (ucxx
workers and endpoints, our ``bindings`` for RMA), TLS ``FAR_TLS`` (no shared memory, no cma:
TCP here, as for a peer in another host or network namespace), endpoints with error handling
on, as the transport makes them for such a peer.

Who calls what: the test starts two processes, talks to them over their pipes (one JSON line
each way; replies are prefixed ``@@ ``)::

    python tests/ucx_fence_peer.py R close|kill      # receiver: maps 64 MiB of zeros
        -> {"addr", "rkey", "base"}   <- {"addr"} (S's)   -> {"before": ...}
        close: force-closes its endpoint to S, zeroes the memory, watches WATCH s -> {"after": ...}
        kill:  -> {"ready"}; the test kill -9s S; waits for the endpoint's close callback,
               zeroes the memory, watches WATCH s -> {"after": ...}
    python tests/ucx_fence_peer.py S close|kill      # sender: <- R's line -> {"addr"}; then puts
        blocks of 0xAB all over R's memory and a tagged message, without end (close: 1 MiB
        puts, 4 at a time; kill: one 4 KiB put at a time, flushed before the next)

"after" says how many bytes of R's memory are not zero (written after the zeroing), how many
tagged messages of S arrived, R's TCP sockets (``ss``) and whether the endpoint is alive.

Why the killed sender puts one small block at a time: over TCP with error handling, UCX emulates
a put with active messages, and the target answers each one with a completion message. A target
that handles such a put after its endpoint to the sender failed (several in its socket when the
sender died) aborts inside libucp ("ucp_request.inl: Fatal: unexpected error: Endpoint timeout",
UCX 1.21: the completion's send returns the failed endpoint's error, which ``ucp_request_try_send``
does not expect): R died so in 2 of 9 runs on a loaded machine with 1 MiB puts, 4 in flight.
kvxfer never puts to such a peer (``Peer.pack_all``: every run travels in tagged frames).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys
import time

import numpy as np
from ucxx._lib import libucxx as u
from ucxx._lib.arr import Array

from kvxfer_transports.ucx import bindings as ucp
from kvxfer_transports.ucx.peers import failure_of
from kvxfer_transports.ucx.settings import FAR_TLS

N, WATCH = 64 << 20, 4.0
MASK = u.UCXXTagMask(0xFFFFFFFFFFFFFFFF)
HELLO_TAG, DATA_TAG = 1, 7


def say(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_line(w) -> dict:
    """The next JSON line on stdin, progressing the worker while waiting."""
    while not select.select([sys.stdin], [], [], 0.005)[0]:
        w.progress()
    return json.loads(sys.stdin.readline())


def sockets() -> list[str]:
    out = subprocess.run(["ss", "-tnp"], capture_output=True, text=True).stdout
    return [" ".join(line.split()[3:5]) for line in out.splitlines() if f"pid={os.getpid()}," in line]


def receiver(mode: str) -> None:
    ctx = u.UCXContext({"TLS": FAR_TLS}, feature_flags=(u.Feature.TAG, u.Feature.RMA, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    buf = np.zeros(N, np.uint8)
    memh, packed, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
    params = ucp.MemMapParams(ucp.MEMMAP_ADDR_LEN, buf.ctypes.data, N)
    ucp.check(ucp.mem_map(ctx.handle, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
    ucp.check(ucp.rkey_pack(ctx.handle, memh, ctypes.byref(packed), ctypes.byref(size)), "ucp_rkey_pack")
    say({"addr": w.address.tobytes().hex(), "rkey": ctypes.string_at(packed, size.value).hex(),
         "base": buf.ctypes.data})
    s_addr = bytes.fromhex(read_line(w)["addr"])
    while not w.tag_probe(u.UCXXTag(HELLO_TAG), MASK, remove=False).matched:   # as the transport: ep on HELLO
        w.progress()
    ep = w.create_endpoint_from_worker_address(u.UCXAddress.create_from_buffer(s_addr), True)
    closed: list[float] = []
    ep.set_close_callback(lambda: closed.append(time.monotonic()))
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        w.progress()
    say({"before": {"written": int((buf != 0).sum()), "sockets": sockets()}})
    t0 = time.monotonic()
    if mode == "close":
        ep.close()   # error handling on: ucxx closes in force mode
        for _ in range(100):
            w.progress()
    else:
        say({"ready": True})
        while not closed and time.monotonic() - t0 < 20:
            w.progress()
    callback = round(closed[0] - t0, 3) if closed else None
    status = failure_of(ep)   # what the transport makes of the failure ("reset" after a kill)
    buf[:] = 0
    tags, end = 0, time.monotonic() + WATCH
    while time.monotonic() < end:
        w.progress()
        while w.tag_probe(u.UCXXTag(DATA_TAG), MASK, remove=True).matched:
            tags += 1
    say({"after": {"written": int((buf != 0).sum()), "tags": tags, "sockets": sockets(), "alive": ep.alive,
                   "callback_s": callback, "status": status}})
    sys.stdin.readline()


def sender(mode: str) -> None:
    ctx = u.UCXContext({"TLS": FAR_TLS}, feature_flags=(u.Feature.TAG, u.Feature.RMA, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    info = read_line(w)
    ep = w.create_endpoint_from_worker_address(u.UCXAddress.create_from_buffer(bytes.fromhex(info["addr"])), True)
    say({"addr": w.address.tobytes().hex()})
    msg = np.zeros(16, np.uint8)
    keep = [ep.tag_send(Array(msg), u.UCXXTag(HELLO_TAG))]
    rkey = ctypes.c_void_p()
    ucp.check(ucp.rkey_unpack(ep.handle, bytes.fromhex(info["rkey"]), ctypes.byref(rkey)), "ucp_ep_rkey_unpack")
    paced = mode == "kill"   # see the module docstring
    src, param = np.full(4096 if paced else 1 << 20, 0xAB, np.uint8), ucp.RequestParam()
    k = 0
    while not select.select([sys.stdin], [], [], 0.005)[0]:
        for _ in range(1 if paced else 4):
            req = ucp.put_nbx(ep.handle, src.ctypes.data, len(src), info["base"] + ((k % 64) << 20), rkey,
                              ctypes.byref(param))
            k += 1
            if req:
                ucp.request_free(req)   # done or not, UCX completes it; we never look again
        if paced:   # the put's completion came back before the next put goes
            flush, end = ucp.Flush(ucp.ep_flush(ep.handle, ctypes.byref(param))), time.monotonic() + 5
            while flush.poll() is None and time.monotonic() < end:
                w.progress()
        keep = [*keep[-63:], ep.tag_send(Array(msg), u.UCXXTag(DATA_TAG))]
        for _ in range(20):
            w.progress()


if __name__ == "__main__":
    receiver(sys.argv[2]) if sys.argv[1] == "R" else sender(sys.argv[2])
