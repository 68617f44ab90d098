"""What UCX guarantees when an endpoint to a peer ends (issue 17, fencing across hosts), measured
with raw UCX between two processes (``tests/ucx_fence_peer.py``): the FAR_TLS transports (TCP
here; software RMA, applied by the receiver's own worker progress) and endpoints with error
handling on, as the transport makes them for a peer in another host or network namespace.

- Closing our endpoint to a live peer (force mode) does NOT fence it: its puts and messages
  keep landing in our memory and its TCP connection stays open (the connection its writes
  travel on is the worker's, made by the peer's wireup, not the endpoint we created). So a
  silent peer is not released by closing our endpoint: its memory stays quarantined
  (``transports/ucx/control.py``, "Fencing").
- When the peer's process dies (``kill -9``), our endpoint's close callback fires within a
  fraction of a second, no socket to it is left, and nothing of it lands afterwards: the
  transport counts that as writes impossible (``Fencing.check_failed``).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

import pytest

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow   # two processes, seconds of watching

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ucx_fence_peer.py")


class Side:
    def __init__(self, *args: str):
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self.proc = subprocess.Popen([sys.executable, PEER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.lines.put(json.loads(line[3:]))
        self.lines.put(None)

    def get(self, timeout: float = 60) -> dict:
        res = self.lines.get(timeout=timeout)
        assert res is not None, f"{self.proc.args[2:]} exited with {self.proc.wait()}"
        return res

    def put(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def pair(mode: str) -> tuple[Side, Side]:
    r, s = Side("R", mode), Side("S", mode)
    s.put(r.get())
    r.put(s.get())
    before = r.get()["before"]
    assert before["written"] > 0 and before["sockets"], before   # S's puts land, over TCP
    return r, s


def test_closing_our_endpoint_does_not_stop_a_live_peers_writes():
    r, s = pair("close")
    try:
        after = r.get()["after"]
        assert after["alive"] is False, after
        # The finding: written after our endpoint was closed (and the memory zeroed).
        assert after["written"] > 0 and after["tags"] > 0 and after["sockets"], after
    finally:
        s.stop()
        r.stop()


def test_a_killed_peers_connection_fails_and_nothing_of_it_lands_after():
    r, s = pair("kill")
    try:
        assert r.get()["ready"]
        s.proc.kill()   # kill -9, mid-put
        s.proc.wait(10)
        after = r.get()["after"]
        assert after["callback_s"] is not None and after["callback_s"] < 5, after
        assert after["alive"] is False and after["written"] == 0 and after["sockets"] == [], after
        assert after["status"] == "reset", after["status"]   # what _check_failed takes as proof
    finally:
        s.stop()
        r.stop()
