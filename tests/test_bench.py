"""`kvxfer bench`: the aggregator runs scripts, survives broken ones, writes JSON and a PNG.

Fast (no timed assertions): the planner benchmark at a tiny size, and stand-in scripts for
the failure paths.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from kvxfer.cli import bench

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)


def read_png(path: Path) -> tuple[int, int]:
    """Check a PNG chunk by chunk (signature, CRCs, IHDR, IDAT size); return (width, height)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos: pos + 4])
        tag, body = data[pos + 4: pos + 8], data[pos + 8: pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n: pos + 12 + n])
        assert zlib.crc32(tag + body) == crc, f"bad CRC in {tag!r}"
        chunks.setdefault(tag, []).append(body)
        pos += 12 + n
    assert pos == len(data) and b"IEND" in chunks
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    assert depth == 8
    assert len(zlib.decompress(b"".join(chunks[b"IDAT"]))) == h * (1 + w * channels)
    return w, h


def test_planner_subset_writes_json_and_png(tmp_path, monkeypatch):
    # The planner bench at a tiny size (passed as extra arguments, whatever --quick means to it).
    plan = bench.Bench(name="plan", script="bench_plan.py", extra=("--tokens", "2048", "--reps", "1"))
    monkeypatch.setattr(bench, "BENCHES", [plan, *[b for b in bench.BENCHES if b.name != "plan"]])
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert bench.main(["--only", "plan", "--json", str(out), "--chart", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["benches"]) == ["plan"] and doc["benches"]["plan"]["returncode"] == 0
    rows = doc["rows"]
    assert rows and all(not r.get("error") for r in rows), rows
    for r in rows:
        assert r["bench"] == "plan" and r["value"] is not None and r["ceiling"] and r["ratio"] is not None
    w, h = read_png(png)
    assert w > 100 and h > 10


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that is gone too)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _script(dir_: Path, name: str, body: str) -> None:
    (dir_ / name).write_text("import argparse, json, sys\n" + body)


def test_broken_scripts_become_rows(tmp_path, monkeypatch, capsys):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _script(scripts, "fails.py", "print('boom: no device'); sys.exit(3)\n")
    _script(scripts, "silent.py", "pass\n")
    _script(scripts, "good.py", """ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--json")
a = ap.parse_args()
rows = [{"name": "x", "value": 2.0, "unit": "GB/s", "ceiling": 4.0, "ceiling_name": "memcpy", "ratio": 0.5,
         "quick": a.quick}]
open(a.json, "w").write(json.dumps({"rows": rows}))
""")
    # hangs, with a worker of its own: the timeout must end both
    _script(scripts, "hangs.py", f"""import subprocess, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({str(tmp_path / 'worker.pid')!r}, "w").write(str(w.pid))
time.sleep(120)
""")
    monkeypatch.setattr(bench, "SCRIPTS", scripts)
    monkeypatch.setattr(bench, "BENCHES", [bench.Bench(name=n, script=f"{n}.py")
                                           for n in ("fails", "silent", "good", "missing", "hangs")])
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert bench.main(["--quick", "--json", str(out), "--chart", str(png),
                       "--timeout", "3"]) == 0
    rows = {r.get("bench"): r for r in json.loads(out.read_text())["rows"]}
    assert rows["hangs"]["error"] == "timed out after 3 s"
    assert not _alive(int((tmp_path / "worker.pid").read_text()))
    assert rows["fails"]["error"] == "exit code 3: boom: no device"
    assert rows["silent"]["error"] == "wrote no JSON"
    assert rows["good"]["ratio"] == 0.5 and rows["good"]["quick"] is True   # --quick reached the script
    assert "not found" in rows["missing"]["error"]
    read_png(png)
    table = capsys.readouterr().out
    assert "boom: no device" in table and "0.50x" in table


def test_the_busy_caller_table_runs_with_peers(tmp_path, monkeypatch):
    """``--peers`` adds the peer rows measured beside a busy thread; a plain run leaves them out."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _script(scripts, "p.py", """ap = argparse.ArgumentParser()
ap.add_argument("--json")
ap.add_argument("--peers", action="store_true")
ap.add_argument("--busy-caller", action="store_true")
a = ap.parse_args()
open(a.json, "w").write(json.dumps({"rows": [{"name": f"busy={a.busy_caller} peers={a.peers}", "value": 1.0}]}))
""")
    busy = next(b for b in bench.BENCHES if b.name == "peers-busy")     # the real entry's settings
    assert busy.script == "bench_peers.py" and busy.peers_only and busy.extra == ("--busy-caller",)
    monkeypatch.setattr(bench, "SCRIPTS", scripts)
    monkeypatch.setattr(bench, "BENCHES", [bench.Bench(name="peers", script="p.py", needs_peers_flag=True),
                                           bench.Bench(name="peers-busy", script="p.py", extra=busy.extra,
                                                       needs_peers_flag=True, peers_only=True)])
    out = tmp_path / "b.json"

    def names(*argv):
        assert bench.main([*argv, "--json", str(out), "--chart", str(tmp_path / "c.png")]) == 0
        return sorted(r["name"] for r in json.loads(out.read_text())["rows"])
    assert names() == ["busy=False peers=False"]
    assert names("--peers") == ["busy=False peers=True", "busy=True peers=True"]


def test_without_matplotlib_the_bench_says_how_to_get_the_chart(tmp_path, monkeypatch, capsys):
    """No package is installed at run time: the chart comes with the ``bench`` extra."""
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes the import fail
    monkeypatch.setattr(bench, "BENCHES", [])
    png = tmp_path / "none.png"
    assert bench.main(["--chart", str(png)]) == 0
    assert not png.exists()
    assert "pip install 'kvxfer[bench]'" in capsys.readouterr().out


def test_unknown_benchmark_is_a_usage_error():
    with pytest.raises(SystemExit):
        bench.main(["--only", "nope"])


def _script_module(name: str):
    """scripts/<name>.py as a module (the scripts import their neighbours by name)."""
    import importlib
    import sys
    if str(bench.SCRIPTS) not in sys.path:
        sys.path.insert(0, str(bench.SCRIPTS))
    return importlib.import_module(name)


def test_posting_plan_and_digest_catch_a_misplaced_run():
    """The posting benchmark's own check: distinct aligned runs, and a digest that sees one run
    landed in another's place."""
    import numpy as np
    bp = _script_module("bench_posting")
    spec = {"runs": 5000, "run_bytes": 512, "pool_bytes": bp.pool_bytes(5000, 512), "seed": 0}
    case = bp.make_plan(spec)
    for offs in (case["so"], case["do"]):
        assert len(np.unique(offs)) == 5000 and not (offs % 512).any() and offs.max() + 512 <= spec["pool_bytes"]
    src, dst = np.zeros(spec["pool_bytes"], np.uint8), np.zeros(spec["pool_bytes"], np.uint8)
    bp.fill_source(src, case)
    rows_s, rows_d = bp._rows(src, 512), bp._rows(dst, 512)
    rows_d[case["do"] // 512] = rows_s[case["so"] // 512]   # what a correct transfer leaves
    want = bp.digest(src, case["so"], 512)
    assert bp.digest(dst, case["do"], 512) == want
    a, b = case["do"][7] // 512, case["do"][8] // 512
    rows_d[[a, b]] = rows_d[[b, a]]   # two runs swapped
    assert bp.digest(dst, case["do"], 512) != want


def test_posting_row_runs_and_checks_its_bytes(tmp_path, monkeypatch):
    """The posting row end to end through ``kvxfer bench``, kvxfer UCX only, a small plan: rows
    with values, every transfer's bytes checked (a digest mismatch would be an error row)."""
    pytest.importorskip("ucxx")
    posting = bench.Bench(name="posting", script="bench_posting.py",
                          extra=("--only", "kvxfer ucx", "--runs", "4096", "--reps", "1"))
    monkeypatch.setattr(bench, "BENCHES", [posting])
    out = tmp_path / "b.json"
    assert bench.main(["--only", "posting", "--json", str(out), "--chart", str(tmp_path / "b.png")]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert rows and all(not r.get("error") for r in rows), rows
    assert {r["unit"] for r in rows} == {"us/run", "GB/s"} and all(r["value"] > 0 for r in rows)
    data = doc["benches"]["posting"]["data"]
    assert data["runs"] == 4096 and len(data["samples"]["kvxfer ucx"]) == 1 and not data["errors"]


def test_process_cpu_counts_every_live_thread():
    """The peers' CPU figure reads every thread of a worker: CPU burned by a thread other than
    the main one shows in it (a transport's I/O thread is where most of it goes)."""
    import os
    import threading
    import time
    bp = _script_module("bench_peers")
    assert isinstance(bp.process_cpu_ns(os.getpid()), int)   # Linux: every thread's schedstat is there
    burned, hold = threading.Event(), threading.Event()

    def spin():
        t = time.thread_time()
        while time.thread_time() - t < 0.2:
            pass
        burned.set()
        hold.wait()   # alive while we read: a thread that ended takes its time with it
    th = threading.Thread(target=spin)
    before = bp.process_cpu_ns(os.getpid())
    th.start()
    try:
        assert burned.wait(30)
        after = bp.process_cpu_ns(os.getpid())
    finally:
        hold.set()
        th.join()
    assert after - before >= 0.18e9, (before, after)
    assert bp.process_cpu_ns(2**22 + 12345) is None   # no such process


def test_peers_report_cpu_per_transfer_against_the_floor(tmp_path):
    """``bench_peers.py`` end to end, two zmq peers, tiny cases: each peer's CPU per transfer
    (initiator and target processes) is in its results, and kvxfer zmq's row reads it against
    ``zmq threads``; every transfer's bytes were checked at the warm-up as before."""
    import subprocess
    import sys
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(bench.SCRIPTS / "bench_peers.py"), "--quick", "--reps", "1",
                        "--only", "zmq threads,kvxfer zmq", "--pages", "16", "--page-kib", "1024",
                        "--run-mib", "16", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    for peer in ("zmq threads", "kvxfer zmq"):
        for case, res in doc["results"][peer].items():
            assert res["cpu_us"]["initiator"] > 0 and res["cpu_us"]["target"] > 0, (peer, case, res)
    rows = {r["name"]: r for r in doc["rows"] if r["name"].startswith("peers cpu per transfer")}
    ours = rows["peers cpu per transfer kvxfer zmq, one run 16 MiB"]
    floor = rows["peers cpu per transfer zmq threads, one run 16 MiB"]
    assert ours["ceiling_name"] == "zmq threads" and ours["ceiling"] == pytest.approx(floor["value"])
    assert ours["ratio"] == pytest.approx(ours["value"] / floor["value"]) and ours["unit"] == "us CPU"
    assert "CPU per transfer" in r.stdout


def _switch(pid: int, tid: int, cpu: int, t_us: int, prev: int, nxt: int) -> str:
    """One ``perf script -F pid,tid,cpu,time,event,trace --ns`` line of a context switch."""
    return (f"  {pid}/{tid}  [{cpu:03d}]  12.{t_us * 1000:09d}: sched:sched_switch: prev_comm=x y prev_pid={prev} "
            f"prev_prio=120 prev_state=S ==> next_comm=python next_pid={nxt} next_prio=120")


def test_critical_path_splits_a_transfer_by_who_is_on_a_cpu():
    """Worker pid 7: Python thread 7 and a library thread 8; pid 50 is someone else. CPU 0 runs
    7 over [0, 100) us, then 8 over [100, 300); CPU 1 runs 50 over [0, 200), then 7 over
    [200, 250). A transfer's window [50, 350) splits into Python, the library alone, nobody."""
    cp = _script_module("bench_critical_path")
    lines = [_switch(0, 0, 0, 0, 0, 7), _switch(0, 0, 1, 0, 0, 50),
             _switch(7, 7, 0, 100, 7, 8),       # 7 leaves CPU 0 (the line names it), 8 comes
             _switch(50, 50, 1, 200, 50, 7),    # someone else leaves CPU 1, 7 comes
             _switch(7, 7, 1, 250, 7, 0),       # 7 sleeps
             _switch(7, 8, 0, 300, 8, 0),       # 8 sleeps
             "a line of some other event",
             _switch(7, 7, 0, 400, 99, 7)]   # says 99 left CPU 0, where 0 ran: no interval for either
    runs, owner = cp.on_cpu(lines)
    assert owner == {0: 0, 7: 7, 50: 50, 8: 7}   # 0: the idle task
    ns = 12_000_000_000
    assert runs[7] == [(ns, ns + 100_000), (ns + 200_000, ns + 250_000)] and runs[8] == [(ns + 100_000, ns + 300_000)]
    got = cp.split((ns + 50_000, ns + 350_000), runs, owner, pids={7}, python_tids={7})
    # Python: [50, 100) and [200, 250) = 100 us; anyone of pid 7: [50, 300) = 250 us, so the
    # library alone 150 us; nobody [300, 350) = 50 us. Thread 50 (another process) counts nowhere.
    assert got == {"wall": 300.0, "python": 100.0, "library": 150.0, "nobody": 50.0}
    # a thread the worker lists as Python counts so whatever process the perf lines gave it
    assert cp.split((ns, ns + 200_000), runs, owner, pids=set(), python_tids={50})["python"] == 200.0
    typical = cp.middle_mean([{"wall": w, "python": w / 2, "library": w / 4, "nobody": w / 4}
                              for w in (1.0, 10, 10, 10, 10, 10, 10, 10, 10, 1000)])
    assert typical == {"wall": 10.0, "python": 5.0, "library": 2.5, "nobody": 2.5}   # the outliers left out


def test_each_transfer_says_when_it_started_and_which_threads_are_python(tmp_path):
    """What ``bench_critical_path.py`` reads off each transfer of ``bench_peers.py``'s workers:
    its start on CLOCK_MONOTONIC (perf's clock there) and both workers' Python threads."""
    import time
    bp = _script_module("bench_peers")
    cases = [{"name": "one run 1 MiB", "nbytes": 1 << 20, "so": [0], "do": [1 << 20]}]
    before = time.monotonic_ns()
    pair = bp.PeerPair("zmq threads", __import__("sys").executable,
                       {"pool_bytes": 4 << 20, "cases": cases, "busy_caller": False}, tmp_path, 120)
    try:
        done = pair.run_measured(0, verify=True)
        pids = [p.pid for p in pair.procs]
    finally:
        pair.close()
    assert before < done["t0_ns"] < time.monotonic_ns() and done["seconds"] > 0
    # each worker's main thread (its pid) and the I/O thread zmq threads starts on each side
    assert pids[1] in done["tids"]["initiator"] and pids[0] in done["tids"]["target"]
    assert len(done["tids"]["initiator"]) >= 2 and len(done["tids"]["target"]) >= 2


def test_critical_path_end_to_end_when_perf_can_run(tmp_path):
    """The script with a real perf: every transfer of a peer is split, and the shares add up.
    Skipped only without perf (an optional tool) or without a way to its sched tracepoints
    (not root, no tracefs); a perf that is there and fails here fails the test."""
    import os
    import shutil
    import subprocess
    import sys
    cp = _script_module("bench_critical_path")
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed")
    if not (cp.TRACEFS / "events" / "sched").exists() and os.geteuid() != 0:
        pytest.skip("no sched tracepoints, and not root to mount tracefs")
    out = tmp_path / "cp.json"
    r = subprocess.run([sys.executable, str(bench.SCRIPTS / "bench_critical_path.py"), "--peers", "zmq raw",
                        "--runs", "1", "--transfers", "10", "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"]["zmq raw"]
    assert run["python"] > 0 and run["wall"] > 0
    assert sum(run[k] for k in cp.SHARES) == pytest.approx(run["wall"], rel=1e-6)
    assert "| zmq raw |" in r.stdout


def test_critical_path_says_why_when_perf_cannot_record(tmp_path, monkeypatch, capsys):
    """A perf that is there but cannot record (no rights, no events) ends the script with exit
    2 and perf's own words, at once: no traceback, no wait for an ack that never comes. The
    stand-in perf needs no tracepoints: the check for them is told they are there."""
    import os
    import time
    cp = _script_module("bench_critical_path")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "perf").write_text("#!/bin/sh\necho 'perf_event_open(...) failed: Permission denied' >&2\n"
                               "exit 255\n")
    (fake / "perf").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setattr(cp, "tracefs_ready", lambda: (True, ""))
    t0 = time.monotonic()
    assert cp.main(["--peers", "zmq raw", "--runs", "1", "--transfers", "2"]) == 2
    err = capsys.readouterr().err
    assert "perf record did not start" in err and "Permission denied" in err
    assert "Traceback" not in err and time.monotonic() - t0 < 50   # not the 60 s wait for an ack
