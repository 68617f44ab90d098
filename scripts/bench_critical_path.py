#!/usr/bin/env python
"""Where one transfer's wall time goes: Python, the library's own threads, or waiting.

    .venv/bin/python scripts/bench_critical_path.py [--peers "kvxfer zmq,zmq threads,gloo"]
        [--case "one run 1 MiB"] [--transfers 60] [--runs 3] [--json PATH]

Each peer of ``bench_peers.py`` (its two worker processes, the same cases and pools as its
``--quick``) does ``--transfers`` transfers of one case, one at a time, while ``perf record``
takes every context switch of the machine (``sched:sched_switch``, CLOCK_MONOTONIC, the clock
the initiator stamps each transfer's start with). Each transfer's wall time, as ``bench_peers.py``
times it (the initiator's ``transfer`` call: submit to done), splits into:

  python    a Python thread of either worker is on a CPU: the interpreter and whatever it calls
            (numpy's copy of a message, a zmq or UCX call, a syscall, waking another thread);
            the workers list their Python threads (``threading.enumerate``) with every transfer
  library   no Python thread is, but another thread of the workers is: libzmq's I/O threads,
            gloo's, UCX's; TCP's copies happen there for the zmq peers
  nobody    no thread of either worker is on a CPU: wake-ups in flight, other processes

UCX does its work on the threads that call it (progress, cma copies) and NIXL's caller spins on
its transfer's state, so their transfers read as ``python`` whole: the split tells something of
peers whose libraries have threads of their own (zmq's, gloo's).

A peer whose transfer time is mostly ``python`` is limited by its Python work per transfer,
whatever its transport could move: read its ``python`` against a floor peer's (``zmq threads``
for kvxfer zmq: the same threads, no protocol). Per run, the mean of each share over the middle
60% of the transfers by wall time (so that the shares add up); each run's figures, then the
median of the runs.

Needs Linux ``perf`` and its sched tracepoints: root (or ``perf_event_paranoid`` <= -1) and
tracefs. Run as root without tracefs mounted, this mounts it at /sys/kernel/tracing and
unmounts it at the end. Peers in their own venvs (NIXL, Mooncake) need ``bench_peers.py
--peers`` to have made them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import bench_peers as bp
from bench_peers_workers import KiB, MiB, make_cases

TRACEFS = Path("/sys/kernel/tracing")
_SWITCH = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+(\d+)\.(\d+):\s+sched:sched_switch:.*\sprev_pid=(\d+)\s"
                     r".*==> .*\snext_pid=(\d+)\s")
SHARES = ("python", "library", "nobody")


class PerfUnavailable(RuntimeError):
    """perf is installed but cannot record here (no rights, no events): the script exits 2."""


def on_cpu(lines) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int]]:
    """``perf script -F pid,tid,cpu,time,event,trace --ns`` lines of sched_switch events ->
    (tid -> intervals it ran, ns CLOCK_MONOTONIC), (tid -> its process id). An interval runs from
    the switch that put the thread on a CPU to the next switch on that CPU."""
    runs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    owner: dict[int, int] = {}
    current: dict[int, tuple[int, int]] = {}   # cpu -> (tid on it, since)
    for line in lines:
        m = _SWITCH.match(line)
        if not m:
            continue
        pid, tid, cpu, sec, frac, prev, nxt = m.groups()
        t = int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])
        owner[int(tid)] = int(pid)   # the thread switched out is the one the line is about
        if (held := current.get(int(cpu))) is not None and held[0] == int(prev):
            runs[held[0]].append((held[1], t))
        current[int(cpu)] = (int(nxt), t)
    return runs, owner


def _union(spans: list[tuple[int, int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(spans) -> int:
    return sum(b - a for a, b in spans)


def split(window: tuple[int, int], runs: dict[int, list[tuple[int, int]]], owner: dict[int, int],
          pids: set[int], python_tids: set[int]) -> dict[str, float]:
    """One transfer's ``window`` (ns) -> microseconds of ``SHARES`` and the wall: ``python`` while
    any of ``python_tids`` ran, ``library`` while only other threads of ``pids`` did, ``nobody``
    the rest."""
    lo, hi = window
    py: list[tuple[int, int]] = []
    lib: list[tuple[int, int]] = []
    for tid, spans in runs.items():
        if owner.get(tid) not in pids and tid not in python_tids:
            continue
        clipped = [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]
        (py if tid in python_tids else lib).extend(clipped)
    python, anyone = _length(_union(py)), _length(_union(py + lib))
    wall = hi - lo
    return {"wall": wall / 1e3, "python": python / 1e3, "library": (anyone - python) / 1e3,
            "nobody": (wall - anyone) / 1e3}


def middle_mean(splits: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each share over the middle 60% of the transfers by wall time: a typical
    transfer whose shares add up to its wall (medians of each share need not), without the
    bursts of load that the slowest and the fastest few met."""
    ranked = sorted(splits, key=lambda s: s["wall"])
    cut = len(ranked) // 5
    mid = ranked[cut: len(ranked) - cut] or ranked
    return {k: statistics.fmean(s[k] for s in mid) for k in ("wall", *SHARES)}


def tracefs_ready() -> tuple[bool, str]:
    """Whether perf can take sched_switch here; mounts tracefs when root and it is missing."""
    if shutil.which("perf") is None:
        return False, "perf is not installed (Debian: apt-get install linux-perf)"
    if not (TRACEFS / "events" / "sched").exists():
        if os.geteuid() != 0:
            return False, f"no sched tracepoints: mount tracefs at {TRACEFS} (root)"
        r = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"cannot mount tracefs: {r.stderr.strip()[:200]}"
        return True, "mounted"
    return True, ""


def _enable(rec: subprocess.Popen, ctl: Path, ack: Path, timeout: float = 60.0) -> None:
    """Turn the events of ``perf record -D -1 --control=fifo:ctl,ack`` on and wait for its ack.
    The fifos' opens block until perf opens its ends: a perf that never does is killed, and
    the helper thread is let go by holding those ends here until it ended."""
    said: list[str] = []

    def talk() -> None:
        try:
            with open(ctl, "w") as c, open(ack) as a:
                c.write("enable\n")
                c.flush()
                said.append(a.readline().strip())
        except OSError:   # perf is gone (a broken pipe)
            pass
    t = threading.Thread(target=talk, daemon=True)
    t.start()
    limit = time.monotonic() + timeout
    while t.is_alive() and rec.poll() is None and time.monotonic() < limit:   # a perf that ended: at once
        t.join(0.05)
    if said != ["ack"]:
        rec.kill()
        # perf's ends, held here (O_RDWR never blocks on a fifo), with a line waiting in ack:
        # the helper's opens and its read return whenever it gets to them
        ends = [os.open(ctl, os.O_RDWR), os.open(ack, os.O_RDWR)]
        os.write(ends[1], b"gone\n")
        t.join(10)
        for fd in ends:
            os.close(fd)
        err = rec.communicate(timeout=30)[1].decode(errors="replace").strip()
        raise PerfUnavailable(f"perf record did not start: {err[-300:] or 'no ack to enable'}")


def measure(peer: str, case: int, cases: list[dict], transfers: int, tmp: Path, python: str) -> list[dict]:
    """``transfers`` transfers of ``cases[case]`` by ``peer`` under perf: each one's split."""
    spec = {"pool_bytes": 256 * MiB, "cases": cases, "busy_caller": False}
    pair = bp.PeerPair(peer, python, spec, tmp, 300)
    try:
        for _ in range(3):   # warm-up: connections, page faults; bytes checked
            pair.run(case, verify=True)
        data, ctl, ack = tmp / "sched.data", tmp / "perf.ctl", tmp / "perf.ack"
        for fifo in (ctl, ack):
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo)
        # started with its events off; "enable" is acknowledged once they are on
        rec = subprocess.Popen(["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-e", "sched:sched_switch",
                                "-D", "-1", f"--control=fifo:{ctl},{ack}", "-o", str(data)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _enable(rec, ctl, ack)
            done = [pair.run_measured(case, verify=False) for _ in range(transfers)]
        finally:
            rec.send_signal(signal.SIGINT)
            err = rec.communicate(timeout=60)[1].decode(errors="replace")
        if rec.returncode not in (0, -signal.SIGINT):
            raise RuntimeError(f"perf record failed: {err.strip()[-300:]}")
        pids = {p.pid for p in pair.procs}
    finally:
        pair.close()
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,tid,cpu,time,event,trace", "--ns"],
                            capture_output=True, text=True, timeout=600)
    runs, owner = on_cpu(script.stdout.splitlines())
    return [split((d["t0_ns"], d["t0_ns"] + int(d["seconds"] * 1e9)), runs, owner, pids,
                  set(d["tids"]["initiator"]) | set(d["tids"]["target"])) for d in done]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="kvxfer zmq,zmq threads,gloo", help="comma-separated peers of bench_peers.py")
    ap.add_argument("--case", default="one run 1 MiB", help="a case name of bench_peers.py --quick")
    ap.add_argument("--transfers", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ok, why = tracefs_ready()
    if not ok:
        print(f"bench_critical_path: {why}", file=sys.stderr)
        return 2
    mounted = why == "mounted"
    cases = make_cases(256 * MiB, 1000, [64 * KiB, 4 * KiB], [16 * MiB, 1 * MiB], seed=0)
    names = [c["name"] for c in cases]
    if args.case not in names:
        ap.error(f"--case must be one of: {', '.join(names)}")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := [p for p in peers if p not in bp.PEERS]:
        ap.error(f"unknown peers {unknown}; known: {', '.join(bp.PEERS)}")
    results: dict[str, list[dict]] = {p: [] for p in peers}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.runs):
                for peer in peers:   # peers take turns within each run, as in bench_peers.py
                    python = sys.executable
                    if peer.startswith(("nixl", "mooncake")):
                        venv, reason = bp.ensure_venv(peer.split()[0])
                        if venv is None:
                            print(f"  {peer}: {reason}")
                            continue
                        python = venv
                    splits = measure(peer, names.index(args.case), cases, args.transfers, Path(tmp), python)
                    run = middle_mean(splits)
                    results[peer].append(run)
                    print(f"  run {r + 1} {peer}: " + ", ".join(f"{k} {v:.0f}" for k, v in run.items()) + " us",
                          flush=True)
    except PerfUnavailable as e:
        print(f"bench_critical_path: {e}", file=sys.stderr)
        return 2
    finally:
        if mounted:
            subprocess.run(["umount", str(TRACEFS)], capture_output=True)
    print(f"\n{args.case}: microseconds a transfer (the mean of the middle 60% of {args.transfers} transfers a "
          f"run by wall time); each run's figure, then the median of the runs")
    print("| peer | wall | python | library | nobody |\n|---|---|---|---|---|")
    for peer, runs in results.items():
        if runs:
            cells = [", ".join(f"{r[k]:.0f}" for r in runs) + f" (**{statistics.median(r[k] for r in runs):.0f}**)"
                     for k in ("wall", *SHARES)]
            print(f"| {peer} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"bench": "critical_path", "case": args.case, "transfers": args.transfers,
                                         "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
