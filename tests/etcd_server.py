"""A real etcd for the tests, and the ``registry`` fixture that runs a rank test against both
registry backends (the embedded ``kvxfer bootstrap`` and etcd).

etcd is Debian's ``etcd-server`` (3.4), installed by ``scripts/setup`` (``scripts/install_etcd``).
Each ``Etcd`` is one process on loopback ports of its own, with its data in a directory of its
own (on /dev/shm when there is one: etcd fsyncs every write), started by the test and stopped by
its pid. One etcd serves a whole test session; every test gets a key prefix of its own
(``etcd://127.0.0.1:P/<prefix>``), so tests never see each other's ranks. Tests that kill etcd start
their own. Without the binary (apt-get could not install it here) the etcd cases are skipped with
that reason.

A test file takes the fixtures by importing them: ``from etcd_server import etcd, registries, registry  # noqa``.
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest
from support.ports import free_port

from kvxfer.control.bootstrap import BootstrapConfig, BootstrapServer
from kvxfer.control.client import BootstrapClient

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
_prefixes = itertools.count(1)


def skip_reason() -> str:
    if not os.access(ETCD, os.X_OK):
        return "etcd is not installed (scripts/setup installs Debian's etcd-server with apt-get, which failed here)"
    return ""


class Etcd:
    """One etcd process on 127.0.0.1 (see the module docstring)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvxfer-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "") -> str:
        return f"etcd://{self.endpoint}" + (f"/{prefix}" if prefix else "")

    def start(self, timeout: float = 30.0) -> "Etcd":
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        cmd = [ETCD, "--name", "kvxfer-test", "--data-dir", os.path.join(self.dir, "data"),
               "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
               "--initial-advertise-peer-urls", peer, "--initial-cluster", f"kvxfer-test={peer}",
               "--logger", "zap", "--log-level", "error"]
        with open(os.path.join(self.dir, "log"), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}): {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer within {timeout}s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self) -> None:
        """``kill -9`` (its data stays: ``start`` brings it back as it was)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- raw gateway calls (no kvxfer code): what a test looks at or an attacker writes --------
    def rpc(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://{self.endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read().splitlines()[0])

    def keys(self, prefix: str) -> dict[str, dict]:
        """Every key under ``prefix`` -> its kv (value decoded into "json" when it is JSON)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        ans = self.rpc("kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        out = {}
        for kv in ans.get("kvs", []):
            kv = dict(kv)
            raw = base64.b64decode(kv.get("value", ""))
            try:
                kv["json"] = json.loads(raw)
            except ValueError:
                kv["json"] = None
            out[base64.b64decode(kv["key"]).decode()] = kv
        return out

    def put(self, key: str, value: bytes) -> None:
        self.rpc("kv/put", {"key": _b64(key), "value": _b64(value)})

    def delete(self, key: str) -> None:
        self.rpc("kv/deleterange", {"key": _b64(key)})


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class Registry:
    """One registry for one test, of either kind: ``url``; ``down()`` / ``up()`` (the embedded server
    stopped and started on its port, or etcd killed with -9 and started again on its data);
    ``forget(key, owner)`` (the key lapses) and ``expire(key, owner)`` (its registration expires)."""

    def __init__(self, kind: str, ttl: float, etcd: "Etcd | None", own: bool):
        self.kind, self.ttl, self.etcd, self._own = kind, ttl, etcd, own
        self.server: BootstrapServer | None = None
        if kind == "embedded":
            self.server = BootstrapServer(BootstrapConfig(ttl=ttl)).start()
            self.url = self.server.url
        else:
            self.prefix = f"t{os.getpid()}x{next(_prefixes)}"
            self.url = etcd.url(self.prefix)

    def down(self) -> "Registry":
        """Stop it (the embedded server forgets every rank; etcd is killed with -9, its data kept);
        ``up()`` starts it again where it was."""
        if self.kind == "embedded":
            self._port = self.server.port
            self.server.stop()
        else:
            self.etcd.kill()
        return self

    def up(self) -> None:
        if self.kind == "embedded":
            self.server = BootstrapServer(BootstrapConfig(ttl=self.ttl, port=self._port)).start()
        else:
            self.etcd.start()

    def forget(self, key: str, owner: str) -> None:
        """The key lapses: its registration is gone (the rank is not told)."""
        if self.kind == "embedded":
            BootstrapClient(self.url).deregister(key, owner)
        else:
            self.etcd.delete(f"{self.prefix}/ranks/{key}")

    def expire(self, key: str, owner: str) -> None:
        """The registration of ``key`` expires now (etcd: its lease is revoked)."""
        if self.kind == "embedded":
            BootstrapClient(self.url).deregister(key, owner)
        else:
            lease = self.etcd.keys(f"{self.prefix}/ranks/")[f"{self.prefix}/ranks/{key}"]["lease"]
            self.etcd.rpc("lease/revoke", {"ID": lease})

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._own and self.etcd is not None:
            self.etcd.close()


@pytest.fixture(scope="session")
def etcd():
    """One etcd for the session (skipped, with the reason, when it is not installed)."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    e = Etcd().start()
    yield e
    e.close()


@pytest.fixture
def registries(request):
    """Makes the test's registries: ``registries(kind, ttl, own=False)`` -> ``Registry``; a test that
    restarts etcd asks for one of its own (``own=True``)."""
    made: list[Registry] = []

    def make(kind: str, ttl: float = 5.0, own: bool = False) -> Registry:
        e = None
        if kind == "etcd":
            why = skip_reason()
            if why:
                pytest.skip(why)
            e = Etcd().start() if own else request.getfixturevalue("etcd")
        r = Registry(kind, ttl, e, own)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


@pytest.fixture(params=["embedded", pytest.param("etcd", marks=pytest.mark.slow)])
def registry(request, registries):
    """``registries`` for one kind per test run: ``registry(ttl, own=False)`` -> ``Registry`` (the
    etcd runs are in the slow tier: they start a process)."""
    return lambda ttl=5.0, own=False: registries(request.param, ttl, own)
