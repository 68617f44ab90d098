#!/usr/bin/env python
"""kvxfer next to what a user would otherwise pick, moving the same bytes between two processes
on 127.0.0.1: torch.distributed gloo, NIXL (UCX backend) and Mooncake Transfer Engine (TCP).

    .venv/bin/python scripts/bench_peers.py [--quick] [--json PATH] [--peers] [--busy-caller]

Cases (pools of 1 GiB, 256 MiB with --quick, on both sides):
  scattered    1000 pages of 64 KiB, and 1000 of 4 KiB, at random places of the source pool ->
               random places of the destination pool (a request's KV pages after some churn)
  one run      one 16 MiB contiguous run, and one of 1 MiB

Peers, each the way its users drive it:
  kvxfer zmq        one ``submit`` of a plan with the runs; done when the receiver acked
  kvxfer ucx        the same, with UCX's defaults: the receiver pregrants the request
                    (``eager_writes``), the sender announces and puts at once and is done when
                    its puts are flushed, as NIXL's is
  kvxfer ucx announced  ``eager_writes=False``: announced, put after GO, done at the ACK
  gloo              gather the pages (``index_select``), send in 1 MiB messages (gloo slows
                    on multi-MiB ones), receiver scatters, then acks with a 1-byte send
  NIXL              descriptor lists per transfer, one WRITE (``initialize_xfer`` + ``transfer``),
                    done when its state is DONE; default UCX_TLS (cma puts here). No progress
                    thread (the Python API's spins a core): both sides poll, as engines do
  NIXL notified     the same WRITE carrying a notification (``notif_msg``), which the target
                    waits for: how engines drive it (the target learns that the bytes arrived),
                    and the work kvxfer's DONE does for its receiver
  Mooncake          ``batch_transfer_sync_write`` of the runs over TCP (no RDMA NIC here)
NIXL and Mooncake live in their own virtual environments, created on demand under
``.bench-venvs/<peer>`` in the repository root when ``--peers`` is given (never in kvxfer's
dependencies); a peer that cannot be installed or fails is a row with the reason.
gloo needs only torch, so it always runs.

Every peer's bytes are checked at the receiver after the warm-up (the source pool holds a
position-dependent pattern at the source runs). All peers are started first and then take
turns, one transfer each per round, with the ceilings sampled in the same round: a burst of
load from other processes hits them alike. Best of N rounds (more for the small case).

Ceilings measured in the same run (single thread):
  memcpy     one ``copy_`` of the case's bytes              (shared-memory peers, one run)
  gather     ``index_select`` of the same pages, one process (shared-memory peers, scattered)
  tcp raw    the case's bytes over one loopback TCP socket, 1 MiB messages (TCP peers)
  zmq raw    (a row of its own) pyzmq alone moving the case as gloo does: the floor under any
             transport on libzmq, which receives into buffers of its own, never the caller's
             memory: one copy more than gloo at the receiver. Where it reads below gloo, no
             zmq transport can beat gloo on that case here
  zmq threads  (a row of its own) zmq raw with an I/O thread per side owning its socket, as zmq
             sockets are not thread-safe (kvxfer zmq is built so): the caller hands each transfer
             to its I/O thread and is woken by it; the target's I/O thread receives, acks and
             wakes the main thread. No protocol work: the floor under that design here
CPU per transfer (not with --busy-caller, whose busy thread burns a core by design): every
thread of both worker processes, from /proc/<pid>/task/*/schedstat (Linux), read when a case's
rounds start and when they end, divided by the peer's transfers in them. All CPU is charged to
some transfer: work that lingers after the initiator's DONE, and idle wake-ups while other peers
take their turns. Far steadier here than wall time: a cut in per-transfer work shows in it when
the best-of-rounds GB/s cannot see it. kvxfer zmq is read against ``zmq threads`` (its design's
floor), kvxfer ucx against NIXL notified (the work its DONE does).
--busy-caller: every initiator process also runs a thread busy in Python, as a serving engine's
scheduler is; a peer whose transfers need its own threads to take the GIL (kvxfer's I/O thread)
waits for it (``sys.getswitchinterval()``, 5 ms) while that thread runs.
Run with ``--worker`` only by this script itself (one side of one peer).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_peers_workers import PEERS, KiB, MiB, make_cases, source_pool, worker

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".bench-venvs"
TCP_PEERS = {"kvxfer zmq", "gloo", "mooncake tcp", "tcp raw", "zmq raw", "zmq threads"}
# How each peer's environment is made: pip argument lists, in order, in a fresh venv.
# NIXL: torch first (the CPU wheel), so that nothing pulls a CUDA build; the `nixl` meta
# package only for its `nixl._api` import path, never with its dependencies (~5.9 GB).
INSTALL = {
    "nixl": [["torch==2.13.0"], ["nixl-cu12"], ["--no-deps", "nixl"]],
    "mooncake": [["mooncake-transfer-engine-non-cuda", "numpy"]],
}
IMPORT_CHECK = {"nixl": "from nixl._api import nixl_agent, nixl_agent_config",
                "mooncake": "from mooncake.engine import TransferEngine"}
APT_FOR = {"libibverbs": ["libibverbs1", "libnuma1"], "libnuma": ["libnuma1"]}


# ---------------------------------------------------------------------------------------
# Peer environments
# ---------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float) -> tuple[bool, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"[:200]
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
    return r.returncode == 0, (lines[-1] if lines else f"exit code {r.returncode}")[:200]


def ensure_venv(name: str) -> tuple[str | None, str]:
    """The peer's python, creating ``.bench-venvs/<name>`` when needed; else (None, reason)."""
    VENVS.mkdir(exist_ok=True)
    (VENVS / ".gitignore").write_text("*\n")   # never committed, whatever the root .gitignore says
    venv, want = VENVS / name, json.dumps(INSTALL[name])
    py, stamp = venv / "bin" / "python", venv / ".kvxfer-bench"
    if not (stamp.exists() and stamp.read_text() == want and py.exists()):
        print(f"  creating {venv.relative_to(ROOT)} for {name}: pip install "
              + "; ".join(" ".join(a) for a in INSTALL[name]) + " (minutes, once)", flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)   # not this venv's python: a clean venv
        ok, why = _run([base, "-m", "venv", str(venv)], 300)
        for args in INSTALL[name] if ok else []:
            ok, why = _run([str(py), "-m", "pip", "install", "-q", *args], 1800)
            if not ok:
                break
        if not ok:
            return None, f"install failed: {why}"
        stamp.write_text(want)
    ok, why = _run([str(py), "-c", IMPORT_CHECK[name]], 120)
    missing = [pkg for lib, pkgs in APT_FOR.items() if lib in why for pkg in pkgs]
    if not ok and missing and shutil.which("apt-get") and os.geteuid() == 0:
        print(f"  {name} needs {', '.join(missing)}: apt-get install -y {' '.join(missing)}", flush=True)
        ok_apt, why_apt = _run(["apt-get", "install", "-y", "-q", *missing], 600)
        if not ok_apt:
            _run(["apt-get", "update", "-q"], 600)
            _run(["apt-get", "install", "-y", "-q", *missing], 600)
        ok, why = _run([str(py), "-c", IMPORT_CHECK[name]], 120)
    return (str(py), "") if ok else (None, f"import failed: {why}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerPair:
    """Both workers of one peer, as subprocesses, driven one transfer at a time."""

    def __init__(self, peer: str, python: str, spec: dict, tmp: Path, timeout: float, script: Path | None = None,
                 wait: bool = True):
        """Starts both workers, one after the other. ``wait=False`` only launches the target:
        then ``launch_initiator()`` and ``ready()`` finish the start, so that several pairs
        start side by side (their imports take seconds)."""
        self.peer, self.timeout = peer, timeout
        self.spec = {**spec, "port": _free_port(), "port2": _free_port()}   # for peers that need ports
        self.spec_path = tmp / f"{peer.replace(' ', '_')}.json"
        self.spec_path.write_text(json.dumps(self.spec))
        # the script whose ``--worker`` runs one side (bench_posting.py brings its own)
        self.cmd = [python, str(script or Path(__file__).resolve()), "--worker", peer, "--spec", str(self.spec_path)]
        self.procs: list[subprocess.Popen] = []
        self.logs = [open(tmp / f"{peer.replace(' ', '_')}.{r}.err", "w+") for r in ("target", "initiator")]
        self.lines: list[queue.Queue] = []
        self._launch([*self.cmd, "--role", "target"], 0)
        if wait:
            self.launch_initiator()
            self.ready()

    def launch_initiator(self) -> None:
        """Once the target is up: the initiator, told where the target is."""
        info = self._expect(0, "READY")
        self.spec_path.write_text(json.dumps({**self.spec, "target": info}))
        self._launch([*self.cmd, "--role", "initiator"], 1)

    def ready(self) -> None:
        """Once the initiator is connected."""
        self._expect(1, "READY")

    def _launch(self, cmd: list[str], side: int) -> None:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logs[side], text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [q.put(ln) for ln in p.stdout] + [q.put(None)], daemon=True).start()
        self.procs.append(p)
        self.lines.append(q)

    def _expect(self, side: int, what: str) -> dict:
        try:
            line = self.lines[side].get(timeout=self.timeout)
        except queue.Empty:
            line = None
        if line is None or not line.startswith(f"@@{what} "):
            time.sleep(0.5)   # the other side may have failed first: its reason is the better one
            first = next((i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)), side)
            side = "target: " if first == 0 else "initiator: "
            raise RuntimeError(side + _tail(self.logs[first], self.procs[first]))
        return json.loads(line[len(what) + 3:])

    def run(self, case: int, verify: bool) -> float:
        """Seconds of one transfer of ``case`` (its bytes checked at the target when ``verify``)."""
        return self.run_measured(case, verify)["seconds"]

    def run_measured(self, case: int, verify: bool) -> dict:
        """One transfer of ``case``: the initiator's DONE (``seconds`` and whatever else it measured)."""
        self.procs[1].stdin.write(json.dumps({"op": "run", "case": case, "verify": verify}) + "\n")
        self.procs[1].stdin.flush()
        out = self._expect(1, "DONE")
        if out["why"]:
            raise RuntimeError(out["why"])
        return out

    def cpu_ns(self) -> tuple[int, int] | None:
        """CPU time so far of (target, initiator), every live thread, ns; None off Linux."""
        got = [process_cpu_ns(p.pid) for p in self.procs]
        if len(got) != 2 or got[0] is None or got[1] is None:
            return None
        return got[0], got[1]

    def quit(self) -> None:
        """Tell the workers to end (``close`` waits for them): pairs may end side by side."""
        if len(self.procs) == 2 and self.procs[1].poll() is None and not self.procs[1].stdin.closed:
            try:
                self.procs[1].stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.procs[1].stdin.flush()
                self.procs[1].stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        self.quit()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()


def process_cpu_ns(pid: int) -> int | None:
    """CPU time (user + system) of every live thread of ``pid``, ns, from its threads' schedstat
    (Linux); None when /proc does not have it. A thread that ended takes its time with it: the
    workers' threads live as long as they do."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):   # it ended meanwhile
            continue
    return total


CPU_FLOOR = {"kvxfer zmq": "zmq threads", "kvxfer ucx": "nixl ucx notified",
             "kvxfer ucx announced": "nixl ucx notified"}


def _tail(log, proc: subprocess.Popen) -> str:
    log.flush()
    log.seek(0)
    lines = [ln.strip() for ln in log.read().splitlines() if ln.strip() and "UCX  WARN" not in ln]
    rc = proc.poll()
    state = "still running at the deadline" if rc is None else f"exit code {rc}"
    return (f"{lines[-1][:200]} ({state})" if lines else state)


# ---------------------------------------------------------------------------------------
# Ceilings in this process
# ---------------------------------------------------------------------------------------
class LocalCeilings:
    """memcpy and gather of each case's bytes, single thread; one sample per call."""

    def __init__(self, pool_bytes: int, cases: list[dict]):
        import torch
        torch.set_num_threads(1)
        self.torch = torch
        self.src = torch.from_numpy(source_pool(pool_bytes, cases))
        self.cases = cases
        most = max(c["nbytes"] * len(c["so"]) for c in cases)
        self.a = torch.randint(0, 256, (most,), dtype=torch.uint8)   # not the zero page: real memory
        self.b = torch.zeros_like(self.a)   # zeros_like writes it: no page faults inside the timing

    def sample(self, i: int) -> dict[str, float]:
        c, torch = self.cases[i], self.torch
        n, k = c["nbytes"], len(c["so"])
        rows, idx = self.src[: self.src.numel() // n * n].view(-1, n), torch.tensor(c["so"]) // n
        out = {}
        for name, fn in (("memcpy", lambda: self.b[: n * k].copy_(self.a[: n * k])),
                         ("gather", lambda: torch.index_select(rows, 0, idx, out=self.b[: n * k].view(-1, n)))):
            t0 = time.perf_counter()
            fn()
            out[name] = time.perf_counter() - t0
        return out


def ceiling_for(peer: str, case: str) -> str:
    if peer in TCP_PEERS:
        return "tcp raw"
    return "gather" if case.startswith("scattered") else "memcpy"


def cpu_table(cpu: dict[str, dict[str, dict[str, float]]], order: list[str], cases: list[dict]) -> list[dict]:
    """Print CPU per transfer (initiator + target) and return its rows: kvxfer's against the
    peer in ``CPU_FLOOR`` (ratio = ours / theirs: lower is better)."""
    if not cpu:
        return []
    print("\nCPU per transfer, us: initiator + target (every thread of both processes; lower is better)")
    print(f"| peer | {' | '.join(c['name'] for c in cases)} |\n|---|" + "---|" * len(cases))
    rows = []
    for peer in (p for p in order if p in cpu):
        cells = []
        for c in cases:
            m = cpu[peer].get(c["name"])
            if m is None:
                cells.append("-")
                continue
            total, floor = m["initiator"] + m["target"], CPU_FLOOR.get(peer, "")
            f = cpu.get(floor, {}).get(c["name"])
            ceil = f["initiator"] + f["target"] if f else None
            vs = f" ({total / ceil:.2f}x {floor})" if ceil else ""
            cells.append(f"{m['initiator']:.0f} + {m['target']:.0f}{vs}")
            rows.append({"name": f"peers cpu per transfer {peer}, {c['name']}", "value": total, "unit": "us CPU",
                         "ceiling": ceil, "ceiling_name": floor if ceil else "",
                         "ratio": total / ceil if ceil else None})
        print(f"| {peer} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 MiB pools, 3 repetitions")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--peers", action="store_true", help="include NIXL and Mooncake (creates their venvs)")
    ap.add_argument("--pages", type=int, default=1000)
    ap.add_argument("--page-kib", default="64,4", help="page sizes of the scattered cases, comma-separated")
    ap.add_argument("--run-mib", default="16,1", help="sizes of the one-run cases, comma-separated")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per peer")
    ap.add_argument("--only", help=f"comma-separated subset of: {','.join(PEERS)}")
    ap.add_argument("--busy-caller", action="store_true", help="a thread busy in Python beside each initiator")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if args.worker.startswith("kvxfer"):
            spec["transport"] = args.worker.split()[1]
            spec["options"] = {"eager_writes": False} if args.worker.endswith("announced") else {}
        # stdout carries only our lines; whatever a library prints goes to stderr (the log)
        proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        worker(args.worker, args.role, spec, lambda what, obj: proto.write(f"@@{what} {json.dumps(obj)}\n"))
        return 0
    pool_bytes = (256 if args.quick else 1024) * MiB
    reps = args.reps or (3 if args.quick else 5)
    cases = make_cases(pool_bytes, args.pages, [int(k) * KiB for k in args.page_kib.split(",")],
                       [int(m) * MiB for m in args.run_mib.split(",")], seed=0)
    spec = {"pool_bytes": pool_bytes, "cases": cases, "busy_caller": args.busy_caller}
    print(f"pools {pool_bytes // MiB} MiB on both sides; cases: {', '.join(c['name'] for c in cases)}; "
          f"best of {reps}+ rounds after a checked warm-up; peers interleaved within each round"
          + ("; each initiator beside a thread busy in Python (--busy-caller)" if args.busy_caller else ""), flush=True)
    order = [p for p in PEERS if not args.only or p in args.only.split(",")]
    results: dict[str, dict] = {}
    pairs: dict[str, PeerPair] = {}
    local = LocalCeilings(pool_bytes, cases)
    times: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}   # peer -> case -> side -> us per transfer
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for peer in order:   # start every peer; each idles until its turn
                python, why = sys.executable, ""
                if peer.startswith(("nixl", "mooncake")):
                    if not args.peers:
                        results[peer] = {"error": "skipped: pass --peers"}
                        continue
                    python, why = ensure_venv(peer.split()[0])
                if peer.startswith("kvxfer ucx") and importlib.util.find_spec("ucxx") is None:
                    why = "ucxx not installed: pip install 'kvxfer[ucx]'"
                try:
                    if why:
                        raise RuntimeError(why)
                    print(f"  starting {peer}", flush=True)
                    pairs[peer] = PeerPair(peer, python, spec, Path(tmp), args.timeout)
                    for i in range(len(cases)):   # warm-up: connections, page faults; bytes checked
                        pairs[peer].run(i, verify=True)
                except Exception as e:   # a peer that cannot run is a row with its reason
                    results[peer] = {"error": str(e)[:300]}
                    print(f"  {peer}: {results[peer]['error']}", flush=True)
                    pairs.pop(peer, None)
            for i, c in enumerate(cases):
                nbytes = c["nbytes"] * len(c["so"])
                cpu0 = {} if args.busy_caller else {peer: pair.cpu_ns() for peer, pair in pairs.items()}
                # small cases take a few ms: more rounds, so that the best is not a burst of load
                for _ in range(reps * max(1, (64 * MiB) // nbytes)):
                    for name, dt in local.sample(i).items():
                        times.setdefault(name, {}).setdefault(c["name"], []).append(dt)
                    for peer, pair in list(pairs.items()):
                        try:
                            times.setdefault(peer, {}).setdefault(c["name"], []).append(pair.run(i, verify=False))
                        except Exception as e:
                            results[peer] = {"error": f"{c['name']}: {e}"[:300]}
                            pairs.pop(peer).close()
                for peer, pair in pairs.items():   # back-to-back windows: all of the case's CPU
                    a, b, n = cpu0.get(peer), pair.cpu_ns(), len(times[peer][c["name"]])
                    if a is not None and b is not None and n:
                        cpu.setdefault(peer, {})[c["name"]] = {"target": (b[0] - a[0]) / n / 1e3,
                                                               "initiator": (b[1] - a[1]) / n / 1e3}
        finally:
            for pair in pairs.values():
                pair.close()
    size = {c["name"]: c["nbytes"] * len(c["so"]) for c in cases}
    for name, by_case in times.items():
        if name not in results:
            results[name] = {case: {"gbps": size[case] / min(t) / 1e9, "seconds": t,
                                    **({"cpu_us": cpu[name][case]} if case in cpu.get(name, {}) else {})}
                             for case, t in by_case.items()}
    ceilings = {k: {case: r["gbps"] for case, r in results.pop(k).items()} for k in ("memcpy", "gather")}
    if "tcp raw" in results and "error" not in results["tcp raw"]:
        ceilings["tcp raw"] = {case: r["gbps"] for case, r in results["tcp raw"].items()}

    rows = []
    print("\nGB/s (1 GB = 1e9 bytes), best of the rounds; (x ceiling)")
    print(f"| peer | {' | '.join(c['name'] for c in cases)} |\n|---|" + "---|" * len(cases))
    for name in ("memcpy", "gather"):
        print(f"| ceiling {name} | " + " | ".join(f"{ceilings[name][c['name']]:.2f}" for c in cases) + " |")
    for peer in order:
        r, cells = results.get(peer, {"error": "not run"}), []
        for c in cases:
            ck = ceiling_for(peer, c["name"]) if peer != "tcp raw" else None   # a ceiling has none
            row = {"name": f"peers {'busy caller ' if args.busy_caller else ''}{'ceiling ' if ck is None else ''}"
                           f"{peer}, {c['name']}", "unit": "GB/s"}
            if "error" in r:
                row["error"] = r["error"]
                cells.append("-")
            else:
                g, ceil = r[c["name"]]["gbps"], ceilings.get(ck, {}).get(c["name"])
                row.update(value=g, ceiling=ceil, ceiling_name=ck or "", ratio=g / ceil if ceil else None)
                cells.append(f"{g:.2f}" + (f" ({g / ceil:.2f}x {ck})" if row["ratio"] else ""))
            rows.append(row)
        tail = f" {r['error']}" if "error" in r else ""
        print(f"| {peer} | " + " | ".join(cells) + f" |{tail}")
    rows += cpu_table(cpu, order, cases)
    if args.json:
        args.json.write_text(json.dumps({"bench": "peers", "rows": rows, "ceilings": ceilings, "results": results,
                                         "pool_bytes": pool_bytes, "rounds": reps,
                                         "cases": [{"name": c["name"], "runs": len(c["so"]), "run_bytes": c["nbytes"]}
                                                   for c in cases]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
