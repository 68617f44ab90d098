#!/usr/bin/env python
"""Discovery at deployment scale (issue 38): N prefill ranks and N decode ranks, simulated through
kvxfer's own client classes, against one registry (the embedded ``kvxfer bootstrap`` with its
default settings, or one etcd node), for N = 128, 512 and 1,024.

    .venv/bin/python scripts/bench_registry.py [--quick] [--sizes 128,512,1024] [--backends embedded,etcd]
                                                [--steady SECONDS] [--json PATH]

Deployment: N/8 prefill instances x TP 8 (real ``RankInfo`` records: an 80-layer FP8 page-major
pool, 30 KB of layout each) and N/8 decode instances x TP 8, decode instance i pulling from prefill
instance i. Every 8 ranks are one host, connecting from a loopback address of its own (127.10.x.y
prefill, 127.20.x.y decode) as 8-GPU hosts would. A prefill rank is a ``Registration`` (the
registry's default ttl: 10 s embedded, 30 s etcd; a heartbeat every ttl / 3); a decode rank runs
``find_ranks`` (what a decode endpoint's connect runs), then a ``PeerRecovery`` following its
instance (a decode endpoint's recovery thread, over a stand-in endpoint whose rejoin records what
it was given and says no HELLO). Ranks live in worker processes of at most 256 ranks (this script
with --worker).

Phases, one registry per (backend, N), in order:
  start-up  all N prefill ranks start at once: how many failed to register (goal 0)
  connect   all N decode ranks connect at once: ready within 30 s (goal all), registrations lost
            meanwhile (goal 0)
  steady    recovery running, nothing changing (--steady s): the registry's CPU in % of one core
            (goal <= 10 at 1,024) and bytes a decode rank's recovery read from it per minute
            (answers: status lines, headers, bodies; goal ~0)
  churn     10% of the prefill ranks killed (heartbeats stop) and started again at once on new
            ports: the slowest decode rank to see a replacement, after the kill (goal <= 2 x ttl),
            and other registrations lost (goal 0)
  restart   the registry killed (-9) and started again on its port (etcd on its data): seconds until
            every prefill rank is registered again, and requests of a real prefill/decode pair
            (zmq, in this process; bytes checked) failed meanwhile (goal 0)
Once per backend: fit      1,024 records of an 80-layer FP8 page-major pool with per-block scales
                           (67 KB of layout each) against the defaults: accepted (goal 1,024)
Once:             fan-out  a decode rank's connect to an instance of 64 prefill ranks against one
                           of 8 (real endpoints over zmq, 8 prefill ranks a process): the median
                           ratio of 5 connects (goal <= 2), and the same-run ceiling of each (the
                           CPU the connect costs, spread over this machine's cores)

Every figure of the table comes from this run. The machine's other load shows in the CPU figure:
run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_WORKER = 256
CONNECT_WITHIN = 30.0


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def host_of(role: str, rank: int) -> str:
    """The loopback address of the host of ``rank`` (8 ranks a host)."""
    h = rank // 8
    return f"127.{10 if role == 'prefill' else 20}.{h // 250}.{h % 250 + 1}"


def layout(scales: bool = False) -> dict:
    from kvxfer.layout import page_major_layout
    return page_major_layout(layers=80, heads=1, head_dim=128, dtype="fp8_e4m3", num_pages=4096, page_size=16,
                             scale_block=32 if scales else None).to_dict()


def rank_info(rank: int, port: int, lay: dict, instance: str | None = None):
    from kvxfer.control.records import RankInfo
    from kvxfer.ranks import RankSpec
    inst, tp = divmod(rank, 8)
    spec = RankSpec(role="prefill", num_kv_heads=8, num_layers=80, instance=instance or f"p{inst}", tp_rank=tp,
                    tp_size=8)
    data = {"zmq": {"transport": "zmq", "id": f"x{rank}-{port}", "endpoint": f"tcp://127.0.0.1:{port + 1}"}}
    return RankInfo(spec=spec, control=f"tcp://127.0.0.1:{port}", data=data, layout=lay)


# ------------------------------------------------------------------------------------
# Workers: simulated ranks in their own processes, driven by JSON lines on stdin
# ------------------------------------------------------------------------------------
class Decode:
    """One decode rank: its registry client, the records it connected with, and what its recovery
    thread told it (the stand-in endpoint of ``PeerRecovery``)."""

    def __init__(self, url: str, rank: int):
        from kvxfer.control.client import BootstrapClient
        self.rank, self.instance = rank, f"p{rank // 8}"
        self.client = BootstrapClient(url, timeout=10.0, source=host_of("decode", rank))
        self.known: dict = {}
        self.seen: dict[str, tuple[float, str]] = {}    # key -> (time.time() of the rejoin, control)
        self.recovery = None
        self.lock = threading.Lock()

    lost_peers: dict = {}

    def registries(self):
        return {self.instance: self.client}

    def known_peers(self):
        with self.lock:
            return dict(self.known)

    def rejoin(self, key, info, *, replaced, read_at):
        with self.lock:
            if replaced:
                self.seen[key] = (time.time(), info.control)
            self.known[key] = info
        return True

    def break_endpoint(self, why):
        print(json.dumps({"broken": why}), file=sys.stderr, flush=True)


def _at(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _each(items, fn) -> list:
    """``fn(item)`` for every item at once (a thread each); what each returned or raised."""
    out: list = [None] * len(items)

    def one(i, x):
        try:
            out[i] = fn(x)
        except Exception as e:   # counted by the caller
            out[i] = e
    threads = [threading.Thread(target=one, args=(i, x), daemon=True) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def worker(role: str, url: str, lo: int, hi: int) -> None:
    raise_nofile()
    from kvxfer.control.client import BootstrapClient, Registration
    from kvxfer.endpoint.base import Timeouts
    from kvxfer.endpoint.instances import find_ranks
    from kvxfer.endpoint.recovery import PeerRecovery
    from kvxfer.metrics import REGISTRATIONS_LOST
    lay = layout()
    regs: dict[int, Registration] = {}
    decs = [Decode(url, r) for r in range(lo, hi)] if role == "decode" else []

    def lost() -> int:
        return int(sum(REGISTRATIONS_LOST.labels(w)._value.get() for w in ("expired", "taken")))

    def start(rank: int, port: int) -> float:
        t0 = time.monotonic()
        client = BootstrapClient(url, timeout=10.0, source=host_of("prefill", rank))
        regs[rank] = Registration(client, rank_info(rank, port, lay)).start()
        return time.monotonic() - t0

    def failures(res: list) -> dict:
        errs = [r for r in res if isinstance(r, Exception)]
        return {"failed": len(errs), "errors": sorted({str(e)[:160] for e in errs})[:3],
                "seconds": max([r for r in res if isinstance(r, float)], default=0.0)}

    print(json.dumps({"ready": role}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, reply = cmd["op"], {}
        if op == "start":
            _at(cmd["at"])
            reply = failures(_each(list(range(lo, hi)), lambda r: start(r, 30000 + 2 * r)))
        elif op == "restart":        # killed (heartbeats stop, no goodbye), started again on new ports
            ranks = [r for r in cmd["ranks"] if lo <= r < hi]
            for r in ranks:
                regs.pop(r).stop(deregister=False)
            reply = failures(_each(ranks, lambda r: start(r, 40000 + 2 * r)))
        elif op == "lost":
            reply = {"lost": lost(), "states": sum(reg.state != "registered" for reg in regs.values())}
        elif op == "connect":
            _at(cmd["at"])

            def connect(d: Decode) -> float:
                t0 = time.monotonic()
                _, ranks = find_ranks(d.client, d.instance, t0 + CONNECT_WITHIN)
                d.known = {r.spec.key: r for r in ranks}
                return time.monotonic() - t0
            reply = failures(_each(decs, connect))
        elif op == "recover":
            for d in decs:
                d.recovery = PeerRecovery(d, Timeouts().registry, 1.0).start()
        elif op == "seen":           # the replacements each decode rank saw: delay after the kill
            delays, missing = [], 0
            for d in decs:
                for key, control in cmd["want"].items():
                    if key.startswith(d.instance + "/"):
                        got = d.seen.get(key)
                        if got is None or got[1] != control:
                            missing += 1
                        else:
                            delays.append(got[0] - cmd["since"])
            reply = {"delays": delays, "missing": missing}
        elif op == "io":             # bytes the recovery threads read from the registry (their watches)
            reply = {"read": sum(d.recovery.bytes_read for d in decs if d.recovery is not None)}
        elif op == "quit":
            for d in decs:
                if d.recovery is not None:
                    d.recovery.stop()
            for reg in regs.values():
                reg.stop(deregister=False)
            print(json.dumps({}), flush=True)
            return
        print(json.dumps(reply), flush=True)


class Worker:
    """A worker process (coordinator side)."""

    def __init__(self, role: str, url: str, lo: int, hi: int):
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", role, "--url", url, "--ranks", f"{lo}:{hi}"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.pid = self.p.pid
        assert "ready" in json.loads(self.p.stdout.readline())

    def send(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.pid} exited ({self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.send(op="quit")
            self.recv()
            self.p.wait(60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError):
            self.p.kill()


def everyone(workers: list[Worker], **cmd) -> list[dict]:
    for w in workers:
        w.send(**cmd)
    return [w.recv() for w in workers]


# ------------------------------------------------------------------------------------
# Registries: one process each, killed and started by pid
# ------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Embedded:
    """``kvxfer bootstrap`` with its defaults, on a port of its own."""
    name = "embedded"

    def __init__(self, tmp: str):
        self.port, self.log = free_port(), open(os.path.join(tmp, "bootstrap.log"), "ab")
        self.start()

    def start(self) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "bootstrap", "--host", "127.0.0.1", "--port",
                                   str(self.port)], stdout=subprocess.PIPE, stderr=self.log,
                                  text=True, cwd=ROOT)
        line = self.p.stdout.readline()
        assert "advertised as " in line, line
        self.url = line.split("advertised as ")[1].split()[0]

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


class Etcd:
    """One etcd node (Debian's etcd-server), its data in a directory of its own."""
    name = "etcd"

    def __init__(self, tmp: str):
        self.dir, self.port, self.peer = tempfile.mkdtemp(dir=tmp), free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{self.port}/bench"
        self.start()

    def start(self) -> None:
        peer, client = f"http://127.0.0.1:{self.peer}", f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen([shutil.which("etcd") or "etcd", "--name", "bench", "--data-dir", self.dir + "/d",
                                   "--listen-client-urls", client, "--advertise-client-urls", client,
                                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                   "--initial-cluster", f"bench={peer}", "--logger", "zap", "--log-level", "error"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)

    stop = kill


def registered(url: str) -> int:
    from kvxfer.control.client import BootstrapClient
    try:
        return int(BootstrapClient(url, timeout=10.0).health().get("registered", 0))
    except Exception:
        return -1


# ------------------------------------------------------------------------------------
# A real prefill/decode pair whose requests must keep flowing while the registry restarts
# ------------------------------------------------------------------------------------
class LivePair:
    """Prefill and decode endpoints (zmq, this process, instance "live"), registered at ``url``; a
    thread sends one request after another (every byte checked) until ``stop``."""

    def __init__(self, url: str):
        import numpy as np
        import torch

        from kvxfer.endpoint.decode import DecodeEndpoint
        from kvxfer.endpoint.prefill import PrefillEndpoint
        from kvxfer.pools import MHAPool
        from kvxfer.ranks import RankSpec
        self.np, self.torch = np, torch
        make = lambda: MHAPool(layers=2, heads=2, head_dim=32, dtype="bfloat16", num_pages=64, page_size=8)
        self.p_pool, self.d_pool = make(), make()
        for b in self.p_pool.buffers:
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8))
        self.p = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=2, num_layers=2, instance="live"), self.p_pool)
        self.p.register(url)
        self.d = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=2, num_layers=2, instance="livedecode"),
                                self.d_pool, bootstrap=url)
        self.d.connect(instance="live", timeout=60)
        self.ok = self.failed = 0
        self.why: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _one(self, room: int) -> str:
        from kvxfer.endpoint.base import KVPoll
        slots = self.np.arange(8 * (1 + room % 8), 8 * (2 + room % 8))     # page 0 is padding
        r = self.d.receiver(room, instance="live")
        r.init(slots)
        s = self.p.sender(room)
        s.send(slots, last=True)
        if r.wait(10) != KVPoll.Success:
            return r.reason or str(r.poll())
        for layer in range(2):
            for a, b in zip(self.p_pool.get_kv_buffer(layer, slots), self.d_pool.get_kv_buffer(layer, slots)):
                if not self.torch.equal(a.view(self.torch.uint8), b.view(self.torch.uint8)):
                    return "bytes differ"
        return ""

    def _run(self) -> None:
        room = 0
        while not self._stop.is_set():
            room += 1
            try:
                why = self._one(room)
            except Exception as e:
                why = repr(e)
            if why:
                self.failed += 1
                self.why.append(why[:160])
            else:
                self.ok += 1
            time.sleep(0.02)

    def counts(self) -> tuple[int, int]:
        return self.ok, self.failed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.d.close()
        self.p.close()


# ------------------------------------------------------------------------------------
# The phases
# ------------------------------------------------------------------------------------
def lost(prefill: list[Worker]) -> int:
    return sum(r["lost"] for r in everyone(prefill, op="lost"))


def run_size(backend: str, n: int, steady: float, tmp: str) -> dict:
    """Every phase for one registry of ``backend`` and ``n`` ranks a role (see the module docstring)."""
    from kvxfer.control.client import BootstrapClient
    reg = (Embedded if backend == "embedded" else Etcd)(tmp)
    ttl = BootstrapClient(reg.url).default_ttl      # the registry's default, as every rank here uses (no I/O)
    out: dict = {"backend": backend, "n": n, "ttl": ttl}
    slices = [(lo, min(lo + PER_WORKER, n)) for lo in range(0, n, PER_WORKER)]
    prefill = [Worker("prefill", reg.url, lo, hi) for lo, hi in slices]
    decode = [Worker("decode", reg.url, lo, hi) for lo, hi in slices]
    pair = None
    try:
        res = everyone(prefill, op="start", at=time.time() + 1.0)
        out["startup_failed"] = sum(r["failed"] for r in res)
        out["startup_seconds"] = max(r["seconds"] for r in res)
        out["startup_errors"] = sorted({e for r in res for e in r["errors"]})[:3]
        before = lost(prefill)
        res = everyone(decode, op="connect", at=time.time() + 1.0)
        out["connect_ready"] = n - sum(r["failed"] for r in res)
        out["connect_seconds"] = max(r["seconds"] for r in res)
        out["connect_errors"] = sorted({e for r in res for e in r["errors"]})[:3]
        time.sleep(ttl / 3 + 1)                   # a lost registration is noticed at the next heartbeat
        out["connect_lost"] = lost(prefill) - before

        everyone(decode, op="recover")
        time.sleep(10.0)                          # every watch made its first read
        io0, cpu0, t0 = sum(r["read"] for r in everyone(decode, op="io")), cpu_seconds(reg.p.pid), time.monotonic()
        time.sleep(steady)
        io1, cpu1, t1 = sum(r["read"] for r in everyone(decode, op="io")), cpu_seconds(reg.p.pid), time.monotonic()
        out["steady_cpu_pct"] = 100 * (cpu1 - cpu0) / (t1 - t0)
        out["steady_bytes_per_rank_min"] = (io1 - io0) / n / ((t1 - t0) / 60)

        before = lost(prefill)
        churn = list(range(0, n, 10))             # 10%, spread over the instances
        want = {f"p{r // 8}/dp0/pp0/tp{r % 8}": f"tcp://127.0.0.1:{40000 + 2 * r}" for r in churn}
        killed = time.time()
        res = everyone(prefill, op="restart", ranks=churn)
        out["churn_restart_failed"] = sum(r["failed"] for r in res)
        end, seen = killed + 2 * ttl + 10, {"delays": [], "missing": len(churn) * 8}
        while time.time() < end:
            got = everyone(decode, op="seen", want=want, since=killed)
            seen = {"delays": [d for g in got for d in g["delays"]], "missing": sum(g["missing"] for g in got)}
            if not seen["missing"]:
                break
            time.sleep(0.5)
        out["churn_pairs"] = len(churn) * 8
        out["churn_missing"] = seen["missing"]
        out["churn_max_seen"] = max(seen["delays"], default=float("nan"))
        time.sleep(ttl / 3 + 1)
        out["churn_lost"] = lost(prefill) - before

        pair = LivePair(reg.url)
        time.sleep(1.0)
        ok0, failed0 = pair.counts()
        reg.kill()
        down_at = time.monotonic()
        time.sleep(2.0)                           # requests flow while no registry answers
        reg.start()
        while registered(reg.url) < n + 1 and time.monotonic() - down_at < 120:
            time.sleep(0.2)
        out["restart_reregistered_s"] = time.monotonic() - down_at
        out["restart_registered"] = registered(reg.url)
        time.sleep(1.0)
        ok1, failed1 = pair.counts()
        out["restart_requests_ok"], out["restart_requests_failed"] = ok1 - ok0, failed1 - failed0
        out["restart_request_errors"] = sorted(set(pair.why))[:3]
    finally:
        if pair is not None:
            pair.close()
        for w in prefill + decode:
            w.close()
        reg.stop()
    return out


def run_fit(backend: str, tmp: str) -> dict:
    """1,024 records of the largest layout against the defaults (one client, one after another)."""
    from kvxfer.control.client import BootstrapClient
    reg = (Embedded if backend == "embedded" else Etcd)(tmp)
    lay, accepted, errors = layout(scales=True), 0, set()
    try:
        c = BootstrapClient(reg.url, timeout=30.0)
        for r in range(1024):
            try:
                c.register(rank_info(r, 30000 + 2 * r, lay, instance=f"fit{r // 8}"), "f" * 32, ttl=60.0)
                accepted += 1
            except Exception as e:
                errors.add(str(e)[:160])
        ready = registered(reg.url)
    finally:
        reg.stop()
    return {"backend": backend, "fit_accepted": accepted, "fit_registered": ready, "fit_errors": sorted(errors)[:3],
            "layout_bytes": len(json.dumps(lay))}


def fanout_prefill(url: str, peers: int, lo: int, hi: int) -> None:
    """--fanout: prefill ranks ``lo``..``hi - 1`` of one instance of TP ``peers`` (real endpoints, 8 a
    process as on an 8-GPU host), until stdin closes."""
    raise_nofile()
    from kvxfer.endpoint.prefill import PrefillEndpoint
    from kvxfer.pools import MHAPool
    from kvxfer.ranks import RankSpec
    eps = []
    for r in range(lo, hi):
        pool = MHAPool(layers=2, heads=64 // peers, head_dim=32, dtype="bfloat16", num_pages=16, page_size=8)
        ep = PrefillEndpoint(RankSpec(role="prefill", num_kv_heads=64, num_layers=2, instance=f"fan{peers}",
                                      tp_rank=r, tp_size=peers), pool)
        ep.register(url)
        eps.append(ep)
    print("ready", flush=True)
    sys.stdin.read()
    for ep in eps:
        ep.close()


def _cpu(pids: list[int]) -> dict:
    """CPU seconds so far of this process (decode and the registry) and of each of ``pids``."""
    return {"self": time.process_time(), **{p: cpu_seconds(p) for p in pids}}


def run_fanout(reps: int = 5) -> dict:
    """The median connect of a decode rank (TP 1, 64 heads) to 8 and to 64 prefill ranks, and the
    same-run ceiling of each: the CPU the connect made the processes spend (what the idle ranks
    burn meanwhile taken off, measured over a second before), spread perfectly over this machine's
    cores, and never less than the busiest process's share (one interpreter runs on one core at a
    time). Ceiling ratio 64 / 8 above 2: no schedule of that work on this machine meets the goal;
    the process that sets the ceiling says whose work it is."""
    import statistics

    from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
    from kvxfer.endpoint.decode import DecodeEndpoint
    from kvxfer.pools import MHAPool
    from kvxfer.ranks import RankSpec
    server = BootstrapServer(BootstrapConfig()).start()
    out: dict = {}
    try:
        for peers in (8, 64):
            children = [subprocess.Popen([sys.executable, __file__, "--fanout", str(peers), "--url", server.url,
                                          "--ranks", f"{lo}:{lo + 8}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, cwd=ROOT) for lo in range(0, peers, 8)]
            try:
                for child in children:
                    assert child.stdout.readline().strip() == "ready"
                pids = [child.pid for child in children]
                c0, t0 = _cpu(pids), time.monotonic()
                time.sleep(1.0)
                c1, idle = _cpu(pids), time.monotonic() - t0
                rate = {k: (c1[k] - c0[k]) / idle for k in c0}          # CPU s per s of the idle ranks
                times, ceilings, setters, own = [], [], [], []
                for rep in range(reps):
                    pool = MHAPool(layers=2, heads=64, head_dim=32, dtype="bfloat16", num_pages=16, page_size=8)
                    d = DecodeEndpoint(RankSpec(role="decode", num_kv_heads=64, num_layers=2,
                                                instance=f"fand{peers}x{rep}"), pool, bootstrap=server.url)
                    c0, t0 = _cpu(pids), time.monotonic()
                    d.connect(instance=f"fan{peers}", timeout=60)
                    dt = time.monotonic() - t0
                    c1 = _cpu(pids)
                    times.append(dt)
                    work = {k: max(0.0, c1[k] - c0[k] - rate[k] * dt) for k in c0}
                    busiest = max(work, key=lambda k: work[k])
                    spread = sum(work.values()) / (os.cpu_count() or 1)
                    own.append(work["self"])
                    ceilings.append(max(spread, work[busiest]))
                    setters.append("all processes" if spread >= work[busiest] else
                                   "decode + registry" if busiest == "self" else "one prefill process")
                    d.close()
                out[f"fanout_{peers}_s"] = statistics.median(times)
                out[f"fanout_{peers}_runs_s"] = [round(t, 4) for t in times]
                out[f"fanout_{peers}_ceiling_s"] = statistics.median(ceilings)
                out[f"fanout_{peers}_set_by"] = max(set(setters), key=setters.count)
                out[f"fanout_{peers}_decode_cpu_s"] = statistics.median(own)   # decode and registry alone
            finally:
                for child in children:
                    child.stdin.close()
                    child.wait(60)
    finally:
        server.stop()
    out["fanout_ratio"] = out["fanout_64_s"] / out["fanout_8_s"]
    out["fanout_ceiling_ratio"] = out["fanout_64_ceiling_s"] / max(out["fanout_8_ceiling_s"], 1e-9)
    return out


# ------------------------------------------------------------------------------------
# Rows, table, main
# ------------------------------------------------------------------------------------
def rows_of(r: dict) -> list[dict]:
    """``kvxfer bench`` rows for one (backend, N) run."""
    b, n = r["backend"], r["n"]
    name = f"registry {b} N={n}"

    def row(what, value, unit, goal, ok):
        return {"name": f"{name}: {what}", "value": value, "unit": unit, "goal": goal,
                "ok": None if ok is None else bool(ok)}
    return [
        row("start-up failures", r["startup_failed"], "ranks", "0", r["startup_failed"] == 0),
        row("decode ready within 30 s", r["connect_ready"], "ranks", f"{n}", r["connect_ready"] == n),
        row("registrations lost in the connect burst", r["connect_lost"], "", "0", r["connect_lost"] == 0),
        row("steady registry CPU", r["steady_cpu_pct"], "% core", "<= 10 at N=1024",
            r["steady_cpu_pct"] <= 10 if n >= 1024 else None),
        row("steady bytes read per decode rank", r["steady_bytes_per_rank_min"], "B/min", "~0 (< 2 KiB)",
            r["steady_bytes_per_rank_min"] < 2048),
        row("churn: slowest replacement seen", r["churn_max_seen"], "s", f"<= {2 * r['ttl']:g}",
            r["churn_missing"] == 0 and r["churn_max_seen"] <= 2 * r["ttl"]),
        row("churn: other registrations lost", r["churn_lost"], "", "0", r["churn_lost"] == 0),
        row("restart: all registered again after", r["restart_reregistered_s"], "s", "",
            r["restart_registered"] >= n + 1),
        row("restart: requests failed meanwhile", r["restart_requests_failed"], "", "0",
            r["restart_requests_failed"] == 0 and r["restart_requests_ok"] > 0),
    ]


def table(runs: list[dict], fits: list[dict], fan: dict | None) -> str:
    cols = ["backend", "ttl s", "N", "start fail", "ready/30s", "lost@conn", "CPU %", "B/rank/min", "churn seen s",
            "missing", "lost@churn", "re-reg s", "req ok/fail"]
    lines = [" | ".join(cols)]
    for r in runs:
        lines.append(" | ".join([
            r["backend"], f"{r['ttl']:g}", str(r["n"]), str(r["startup_failed"]), f"{r['connect_ready']}/{r['n']}",
            str(r["connect_lost"]), f"{r['steady_cpu_pct']:.1f}", f"{r['steady_bytes_per_rank_min']:.0f}",
            f"{r['churn_max_seen']:.1f}", str(r["churn_missing"]), str(r["churn_lost"]),
            f"{r['restart_reregistered_s']:.1f}", f"{r['restart_requests_ok']}/{r['restart_requests_failed']}"]))
    for f in fits:
        lines.append(f"fit {f['backend']}: {f['fit_accepted']}/1024 records of {f['layout_bytes']} B layout accepted, "
                     f"{f['fit_registered']} registered {f['fit_errors'] or ''}")
    if fan:
        lines.append(f"fan-out: connect to 8 prefill ranks {fan['fanout_8_s'] * 1e3:.0f} ms, to 64 "
                     f"{fan['fanout_64_s'] * 1e3:.0f} ms: ratio {fan['fanout_ratio']:.2f} (goal <= 2); same-run "
                     f"ceiling {fan['fanout_8_ceiling_s'] * 1e3:.0f} ms and {fan['fanout_64_ceiling_s'] * 1e3:.0f} ms "
                     f"(set by {fan['fanout_8_set_by']}, {fan['fanout_64_set_by']}): ceiling ratio "
                     f"{fan['fanout_ceiling_ratio']:.2f}; decode's own CPU {fan['fanout_8_decode_cpu_s'] * 1e3:.0f} ms "
                     f"and {fan['fanout_64_decode_cpu_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="128,512,1024", help="ranks of each role, comma separated")
    ap.add_argument("--backends", default="embedded,etcd")
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of the steady-state phase")
    ap.add_argument("--quick", action="store_true", help="N=128 only, 30 s of steady state")
    ap.add_argument("--no-fit", action="store_true")
    ap.add_argument("--no-fanout", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here (rows for kvxfer bench)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--fanout", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        lo, hi = map(int, a.ranks.split(":"))
        worker(a.worker, a.url, lo, hi)
        return 0
    if a.fanout:
        lo, hi = map(int, a.ranks.split(":"))
        fanout_prefill(a.url, a.fanout, lo, hi)
        return 0
    raise_nofile()
    sizes = [128] if a.quick else [int(x) for x in a.sizes.split(",")]
    steady = 30.0 if a.quick else a.steady
    backends = [b for b in a.backends.split(",") if b]
    rows: list[dict] = []
    runs, fits, errors = [], [], {}
    if "etcd" in backends and not shutil.which("etcd"):
        errors["etcd"] = "etcd is not installed (scripts/setup installs Debian's etcd-server)"
        backends.remove("etcd")
    with tempfile.TemporaryDirectory(prefix="kvxfer-bench-registry-") as tmp:
        for b in backends:
            for n in sizes:
                print(f"-- {b}, N={n}", flush=True)
                try:
                    runs.append(run_size(b, n, steady, tmp))
                    rows += rows_of(runs[-1])
                    print(json.dumps(runs[-1]), flush=True)
                except Exception as e:
                    errors[f"{b} N={n}"] = f"{type(e).__name__}: {e}"[:300]
            if not a.no_fit:
                try:
                    fits.append(run_fit(b, tmp))
                    f = fits[-1]
                    rows.append({"name": f"registry {b}: 1,024 ranks of an 80-layer FP8 page-major pool fit",
                                 "value": f["fit_accepted"], "unit": "ranks", "goal": "1024",
                                 "ok": f["fit_accepted"] == 1024 and f["fit_registered"] == 1024})
                except Exception as e:
                    errors[f"{b} fit"] = f"{type(e).__name__}: {e}"[:300]
        fan = None
        if not a.no_fanout:
            try:
                fan = run_fanout()
                rows.append({"name": "decode connect, 64 prefill peers / 8", "value": fan["fanout_ratio"],
                             "unit": "x", "goal": "<= 2", "ok": fan["fanout_ratio"] <= 2})
            except Exception as e:
                errors["fan-out"] = f"{type(e).__name__}: {e}"[:300]
    rows += [{"name": f"registry {k}", "error": v} for k, v in errors.items()]
    print(table(runs, fits, fan))
    for k, v in errors.items():
        print(f"{k}: {v}")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "runs": runs, "fits": fits, "fanout": fan}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
