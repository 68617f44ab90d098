"""What the registry tests share, written without kvxfer's client: a counting TCP relay (what a
client sends and reads, request by request), a connection flood from addresses of our choosing,
raw HTTP on one kept-alive connection, and rank records built by hand as JSON.

Loopback is 127.0.0.0/8 on Linux: a socket bound to 127.0.0.66 reaches a server on 127.0.0.1
and the server sees it as another host, so one machine plays an attacker and honest hosts.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time


def record(instance: str = "default", tp_rank: int = 0, tp_size: int = 1, layout: dict | None = None,
           control: str | None = None, **over) -> dict:
    """A prefill rank's record as JSON fields (the registry's PUT /register body, without owner)."""
    return {"role": "prefill", "num_kv_heads": 8, "num_layers": 2, "instance": instance, "tp_rank": tp_rank,
            "tp_size": tp_size, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1, "replicated": False,
            "control": control or f"tcp://127.0.0.1:{20000 + tp_rank}", "data": {},
            "layout": layout if layout is not None else {}, "aux_bytes": 0, "protocol": 3, **over}


class Conn:
    """One kept-alive HTTP/1.1 connection (http.client), JSON in and out."""

    def __init__(self, url: str, source: str | None = None, timeout: float = 10.0):
        host, port = url.split("//")[1].rsplit(":", 1)
        self.c = http.client.HTTPConnection(host, int(port), timeout=timeout,
                                            source_address=(source, 0) if source else None)

    def call(self, method: str, path: str, body=None) -> tuple[int, bytes, http.client.HTTPResponse]:
        """One request; made again on a fresh connection when the server had closed this one (as
        every HTTP client does with a kept-alive connection)."""
        raw = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body=raw, headers={"Content-Type": "application/json"})
                r = self.c.getresponse()
                return r.status, r.read(), r
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.c.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.c.close()


class CountingRelay:
    """A TCP relay to ``target`` on 127.0.0.1 that counts connections, request lines sent and bytes
    read back; ``url`` is its address."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.connections = self.requests = self.bytes_back = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._stop = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:
                a.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [a, b]
            pumps = [threading.Thread(target=self._pump, args=(a, b, True), daemon=True),
                     threading.Thread(target=self._pump, args=(b, a, False), daemon=True)]
            with self._lock:
                self._threads += pumps
            for t in pumps:
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    if up:
                        self.requests += data.count(b" HTTP/1.1\r\n")
                    else:
                        self.bytes_back += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def counts(self) -> tuple[int, int, int]:
        with self._lock:
            return self.connections, self.requests, self.bytes_back

    def close(self) -> None:
        """Stop accepting, end every relayed connection and wait for the relay's threads (a close
        alone wakes no thread blocked in accept or recv: shutdown does)."""
        self._stop = True
        with self._lock:
            socks, threads = [self.srv, *self._socks], list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(5.0)
        for s in socks:
            s.close()


class FloodProcess:
    """A ``Flood`` in a process of its own (the attacker is another program: no shared GIL);
    stopped by its pid."""

    def __init__(self, port: int, sources: list[str], per_address: int, trickle: bool = False):
        cmd = [sys.executable, __file__, "--port", str(port), "--per-address", str(per_address),
               "--sources", ",".join(sources), *(["--trickle"] if trickle else [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "flooding", "the flood did not start"

    def stop(self) -> int:
        """Stop it; the connections it made in all."""
        os.kill(self.proc.pid, signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        return int(out.split()[-1]) if out.split() else 0


class LoadProcess:
    """Another program that loads the registry at ``url``: ``readers`` threads each GET ``path`` in a
    loop on a kept-alive connection, reading every answer whole, and ``KEEPERS`` threads that
    heartbeat ``keys`` (as ``owner``, a share each) every ``beat`` seconds. ``stop`` returns the
    sizes of the answers read.
    (Readers and heartbeats belong in different processes: readers of large answers hold the GIL
    often enough to delay a heartbeat thread of their own process by seconds.)"""

    def __init__(self, url: str, readers: int, path: str, keys: list[str], owner: str, beat: float = 0.5):
        cmd = [sys.executable, __file__, "--load", url, "--readers", str(readers), "--path", path,
               "--keys", ",".join(keys), "--owner", owner, "--beat", str(beat)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "loading", "the load did not start"

    def stop(self) -> list[int]:
        os.kill(self.proc.pid, signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out.strip().splitlines()[-1])


KEEPERS = 8     # heartbeat connections of a LoadProcess


def _load(url: str, readers: int, path: str, keys: list[str], owner: str, beat: float) -> None:
    done, sizes = threading.Event(), []
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def read():
        c = Conn(url, timeout=60)
        while not done.is_set():
            sizes.append(len(c.call("GET", path)[1]))

    def keep(mine: list[str]):
        c = Conn(url, timeout=60)
        while not done.wait(beat):
            for k in mine:
                c.call("POST", "/heartbeat", {"key": k, "owner": owner})
    threads = [threading.Thread(target=read, daemon=True) for _ in range(readers)]
    # ranks heartbeat from several connections, as ranks of several hosts do: one connection for
    # 256 keys would take a round longer than a short ttl whenever the server is busy
    threads += [threading.Thread(target=keep, args=(keys[i::KEEPERS],), daemon=True)
                for i in range(min(KEEPERS, len(keys)))]
    for t in threads:
        t.start()
    print("loading", flush=True)
    done.wait()
    for t in threads:
        t.join(60)
    print(json.dumps(sizes), flush=True)


class Flood:
    """``per_address`` connections from each of ``sources`` to ``port``, each opened again as soon
    as the server closes it, until ``stop``; they send nothing (or, with ``trickle``, one header
    byte now and then). ``opened``: connections made in all."""

    def __init__(self, port: int, sources: list[str], per_address: int, trickle: bool = False):
        self.port, self.sources, self.per_address, self.trickle = port, sources, per_address, trickle
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self, sel: selectors.DefaultSelector, source: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            return
        sel.register(s, selectors.EVENT_READ, source)
        self.opened += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for src in self.sources:
            for _ in range(self.per_address):
                self._open(sel, src)
        last = time.monotonic()
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                s = key.fileobj
                try:
                    gone = s.recv(4096) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:    # closed by the server: open another at once
                    sel.unregister(s)
                    s.close()
                    self._open(sel, key.data)
            have = {}
            for key in list(sel.get_map().values()):
                have[key.data] = have.get(key.data, 0) + 1
            for src in self.sources:
                for _ in range(self.per_address - have.get(src, 0)):
                    self._open(sel, src)
            if self.trickle and time.monotonic() - last > 1.0:
                last = time.monotonic()
                for key in list(sel.get_map().values()):
                    try:
                        key.fileobj.send(b"X")
                    except OSError:
                        pass
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="flood a port with connections (FloodProcess), or load a registry "
                                             "(LoadProcess)")
    ap.add_argument("--port", type=int)
    ap.add_argument("--sources")
    ap.add_argument("--per-address", type=int)
    ap.add_argument("--trickle", action="store_true")
    ap.add_argument("--load")
    ap.add_argument("--readers", type=int)
    ap.add_argument("--path")
    ap.add_argument("--keys")
    ap.add_argument("--owner")
    ap.add_argument("--beat", type=float)
    a = ap.parse_args()
    if a.load:
        _load(a.load, a.readers, a.path, [k for k in a.keys.split(",") if k], a.owner, a.beat)
        sys.exit(0)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    f = Flood(a.port, a.sources.split(","), a.per_address, a.trickle)
    print("flooding", flush=True)
    done.wait()
    f.stop()
    print(f.opened, flush=True)
