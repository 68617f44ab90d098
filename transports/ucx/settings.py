"""Settings of a UCX transport: the put/pack thresholds, the UCX settings it changes, the
shared-memory settings both peers must agree on, and where a process runs (``host_identity``,
``reach``). Plain functions and constants, no UCX calls."""
from __future__ import annotations

import os
from collections.abc import Mapping

# Runs shorter than PUT_BELOW are packed, longer ones put; in a plan of more than FEW_RUNS runs,
# runs shorter than PUT_BELOW_MANY are packed too. Measured (bench_transport.py, bench_hetero.py,
# bench_request.py; shared memory on the 2-core box): 4 KiB pages go 1.6x faster packed than put.
# A request of a few 8-16 KiB runs is faster put (1-page request 2.0 vs 2.35 ms packed): a frame
# costs a rendezvous. Many such runs are faster packed, once the receiver's FIFO is large enough
# (UCX_DEFAULTS): TP 2 -> 2 with 16 KiB runs 2.4 -> 3.3 GB/s, HND TP 2 -> 4 / 4 -> 2 with 8 KiB
# runs 1.5 -> 2.3 / 1.9 -> 2.2; a put costs the sender a system call per run.
PUT_BELOW = 8 * 1024
PUT_BELOW_MANY = 32 * 1024
# UCX settings this transport changes unless ``ucx_config`` or the environment (UCX_<name>) sets
# them. SYSV_FIFO_SIZE: packed frames cross shared memory through the receiver's FIFO of 8 KiB
# segments; UCX's 256 (2 MiB) fills in well under a millisecond, and a sender whose FIFO is full
# waits for the receiver's thread to be scheduled and drain it. With six rank processes on two
# cores (bench_hetero.py, token-major head slices) 4096 took TP 4 -> 2 from 0.75 to 1.4 GB/s and
# 2 -> 4 from 1.2 to 1.4 (medians), same TP and one-sender transfers unchanged; it costs ~33 MB
# of resident shared memory per transport (61 MiB of sysv segments reserved).
UCX_DEFAULTS = {"SYSV_FIFO_SIZE": "4096"}
# Settings of UCX's TCP transport (what reaches a peer without shared memory or RDMA), given to
# every context of the transport (the main worker's and the FAR_TLS one) unless ``ucx_config``
# or the environment sets them. TCP_MAX_IOV: how many pieces one TCP send (sendmsg) of UCX may
# carry; UCX's 6 cuts a packed frame (an iov of head-slice rows, 512 B each at TP 2 -> 4) into a
# system call and a protocol step per ~5 rows. Between two network namespaces (scripts/bench_hosts.py,
# veth, UCX_TLS=tcp, 64 MiB, median of 3, ratio to raw TCP in the same run) TP 2 -> 4 went from
# 0.29-0.43x to 0.51-0.64x (4 runs each); one pair alone (16 MiB of 512 B rows) 0.40-0.45 -> 0.59-0.74 GB/s.
# 256 measured no better; 512 and up fail the context (UCX: "AM Zcopy context must be <= TX
# segment size", 16 bytes a piece against TCP_TX_SEG_SIZE 8K). Only the sending side reads it: no
# need to match the peer.
TCP_DEFAULTS = {"TCP_MAX_IOV": "128"}
# Shared-memory settings both peers must agree on: a sender indexes the receiver's FIFO with its
# own size, so a mismatch hangs the pair silently. Descriptors carry them; connect() compares.
MUST_MATCH = ("SYSV_FIFO_SIZE", "SYSV_SEG_SIZE", "POSIX_FIFO_SIZE", "POSIX_SEG_SIZE")


def ucx_settings(tls: str | None, ucx_config: Mapping[str, str] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings a transport hands UCX (names without ``UCX_``): ``UCX_DEFAULTS`` the
    environment does not set, then ``ucx_config``, then ``tls``."""
    return {**{k: v for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in environ},
            **(ucx_config or {}), **({"TLS": tls} if tls else {})}


def with_tcp_defaults(config: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``config`` (from ``ucx_settings``) plus the ``TCP_DEFAULTS`` neither it nor the
    environment sets."""
    return {**{k: v for k, v in TCP_DEFAULTS.items() if k not in config and f"UCX_{k}" not in environ}, **config}


def shared_memory_settings(config: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The ``MUST_MATCH`` settings in effect ("" for UCX's own default)."""
    return {k: str(config.get(k, environ.get(f"UCX_{k}", ""))) for k in MUST_MATCH}


def settings_differ(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """Each ``MUST_MATCH`` setting that differs, in words ("UCX_SYSV_FIFO_SIZE 4096 here, 256 at
    the peer"); [] when they agree."""
    return [f"UCX_{k} {mine.get(k) or 'unset'} here, {theirs.get(k) or 'unset'} at the peer"
            for k in MUST_MATCH if str(theirs.get(k, "")) != str(mine.get(k, ""))]


# Transports for a peer on another host or in another network namespace of this kernel: every
# one but shared memory and cma. Namespaces of one kernel share IPC, so UCX would pick sysv/posix
# shared memory for them, whose queues never deliver across network namespaces (docs: UCX.md,
# "Across hosts"); on another host they do not reach at all.
FAR_TLS = "^sm,cma"


def front_tls(tls: str | None) -> str:
    """``UCX_TLS`` of the front worker (``join``): no shared memory and no cma (``FAR_TLS``), within
    what the user chose (``tls``: an explicit setting, or None). A user's choice without TCP
    (``"sm,self"``) is kept as it is: then nothing else reaches the peers."""
    if not tls:
        return FAR_TLS
    names = [x.strip() for x in tls.strip().lstrip("^").split(",") if x.strip()]
    if tls.strip().startswith("^"):
        return tls if "tcp" in names else "^" + ",".join(dict.fromkeys(["sm", "cma", *names]))
    return "tcp" if "tcp" in names or "all" in names else tls


def tls_explicit(tls: str | None, ucx_config: Mapping[str, str] | None, environ: Mapping[str, str]) -> bool:
    """The user chose UCX's transports (the ``tls`` option, ``ucx_config["TLS"]`` or UCX_TLS):
    then every peer is reached with them, as told."""
    return bool(tls) or "TLS" in (ucx_config or {}) or "UCX_TLS" in environ


def reach(mine: str, theirs: str) -> str:
    """Where a peer is, from two ``host_identity()`` strings (boot id / PID ns / network ns):
    "same" (this kernel and network namespace), "netns" (this kernel, another network
    namespace), "host" (another kernel) or "unknown" (the peer did not say)."""
    m, t = mine.split("/"), theirs.split("/")
    if len(m) != 3 or len(t) != 3 or not all(m) or not all(t):
        return "unknown"
    return "host" if m[0] != t[0] else "netns" if m[2] != t[2] else "same"


def far_path(where: str, explicit: bool) -> bool:
    """Connect through the ``FAR_TLS`` worker? Only when the peer said where it is, is not in
    our network namespace, and the user did not choose the transports."""
    return not explicit and where in ("host", "netns")


def host_identity() -> str:
    """This process's kernel and namespaces (boot id, PID and network namespace): a peer with the
    same identity can tell whether our process is alive by its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of process ``pid``, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
