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
refused when the bootstrap is on another host, a wildcard always. The control address is the
prefill endpoint's own ``bind=`` / ``advertise=``; the zmq data socket binds ``--bind`` and
advertises ``--advertise`` the same way (the transport's ``advertise=``).

This module holds the flags, their checks (``resolve``: ``UsageError`` names the flag and the
fix) and the addresses; ``kvxfer.cli.rank_serve`` what the running rank does.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping

from ..addresses import rank_addresses
from ..control.auth import OPEN_DEPLOYMENT
from .rank_serve import RankConfig

log = logging.getLogger("kvxfer.rank")

LAYOUTS = ("token_major", "hnd", "page_major", "mla", "mla_page_major")


class UsageError(Exception):
    """A bad flag or flag combination; the message names the flag and the fix."""


# ------------------------------------------------------------------------------------
# Flags -> a checked configuration
# ------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvxfer rank", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument_group("who")
    a.add_argument("--role", choices=["prefill", "decode"], required=True)
    a.add_argument("--bootstrap", required=True, metavar="URL",
                   help="the registry: http://HOST:PORT (kvxfer bootstrap) or etcd://HOST:2379[,...]")
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
    p.add_argument("--head-map", default=None, metavar="HEADS",
                   help="global KV heads of every TP rank, in pool order, e.g. '3,1;0,2' (default: contiguous blocks)")
    p.add_argument("--head-dim", type=int, default=None, help="head dimension (default 128; not for MLA)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="MLA latent width")
    p.add_argument("--rope-dim", type=int, default=64, help="MLA rope width")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pages", type=int, default=1024, help="pages in the pool (page 0 is padding)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:LOCAL_RANK)")
    net = ap.add_argument_group("network")
    net.add_argument("--transport", choices=["zmq", "ucx"], default="zmq")
    net.add_argument("--ucx-tls", default=None, help="UCX_TLS for this rank, e.g. tcp between containers")
    net.add_argument("--ucx-eager-writes", action=argparse.BooleanOptionalAction, default=None,
                     help="decode: pregrant each request to its prefill ranks, which then put at once, without "
                          "waiting for GO, and succeed at their flush (UCX eager_writes, the default; "
                          "--no-ucx-eager-writes: announce and wait for GO; README)")
    net.add_argument("--bind", default=None, help="address or interface the sockets bind (0.0.0.0: all)")
    net.add_argument("--advertise", default=None, help="address, hostname or interface peers are told")
    net.add_argument("--port", type=int, default=0, help="prefill control port (0: any; torchrun: + LOCAL_RANK)")
    net.add_argument("--data-port", type=int, default=0, help="zmq data port (0: any; torchrun: + LOCAL_RANK)")
    net.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (torchrun: + LOCAL_RANK)")
    net.add_argument("--timeouts", type=float, nargs=4, default=[30.0, 300.0, 30.0, 30.0],
                   metavar=("BOOTSTRAP", "WAITING", "TRANSFER", "LEASE"), help="request phase deadlines (s)")
    net.add_argument("--heartbeat", type=float, nargs=2, default=[1.0, 5.0], metavar=("INTERVAL", "TIMEOUT"))
    net.add_argument("--connect-timeout", type=float, default=60.0, help="decode: wait this long for the registry")
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
            h = shape["kv_heads"]
            fits = [t for t in range(1, 2 * h + 1) if h % t == 0 or t % h == 0]
            raise UsageError(f"--kv-heads {h} and --tp-size {place['tp_size']}: each rank must hold whole heads; "
                             f"use a TP size that divides {h} or is a multiple of it ({', '.join(map(str, fits))}, "
                             f"...)") from None
    head_map = None if args.head_map is None else _head_map(args, shape["kv_heads"], place["tp_size"])
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
    if args.ucx_eager_writes is not None and (args.transport != "ucx" or args.role != "decode"):
        flag = "--ucx-eager-writes" if args.ucx_eager_writes else "--no-ucx-eager-writes"
        raise UsageError(f"{flag} given to a {args.role} rank with --transport {args.transport}: it is a "
                         "decode rank's choice over UCX (its prefill ranks follow it): pass it to decode ranks "
                         "started with --transport ucx")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device {args.device}: use cpu, cuda (cuda:LOCAL_RANK) or cuda:N")
    device = f"cuda:{place['local_rank']}" if args.device == "cuda" else args.device
    bind, advertise = addresses(args.bind, args.advertise, args.bootstrap)
    try:
        from .rank_serve import timeouts_of
        timeouts_of(args.timeouts, args.heartbeat)
    except ValueError as e:
        raise UsageError(f"--timeouts / --heartbeat: {e}") from None
    bump = lambda port: port + place["local_rank"] if port else port   # noqa: E731 (torchrun: one per rank)
    return RankConfig(role=args.role, bootstrap=args.bootstrap, secret=_secret(args), instance=args.instance,
                      **place, layout=args.layout, layers=args.layers, **shape, kv_lora_rank=args.kv_lora_rank,
                      rope_dim=args.rope_dim, dtype=args.dtype, pages=args.pages, page_size=args.page_size,
                      device=device, transport=args.transport, ucx_tls=args.ucx_tls,
                      ucx_eager_writes=args.ucx_eager_writes, bind=bind, advertise=advertise,
                      port=bump(args.port), data_port=bump(args.data_port),
                      metrics_port=None if args.metrics_port is None else bump(args.metrics_port),
                      timeouts=tuple(args.timeouts), heartbeat=tuple(args.heartbeat), seed=args.seed,
                      check=args.check, selftest=args.selftest, tokens=args.tokens, room=args.room,
                      serve=args.serve, connect_timeout=args.connect_timeout, head_map=head_map)


def _head_map(args, kv_heads: int, tp_size: int) -> tuple[tuple[int, ...], ...] | None:
    """``--head-map '3,1;0,2'``: the rows of ``RankSpec.head_map``, checked by it (None: the default)."""
    from ..ranks import RankSpec
    if args.layout.startswith("mla"):
        raise UsageError("--head-map with --layout mla: MLA's latent head is whole on every TP rank; drop --head-map")
    try:
        rows = tuple(tuple(int(h) for h in row.split(",")) for row in args.head_map.split(";"))
        return RankSpec(role=args.role, num_kv_heads=kv_heads, num_layers=args.layers, tp_size=tp_size,
                        head_map=rows).head_map
    except ValueError as e:
        raise UsageError(f"--head-map {args.head_map!r}: {e} (one ';'-separated row of ','-separated global head "
                         f"ids per TP rank, the same on every rank of the group)") from None


def addresses(bind: str | None, advertise: str | None, bootstrap: str) -> tuple[str, str]:
    """(bind, advertise) addresses of a rank (``kvxfer.addresses.rank_addresses``); UsageError
    naming the flag when peers could not reach what would be advertised."""
    try:
        return rank_addresses(bind, advertise, bootstrap)
    except ValueError as e:
        raise UsageError(str(e)) from None


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
    saved = None
    if cfg.serve == "stdin":   # stdout carries replies only: what C libraries print (UCX) goes to stderr
        sys.stdout.flush()
        saved = (os.dup(1), sys.stdout)
        sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    try:
        return _run(cfg)
    finally:
        if saved is not None:
            sys.stdout.close()
            os.dup2(saved[0], 1)
            os.close(saved[0])
            sys.stdout = saved[1]


def _run(cfg: RankConfig) -> int:
    from ..errors import KVXferError
    from .rank_io import run_check, serve_stdin, serve_unix
    from .rank_serve import Rank
    if cfg.secret is None:
        log.warning("kvxfer rank: %s", OPEN_DEPLOYMENT)
    try:
        rank = Rank(cfg)
    except (KVXferError, ValueError, RuntimeError) as e:
        print(f"kvxfer rank: cannot start {cfg.role} rank: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    srv, handlers = None, {}
    try:
        if cfg.check:
            return run_check(rank)
        if threading.current_thread() is threading.main_thread():   # main(argv) may run in any thread
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
                  f"byte-exact on {rank.spec.key} ({res['nbytes'] / 1e6:.1f} MB; on the wire {res['wire_seconds']}s, "
                  f"{res['wire_MBps']} MB/s; with writing and checking the pattern {res['seconds']}s, "
                  f"{res['MBps']} MB/s)", flush=True)
            for room, v in bad.items():
                print(f"  - room {room}: {v.get('state')}: {v.get('mismatch') or v.get('reason')}", flush=True)
            return 0 if res["ok"] else 1
        if cfg.serve == "stdin":
            print(json.dumps({"ready": True, "pid": os.getpid(), **info}), flush=True)
            threading.Thread(target=serve_stdin, args=(rank, stop), name="kvxfer-rank-stdin", daemon=True).start()
        else:
            if cfg.serve:
                srv = serve_unix(rank, cfg.serve[len("unix:"):], stop)
            print(f"kvxfer rank: {cfg.role} {rank.spec.key} ready: heads {info['heads']}, control "
                  f"{info['control'] or '-'}, data {json.dumps(info['data'])}"
                  + (f", control socket {cfg.serve}" if cfg.serve else ""), flush=True)
        while not stop.wait(0.2):
            pass
        return 0
    except ValueError as e:   # --serve unix:PATH that cannot be used
        print(f"kvxfer rank: error: {e}", file=sys.stderr)
        return 2
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
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
