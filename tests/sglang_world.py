"""A small SGLang deployment for the backend tests: scheduler processes of both sides, each running
``sglang_worker.py`` with the SGLang venv's python (``scripts/engine_venv sglang``: made on demand,
cached outside the checkout). Prefill processes P0, P1 (one gloo world) and P2 (its own, to be
killed); decode processes D0, D1 (one gloo world). Each instance below is a prefill instance (its
own bootstrap server, in the process of its TP rank 0) paired with a decode instance.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.ports import free_port

ROOT = Path(__file__).resolve().parent.parent

# name: (prefill kind, page, processes), (decode kind, page, processes)
INSTANCES = {
    "mha12": (("mha", 4, ["P0"]), ("mha", 8, ["D0", "D1"])),
    "mha21": (("mha", 8, ["P0", "P1"]), ("mha", 4, ["D0"])),
    "uni12": (("unified", 4, ["P1"]), ("unified", 8, ["D0", "D1"])),
    "uni2tok": (("unified", 4, ["P0", "P1"]), ("mha", 16, ["D1"])),
    "mla": (("mla", 4, ["P0"]), ("mla", 8, ["D0", "D1"])),
    "swa": (("swa", 4, ["P1"]), ("swa", 4, ["D0", "D1"])),
    "mamba": (("mamba", 4, ["P0"]), ("mamba", 4, ["D0", "D1"])),
    "kill": (("mha", 4, ["P2"]), ("mha", 4, ["D0", "D1"])),
    "abort": (("mha", 4, ["P0"]), ("mha", 4, ["D0", "D1"])),
    "timeout": (("mha", 4, ["P1"]), ("mha", 4, ["D0", "D1"])),
}
WORLDS = {"pw": ["P0", "P1"], "kw": ["P2"], "dw": ["D0", "D1"]}
TIMEOUTS = {"bootstrap": 20.0, "waiting": 3.0, "transfer": 3.0, "lease": 5.0, "heartbeat": 1.0}


def engine_python() -> tuple[str | None, str]:
    """The SGLang venv's python (made on first use, minutes), or None and why it cannot be had."""
    try:
        p = subprocess.run([str(ROOT / "scripts" / "engine_venv"), "sglang"], capture_output=True, text=True,
                           timeout=3600)
    except subprocess.TimeoutExpired:
        return None, "scripts/engine_venv sglang took over an hour"
    if p.returncode != 0:
        return None, f"scripts/engine_venv sglang failed (SGLang cannot be installed here): {p.stderr[-2000:]}"
    return p.stdout.strip().splitlines()[-1], ""


class Worker:
    def __init__(self, python: str, cfg: dict, log: Path):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.name = cfg["name"]
        self.log = open(log, "w")
        self.proc = subprocess.Popen([python, str(ROOT / "tests" / "sglang_worker.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=str(ROOT), start_new_session=True)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"ev": "exited", "rc": self.proc.wait()})

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, ev: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {ev!r} within {timeout}s (log: {self.log.name})") from None
            if e["ev"] == ev:
                return e
            if e["ev"] == "exited":
                raise RuntimeError(f"{self.name} exited (rc {e['rc']}) waiting for {ev!r}; log: {self.log.name}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tell_exit(self):
        """Ask the worker to end (``close`` waits for it): its endpoints' closes wait for their
        peers, so workers told together end side by side."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.send(op="exit")
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self):
        self.tell_exit()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
        self.log.close()


class World:
    """The processes and instances above; ``run`` drives one instance's requests on both sides."""

    def __init__(self, python: str, tmp: Path):
        self.instances, taken = {}, set()
        for name, (p, d) in INSTANCES.items():
            self.instances[name] = {"bport": free_port(taken), **{
                role: {"kind": kind, "page": page, "procs": procs,
                       "world": next(w for w, members in WORLDS.items() if procs[0] in members)}
                for role, (kind, page, procs) in (("prefill", p), ("decode", d))}}
        self.workers: dict[str, Worker] = {}
        for wname, procs in WORLDS.items():
            store = tmp / f"store-{wname}"
            store.unlink(missing_ok=True)   # a FileStore left by an earlier run holds stale addresses
            for i, proc in enumerate(procs):
                cfg = {"name": proc, "role": "decode" if proc.startswith("D") else "prefill", "proc": i,
                       "world": {"name": wname, "procs": procs}, "store": str(store), "instances": self.instances,
                       "timeouts": TIMEOUTS}
                self.workers[proc] = Worker(python, cfg, tmp / f"{proc}.log")
        try:
            self.ready = {name: w.wait("ready", 300) for name, w in self.workers.items()}
        except BaseException:
            self.close()
            raise

    def run(self, inst: str, reqs: list[dict], fault: dict | None = None, during=None, timeout: float = 90):
        """Run ``reqs`` on both sides of ``inst``; ``during(world)`` runs while they do (faults).
        Returns ({process: its "done"}) for the processes that finished."""
        spec = self.instances[inst]
        fault = fault or {}
        procs = spec["prefill"]["procs"] + spec["decode"]["procs"]
        for p in procs:
            role = "prefill" if p in spec["prefill"]["procs"] else "decode"
            self.workers[p].send(op="run", inst=inst, fault=fault.get(role, {}),
                                 reqs=[dict(q, bport=spec["bport"]) for q in reqs])
        if during is not None:
            during(self)
        return {p: self.workers[p].wait("done", timeout) for p in procs if self.workers[p].proc.poll() is None}

    def close(self):
        for w in self.workers.values():   # every worker told first: their shutdowns overlap
            w.tell_exit()
        for w in self.workers.values():
            w.close()


def world_or_skip(tmp: Path):
    python, why = engine_python()
    if python is None:
        import pytest
        pytest.skip(why)
    return World(python, tmp)


if __name__ == "__main__":   # a manual run: python tests/sglang_world.py
    w = World(engine_python()[0], Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
    try:
        print(json.dumps(w.ready["P0"]["plugin"], indent=1))
        for inst in sys.argv[2:]:
            print(inst, json.dumps(w.run(inst, [{"room": 1001, "n": 13}, {"room": 1002, "n": 22, "prefix": 16},
                                                {"room": 1003, "n": 5}]), indent=1))
    finally:
        w.close()
