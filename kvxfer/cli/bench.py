"""``kvxfer bench``: every benchmark in one go, one table, a JSON file and a chart.

    kvxfer bench [--quick] [--peers] [--only plan,hetero] [--json PATH] [--chart PATH]

Each benchmark is a script in ``scripts/`` run as its own process, one after the other
(they measure, so they must not share the cores): with ``--quick`` when the script has it
and ``--json`` to a temporary file when it has that. ``--peers`` adds NIXL and Mooncake next to
kvxfer, and a second table of the peer rows with a thread busy in Python beside each initiator
(as an engine's scheduler is: ``--busy-caller``). A script that fails, times out or
writes nothing readable becomes a row with the reason; the others still run.

A script's JSON carries its own rows (every script but ``bench_transport.py`` does)::

    {"rows": [{"name": str, "value": float, "unit": str, "ceiling": float, "ceiling_name": str,
               "ratio": float, "goal": str, "ok": bool, "error": str}, ...]}

(``ceiling`` is measured in the same run by the script itself; every key but ``name`` is
optional). For a script without rows, a reader below turns its JSON into rows. Each row is
shown next to its ceiling and the ratio; the chart draws the ratios. Needs a source
checkout (the scripts are not part of the wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
LOG_FLOOR = 1e-3   # the chart's log axis starts here; smaller ratios draw as this
Row = dict


# ------------------------------------------------------------------------------------
# Readers: a script's JSON without rows -> rows
# ------------------------------------------------------------------------------------
def _row(name: str, value: float | None, unit: str, ceiling: float | None = None, ceiling_name: str = "",
         goal: str = "", ok: bool | None = None) -> Row:
    ratio = value / ceiling if value is not None and ceiling else None
    return {"name": name, "value": value, "unit": unit, "ceiling": ceiling, "ceiling_name": ceiling_name,
            "ratio": ratio, "goal": goal, "ok": ok}


def transport_json(d: dict) -> list[Row]:
    """bench_transport.py: each transport against its raw path; scattered pages against a gather."""
    ceiling_of = {"zmq": "tcp raw", "ucx": "ucx put raw", "local": "memcpy"}
    rows = []
    for t, cases in d["transports"].items():
        for case, gbps in cases.items():
            ck = "gather" if case.startswith("scattered") else ceiling_of.get(t, "memcpy")
            rows.append(_row(f"transport {t}, {case}", gbps, "GB/s", d["ceilings"].get(ck, {}).get(case), ck))
    rows += [{"name": f"transport {t}", "error": why} for t, why in d.get("errors", {}).items()]
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class Bench:
    name: str
    script: str
    from_json: Callable[[dict], list[Row]] | None = None
    quick_fallback: tuple[str, ...] = ()   # for a script without --quick: smaller sizes it understands
    quick_extra: tuple[str, ...] = ()      # with --quick, when the script understands them
    extra: tuple[str, ...] = ()
    needs_peers_flag: bool = False
    peers_only: bool = False               # runs with ``--peers`` (or when ``--only`` names it)


BENCHES = [
    Bench(name="plan", script="bench_plan.py", quick_fallback=("--tokens", "32768", "--reps", "3")),
    # quick: the network transports only (the in-process "local" one is the suite's reference)
    Bench(name="transport", script="bench_transport.py", from_json=transport_json,
          quick_extra=("--transports", "zmq,ucx")),
    Bench(name="hetero", script="bench_hetero.py"),
    Bench(name="offload", script="bench_offload.py"),
    Bench(name="request", script="bench_request.py",
          quick_fallback=("--requests", "100", "--throughput-requests", "300")),
    Bench(name="peers", script="bench_peers.py", needs_peers_flag=True),
    # the same, each initiator beside a thread busy in Python (an engine's scheduler): with --peers
    Bench(name="peers-busy", script="bench_peers.py", extra=("--busy-caller",), needs_peers_flag=True,
          peers_only=True),
    # sender CPU per run of a 1.3 M-run plan, kvxfer UCX next to NIXL (with --peers)
    Bench(name="posting", script="bench_posting.py", needs_peers_flag=True),
    # discovery at 128 / 512 / 1,024 simulated ranks a role, embedded registry and etcd (quick: 128)
    Bench(name="registry", script="bench_registry.py"),
]


# ------------------------------------------------------------------------------------
# Running one script
# ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Outcome:
    cmd: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    rows: list[Row] = field(default_factory=list)
    data: dict | None = None
    output_tail: str = ""


def _flags(source: str) -> set[str]:
    """Options the script declares (read from its source: importing it would cost seconds)."""
    return set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)""", source))


def run_bench(b: Bench, quick: bool, peers: bool, timeout: float, verbose: bool) -> Outcome:
    path = SCRIPTS / b.script
    if not path.exists():
        return Outcome([str(path)], rows=[{"name": b.name, "error": f"{path} not found"}])
    flags = _flags(path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / f"{b.name}.json"
        cmd = [sys.executable, str(path), *b.extra]
        if quick and "--quick" in flags:
            cmd.append("--quick")
        elif quick and all(a in flags for a in b.quick_fallback if a.startswith("--")):
            cmd += b.quick_fallback
        if quick and all(a in flags for a in b.quick_extra if a.startswith("--")):
            cmd += b.quick_extra
        if "--json" in flags:
            cmd += ["--json", str(out_json)]
        if peers and b.needs_peers_flag:
            cmd.append("--peers")
        res = Outcome(cmd)
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Its own session, so that a timeout ends the script's workers too, not just the script.
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            output, _ = p.communicate(timeout=timeout)
            res.returncode = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            output, _ = p.communicate()
            res.rows = [{"name": b.name, "error": f"timed out after {timeout:.0f} s"}]
        res.seconds = time.monotonic() - t0
        res.output_tail = output[-6000:]
        if verbose:
            print(output)
        if res.rows:
            return res
        if res.returncode != 0:
            last = [ln for ln in output.splitlines() if ln.strip() and "UCX  WARN" not in ln][-1:] or ["no output"]
            res.rows = [{"name": b.name, "error": f"exit code {res.returncode}: {last[0].strip()[:200]}"}]
            return res
        try:
            if out_json.exists():
                res.data = json.loads(out_json.read_text())
                if "rows" not in res.data and b.from_json is None:
                    raise ConfigError("its JSON has no rows")
                res.rows = res.data["rows"] if "rows" in res.data else b.from_json(res.data)
            else:
                res.rows = [{"name": b.name, "error": "wrote no JSON"}]
        except Exception as e:  # a script whose output changed shape: a row, not a crash
            res.rows = [{"name": b.name, "error": f"could not read its results ({type(e).__name__}: {e})"[:200]}]
        return res


# ------------------------------------------------------------------------------------
# Table and chart
# ------------------------------------------------------------------------------------
def _num(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _ratio(r: float) -> str:
    return f"{r:.2f}x" if r >= 0.01 else f"{r:.4f}x"


def table(rows: list[Row]) -> str:
    head = ["#", "figure", "value", "ceiling (same run)", "ratio", "goal"]
    body = []
    for i, r in enumerate(rows, 1):
        if r.get("error"):
            body.append([str(i), r["name"], "-", r["error"], "", ""])
            continue
        unit = r.get("unit", "")
        ceil = f"{_num(r.get('ceiling'))} {unit} {r.get('ceiling_name', '')}".strip() if r.get("ceiling") else ""
        ratio = _ratio(r["ratio"]) if r.get("ratio") is not None else ""
        goal = r.get("goal", "") + {True: " ok", False: " MISSED", None: ""}[r.get("ok")]
        body.append([str(i), r["name"], f"{_num(r.get('value'))} {unit}".strip(), ceil, ratio, goal.strip()])
    widths = [max(len(x[c]) for x in [head, *body]) for c in range(len(head))]
    widths[3] = min(widths[3], 60)
    fmt = lambda cells: " | ".join(c.ljust(w) if i != 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), *(fmt(b) for b in body)])


def _pyplot():
    """pyplot, or None when matplotlib is not installed (it comes with the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def chart(rows: list[Row], path: Path) -> bool:
    """Bars of each row's ratio to its ceiling, written to ``path``; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    bars = [(i, r) for i, r in enumerate(rows, 1) if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.26 * max(len(bars), 1)))
    colors = ["tab:green" if r.get("ok") else "tab:red" if r.get("ok") is False else "tab:blue" for _, r in bars]
    y = np.arange(len(bars))[::-1]
    ratios = [max(r["ratio"], LOG_FLOOR) for _, r in bars]
    ax.barh(y, ratios, color=colors, left=LOG_FLOOR)
    for yy, v in zip(y, ratios):
        ax.text(v * 1.05, yy, _ratio(v), va="center", fontsize=6)
    ax.set_xscale("log")   # ratios span 1e-3 .. 1e1: a linear axis hides all but the largest
    ax.set_xlim(LOG_FLOOR, max([2.0, *ratios]) * 2)
    ax.set_yticks(y, [f"{i}. {r['name']} (vs {r.get('ceiling_name', '')})"[:100] for i, r in bars], fontsize=7)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("value / ceiling measured in the same run, log scale (green: goal met, red: missed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run of each benchmark")
    ap.add_argument("--peers", action="store_true", help="include NIXL and Mooncake (creates their venvs)")
    ap.add_argument("--only", help=f"comma-separated subset of: {','.join(b.name for b in BENCHES)}")
    ap.add_argument("--json", type=Path, help="write everything here: rows, each script's JSON and output")
    ap.add_argument("--chart", type=Path, default=Path("bench.png"), help="PNG of the ratios (default bench.png)")
    ap.add_argument("--timeout", type=float, help="seconds per benchmark (default 600, 1800 without --quick)")
    ap.add_argument("--verbose", action="store_true", help="print each script's own output")
    args = ap.parse_args(argv)
    if not SCRIPTS.is_dir():
        print(f"kvxfer bench runs the scripts of a source checkout; {SCRIPTS} does not exist", file=sys.stderr)
        return 2
    names = [b.name for b in BENCHES]
    only = args.only.split(",") if args.only else names
    if unknown := [n for n in only if n not in names]:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {names}")
    timeout = args.timeout or (600 if args.quick else 1800)
    outcomes: dict[str, Outcome] = {}
    t_all = time.monotonic()
    chosen = [b for b in BENCHES if b.name in only and (args.peers or not b.peers_only or args.only)]
    for k, b in enumerate(chosen):
        print(f"[{k + 1}/{len(chosen)}] {b.name}: scripts/{b.script} ...", flush=True)
        outcomes[b.name] = o = run_bench(b, args.quick, args.peers, timeout, args.verbose)
        for r in o.rows:
            r.setdefault("bench", b.name)
        bad = sum(1 for r in o.rows if r.get("error"))
        print(f"      {o.seconds:.0f} s, {len(o.rows) - bad} figures" + (f", {bad} not measured" if bad else ""),
              flush=True)
    rows = [r for o in outcomes.values() for r in o.rows]
    print(f"\nkvxfer bench{' --quick' if args.quick else ''}: {time.monotonic() - t_all:.0f} s; every ceiling was "
          "measured in the same run, next to its figure\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({
            "quick": args.quick, "peers": args.peers, "seconds": time.monotonic() - t_all, "python": sys.executable,
            "rows": rows, "benches": {n: {"cmd": o.cmd, "seconds": o.seconds, "returncode": o.returncode,
                                          "data": o.data, "output_tail": o.output_tail} for n, o in outcomes.items()},
        }, indent=1, default=str))
    if chart(rows, args.chart):
        print(f"\nwrote {args.chart}" + (f" and {args.json}" if args.json else ""))
    else:
        print(f"\nno chart: it needs matplotlib (pip install 'kvxfer[bench]', or {sys.executable} -m pip install "
              "matplotlib)" + (f"; wrote {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
