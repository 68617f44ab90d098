"""UCX over TCP (what a user without shared memory or RDMA gets): the settings the transport
gives UCX's TCP transport, and packed rows that cross it as frames of many iov pieces."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from xfer_peer import raw_plan  # noqa: E402

from kvxfer.grant import ByteRanges  # noqa: E402
from kvxfer.transport.registry import get_transport  # noqa: E402
from kvxfer_transports.ucx.rto import TCP_RTO_MAX_MS  # noqa: E402
from kvxfer_transports.ucx.settings import TCP_DEFAULTS, ucx_settings, with_tcp_defaults  # noqa: E402


def test_tcp_sends_carry_many_iov_pieces_unless_told_otherwise():
    """UCX's TCP_MAX_IOV of 6 cut packed frames into a system call per ~5 rows (TP 2 -> 4 across
    namespaces: 0.3x of raw TCP; 128: 0.55-0.6x). The environment and the caller still win, and
    the shared-memory settings are untouched."""
    assert TCP_DEFAULTS == {"TCP_MAX_IOV": "128"}
    for tls in (None, "tcp"):
        given = ucx_settings(tls, None, {})
        assert with_tcp_defaults(given, {}) == {**given, "TCP_MAX_IOV": "128"}
    assert "TCP_MAX_IOV" not in with_tcp_defaults(ucx_settings(None, None, {}), {"UCX_TCP_MAX_IOV": "6"})
    assert with_tcp_defaults(ucx_settings(None, {"TCP_MAX_IOV": "16"}, {}), {})["TCP_MAX_IOV"] == "16"


def test_the_tcp_defaults_reach_ucx(monkeypatch):
    """The transport hands ``TCP_DEFAULTS`` to UCX itself: a value UCX refuses (1024 pieces:
    "AM Zcopy context (16416) must be <= TX segment size") fails start-up, as a ``ConfigError``
    naming the settings (UCX's own error mapped into the tree); ours starts."""
    from ucxx._lib.libucxx import UCXError

    from kvxfer.errors import ConfigError
    from kvxfer_transports.ucx import settings
    monkeypatch.delenv("UCX_TCP_MAX_IOV", raising=False)
    monkeypatch.setattr(settings, "TCP_DEFAULTS", {"TCP_MAX_IOV": "1024"})
    with pytest.raises(ConfigError, match="UCX refused the settings .*'TCP_MAX_IOV': '1024'") as e:
        get_transport("ucx", tls="tcp").close()
    assert isinstance(e.value.__cause__, UCXError)
    monkeypatch.undo()
    get_transport("ucx", tls="tcp").close()


@pytest.mark.parametrize("far", [False, True], ids=["tls-tcp", "far-worker"])
def test_packed_rows_cross_tcp_byte_exact(far):
    """2048 rows of 512 B, scattered on both sides (no two touch), 1 MiB in frames of 64 KiB:
    128 iov pieces a frame on each side, more than one TCP send carries. UCX accepts the
    setting (a value it refuses fails the context) and every byte lands where the plan says,
    nothing between the rows is touched. ``far``: through the second worker a peer in another
    network namespace gets (its own context, the same settings)."""
    opts = {"frame_bytes": 64 << 10} | ({} if far else {"tls": "tcp"})
    rx, tx = get_transport("ucx", **opts), get_transport("ucx", **opts)
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    dst = torch.full((2 << 20,), 0xA5, dtype=torch.uint8)
    rows = 2048
    so = np.random.default_rng(3).permutation(rows).astype(np.int64) * 2048   # scattered source rows
    do = np.arange(rows, dtype=np.int64) * 768                                   # 256 B gaps at the receiver
    n, z = np.full(rows, 512, np.int64), np.zeros(rows, np.int64)
    try:
        rx.register([dst])
        tx.register([src])
        desc = rx.descriptor()
        if far:   # as a peer in another network namespace of this kernel describes itself
            ids = desc["host"].split("/")
            desc = {**desc, "host": "/".join([ids[0], ids[1], str(int(ids[2]) + 1)])}
        peer = tx.connect(desc)
        zz = np.zeros(1, np.int64)
        rx.expect("tcp.1", ByteRanges(zz, zz, np.full(1, dst.numel(), np.int64)))
        h = tx.submit(peer, "tcp.1", raw_plan(z, so, z, do, n), timeout=20)
        assert h.wait(20), h.error
        got = dst.numpy()
        want = src.numpy()
        for s, d in zip(so.tolist(), do.tolist()):
            assert np.array_equal(got[d: d + 512], want[s: s + 512])
            assert (got[d + 512: d + 768] == 0xA5).all()
        assert (got[rows * 768:] == 0xA5).all()
    finally:
        tx.close()
        rx.close()


def _tcp_rto_caps() -> dict[tuple, int]:
    """Every connected TCP socket of this process: (local, remote) address -> its TCP_RTO_MAX_MS."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(fd))
        except OSError:
            continue   # closed meanwhile
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue   # not a socket
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                out[(s.getsockname()[:2], s.getpeername()[:2])] = s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS)
        except OSError:
            pass   # a listener (no peer name)
        finally:
            s.close()
    return out


needs_rto = pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/tcp_rto_max_ms"),
                               reason="a kernel without TCP_RTO_MAX_MS (Linux < 6.15)")


@needs_rto
@pytest.mark.parametrize("far", [False, True], ids=["tls-tcp", "far-worker"])
@pytest.mark.parametrize("cap", [2.0, None], ids=["capped", "not-capped"])
def test_ucx_tcp_connections_get_the_retransmit_cap_and_no_other_socket_does(far, cap):
    """Issue 35: after a partition heals, a cut connection moves again at TCP's next retry,
    which its backoff puts up to net.ipv4.tcp_rto_max_ms (120 s) away. The transport caps that
    backoff on its own UCX connections (``tcp_rto_max``): every TCP connection UCX made between
    the two transports carries the cap within a few ticks, a connection of someone else's in
    the same process (a plain socket pair on the same loopback address) keeps the kernel's,
    and ``tcp_rto_max=None`` leaves UCX's alone too."""
    default = int(open("/proc/sys/net/ipv4/tcp_rto_max_ms").read())
    srv = socket.create_server(("127.0.0.1", 0))
    plain = []   # several pairs: one whose port happens to sit in a worker address is not judged (below)
    for _ in range(4):
        mine = socket.create_connection(srv.getsockname())
        plain += [mine, srv.accept()[0]]
    before = set(_tcp_rto_caps())
    opts = {"tcp_rto_max": cap} | ({} if far else {"tls": "tcp"})
    rx, tx = get_transport("ucx", **opts), get_transport("ucx", **opts)
    src, dst = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8), torch.zeros(1 << 18, dtype=torch.uint8)
    try:
        rx.register([dst])
        tx.register([src])
        desc = rx.descriptor()
        if far:   # each as a peer in another network namespace of this kernel describes itself
            ids = desc["host"].split("/")
            desc = {**desc, "host": "/".join([ids[0], ids[1], str(int(ids[2]) + 1)])}
            tx.workers.host_id = "/".join([ids[0], ids[1], str(int(ids[2]) + 2)])   # what its HELLO says
        peer = tx.connect(desc)
        z, n = np.zeros(1, np.int64), np.full(1, src.numel(), np.int64)
        rx.expect("rto.1", ByteRanges(z, z, n))
        h = tx.submit(peer, "rto.1", raw_plan(z, z, z, z, n), timeout=20)
        assert h.wait(20), h.error
        assert torch.equal(dst[: src.numel()], src)
        want = default if cap is None else min(default, int(cap * 1000))   # a lower host setting stays
        deadline = time.monotonic() + 10
        while True:
            ucx = {k: v for k, v in _tcp_rto_caps().items() if k not in before}
            if (ucx and all(v == want for v in ucx.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(ucx) >= 2, ucx   # both ends of at least one connection between them
        assert set(ucx.values()) == {want}, ucx
        caps = _tcp_rto_caps()
        judged = [s for s in plain if not _could_be_taken_for_ucx(s, (rx, tx))]
        assert len(judged) >= 2, "every plain socket's port sits in a worker address: cannot tell"
        for s in judged:
            assert caps[(s.getsockname(), s.getpeername())] == default, s
    finally:
        tx.close()
        rx.close()
        for s in (*plain, srv):
            s.close()


def _could_be_taken_for_ucx(s: socket.socket, transports) -> bool:
    """Would ``rto`` take this socket for a UCX connection by chance? On loopback it matches a
    socket by its port's two bytes anywhere in a worker address (``rto.taken_for_ucx``, the documented
    false positive: ~1 socket in 400 here, 15 of 6,000), so such a socket proves nothing either way."""
    from kvxfer_transports.ucx.rto import addresses, taken_for_ucx
    own = [x for t in transports for x in (t.workers.address, t.workers.far_address, t.workers.front_address) if x]
    far = [x for t in transports for p in t.peers.values() for x in (p.addr, p.front_addr) if x]
    return taken_for_ucx(addresses(s), own, far)


def test_a_socket_is_taken_for_ucx_only_when_a_worker_address_holds_its_ip_and_port():
    """``rto.packs``: UCX packs an interface's IP and port in network byte order; a loopback
    interface by its port alone. A socket's addresses (``rto.addresses``) come in that form,
    an IPv4-mapped IPv6 peer as its IPv4 bytes."""
    from kvxfer_transports.ucx.rto import _ip, addresses, packs
    ip, port = socket.inet_aton("10.213.7.2"), 40123
    blob = b"\x02" + ip + b"\xcf\x19" * 8 + port.to_bytes(2, "big") + b"\x00" * 20
    assert packs(blob, ip, port)
    assert not packs(blob, socket.inet_aton("10.213.7.3"), port)          # another host, same port
    assert not packs(blob, ip, 40124)                                      # same host, another port
    assert not packs(blob, ip, int.from_bytes(port.to_bytes(2, "little"), "big"))   # byte order matters
    assert packs(blob, socket.inet_aton("127.0.0.1"), port)                # loopback: the port alone
    assert _ip(socket.AF_INET6, "::ffff:10.213.7.2") == ip
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    a, _ = srv.accept()
    try:
        assert addresses(a) == (socket.inet_aton("127.0.0.1"), srv.getsockname()[1], socket.inet_aton("127.0.0.1"),
                                c.getsockname()[1])
        with pytest.raises(OSError):
            addresses(srv)   # a listener has no peer: not a connection
    finally:
        for s in (a, c, srv):
            s.close()
