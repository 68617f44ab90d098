"""Keep-alive HTTP/1.1 to a registry (the embedded one, or etcd's JSON gateway), standard library only.

One ``HttpLink`` per registry client: a few connections kept open and reused (a rank heartbeats on
one connection for its whole life instead of opening one per request), a request that failed on a
reused connection (the server closed it while idle) tried once more on a fresh one, failover across
the endpoints of a cluster, bounded answers, long calls (a long-poll, a watch stream) that another
thread can cut short (``interrupt``), and every network failure mapped to
``ConnectError(transient=True)``.

Who calls what: the backends (``kvxfer.control.http_registry``, ``kvxfer.control.etcd_registry``)
from any thread: each call takes a connection of its own from the pool, so calls never share one.
"""
from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse

from ..errors import ConfigError, ConnectError

MAX_IDLE = 4                  # connections kept open between calls
MAX_REPLY = 64 << 20          # bytes of one answer read (the embedded server holds at most max_total_bytes)
STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, BrokenPipeError, ConnectionResetError,
         ConnectionAbortedError)


def endpoints(url: str, schemes: dict[str, str], default_port: int) -> list[tuple[str, str, int]]:
    """``scheme://host[:port][,host2[:port2]...][/path]`` -> [(http or https, host, port), ...];
    ValueError naming the URL when it is not one. ``schemes`` maps the URL's scheme to the one spoken."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in schemes or not parts.netloc:
        raise ConfigError(f"registry URL {url!r}: expected {' or '.join(s + '://HOST:PORT' for s in schemes)}")
    out = []
    for hostport in parts.netloc.split(","):
        one = urllib.parse.urlsplit(f"//{hostport}")
        try:
            port = one.port or default_port
        except ValueError:
            raise ConfigError(f"registry URL {url!r}: bad port in {hostport!r}") from None
        if not one.hostname or one.username or one.password:
            raise ConfigError(f"registry URL {url!r}: bad host {hostport!r}")
        out.append((schemes[parts.scheme], one.hostname, port))
    return out


class HttpLink:
    """Keep-alive connections to ``points`` (tried in turn when one cannot be reached)."""

    def __init__(self, points: list[tuple[str, str, int]], timeout: float, name: str, source: str | None = None):
        self.points, self.timeout, self.name = points, timeout, name
        self.source = (source, 0) if source else None           # the local address to connect from
        self._at = 0                                           # the endpoint that answered last
        self._idle: list[http.client.HTTPConnection] = []
        self._long: set[http.client.HTTPConnection] = set()    # in a long call: ``interrupt`` cuts them
        self._cut: set[http.client.HTTPConnection] = set()     # cut by ``interrupt``: never tried again
        self._lock = threading.Lock()
        self._closed = False
        self.received = 0      # bytes of answers read: status lines, headers and bodies (metrics, benches)

    # -- connections ----------------------------------------------------------------------
    def _fresh(self, timeout: float) -> http.client.HTTPConnection:
        errors = []
        for i in range(len(self.points)):
            scheme, host, port = self.points[(self._at + i) % len(self.points)]
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = cls(host, port, timeout=timeout, source_address=self.source)
            try:
                conn.connect()
            except OSError as e:
                conn.close()
                errors.append(f"{host}:{port}: {e}")
                continue
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._at = (self._at + i) % len(self.points)
            return conn
        raise ConnectError(f"{self.name} unreachable: {'; '.join(errors)}", transient=True)

    def _take(self) -> tuple[http.client.HTTPConnection | None, bool]:
        with self._lock:
            if self._closed:
                raise ConnectError(f"{self.name}: the client was closed")
            return (self._idle.pop(), True) if self._idle else (None, False)

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    # -- calls ----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                wait: float = 0.0, limit: int = MAX_REPLY) -> tuple[int, bytes]:
        """(status, answer bytes). ``wait``: seconds the server may hold the answer (a long-poll),
        added to the timeout; ``interrupt`` ends such a call early with ConnectError(transient)."""
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        for attempt in (0, 1):
            conn, reused = self._take()
            try:
                if conn is None:
                    conn = self._fresh(self.timeout)
                conn.sock.settimeout(self.timeout + wait)
                if wait:
                    with self._lock:
                        self._long.add(conn)
                conn.request(method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read(limit + 1)
                if len(data) > limit:
                    raise ConnectError(f"{self.name}: {method} {path.split('?')[0]} answered more than {limit} bytes")
            except STALE as e:
                conn.close()
                with self._lock:
                    cut = conn in self._cut
                if reused and attempt == 0 and not cut:   # the server closed an idle keep-alive connection
                    continue
                raise ConnectError(f"{self.name} unreachable: {type(e).__name__}: {e}", transient=True) from None
            except (OSError, http.client.HTTPException) as e:
                if conn is not None:
                    conn.close()
                raise ConnectError(f"{self.name} unreachable: {type(e).__name__}: {e}", transient=True) from None
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
            finally:
                if wait and conn is not None:
                    with self._lock:
                        self._long.discard(conn)
                        self._cut.discard(conn)
            self._count(resp, len(data))
            if resp.will_close:
                conn.close()
            else:
                self._give(conn)
            return resp.status, data
        raise AssertionError("unreachable")

    def _count(self, resp: http.client.HTTPResponse, body: int) -> None:
        self.add_received(17 + sum(len(k) + len(v) + 4 for k, v in resp.getheaders()) + 2 + body)   # status, headers

    def add_received(self, n: int) -> None:
        with self._lock:
            self.received += n

    @contextlib.contextmanager
    def stream(self, method: str, path: str, body: bytes, wait: float):
        """A streamed answer read line by line (``readline``: the bytes it returns are counted in
        ``received``), for at most ``wait`` seconds of silence; its connection is closed after (a
        stream ends only by closing)."""
        conn = self._fresh(self.timeout)
        try:
            conn.sock.settimeout(wait)
            with self._lock:
                self._long.add(conn)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self._count(resp, 0)
            yield _Counted(resp, self)
        except (OSError, http.client.HTTPException) as e:
            raise ConnectError(f"{self.name} unreachable: {type(e).__name__}: {e}", transient=True) from None
        finally:
            with self._lock:
                self._long.discard(conn)
                self._cut.discard(conn)
            conn.close()

    def interrupt(self) -> None:
        """Any thread: end every long call now (its caller sees ConnectError(transient=True))."""
        with self._lock:
            cut = list(self._long)
            self._cut.update(cut)
        for conn in cut:
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for conn in idle:
            conn.close()
        self.interrupt()


class _Counted:
    """A streamed answer whose lines are counted in their link's ``received``."""

    def __init__(self, resp: http.client.HTTPResponse, link: HttpLink):
        self.resp, self.link = resp, link

    def readline(self, limit: int = -1) -> bytes:
        line = self.resp.readline(limit)
        self.link.add_received(len(line))
        return line


__all__ = ["HttpLink", "MAX_REPLY", "endpoints"]
