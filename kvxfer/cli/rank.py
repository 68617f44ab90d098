"""``kvxfer rank``: one prefill or decode rank started from the command line, its pool described
by flags, for operators ("can these two talk?") and for the multi-host tests.

A rank started this way has no model, so it serves a pattern: every KV byte of a request is a
function of (``--seed``, room, layer, K/V, global head, token position, byte), the same on
every host, layout and TP size. Prefill ranks answer every request they get with that
pattern (whatever room, tokens and TP split decode asks for); decode ranks verify it byte for
byte once a request succeeds. So a pair of ``kvxfer rank`` processes smoke-tests a real
deployment path (bootstrap, handshake, control and data plane, head slicing across TP, page
and layout conversion) between any two hosts.

Who calls what
--------------
Operator, per rank (under ``torchrun`` the TP/PP place comes from RANK / WORLD_SIZE)::

    kvxfer bootstrap --host 10.0.0.1 --port 8998
    kvxfer rank --role prefill --bootstrap http://10.0.0.1:8998 --tp-size 2 --layout page_major
    kvxfer rank --role decode  --bootstrap http://10.0.0.1:8998 --tp-size 4 --selftest 8    # exit 0/1
    kvxfer rank --role decode  --bootstrap http://10.0.0.1:8998 --page-size 24 --check      # exit 0/1

Without ``--check`` / ``--selftest`` a rank runs until SIGTERM or SIGINT, then closes (a prefill
rank deregisters). ``--serve`` adds a control: one JSON command per line on stdin (default)
or on a unix socket (``--serve unix:/run/kvxfer-d0.sock``), one JSON reply per line.
Commands (``room`` an int):

    info                                  -> {role, key, heads, control, data, bind, advertise}
    stats                                 -> requests by outcome, bytes, free pages
    selftest {requests=1, tokens=256, room=1, within=60}    decode: requests rooms room ..
                                             room + requests - 1, waits, verifies -> {ok, requests}
    recv {room, tokens}                   decode: allocate and request (returns at once)
    wait {rooms, within=60}               decode: until they ended -> {room: status, verified}
    exit

In stdin mode the first stdout line is ``{"ready": true, ...}`` (the ``info`` reply plus pid)
and every later stdout line is a reply; logs go to stderr. Every decode rank of a TP group
must ask for the same rooms (``--room`` / ``room``), as a real scheduler would.

Addresses: ``--advertise`` (an address, hostname or interface name) is what peers are told,
``--bind`` what the sockets bind (default: the advertised address). Without either, the rank
advertises the address this host uses to reach the bootstrap server. A loopback address is
refused when the bootstrap is on another host, a wildcard always. The endpoints do not yet
take an advertise address of their own (issue 17): this module rewrites the host of the
control and zmq addresses in the rank record it publishes (``_Advertised``); delete that once
the endpoints split bind from advertise.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("kvxfer.rank")

LAYOUTS = ("token_major", "hnd", "page_major", "mla", "mla_page_major")
MAX_COMMAND = 1 << 16       # bytes of one control line
MAX_LIVE = 4096             # prefill: requests being answered at once


class UsageError(Exception):
    """A bad flag or flag combination; the message names the flag and the fix."""


# ------------------------------------------------------------------------------------
# Flags -> a checked configuration
# ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class RankConfig:
    role: str
    bootstrap: str
    secret: bytes | None
    instance: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    local_rank: int
    layout: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    pages: int
    page_size: int
    device: str
    transport: str
    ucx_tls: str | None
    bind: str
    advertise: str
    port: int
    data_port: int
    metrics_port: int | None
    timeouts: tuple[float, float, float, float]
    heartbeat: tuple[float, float]
    seed: int
    check: bool
    selftest: int
    tokens: int
    room: int
    serve: str | None
    connect_timeout: float

    @property
    def mla(self) -> bool:
        return self.layout.startswith("mla")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvxfer rank", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument_group("who")
    a.add_argument("--role", choices=["prefill", "decode"], required=True)
    a.add_argument("--bootstrap", required=True, metavar="URL", help="the registry, e.g. http://10.0.0.1:8998")
    a.add_argument("--secret", help="shared HMAC secret (visible in ps: prefer --secret-file)")
    a.add_argument("--secret-file", metavar="FILE", help="file holding the shared HMAC secret")
    a.add_argument("--instance", default="default", help="serving instance name (default: default)")
    for n in ("tp", "pp", "dp"):
        a.add_argument(f"--{n}-size", type=int, default=None, help=f"{n.upper()} size (tp, pp: from torchrun's "
                       "WORLD_SIZE when not given; default 1)")
        a.add_argument(f"--{n}-rank", type=int, default=None, help=f"{n.upper()} rank (from torchrun's RANK)")
    p = ap.add_argument_group("pool (the same model shape on both sides)")
    p.add_argument("--layout", choices=LAYOUTS, default="token_major")
    p.add_argument("--layers", type=int, default=2, help="global layers (a PP stage holds its share)")
    p.add_argument("--kv-heads", type=int, default=None, help="global KV heads (default 8; MLA: 1)")
    p.add_argument("--head-dim", type=int, default=None, help="head dimension (default 128; not for MLA)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="MLA latent width")
    p.add_argument("--rope-dim", type=int, default=64, help="MLA rope width")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pages", type=int, default=1024, help="pages in the pool (page 0 is padding)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:LOCAL_RANK)")
    n = ap.add_argument_group("network")
    n.add_argument("--transport", choices=["zmq", "ucx"], default="zmq")
    n.add_argument("--ucx-tls", default=None, help="UCX_TLS for this rank, e.g. tcp between containers")
    n.add_argument("--bind", default=None, help="address or interface the sockets bind (0.0.0.0: all)")
    n.add_argument("--advertise", default=None, help="address, hostname or interface peers are told")
    n.add_argument("--port", type=int, default=0, help="prefill control port (0: any; torchrun: + LOCAL_RANK)")
    n.add_argument("--data-port", type=int, default=0, help="zmq data port (0: any; torchrun: + LOCAL_RANK)")
    n.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (torchrun: + LOCAL_RANK)")
    n.add_argument("--timeouts", type=float, nargs=4, default=[30.0, 300.0, 30.0, 30.0],
                   metavar=("BOOTSTRAP", "WAITING", "TRANSFER", "LEASE"), help="request phase deadlines (s)")
    n.add_argument("--heartbeat", type=float, nargs=2, default=[1.0, 5.0], metavar=("INTERVAL", "TIMEOUT"))
    n.add_argument("--connect-timeout", type=float, default=60.0, help="decode: wait this long for the registry")
    m = ap.add_argument_group("what it does")
    m.add_argument("--seed", type=int, default=0, help="pattern seed: the same on every rank")
    m.add_argument("--check", action="store_true", help="handshake, say whether the pair can talk, exit 0/1")
    m.add_argument("--selftest", type=int, default=0, metavar="N", help="decode: N pattern requests, exit 0/1")
    m.add_argument("--tokens", type=int, default=256, help="tokens per self-test request")
    m.add_argument("--room", type=int, default=1, help="first self-test room (the same on every decode rank)")
    m.add_argument("--serve", nargs="?", const="stdin", default=None, metavar="stdin|unix:PATH",
                   help="line-based JSON control on stdin or a unix socket")
    m.add_argument("--log-level", default="INFO")
    return ap


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"environment {name}={v!r} is not an integer (set by torchrun?)") from None


def _place(args, env: Mapping[str, str]) -> dict:
    """TP/PP/DP size and rank from the flags, else from torchrun's RANK / WORLD_SIZE."""
    rank, world, local = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"), _env_int(env, "LOCAL_RANK")
    pp_size = args.pp_size or 1
    tp_size = args.tp_size
    if tp_size is None:
        if world is not None:
            if world % pp_size:
                raise UsageError(f"torchrun started WORLD_SIZE={world} processes, not a multiple of --pp-size "
                                 f"{pp_size}: launch tp x pp processes or pass --tp-size")
            tp_size = world // pp_size
        else:
            tp_size = 1
    elif world is not None and world != tp_size * pp_size and args.tp_rank is None:
        raise UsageError(f"--tp-size {tp_size} x --pp-size {pp_size} = {tp_size * pp_size} ranks but torchrun "
                         f"started WORLD_SIZE={world}: drop --tp-size (taken from torchrun) or pass --tp-rank "
                         f"and --pp-rank for each process")
    tp_rank, pp_rank = args.tp_rank, args.pp_rank
    if tp_rank is None:
        tp_rank = rank % tp_size if rank is not None else 0
    if pp_rank is None:
        pp_rank = rank // tp_size if rank is not None and pp_size > 1 else 0
    out = {"tp_size": tp_size, "tp_rank": tp_rank, "pp_size": pp_size, "pp_rank": pp_rank,
           "dp_size": args.dp_size or 1, "dp_rank": args.dp_rank or 0, "local_rank": local or 0}
    for n in ("tp", "pp", "dp"):
        size, r = out[f"{n}_size"], out[f"{n}_rank"]
        if size < 1:
            raise UsageError(f"--{n}-size {size} must be >= 1")
        if not 0 <= r < size:
            src = f"--{n}-rank {r}" if getattr(args, f"{n}_rank") is not None else f"RANK={rank} from torchrun"
            raise UsageError(f"{src} is outside 0..{size - 1} (--{n}-size {size}): pass a rank below the size, "
                             f"or a size that includes it")
    return out


def _secret(args) -> bytes | None:
    from ..control.auth import as_secret
    if args.secret is not None and args.secret_file is not None:
        raise UsageError("--secret and --secret-file both given: pass one (--secret-file keeps it out of ps)")
    if args.secret_file is not None:
        try:
            with open(args.secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise UsageError(f"--secret-file {args.secret_file}: {e.strerror}") from None
        if not raw:
            raise UsageError(f"--secret-file {args.secret_file} is empty: put the shared secret in it")
        return as_secret(raw)
    return as_secret(args.secret) if args.secret is not None else None


def _pool_shape(args) -> dict:
    from ..pools import TORCH_DTYPES
    if args.dtype not in TORCH_DTYPES:
        raise UsageError(f"--dtype {args.dtype} is not one of {', '.join(TORCH_DTYPES)}")
    if args.layout.startswith("mla"):
        if args.head_dim is not None:
            raise UsageError("--head-dim does not apply to --layout mla: the row is --kv-lora-rank + --rope-dim")
        if args.kv_heads not in (None, 1):
            raise UsageError(f"--kv-heads {args.kv_heads} with --layout mla: MLA has one latent head, replicated "
                             f"on every TP rank; drop --kv-heads")
        kv_heads, head_dim = 1, args.kv_lora_rank + args.rope_dim
    else:
        kv_heads = 8 if args.kv_heads is None else args.kv_heads
        head_dim = 128 if args.head_dim is None else args.head_dim
    for flag, v, lo in (("--layers", args.layers, 1), ("--kv-heads", kv_heads, 1), ("--head-dim", head_dim, 1),
                        ("--pages", args.pages, 2), ("--page-size", args.page_size, 1),
                        ("--kv-lora-rank", args.kv_lora_rank, 1), ("--rope-dim", args.rope_dim, 0)):
        if v < lo:
            raise UsageError(f"{flag} {v} must be >= {lo}" + (" (page 0 is padding)" if flag == "--pages" else ""))
    return {"kv_heads": kv_heads, "head_dim": head_dim}


def resolve(args, env: Mapping[str, str] | None = None) -> RankConfig:
    """Check every flag and combination; UsageError names the flag and the fix."""
    env = os.environ if env is None else env
    place, shape = _place(args, env), _pool_shape(args)
    if args.role == "decode" and place["pp_size"] != 1:
        raise UsageError(f"--pp-size {place['pp_size']} on a decode rank: decode ranks hold every layer; "
                         f"use --pp-size 1 (only prefill is pipelined)")
    if not args.layout.startswith("mla"):
        from ..topology import heads_held
        try:
            heads_held(shape["kv_heads"], place["tp_size"], 0)
        except Exception:
            raise UsageError(f"--kv-heads {shape['kv_heads']} and --tp-size {place['tp_size']}: each rank must "
                             f"hold whole heads; use a TP size that divides the heads or is a multiple of them"
                             ) from None
    if args.pp_size and args.pp_size > args.layers:
        raise UsageError(f"--pp-size {args.pp_size} is more than --layers {args.layers}: every stage needs a layer")
    if args.check and (args.selftest or args.serve):
        raise UsageError("--check handshakes and exits: drop --selftest / --serve, or drop --check")
    if args.selftest and args.role != "decode":
        raise UsageError("--selftest runs on decode ranks (they ask for the KV); prefill ranks answer every "
                         "request with the pattern anyway: drop --selftest here")
    if args.selftest < 0 or args.tokens < 1 or args.room < 0:
        raise UsageError("--selftest, --tokens and --room must be >= 0, >= 1 and >= 0")
    if args.selftest and -(-args.tokens // args.page_size) * args.selftest > args.pages - 1:
        raise UsageError(f"--selftest {args.selftest} x --tokens {args.tokens} needs "
                         f"{-(-args.tokens // args.page_size) * args.selftest} pages but --pages {args.pages} holds "
                         f"{args.pages - 1}: raise --pages or lower --tokens")
    if args.serve is not None and args.serve != "stdin" and not args.serve.startswith("unix:"):
        raise UsageError(f"--serve {args.serve}: use --serve (stdin) or --serve unix:/path/to.sock")
    if args.transport != "ucx" and args.ucx_tls:
        raise UsageError("--ucx-tls given with --transport zmq: drop it or pass --transport ucx")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device {args.device}: use cpu, cuda (cuda:LOCAL_RANK) or cuda:N")
    device = f"cuda:{place['local_rank']}" if args.device == "cuda" else args.device
    bind, advertise = addresses(args.bind, args.advertise, args.bootstrap)
    try:
        _timeouts(args.timeouts, args.heartbeat)
    except ValueError as e:
        raise UsageError(f"--timeouts / --heartbeat: {e}") from None
    bump = lambda port: port + place["local_rank"] if port else port   # noqa: E731 (torchrun: one per rank)
    return RankConfig(role=args.role, bootstrap=args.bootstrap, secret=_secret(args), instance=args.instance,
                      **place, layout=args.layout, layers=args.layers, **shape, kv_lora_rank=args.kv_lora_rank,
                      rope_dim=args.rope_dim, dtype=args.dtype, pages=args.pages, page_size=args.page_size,
                      device=device, transport=args.transport, ucx_tls=args.ucx_tls, bind=bind, advertise=advertise,
                      port=bump(args.port), data_port=bump(args.data_port),
                      metrics_port=None if args.metrics_port is None else bump(args.metrics_port),
                      timeouts=tuple(args.timeouts), heartbeat=tuple(args.heartbeat), seed=args.seed,
                      check=args.check, selftest=args.selftest, tokens=args.tokens, room=args.room,
                      serve=args.serve, connect_timeout=args.connect_timeout)


def _timeouts(phases: Sequence[float], heartbeat: Sequence[float]):
    from ..control.channel import Heartbeat
    from ..endpoint.base import Timeouts
    bootstrap, waiting, transfer, lease = phases
    return Timeouts(bootstrap=bootstrap, waiting=waiting, transfer=transfer, lease=lease,
                    heartbeat=Heartbeat(interval=heartbeat[0], timeout=heartbeat[1]))


# ------------------------------------------------------------------------------------
# Addresses: bind vs advertise
# ------------------------------------------------------------------------------------
def _interface_addr(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (Linux), or None when it has none / is not one."""
    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:   # SIOCGIFADDR
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _to_ip(value: str, flag: str) -> str:
    """An address, an interface name or a hostname -> an IPv4 address (wildcards kept)."""
    if value in ("*", "0.0.0.0"):
        return "0.0.0.0"
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    ip = _interface_addr(value)
    if ip is not None:
        return ip
    try:
        return socket.gethostbyname(value)
    except OSError:
        raise UsageError(f"{flag} {value}: not an address, an interface with an IPv4 address, or a hostname "
                         f"that resolves") from None


def _route_to(host: str, port: int) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port or 9))
            return s.getsockname()[0]
        except OSError as e:
            raise UsageError(f"no route to the bootstrap host {host} ({e.strerror}): pass --advertise with this "
                             f"host's address or interface") from None


def addresses(bind: str | None, advertise: str | None, bootstrap: str) -> tuple[str, str]:
    """(bind, advertise) addresses; UsageError when peers could not reach what would be advertised."""
    url = urllib.parse.urlsplit(bootstrap)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise UsageError(f"--bootstrap {bootstrap}: use http://HOST:PORT (what `kvxfer bootstrap` prints)")
    try:
        boot_ip = socket.gethostbyname(url.hostname)
    except OSError:
        raise UsageError(f"--bootstrap {bootstrap}: host {url.hostname} does not resolve") from None
    boot_local = ipaddress.ip_address(boot_ip).is_loopback
    b = _to_ip(bind, "--bind") if bind else None
    if advertise:
        adv = _to_ip(advertise, "--advertise")
    elif b and b != "0.0.0.0":
        adv = b
    else:
        adv = _route_to(boot_ip, url.port or 80)
    a = ipaddress.ip_address(adv)
    if a.is_unspecified:
        raise UsageError(f"--advertise {advertise}: a wildcard address reaches nobody; advertise this host's "
                         f"address or interface (bind the wildcard with --bind 0.0.0.0)")
    if a.is_loopback and not boot_local:
        which = f"--advertise {advertise}" if advertise else (f"--bind {bind}" if bind else "the default")
        raise UsageError(f"{which} gives loopback {adv}, but the bootstrap {bootstrap} is on another host: its "
                         f"peers could never reach this rank; pass --advertise with this host's address or "
                         f"interface name (e.g. eth0)")
    return (b or adv), adv


# ------------------------------------------------------------------------------------
# The pattern: KV bytes as a function of logical coordinates
# ------------------------------------------------------------------------------------
def pattern(seed: int, room: int, layer: int, kind: str, heads: Sequence[int], positions: np.ndarray,
            head_bytes: int) -> np.ndarray:
    """``[tokens, heads, head_bytes]`` uint8: the same bytes on every host, layout and TP split."""
    key = (seed * 0x9E3779B97F4A7C15 + room * 0xBF58476D1CE4E5B9 + layer * 0x94D049BB133111EB
           + sum(map(ord, kind)) * 0x2545F4914F6CDD1D) & (2**64 - 1)
    with np.errstate(over="ignore"):
        x = (np.uint64(key) + np.asarray(positions, np.uint64)[:, None, None] * np.uint64(0xD6E8FEB86659FD93)
             + np.asarray(heads, np.uint64)[None, :, None] * np.uint64(0xA0761D6478BD642F)
             + np.arange(head_bytes, dtype=np.uint64)[None, None, :] * np.uint64(0xE7037ED1A0B428DB))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x7FB5D329728EA185)
        x ^= x >> np.uint64(27)
    return (x >> np.uint64(32)).astype(np.uint8)


def _parts(pool) -> list:
    return [p for p in pool.layout.parts if p.kind in pool.kv_kinds]


def fill(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> None:
    """Write the pattern of ``room`` into ``slots`` (token positions 0..len - 1)."""
    import torch

    from ..pools import torch_dtype
    pos = np.arange(len(slots))
    for p in _parts(pool):
        raw = torch.from_numpy(pattern(seed, room, p.layer, p.kind, heads, pos, p.head_bytes))
        pool.set_parts(p.layer, slots, [(p.kind, raw.view(torch_dtype(p.dtype)))])


def verify(pool, seed: int, room: int, heads: Sequence[int], slots: np.ndarray) -> tuple[int, str]:
    """(bytes that differ from the pattern, the first one in words)."""
    import torch
    bad, first = 0, ""
    pos = np.arange(len(slots))
    for p in _parts(pool):
        got = pool.get_part(p.layer, p.kind, slots).contiguous().view(torch.uint8).cpu().numpy()
        diff = got.reshape(len(slots), len(heads), p.head_bytes) != pattern(seed, room, p.layer, p.kind, heads, pos,
                                                                             p.head_bytes)
        n = int(diff.sum())
        if n and not first:
            t, h, b = (int(i[0]) for i in np.nonzero(diff))
            first = f"layer {p.layer} {p.kind} head {heads[h]} token {t} byte {b}"
        bad += n
    return bad, first


# ------------------------------------------------------------------------------------
# Endpoints as this launcher runs them
# ------------------------------------------------------------------------------------
def _readvertise(addr: str, host: str) -> str:
    if not addr.startswith("tcp://"):
        return addr
    return f"tcp://{host}:{addr.rsplit(':', 1)[1]}"


class _Advertised:
    """Publishes ``_advertise`` as the host of the control and zmq data addresses (stopgap until
    the endpoints take an advertise address themselves)."""
    _advertise = ""

    @property
    def info(self):
        from ..ranks import RankInfo
        info = super().info   # type: ignore[misc]
        if not self._advertise:
            return info
        data = {name: ({**d, "endpoint": _readvertise(d["endpoint"], self._advertise)}
                       if isinstance(d.get("endpoint"), str) else d) for name, d in info.data.items()}
        return RankInfo(spec=info.spec, control=_readvertise(info.control, self._advertise) if info.control else "",
                        data=data, layout=info.layout, aux_bytes=info.aux_bytes, protocol=info.protocol)


def _endpoint_classes():
    from ..endpoint.decode import DecodeEndpoint
    from ..endpoint.prefill import PrefillEndpoint

    class PatternPrefill(_Advertised, PrefillEndpoint):
        """A prefill rank with no scheduler: every request decode sends is answered (``on_request``)."""

        def __init__(self, *a, advertise: str, on_request: Callable[[int, int | None], None], **kw):
            self._advertise, self._on_request = advertise, on_request
            super().__init__(*a, **kw)

        def on_message(self, peer: str, msg: dict) -> None:
            super().on_message(peer, msg)   # a request with no sender yet is kept until the sender comes
            if msg.get("t") == "req":
                self._on_request(int(msg["room"]), None if msg.get("dummy") else len(msg.get("kv", b"")) // 8)

    class AdvertisedDecode(_Advertised, DecodeEndpoint):
        def __init__(self, *a, advertise: str, **kw):
            self._advertise = advertise
            super().__init__(*a, **kw)

    return PatternPrefill, AdvertisedDecode


class Rank:
    """One running rank: pool, allocator, endpoint, and the commands of ``--serve``."""

    def __init__(self, cfg: RankConfig):
        from ..pools import MHAPool, MLAPool, PageAllocator
        from ..ranks import RankSpec
        from ..topology import heads_held, stage_layers
        self.cfg = cfg
        self.spec = RankSpec(role=cfg.role, num_kv_heads=cfg.kv_heads, num_layers=cfg.layers, instance=cfg.instance,
                             tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
                             dp_rank=cfg.dp_rank, dp_size=cfg.dp_size, replicated=cfg.mla)
        layers = list(stage_layers(cfg.layers, cfg.pp_size, cfg.pp_rank))
        self.heads = [0] if cfg.mla else list(heads_held(cfg.kv_heads, cfg.tp_size, cfg.tp_rank))
        if cfg.mla:
            self.pool = MLAPool(layers=layers, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.rope_dim, dtype=cfg.dtype,
                                num_pages=cfg.pages, page_size=cfg.page_size, device=cfg.device,
                                layout="page_major" if cfg.layout == "mla_page_major" else "token_major")
        else:
            self.pool = MHAPool(layers=layers, heads=len(self.heads), head_dim=cfg.head_dim, dtype=cfg.dtype,
                                num_pages=cfg.pages, page_size=cfg.page_size, layout=cfg.layout, device=cfg.device)
        self.alloc = PageAllocator(cfg.pages, cfg.page_size)
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.bytes = 0
        self.done: dict[int, dict] = {}             # decode: room -> its end, verified (last 4096)
        self.events: dict[int, threading.Event] = {}
        self.reqs: dict[int, object] = {}           # decode: room -> live receiver
        self.live: dict[int, object] = {}           # prefill: room -> sender being answered
        timeouts = _timeouts(cfg.timeouts, cfg.heartbeat)
        hb = timeouts.heartbeat
        if cfg.transport == "zmq":
            opts = {"endpoint": f"tcp://{cfg.bind}:{cfg.data_port}", "heartbeat_ivl": hb.interval,
                    "heartbeat_timeout": hb.timeout}
        else:
            opts = {"tls": cfg.ucx_tls, "heartbeat": hb.interval, "peer_timeout": hb.timeout}
        prefill_cls, decode_cls = _endpoint_classes()
        common = dict(transport=cfg.transport, transport_options=opts, timeouts=timeouts, secret=cfg.secret,
                      advertise=cfg.advertise)
        if cfg.role == "prefill":
            self._todo: queue.Queue = queue.Queue(MAX_LIVE)
            self.ep = prefill_cls(self.spec, self.pool, host=cfg.bind, port=cfg.port, on_request=self._queue,
                                  **common)
            threading.Thread(target=self._answer_loop, name="kvxfer-rank-answer", daemon=True).start()
        else:
            self.ep = decode_cls(self.spec, self.pool, **common)

    # -- start-up ------------------------------------------------------------------------
    def start(self) -> None:
        """Prefill: register (heartbeats follow). Decode: handshake with every prefill rank it needs."""
        if self.cfg.metrics_port is not None:
            from ..metrics import start_exporter
            start_exporter(self.cfg.metrics_port, self.cfg.bind)
        if self.cfg.role == "prefill":
            self.ep.register(self.cfg.bootstrap, ttl=10.0)
        else:
            self.ep.connect(bootstrap=self.cfg.bootstrap, instance=self.cfg.instance,
                            timeout=self.cfg.connect_timeout)

    def info(self) -> dict:
        i = self.ep.info
        return {"role": self.cfg.role, "key": self.spec.key, "heads": self.heads, "control": i.control,
                "data": {k: {f: v for f, v in d.items() if f in ("endpoint", "transport")} for k, d in i.data.items()},
                "bind": self.cfg.bind, "advertise": self.cfg.advertise, "layout": self.cfg.layout,
                "page_size": self.cfg.page_size}

    def _count(self, outcome: str, nbytes: int = 0) -> None:
        with self.lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            self.bytes += nbytes

    # -- prefill: answer every request with the pattern ------------------------------------
    def _queue(self, room: int, tokens: int | None) -> None:   # channel thread: must not block
        try:
            self._todo.put_nowait((room, tokens))
        except queue.Full:
            log.warning("room %s: %d requests are being answered already; this one will time out", room, MAX_LIVE)

    def _answer_loop(self) -> None:
        from ..endpoint.base import KVPoll
        from ..errors import KVXferError
        while True:
            room, tokens = self._todo.get()
            if room is None:
                return
            with self.lock:
                old = self.live.get(room)
                if old is not None and old.poll() not in (KVPoll.Success, KVPoll.Failed):
                    continue   # another decode rank's part of a request already answered
                slots = self.alloc.alloc(tokens) if tokens else np.zeros(0, np.int64)
            try:
                s = self.ep.sender(room, on_release=self._prefill_released(slots))
            except KVXferError as e:
                log.warning("room %s: cannot answer: %s", room, e)
                if slots is not None and len(slots):
                    with self.lock:
                        self.alloc.free(slots)
                continue
            with self.lock:
                self.live[room] = s
            if slots is None:
                s.abort(f"prefill pool full: {self.alloc.free_pages} pages free, {tokens} tokens asked")
                continue
            if len(slots):
                fill(self.pool, self.cfg.seed, room, self.heads, slots)
            s.send(slots, last=True)

    def _prefill_released(self, slots):
        def released(s) -> None:
            self._count(s.outcome or "ended")
            with self.lock:
                if self.live.get(s.room) is s:
                    del self.live[s.room]
                if slots is not None and len(slots):
                    self.alloc.free(slots)
        return released

    # -- decode: request, then verify ------------------------------------------------------
    def recv(self, room: int, tokens: int) -> None:
        from ..errors import RequestError
        with self.lock:
            if room in self.reqs:
                raise RequestError(f"room {room} is still running here")
            slots = self.alloc.alloc(tokens)
            if slots is None:
                raise RequestError(f"decode pool full: {self.alloc.free_pages} pages free, {tokens} tokens asked")
            self.events[room] = threading.Event()
            self.done.pop(room, None)
        r = self.ep.receiver(room, on_release=self._decode_released(room, slots))
        with self.lock:
            self.reqs[room] = r
        try:
            r.init(slots)
        except Exception:
            r.abort("init failed")
            raise

    def _decode_released(self, room: int, slots: np.ndarray):
        def released(r) -> None:
            from ..endpoint.base import KVPoll
            res = {"state": r.poll().name, "outcome": r.outcome, "reason": r.reason,
                   "seconds": round(r.ended_at - r.created, 4), "tokens": len(slots)}
            if r.poll() == KVPoll.Success:
                bad, first = verify(self.pool, self.cfg.seed, room, self.heads, slots)
                res["verified"] = bad == 0
                res["nbytes"] = sum(len(slots) * p.heads * p.head_bytes for p in _parts(self.pool))
                if bad:
                    res["mismatch"] = (f"{bad} byte(s) differ from the pattern, first at {first} (the same --seed "
                                       f"on both sides?)")
            self._count(r.outcome if r.outcome != "success" or res.get("verified") else "corrupt",
                        res.get("nbytes", 0))
            with self.lock:
                self.alloc.free(slots)
                self.reqs.pop(room, None)
                self.done[room] = res
                while len(self.done) > MAX_LIVE:
                    self.done.pop(next(iter(self.done)))
                ev = self.events.pop(room, None)
            if ev is not None:
                ev.set()
        return released

    def wait(self, rooms: Sequence[int], within: float) -> dict:
        end = time.monotonic() + within
        for room in rooms:
            with self.lock:
                ev = self.events.get(room)
            if ev is not None:
                ev.wait(max(0.0, end - time.monotonic()))
        with self.lock:
            return {str(r): self.done.get(r, {"state": "running" if r in self.reqs else "unknown"}) for r in rooms}

    def selftest(self, requests: int, tokens: int, room: int, within: float) -> dict:
        rooms = list(range(room, room + requests))
        t0 = time.monotonic()
        for r in rooms:
            self.recv(r, tokens)
        res = self.wait(rooms, within)
        seconds = time.monotonic() - t0
        ok = all(v.get("verified") for v in res.values())
        nbytes = sum(v.get("nbytes", 0) for v in res.values())
        return {"ok": ok, "requests": res, "nbytes": nbytes, "seconds": round(seconds, 3),
                "MBps": round(nbytes / seconds / 1e6, 1) if seconds > 0 else None}

    # -- commands --------------------------------------------------------------------------
    def command(self, cmd: Mapping) -> dict:
        op = cmd.get("op")
        decode_only = ("selftest", "recv", "wait")
        if op in decode_only and self.cfg.role != "decode":
            raise ValueError(f"{op!r} is a decode command; prefill ranks answer requests by themselves")
        if op == "info":
            return self.info()
        if op == "stats":
            with self.lock:
                return {"requests": dict(self.counts), "bytes": self.bytes, "free_pages": self.alloc.free_pages,
                        "capacity": self.alloc.capacity}
        if op == "selftest":
            return self.selftest(int(cmd.get("requests", 1)), int(cmd.get("tokens", 256)), int(cmd.get("room", 1)),
                                 float(cmd.get("within", 60)))
        if op == "recv":
            self.recv(int(cmd["room"]), int(cmd["tokens"]))
            return {"room": int(cmd["room"])}
        if op == "wait":
            return self.wait([int(r) for r in cmd["rooms"]], float(cmd.get("within", 60)))
        raise ValueError(f"unknown op {op!r}: info, stats, selftest, recv, wait, exit")

    def close(self) -> None:
        self.ep.close()
        if self.cfg.role == "prefill":
            self._todo.put((None, None))


# ------------------------------------------------------------------------------------
# The control: one JSON command per line, on stdin or a unix socket
# ------------------------------------------------------------------------------------
def _reply(rank: Rank, line: str, stop: threading.Event) -> dict | None:
    try:
        cmd = json.loads(line)
        if not isinstance(cmd, dict):
            raise ValueError("a command is a JSON object, e.g. {\"op\": \"info\"}")
        if cmd.get("op") == "exit":
            stop.set()
            return {"ok": True}
        return rank.command(cmd)
    except Exception as e:   # a bad command never stops the rank
        return {"error": f"{type(e).__name__}: {e}"}


def _serve_stdin(rank: Rank, stop: threading.Event) -> None:
    out = threading.Lock()
    for line in sys.stdin:
        if not line.strip():
            continue
        res = _reply(rank, line[:MAX_COMMAND], stop)
        with out:
            print(json.dumps(res), flush=True)
        if stop.is_set():
            return
    stop.set()   # stdin closed: whoever drove us is gone


def _serve_unix(rank: Rank, path: str, stop: threading.Event) -> socket.socket:
    if os.path.exists(path):
        import stat
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise UsageError(f"--serve unix:{path}: exists and is not a socket; pick another path")
        os.unlink(path)   # a stale socket of an earlier run
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)   # owner only
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(8)

    def client(conn: socket.socket) -> None:
        with conn, conn.makefile("rw", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    f.write(json.dumps(_reply(rank, line[:MAX_COMMAND], stop)) + "\n")
                    f.flush()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=client, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name="kvxfer-rank-control", daemon=True).start()
    return srv


# ------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------
def check_prefill(cfg: RankConfig, info) -> list[str]:
    """What stops this prefill rank from registering, in words ([] when nothing does)."""
    from ..control.client import BootstrapClient
    from ..errors import ConnectError
    try:
        _, ranks = BootstrapClient(cfg.bootstrap, cfg.secret).topology(cfg.instance)
    except ConnectError as e:
        return [str(e)]
    out = []
    s = info.spec
    for r in ranks:
        o = r.spec
        if o.key != s.key and (o.tp_size, o.pp_size, o.dp_size) != (s.tp_size, s.pp_size, s.dp_size):
            out.append(f"{o.key} is registered with tp/pp/dp sizes {o.tp_size}/{o.pp_size}/{o.dp_size} but this "
                       f"rank has {s.tp_size}/{s.pp_size}/{s.dp_size}: the registry would refuse it")
        if o.key == s.key:
            out.append(f"{s.key} is registered already (control {r.control}): starting this rank would replace it")
    return out


def run_check(rank: Rank) -> int:
    from ..errors import CompatibilityError, KVXferError
    cfg = rank.cfg
    if cfg.role == "prefill":
        why = check_prefill(cfg, rank.ep.info)
        for w in why:
            print(f"  - {w}")
        print(f"kvxfer rank --check: prefill {rank.spec.key} " + ("can register with " if not why else
              "cannot register cleanly with ") + cfg.bootstrap)
        return 1 if why else 0
    try:
        rank.start()
    except CompatibilityError as e:
        print(f"kvxfer rank --check: decode {rank.spec.key} and the prefill ranks of {cfg.instance!r} cannot talk:")
        for m in e.mismatches:
            print(f"  - {m}")
        return 1
    except KVXferError as e:
        print(f"kvxfer rank --check: decode {rank.spec.key} could not handshake: {e}")
        return 1
    print(f"kvxfer rank --check: decode {rank.spec.key} handshook with every prefill rank it needs in "
          f"{cfg.instance!r} over {cfg.transport}: compatible (run --selftest to move bytes)")
    return 0


# ------------------------------------------------------------------------------------
# kvxfer rank
# ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = resolve(args)
    except UsageError as e:
        ap.print_usage(sys.stderr)
        print(f"kvxfer rank: error: {e}", file=sys.stderr)
        return 2
    from ..errors import KVXferError
    try:
        rank = Rank(cfg)
    except (KVXferError, ValueError, RuntimeError) as e:
        print(f"kvxfer rank: cannot start {cfg.role} rank: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    srv = None
    try:
        if cfg.check:
            return run_check(rank)
        handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            rank.start()
        except KVXferError as e:
            print(f"kvxfer rank: {cfg.role} {rank.spec.key} could not start: {e}", file=sys.stderr)
            return 1
        info = rank.info()
        if cfg.selftest:
            res = rank.selftest(cfg.selftest, cfg.tokens, cfg.room, cfg.timeouts[0] + cfg.timeouts[2] + 30)
            bad = {k: v for k, v in res["requests"].items() if not v.get("verified")}
            print(json.dumps(res) if cfg.serve == "stdin" else
                  f"kvxfer rank --selftest: {len(res['requests']) - len(bad)}/{len(res['requests'])} requests "
                  f"byte-exact on {rank.spec.key} ({res['nbytes'] / 1e6:.1f} MB in {res['seconds']}s, "
                  f"{res['MBps']} MB/s)", flush=True)
            for room, v in bad.items():
                print(f"  - room {room}: {v.get('state')}: {v.get('mismatch') or v.get('reason')}", flush=True)
            return 0 if res["ok"] else 1
        if cfg.serve == "stdin":
            print(json.dumps({"ready": True, "pid": os.getpid(), **info}), flush=True)
            threading.Thread(target=_serve_stdin, args=(rank, stop), name="kvxfer-rank-stdin", daemon=True).start()
        else:
            if cfg.serve:
                srv = _serve_unix(rank, cfg.serve[len("unix:"):], stop)
            print(f"kvxfer rank: {cfg.role} {rank.spec.key} ready: heads {info['heads']}, control "
                  f"{info['control'] or '-'}, data {json.dumps(info['data'])}"
                  + (f", control socket {cfg.serve}" if cfg.serve else ""), flush=True)
        while not stop.wait(0.2):
            pass
        for sig, h in handlers.items():
            signal.signal(sig, h)
        return 0
    except UsageError as e:
        print(f"kvxfer rank: error: {e}", file=sys.stderr)
        return 2
    finally:
        if srv is not None:
            srv.close()
            try:
                os.unlink(cfg.serve[len("unix:"):])
            except OSError:
                pass
        rank.close()
        log.info("%s %s closed", cfg.role, rank.spec.key)


if __name__ == "__main__":
    sys.exit(main())
