"""What the vLLM tests share: the engine venv (made on demand by ``scripts/engine_venv vllm``), the
tiny model, and ``Engine``, one ``tests/vllm_engine.py`` process driven by JSON lines.

Only a failed install of vLLM skips a test (``engine_python``); an engine that does not start, or
a command that does not answer in time, fails it with the engine's log tail.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "tests" / "vllm_engine.py"
_python: str | None = None
_why: str | None = None


def engine_python() -> str:
    """The engine venv's python (installed on the first call on a machine: minutes); a skip, with
    the installer's last lines, only when vLLM cannot be installed."""
    global _python, _why
    if _python is None and _why is None:
        p = subprocess.run(["bash", str(ROOT / "scripts" / "engine_venv"), "vllm"], capture_output=True, text=True,
                           timeout=1800)
        if p.returncode == 0 and p.stdout.strip():
            _python = p.stdout.strip().splitlines()[-1]
        else:
            _why = "vLLM could not be installed (scripts/engine_venv vllm): " + (p.stderr or p.stdout)[-800:]
    if _python is None:
        pytest.skip(_why)
    return _python


def make_model(path: Path) -> Path:
    subprocess.run([engine_python(), str(SERVER), "model", str(path)], check=True, capture_output=True, timeout=300)
    return path


class Engine:
    """One engine process. ``call(op, **kw)`` sends a command and returns its reply (a dict)."""

    def __init__(self, model: Path, role: str, log: Path, extra: dict | None = None, block_size: int = 32,
                 tp: int = 1):
        self.role, self.log_path = role, log
        self._log = open(log, "w")
        cmd = [engine_python(), str(SERVER), "serve", "--model", str(model), "--role", role,
               "--block-size", str(block_size), "--tp", str(tp), "--extra", json.dumps(extra or {})]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "tests"))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True, bufsize=1)
        self._replies: list[dict] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                with self._cv:
                    self._replies.append(json.loads(line[2:]))
                    self._cv.notify_all()
            else:
                self._log.write(line)
                self._log.flush()
        with self._cv:
            self._cv.notify_all()

    def _next(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        with self._cv:
            while not self._replies:
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"{self.role} engine: no reply within {timeout:.0f} s (exit "
                                         f"{self.proc.poll()}); log tail:\n{self.tail()}")
                self._cv.wait(min(left, 0.5))
            return self._replies.pop(0)

    def ready(self, timeout: float = 240) -> "Engine":
        assert self._next(timeout).get("ready"), self.tail()
        return self

    def call(self, op: str, timeout: float = 60, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (no goodbye to its peers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=20)
                self.proc.wait(20)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._reader.join(10)   # the reader writes the last lines before the log closes
        self._log.close()


def until(fn, timeout: float, what: str, step: float = 0.2):
    """``fn()``'s first truthy value within ``timeout`` s, else AssertionError naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout} s (last: {got!r})")
        time.sleep(step)


__all__ = ["engine_python", "make_model", "Engine", "until"]
