"""A cap on TCP's retransmit backoff for this transport's own UCX connections (``tcp_rto_max``).

Why: a peer cut off by a partition leaves its unacknowledged bytes in the kernel, which retries
them with a backoff that doubles up to ``net.ipv4.tcp_rto_max_ms`` (120 s by default). After the
link comes back, nothing moves on that connection until its next try: after a 35 s cut the next
try came 16-20 s after link-up (measured, issue 35), and what the cut transfers held on both
sides (a sender's source KV, a receiver's pregranted slots) waited for it. Linux (>= 6.15) takes
the same cap per socket (``TCP_RTO_MAX_MS``); ``RtoCap`` sets it on UCX's connections of this
process, so the bound holds without a host setting.

Which sockets are UCX's: UCX owns its sockets (no API hands them out), so they are found among
this process's fds (``/proc/self/fd``; each socket's addresses read once, through a duplicate
fd): a TCP socket whose local address (IP and port, as UCX packs them: network byte order; a
loopback interface by its port alone) appears in the address of one of our own workers (a
connection UCX accepted on its listener), or whose remote address appears in a peer's worker
address (one UCX made to that peer's listener). Only the retransmit cap is changed, nothing
else; a socket of someone else's that matched by chance (both its IP and its 2-byte port inside
a ~100-byte address) would only retry sooner after an outage.

A side effect, the same as the host setting's: during a long cut the kernel retries such a
connection every ~2 s and gives up after ``net.ipv4.tcp_retries2`` tries (~25-30 s measured),
so both sides see it reset; ``Fencing`` takes a reset after that much silence as no proof of
death (the peer's own side may still carry its writes), and what it held waits for its
re-handshake, which the heal brings within the cap.

Who calls what: ``Loop.tick`` calls ``RtoCap.apply`` about once a second while a peer is reached
over TCP (a far peer, a far sender, or a UCX_TLS without shared memory; connections appear as
UCX makes them, also after a re-handshake); everything runs on the I/O thread.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Iterable

log = logging.getLogger("kvxfer.transport.ucx")

TCP_RTO_MAX_MS = 44   # <linux/tcp.h>, Linux >= 6.15 (Python's socket module does not name it yet)
RTO_MIN_S, RTO_MAX_S = 1.0, 120.0   # what the kernel accepts (it refuses below 1 s)


def socket_fds(proc: str = "/proc/self") -> dict[int, int]:
    """This process's sockets: inode -> one of its fds."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir(f"{proc}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"{proc}/fd/{fd}")
        except OSError:
            continue   # closed meanwhile
        if link.startswith("socket:["):
            out.setdefault(int(link[8:-1]), int(fd))
    return out


def _ip(family: int, host: str) -> bytes:
    """A socket address's host in network byte order; an IPv4-mapped IPv6 one as its 4 bytes."""
    raw = socket.inet_pton(family, host.split("%")[0])
    return raw[12:] if len(raw) == 16 and raw[:12] == bytes(10) + b"\xff\xff" else raw


def addresses(s: socket.socket) -> tuple[bytes, int, bytes, int] | None:
    """(local IP, local port, remote IP, remote port) of a connected TCP socket; None for any
    other socket (OSError while it is still connecting: ask again later)."""
    if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    local, remote = s.getsockname(), s.getpeername()   # ENOTCONN: a listener, or connecting
    return _ip(s.family, local[0]), local[1], _ip(s.family, remote[0]), remote[1]


def packs(address: bytes, ip: bytes, port: int) -> bool:
    """Does a UCX worker address hold this IP and this port (both in network byte order)? UCX
    packs a loopback interface without its IP (a flag and the machine's id instead), so a
    loopback IP is taken on its port alone."""
    loopback = ip[:1] == b"\x7f" or ip == bytes(15) + b"\x01"
    return (loopback or ip in address) and port.to_bytes(2, "big") in address


def taken_for_ucx(a: tuple[bytes, int, bytes, int] | None, own: Iterable[bytes], peers: Iterable[bytes]) -> bool:
    """Is a socket with ``addresses`` ``a`` taken for a UCX connection: its local address packed in
    one of ``own`` (our workers' addresses), or its remote one in one of ``peers`` (theirs)?"""
    return a is not None and (any(packs(x, a[0], a[1]) for x in own) or any(packs(x, a[2], a[3]) for x in peers))


def _dup(fd: int) -> socket.socket:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open); OSError when
    ``fd`` is closed or not a socket (the duplicate closed again)."""
    dup = os.dup(fd)
    try:
        return socket.socket(fileno=dup)
    except BaseException:
        os.close(dup)
        raise


class RtoCap:
    """Caps TCP's retransmit backoff at ``seconds`` on this process's UCX connections."""

    def __init__(self, seconds: float):
        self.ms = int(seconds * 1000)
        self.capped: set[int] = set()   # socket inodes done (an open socket's inode is never reused)
        self.seen: dict[int, tuple[bytes, int, bytes, int] | None] = {}   # inode -> ``addresses``
        self.unsupported = False

    def apply(self, own: Iterable[bytes], peers: Iterable[bytes]) -> int:
        """Cap every UCX connection not capped yet: a socket whose local address is in one of
        ``own`` (our workers' addresses) or whose remote address is in one of ``peers`` (their
        workers' addresses). Returns how many were capped now. Each socket is looked at through
        a duplicate of its fd, once (its addresses are kept), and capped at most once."""
        if self.unsupported:
            return 0
        own, peers = [a for a in own if a], [a for a in peers if a]
        fds = socket_fds()
        self.capped &= fds.keys()   # forget sockets that closed
        self.seen = {ino: a for ino, a in self.seen.items() if ino in fds}
        done = 0
        for ino, fd in fds.items():
            if ino in self.capped or (ino in self.seen and not taken_for_ucx(self.seen[ino], own, peers)):
                continue
            try:
                s = _dup(fd)
            except OSError:
                continue   # closed meanwhile, or not a socket any more
            try:
                if os.fstat(s.fileno()).st_ino != ino:
                    continue   # the fd number was reused meanwhile: not the socket we looked at
                if ino not in self.seen:
                    try:
                        self.seen[ino] = addresses(s)
                    except OSError:
                        continue   # not connected yet: next look
                    if not taken_for_ucx(self.seen[ino], own, peers):
                        continue
                if s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS) > self.ms:   # a lower host setting stays
                    s.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, self.ms)
            except OSError as e:
                if e.errno in (errno.ENOPROTOOPT, errno.EINVAL):   # a kernel without the option
                    self.unsupported = True
                    log.warning("UCX transport: this kernel cannot cap TCP's retransmit backoff per socket "
                                "(TCP_RTO_MAX_MS, Linux >= 6.15): after a partition heals, what a cut peer held "
                                "comes back after TCP's next retry (net.ipv4.tcp_rto_max_ms; kvxfer doctor)")
                    return done
                continue
            finally:
                s.close()   # the duplicate only: UCX's socket stays open
            self.capped.add(ino)
            done += 1
        return done
