"""How ``kvxfer rank`` is driven: ``--serve`` (one JSON command per line, on stdin or a unix socket,
answered by one line: ``serve_stdin``, ``serve_unix``) and ``--check`` (``run_check``).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading

from ..errors import ConfigError
from .rank_serve import MAX_COMMAND, Rank, RankConfig


def _reply(rank: Rank, line: str, stop: threading.Event) -> dict | None:
    try:
        cmd = json.loads(line)
        if not isinstance(cmd, dict):
            raise ConfigError("a command is a JSON object, e.g. {\"op\": \"info\"}")
        if cmd.get("op") == "exit":
            stop.set()
            return {"ok": True}
        return rank.command(cmd)
    except Exception as e:   # a bad command never stops the rank
        return {"error": f"{type(e).__name__}: {e}"}


def serve_stdin(rank: Rank, stop: threading.Event) -> None:
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


def serve_unix(rank: Rank, path: str, stop: threading.Event) -> socket.socket:
    if os.path.exists(path):
        import stat
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ConfigError(f"--serve unix:{path}: exists and is not a socket; pick another path")
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


__all__ = ["serve_stdin", "serve_unix", "run_check", "check_prefill"]
