"""Test hosts on one machine: Linux network namespaces on a private bridge.

Who calls what
--------------
Tests and benchmarks (``tests/test_hosts.py``, ``tests/test_multihost.py``,
``scripts/bench_hosts.py``)::

    why = hosts_skip_reason()            # None, or why namespaces cannot be made here
    with TestHosts(3) as hosts:          # hosts[0..2]: namespaces kvx-<pid>-<i>
        p = hosts[1].popen([sys.executable, "server.py", hosts[1].addr], env=UCX_ENV)
        hosts[1].link_down(); ...; hosts[1].link_up()

or the fixture factory, in a test module: ``three_hosts = hosts_fixture(3)``.

What is made, and where traffic can go
--------------------------------------
One bridge ``kvxb<pid><k>`` (k: a letter counting instances in this process) in the root
namespace with no address; per host a veth pair whose root end ``kvxv<pid><k>-<i>`` is a bridge port and
whose other end, ``veth0`` inside the namespace, holds 10.213.<net>.<i+1>/24. ``lo`` is up in each
namespace. IPv6 is off on all of them. No default route is added anywhere and the root namespace
gets no address or route, so a process in a test
host can reach only the other test hosts and its own loopback.

Teardown always runs: ``__exit__`` (also when the body raised), ``atexit``, and SIGTERM/
SIGHUP (turned into ``SystemExit`` when no handler was installed). It kills every process
still inside the namespaces (``ip netns pids``), then deletes namespaces, veths and bridge.
``sweep_stale()`` (run by every ``TestHosts``) removes what runs whose pid is dead left.

Processes in different network namespaces still share IPC (System V / POSIX shared memory),
so UCX's default choice would be shared memory, which never delivers across namespaces; the
UCX transport sees the other namespace in the peer's descriptor and connects it without shared
memory (``test_multihost`` runs that once with no setting). ``UCX_ENV`` (``UCX_TLS=tcp``) pins
the other multi-host tests to TCP explicitly.

``tc netem`` is not in this kernel (``qdisc_available("netem")`` says so); ``tbf`` is.
Delay and loss are emulated by ``tests/relay.py`` instead.
"""
from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

UCX_ENV = {"UCX_TLS": "tcp"}     # also works: "cma,tcp,self"; never sysv/posix across namespaces
PREFIX = "kvx"
NET_PREFIX = "10.213"
_NS = re.compile(rf"^{PREFIX}-(\d+)[a-z]?-\d+$")
_LINK = re.compile(rf"^{PREFIX}[bvp](\d+)[a-z]?(-\d+)?$")
_COUNT = iter(range(1 << 30))


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


_SKIP: list[str | None] = []


def hosts_skip_reason() -> str | None:
    """None when test hosts can be made here; otherwise why not, in words (tests skip with it).
    Probes once per process: creates and deletes one namespace."""
    if _SKIP:
        return _SKIP[0]
    why = None
    if not sys.platform.startswith("linux"):
        why = "test hosts need Linux network namespaces"
    elif os.geteuid() != 0:
        why = "test hosts need root (ip netns add, veth, bridge)"
    elif shutil.which("ip") is None:
        why = "test hosts need iproute2's `ip` command"
    else:
        name = f"{PREFIX}-{os.getpid()}-probe"
        try:
            r = _ip("netns", "add", name, check=False)
            if r.returncode:
                why = f"`ip netns add` failed: {r.stderr.strip()}"
            else:
                r = _ip("netns", "exec", name, "ip", "link", "set", "lo", "up", check=False)
                if r.returncode:
                    why = f"`ip netns exec` failed: {r.stderr.strip()}"
        finally:
            _ip("netns", "del", name, check=False)
    _SKIP.append(why)
    return why


def qdisc_available(kind: str, args: Sequence[str] = ()) -> bool:
    """Whether ``tc qdisc add ... root <kind> <args>`` works here (tried on a throwaway veth in a
    throwaway namespace). netem: False on this kernel; tbf: True."""
    if hosts_skip_reason() or shutil.which("tc") is None:
        return False
    with TestHosts(1) as hosts:
        return hosts[0].tc("qdisc", "add", "dev", "veth0", "root", kind, *args, check=False).returncode == 0


def sweep_stale() -> list[str]:
    """Delete kvx-* namespaces and kvx* links whose creating pid is dead. Returns what went."""
    gone = []
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    r = _ip("-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _LINK.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def _no_ipv6(link: str) -> None:
    """No IPv6 (link-local addresses, router solicitations) on a root-namespace link of ours."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass   # no IPv6 in this kernel: nothing to turn off


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (ours by construction: only we start them)."""
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Host:
    """One test host: a network namespace with one address. Made by ``TestHosts``."""

    def __init__(self, ns: str, index: int, addr: str, link: str):
        self.ns, self.index, self.addr, self.link = ns, index, addr, link
        self.procs: list[subprocess.Popen] = []

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside this host (``ip netns exec``, which execs: the pid is the
        program's). ``env`` is added to this process's environment. Killed at teardown."""
        full = {**os.environ, **(env or {})}
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=full, **kw)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to the end (captured text output)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def tc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``tc`` inside this host (e.g. ``tc("qdisc", "add", "dev", "veth0", "root", "tbf", ...)``)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, "tc", *args], capture_output=True, text=True,
                              check=check, timeout=10)

    def link_down(self) -> None:
        """Cut this host off the bridge (its root-side veth down): packets drop both ways, TCP
        connections stay open and retransmit, as with a pulled cable."""
        _ip("link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up")

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.addr})"


class TestHosts:
    """``n`` test hosts on one bridge; a context manager (see the module docstring)."""
    __test__ = False    # not a pytest test class

    def __init__(self, n: int, net: int | None = None):
        if not 1 <= n <= 200:
            raise ValueError(f"1..200 hosts, got {n}")
        self.n, self.pid = n, os.getpid()
        self.net = net if net is not None else random.randrange(1, 255)
        self.tag = f"{self.pid}{'abcdefghijklmnopqrstuvwxyz'[next(_COUNT) % 26]}"   # kvx-<pid><k>-<i>
        self.bridge = f"{PREFIX}b{self.tag}"
        self.hosts: list[Host] = []
        self._made: list[tuple[str, str]] = []   # ("netns"|"link", name), in creation order
        self._old: dict[int, object] = {}
        self._up = False

    # -- set-up ---------------------------------------------------------------------------
    def __enter__(self) -> "TestHosts":
        why = hosts_skip_reason()
        if why:
            raise RuntimeError(why)
        sweep_stale()
        _LIVE.append(self)
        self._up = True
        self._catch_signals()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        if _ip("link", "show", self.bridge, check=False).returncode == 0:
            raise RuntimeError(f"bridge {self.bridge} exists already")
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _no_ipv6(self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, outer, inner = f"{PREFIX}-{self.tag}-{i}", f"{PREFIX}v{self.tag}-{i}", f"{PREFIX}p{self.tag}-{i}"
            assert len(outer) <= 15 and len(inner) <= 15, (outer, inner)
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",   # no IPv6 link-local chatter
                            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], capture_output=True, timeout=10)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _no_ipv6(outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            addr = f"{NET_PREFIX}.{self.net}.{i + 1}"
            for cmd in (["link", "set", "lo", "up"], ["link", "set", inner, "name", "veth0"],
                        ["addr", "add", f"{addr}/24", "dev", "veth0"], ["link", "set", "veth0", "up"]):
                _ip("-n", ns, *cmd)
            self.hosts.append(Host(ns, i, addr, outer))
        self._wait_ready()

    def _wait_ready(self, timeout: float = 10.0) -> None:
        """Until every veth0 has carrier and its address is usable (no tentative DAD state)."""
        end = time.monotonic() + timeout
        for h in self.hosts:
            while True:
                out = _ip("-n", h.ns, "-o", "addr", "show", "dev", "veth0").stdout
                link = _ip("-n", h.ns, "-o", "link", "show", "dev", "veth0").stdout
                if h.addr in out and "tentative" not in out and "LOWER_UP" in link:
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"{h} did not come up: {out.strip()} / {link.strip()}")
                time.sleep(0.02)

    # -- access ---------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    # -- teardown -------------------------------------------------------------------------
    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the hosts, delete namespaces, veths and the bridge. Idempotent."""
        if not self._up:
            return
        self._up = False
        for h in self.hosts:
            for p in h.procs:
                if p.poll() is None:
                    p.kill()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_inside(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)   # deleting one veth end deletes the pair
        for h in self.hosts:
            for p in h.procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self._made.clear()
        if self in _LIVE:
            _LIVE.remove(self)
        self._restore_signals()

    def leftovers(self) -> list[str]:
        """Names this instance made that still exist (empty after ``close``)."""
        names = [h.ns for h in self.hosts] + [h.link for h in self.hosts] + [self.bridge]
        ns = set(_ip("netns", "list", check=False).stdout.split())
        links = _ip("-o", "link", "show", check=False).stdout
        return [x for x in names if x in ns or re.search(rf": {re.escape(x)}[@:]", links)]

    def _catch_signals(self) -> None:
        """SIGTERM/SIGHUP -> SystemExit, so ``finally`` blocks and ``__exit__`` run (main thread
        only, and only where the default handler is in place)."""
        import threading
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_signals(self) -> None:
        import threading
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


_LIVE: list[TestHosts] = []


@atexit.register
def _close_all() -> None:
    for h in list(_LIVE):
        h.close()


def hosts_fixture(n: int, scope: str = "module"):
    """A pytest fixture yielding ``TestHosts(n)``, skipping with ``hosts_skip_reason()``.
    Usage in a test module: ``three_hosts = hosts_fixture(3)``."""
    import pytest

    @pytest.fixture(scope=scope)
    def _hosts():
        why = hosts_skip_reason()
        if why:
            pytest.skip(why)
        with TestHosts(n) as hosts:
            yield hosts
    return _hosts
