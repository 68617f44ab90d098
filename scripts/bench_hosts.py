"""Benchmark across test hosts: one 64 MiB request host B -> host C, TP 1 -> 1 and TP 2 -> 4
(page-major prefill, token-major decode: head slices), over zmq and UCX-tcp, next to a raw TCP
stream (sendall / recv_into) between the same two namespaces, before and after (same run), and
the TP shape's own raw ceiling: as many sending and receiving processes as ranks, the same
bytes per connection (``raw tcp TP 2->4``).
Prints the median of ``--repeat`` runs (default 3) in GB/s. Root only (network namespaces).

    .venv/bin/python scripts/bench_hosts.py [--mib 64] [--repeat 3] [--transports zmq,ucx] [--tp 1:1,2:4]
                                            [--ucx-tls tcp] [--ucx-stage never,network] [--rounds 1]
                                            [--no-raw-ucx]

``--ucx-stage``: the UCX ranks' ``stage_host`` values to compare (A/B: "never" sends packed rows
as in-place iovs, "network" gathers them into the staging ring over TCP); ``--rounds`` repeats
the whole set, interleaved (A, B, A, B, ...), so load that drifts during the run hits both.

``--ucx-tls ""`` sets no UCX_TLS: the ranks reach each other as users get by default (the second
worker a peer in another network namespace gets, ``settings.FAR_TLS``; TCP here).

``raw ucx TP p->d copies`` (with ``--raw-ucx``, TP shapes other than 1 -> 1): the same processes
and bytes with the copies a head slice needs and nothing else of kvxfer. Each sender's bytes for
its receivers lie interleaved in 512 B rows (as a TP 2 -> 4 head slice of page-major KV does); it
gathers each receiver's rows into 4 MiB frames (kvxfer's ``frame_bytes``), each into a slot of its
own, and tag-sends them; each receiver pre-posts one slot per frame and writes each frame into
place as it lands (kvxfer's receiver: token-major destination rows merge into long runs). No
control messages, no planning, no Python per row: what kvxfer's frame path would cost with its
protocol free.

``--raw-ucx`` (on by default; ``--no-raw-ucx`` leaves it out): UCX's own ceiling in the same run,
no kvxfer code: ``raw ucx`` (one process on host B tag-sends N bytes, one contiguous host buffer,
to one on host C) and ``raw ucx TP 2->4`` (the processes and bytes of ``raw tcp TP 2->4``), with
ucxx's low-level API (``ucxx._lib.libucxx``) and the UCX settings kvxfer's ranks get for
``--ucx-tls`` (``transports/ucx/settings.py``: ``ucx_settings``, ``with_tcp_defaults``, and
``FAR_TLS`` when no UCX_TLS is set). Timed like the raw TCP rows: each sender from "go" until
its receivers acknowledged every byte (one untimed warm-up transfer first); every receiver
checks every byte. The kvxfer ucx rows also print their ratio to it.

Uses tests/hosts.py (the hosts) and tests/multihost_rank.py (the ranks). A benchmark, not a
test: it asserts only that every request arrived byte-exact.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hosts import UCX_ENV, TestHosts, hosts_skip_reason  # noqa: E402
from multihost_rank import RankProc  # noqa: E402

FRAME = 4 << 20   # the frames of ``raw ucx TP p->d copies``: kvxfer UCX's default ``frame_bytes``

# Raw TCP: the server prints its port, receives N bytes into one buffer with recv_into,
# answers one byte; the client sends N bytes with sendall and prints the seconds.
RAW_SERVER = r"""
import json, socket, sys
n = int(sys.argv[2]); buf = bytearray(n); view = memoryview(buf)
s = socket.create_server((sys.argv[1], 0)); print(json.dumps({"port": s.getsockname()[1]}), flush=True)
while True:
    c, _ = s.accept(); got = 0
    while got < n:
        k = c.recv_into(view[got:])
        if not k: break
        got += k
    c.sendall(b"k"); c.close()
"""
RAW_CLIENT = r"""
import os, socket, sys, time
n = int(sys.argv[3]); data = os.urandom(1 << 20) * (n >> 20)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t = time.perf_counter(); c.sendall(data); c.recv(1); print(time.perf_counter() - t)
"""


# The same shape raw (``raw_tcp_tp``): a client process per prefill rank connects to the server
# process of each decode rank it feeds, waits for "go" on stdin, then sends N bytes on each
# connection at once (a thread each) and prints the seconds until every server answered.
RAW_TP_CLIENT = r"""
import os, socket, sys, threading, time
n = int(sys.argv[1]); data = os.urandom(1 << 20) * (n >> 20)
conns = [socket.create_connection((a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]))) for a in sys.argv[2:]]
def one(c):
    c.sendall(data); c.recv(1)
print("ready", flush=True); sys.stdin.readline()
t = time.perf_counter(); ts = [threading.Thread(target=one, args=(c,)) for c in conns]
[x.start() for x in ts]; [x.join() for x in ts]; print(time.perf_counter() - t, flush=True)
"""


def raw_tcp(hosts, nbytes: int, repeat: int) -> list[float]:
    srv = hosts[2].popen([sys.executable, "-c", RAW_SERVER, hosts[2].addr, str(nbytes)], stdout=subprocess.PIPE,
                         text=True)
    port = json.loads(srv.stdout.readline())["port"]
    out = []
    for _ in range(repeat):
        r = hosts[1].run([sys.executable, "-c", RAW_CLIENT, hosts[2].addr, str(port), str(nbytes)], timeout=120)
        out.append(nbytes / float(r.stdout) / 1e9)
    srv.kill()
    return out


def raw_tcp_tp(hosts, nbytes: int, repeat: int, p_tp: int, d_tp: int) -> list[float]:
    """The ceiling of the TP ``p_tp`` -> ``d_tp`` shape on these hosts: ``p_tp`` sending processes on
    host B, ``d_tp`` receiving ones on host C, raw TCP, each receiver fed ``nbytes / d_tp`` by the
    one sender whose heads it takes (with ``p_tp`` < ``d_tp``, as kvxfer's head slices go);
    GB/s of the whole ``nbytes`` until the slowest sender is done."""
    if p_tp > d_tp or d_tp % p_tp:
        raise ValueError(f"raw TP {p_tp} -> {d_tp}: a decode TP that is a multiple of prefill's")
    per = nbytes // d_tp
    srvs = [hosts[2].popen([sys.executable, "-c", RAW_SERVER, hosts[2].addr, str(per)], stdout=subprocess.PIPE,
                           text=True) for _ in range(d_tp)]
    ports = [json.loads(s.stdout.readline())["port"] for s in srvs]
    fan = d_tp // p_tp
    out = []
    try:
        for _ in range(repeat):
            cls = [hosts[1].popen([sys.executable, "-c", RAW_TP_CLIENT, str(per),
                                   *[f"{hosts[2].addr}:{port}" for port in ports[r * fan:(r + 1) * fan]]],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(p_tp)]
            for c in cls:
                assert c.stdout.readline().strip() == "ready"
            for c in cls:
                c.stdin.write("go\n")
                c.stdin.flush()
            took = max(float(c.stdout.readline()) for c in cls)
            for c in cls:
                c.wait(30)
            out.append(per * d_tp / took / 1e9)
    finally:
        for srv in srvs:
            srv.kill()
    return out


# Raw UCX (``raw_ucx``), no kvxfer code: ucxx's low-level API, one context and worker per process
# (tag, RMA and wake-up features, as kvxfer's), the worker progressed until the requests complete,
# sleeping on its event fd when nothing moves (6 busy-polling processes on 2 cores would measure
# the scheduler). Receiver ``i`` gets the bytes ``pattern(i)`` XOR the round number (1, 2, ...).
# Both print their worker address first (JSON); then, per round, "ready" once set. What they tell
# the parent starts with "@@ " (``say``): UCX writes its warnings to stdout too.
RAW_UCX_COMMON = r"""
import json, os, select, sys, time
import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array
F = ucx_api.Feature
ctx = ucx_api.UCXContext(json.loads(sys.argv[1]), feature_flags=(F.TAG, F.RMA, F.WAKEUP))
worker = ucx_api.UCXWorker(ctx); worker.init_blocking_progress_mode()
poller = select.poll(); poller.register(worker.epoll_file_descriptor, select.POLLIN)
n, rounds = int(sys.argv[2]), int(sys.argv[3])
DATA, ACK = 1 << 32, 2 << 32
def wait(reqs):
    while not all(r.completed for r in reqs):
        if not worker.progress_once() and worker.arm():
            poller.poll(1)
    for r in reqs:
        r.check_error()
def pattern(i):
    return np.random.default_rng(1000 + i).integers(0, 256, n, dtype=np.uint8)
def say(x):
    print("@@", x, flush=True)
def connect(hexaddr):
    return worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(hexaddr)),
                                                      True)
say(json.dumps({"addr": worker.address.tobytes().hex()}))
"""
# The receiver (argv: config, n, rounds, its index) reads its sender's address on stdin; per round
# it posts the receive, says "ready", receives, answers one byte, and prints whether every byte
# is right ({"ok"}); it exits at the next line on stdin.
RAW_UCX_RECV = RAW_UCX_COMMON + r"""
i, frame = int(sys.argv[4]), int(sys.argv[5]); base = pattern(i); buf = np.zeros_like(base); one = np.ones(1, np.uint8)
ring = [np.empty(min(frame, n - f), np.uint8) for f in range(0, n, frame)] if frame else []
ep = connect(sys.stdin.readline().strip())
for k in range(1, rounds + 1):
    if frame:   # copies: each frame into a slot of its own, then written into place
        reqs = [worker.tag_recv(Array(r), ucx_api.UCXXTag(DATA | i | f + 1 << 16)) for f, r in enumerate(ring)]
        say("ready")
        for f, (req, r) in enumerate(zip(reqs, ring)):
            wait([req])
            buf[f * frame: f * frame + len(r)] = r
    else:
        req = worker.tag_recv(Array(buf), ucx_api.UCXXTag(DATA | i))
        say("ready")
        wait([req])
    wait([ep.tag_send(Array(one), ucx_api.UCXXTag(ACK | i))])
    np.bitwise_xor(buf, k, out=buf)
    say(json.dumps({"ok": bool(np.array_equal(buf, base))}))
sys.stdin.readline(); os._exit(0)
"""
# The sender (argv: config, n, rounds, "index:address" of each receiver it feeds): per round it
# fills its buffers, posts the receives of the acknowledgements, says "ready", waits for "go" on
# stdin, tag-sends n bytes to each receiver at once and prints the seconds until every one
# answered; it exits at the next line on stdin.
RAW_UCX_SEND = RAW_UCX_COMMON + r"""
frame = int(sys.argv[4])
peers = [(int(a.split(":")[0]), connect(a.split(":")[1])) for a in sys.argv[5:]]
bases = {i: pattern(i) for i, _ in peers}; data = {i: np.empty_like(b) for i, b in bases.items()}
acks = {i: np.zeros(1, np.uint8) for i in bases}
# copies (frame > 0): each receiver's bytes are every other 512 B row of one source, as a head
# slice of page-major KV is; gathered frame by frame into slots of their own and tag-sent
ROW = 512
src = np.empty((n // ROW, len(peers), ROW), np.uint8) if frame else None
slots = [np.empty(min(frame, n - f), np.uint8) for _ in peers for f in range(0, n, frame)] if frame else []
for k in range(1, rounds + 1):
    for j, (i, b) in enumerate(bases.items()):
        np.bitwise_xor(b, k, out=data[i])
        if frame:
            src[:, j, :] = data[i].reshape(-1, ROW)
    reqs = [worker.tag_recv(Array(acks[i]), ucx_api.UCXXTag(ACK | i)) for i in bases]
    say("ready"); sys.stdin.readline()
    t = time.perf_counter()
    if frame:
        for f, lo in enumerate(range(0, n, frame)):
            for j, (i, ep) in enumerate(peers):
                slot = slots[j * len(slots) // len(peers) + f]
                np.copyto(slot.reshape(-1, ROW), src[lo // ROW: (lo + len(slot)) // ROW, j, :])
                reqs.append(ep.tag_send(Array(slot), ucx_api.UCXXTag(DATA | i | f + 1 << 16)))
                worker.progress_once()
    else:
        reqs += [ep.tag_send(Array(data[i]), ucx_api.UCXXTag(DATA | i)) for i, ep in peers]
    wait(reqs)
    say(time.perf_counter() - t)
sys.stdin.readline(); os._exit(0)
"""


def raw_ucx_settings(ucx_tls: str) -> tuple[dict[str, str] | None, dict[str, str]]:
    """The environment (``Host.popen``'s ``env``) and UCX config dict of a raw UCX process: what a
    kvxfer UCX rank of ``kvxfer_request(..., ucx_tls)`` hands the context that reaches a peer in
    another network namespace (``Workers``: ``with_tcp_defaults(ucx_settings(...))``, with
    ``TLS=FAR_TLS`` unless UCX_TLS is set, where its data worker takes the environment's)."""
    from kvxfer_transports.ucx import settings as st
    env = {**UCX_ENV, "UCX_TLS": ucx_tls} if ucx_tls else None
    environ = {**os.environ, **(env or {})}
    config = st.with_tcp_defaults(st.ucx_settings(None, None, environ), environ)
    if not st.tls_explicit(None, None, environ):
        config["TLS"] = st.FAR_TLS
    return env, config


def raw_ucx(hosts, nbytes: int, repeat: int, p_tp: int = 1, d_tp: int = 1, ucx_tls: str = "tcp",
            frame: int = 0) -> list[float]:
    """UCX's own ceiling, no kvxfer code: ``p_tp`` sending processes on host B, ``d_tp`` receiving
    ones on host C (1 -> 1: ``raw ucx``), each receiver tag-sent ``nbytes / d_tp`` in one message
    by the sender ``raw_tcp_tp`` gives it, UCX configured as kvxfer's ranks (``raw_ucx_settings``);
    ``frame`` > 0: in frames of that many bytes, with a head slice's copies (``raw ucx TP p->d copies``).
    One warm-up round, then ``repeat`` timed ones: GB/s of the whole ``nbytes`` until the slowest
    sender had every acknowledgement; every receiver checks every byte of every round."""
    if p_tp > d_tp or d_tp % p_tp:
        raise ValueError(f"raw UCX TP {p_tp} -> {d_tp}: a decode TP that is a multiple of prefill's")
    per, fan, rounds = nbytes // d_tp, d_tp // p_tp, repeat + 1
    env, config = raw_ucx_settings(ucx_tls)
    head = [sys.executable, "-c"]
    tail = [json.dumps(config), str(per), str(rounds)]
    procs: list[subprocess.Popen] = []

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    # a child that hangs would hang the run: kill them all (their pipes close, readline fails)
    watchdog = threading.Timer(60 + 30 * rounds, kill_all)
    watchdog.start()

    def line(p: subprocess.Popen) -> str:   # the next "@@ " line, without it
        while True:
            got = p.stdout.readline()
            if not got:
                raise RuntimeError(f"raw ucx: a process ended (exit status {p.wait(10)})")
            if got.startswith("@@ "):
                return got[3:].strip()

    def tell(p: subprocess.Popen, text: str) -> None:
        p.stdin.write(text + "\n")
        p.stdin.flush()

    try:
        rcv = [hosts[2].popen([*head, RAW_UCX_RECV, *tail, str(i), str(frame)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i in range(d_tp)]
        procs += rcv
        raddr = [json.loads(line(r))["addr"] for r in rcv]
        feeds = [[f"{i}:{raddr[i]}" for i in range(s * fan, (s + 1) * fan)] for s in range(p_tp)]
        snd = [hosts[1].popen([*head, RAW_UCX_SEND, *tail, str(frame), *feed], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for feed in feeds]
        procs += snd
        saddr = [json.loads(line(s))["addr"] for s in snd]
        for i, r in enumerate(rcv):
            tell(r, saddr[i // fan])
        out = []
        for k in range(1, rounds + 1):
            for p in rcv + snd:
                assert line(p) == "ready"
            for s in snd:
                tell(s, "go")
            took = max(float(line(s)) for s in snd)
            for i, r in enumerate(rcv):
                assert json.loads(line(r))["ok"], f"raw ucx TP {p_tp}->{d_tp}: round {k}, receiver {i}: bytes differ"
            if k > 1:
                out.append(per * d_tp / took / 1e9)
        for p in procs:
            tell(p, "exit")
        for p in procs:
            p.wait(30)
        return out
    finally:
        watchdog.cancel()
        kill_all()
        for p in procs:
            p.wait(10)


def kvxfer_request(hosts, transport: str, mib: int, repeat: int, p_tp: int = 1, d_tp: int = 1,
                   ucx_tls: str = "tcp", stage: str = "") -> list[float]:
    """One ``mib`` MiB request (all heads) from prefill TP ``p_tp`` (page-major, host B) to decode
    TP ``d_tp`` (token-major, host C): GB/s of each timed run, every head's bytes compared. Timed
    from asking every prefill rank to send, all at once (each rank's ``send``, its planning
    included, runs in the window), until every decode rank's request ended. Before, the ranks
    were asked one after another, each after the previous one's ``send`` returned: at TP 2 -> 4
    the second rank started 4-13 ms late, ~10% of a 64 MiB request."""
    # 2 layers x K,V x 8 heads x 128 dims x bf16 = 8 KiB per token (all ranks together)
    tokens = mib * 1024 * 1024 // 8192
    # decode keeps every successful request's slots: room for all of them
    pool = dict(heads=8, layers=2, head_dim=128, page_size=16, num_pages=(repeat + 1) * tokens // 16 + 2)
    env = ({**UCX_ENV, "UCX_TLS": ucx_tls} if ucx_tls else None) if transport == "ucx" else None
    boot = RankProc(hosts[0], "bootstrap", expect=p_tp)
    ranks: list[RankProc] = []
    try:
        common = dict(bootstrap=boot.url, transport=transport, **pool)
        if stage and transport == "ucx":
            common["ucx_stage_host"] = stage
        ps = [RankProc(hosts[1], "prefill", env=env, layout="page_major", seed=3, tp_rank=r, tp_size=p_tp, **common)
              for r in range(p_tp)]
        ranks += ps
        ds = [RankProc(hosts[2], "decode", env=env, layout="token_major", tp_rank=r, tp_size=d_tp, **common)
              for r in range(d_tp)]
        ranks += ds
        out = []
        for room in range(1, repeat + 2):        # the first one warms up, and is not counted
            for d in ds:
                d.call("receiver", room=room, tokens=tokens)
            for p in ps:
                p.call("sender", room=room, tokens=tokens)
            t = time.perf_counter()
            for p in ps:   # every prefill rank at once, as the raw rows' "go" (one rank's send must not wait for
                p.ask("send", room=room)   # another's to return: each rank's engine calls its own)
            for p in ps:
                p.reply()
            for d in ds:
                st = d.call("wait", rooms=[room], within=120, timeout=180)[str(room)]
                assert st["state"] == "Success", st
            took = time.perf_counter() - t
            sent, got = {}, {}
            for p in ps:
                sent.update(p.call("digest", room=room, timeout=120))
            for d in ds:
                got.update(d.call("digest", room=room, timeout=120))
            assert sent == got, f"room {room}: bytes differ"
            if room > 1:
                out.append(tokens * 8192 / took / 1e9)
            for p in ps:
                p.call("wait", rooms=[room], within=30)
        return out
    finally:
        for r in ranks[::-1] + [boot]:
            r.close()


def main() -> int:
    ap = argparse.ArgumentParser(description="kvxfer across test hosts vs raw TCP")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transports", default="zmq,ucx")
    ap.add_argument("--tp", default="1:1,2:4", help="prefill:decode TP pairs, comma-separated")
    ap.add_argument("--ucx-tls", default=UCX_ENV["UCX_TLS"], help='UCX_TLS of the UCX ranks ("": none set)')
    ap.add_argument("--ucx-stage", default="", help="stage_host values of the UCX ranks to compare (comma-separated)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole set, interleaved")
    ap.add_argument("--raw-ucx", action=argparse.BooleanOptionalAction, default=True,
                    help="UCX's own ceiling next to the raw TCP rows (raw ucx, raw ucx TP p->d)")
    a = ap.parse_args()
    why = hosts_skip_reason()
    if why:
        print(f"cannot run: {why}")
        return 1
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in a.tp.split(",")]
    stages = a.ucx_stage.split(",") if a.ucx_stage else [""]
    raw_ucx_on = a.raw_ucx and importlib.util.find_spec("ucxx") is not None
    if a.raw_ucx and not raw_ucx_on:
        print("raw ucx: ucxx does not import, skipped")
    rows: dict[str, list[float]] = {}
    with TestHosts(3) as hosts:
        for _ in range(a.rounds):
            rows.setdefault("raw tcp", []).extend(raw_tcp(hosts, a.mib << 20, a.repeat))
            if raw_ucx_on:
                rows.setdefault("raw ucx", []).extend(raw_ucx(hosts, a.mib << 20, a.repeat, ucx_tls=a.ucx_tls))
            for p_tp, d_tp in pairs:
                if (p_tp, d_tp) != (1, 1):   # the shape's own ceiling, raw: as many processes as ranks
                    rows.setdefault(f"raw tcp TP {p_tp}->{d_tp}", []).extend(
                        raw_tcp_tp(hosts, a.mib << 20, a.repeat, p_tp, d_tp))
                    if raw_ucx_on:
                        rows.setdefault(f"raw ucx TP {p_tp}->{d_tp}", []).extend(
                            raw_ucx(hosts, a.mib << 20, a.repeat, p_tp, d_tp, a.ucx_tls))
                        rows.setdefault(f"raw ucx TP {p_tp}->{d_tp} copies", []).extend(
                            raw_ucx(hosts, a.mib << 20, a.repeat, p_tp, d_tp, a.ucx_tls, frame=FRAME))
                for t in a.transports.split(","):
                    if t == "ucx" and importlib.util.find_spec("ucxx") is None:
                        print("ucx: ucxx does not import, skipped")
                        continue
                    for stage in stages if t == "ucx" else [""]:
                        how = f"({a.ucx_tls or 'far'}{', ' + stage if stage else ''})" if t == "ucx" else ""
                        name = f"kvxfer {t}{how} TP {p_tp}->{d_tp}"
                        rows.setdefault(name, []).extend(
                            kvxfer_request(hosts, t, a.mib, a.repeat, p_tp, d_tp, a.ucx_tls, stage))
            rows.setdefault("raw tcp (again)", []).extend(raw_tcp(hosts, a.mib << 20, a.repeat))
    raw = statistics.median(rows["raw tcp"] + rows["raw tcp (again)"])
    print(f"one {a.mib} MiB request host B -> host C (veth on a bridge), page-major -> token-major, "
          f"median of {a.repeat} x {a.rounds} rounds; ratio to the raw TCP median of this run ({raw:.2f} GB/s):")
    for name, v in rows.items():
        m = statistics.median(v)
        shape = name.rsplit(" TP ", 1)[-1] if " TP " in name and not name.startswith("raw tcp") else ""
        ceiling = rows.get(f"raw tcp TP {shape}")
        vs = f"  {m / statistics.median(ceiling):5.2f}x of raw TP {shape}" if ceiling else ""
        own = "raw ucx" if shape == "1->1" else f"raw ucx TP {shape}"    # UCX's own ceiling of the shape
        for ceiling_name in (own, f"{own} copies"):   # and with a head slice's copies
            if name.startswith("kvxfer ucx") and ceiling_name in rows:
                vs += f"  {m / statistics.median(rows[ceiling_name]):5.2f}x of {ceiling_name}"
        print(f"  {name:34s} {m:6.2f} GB/s  {m / raw:5.2f}x{vs}   runs: {', '.join(f'{x:.2f}' for x in v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
