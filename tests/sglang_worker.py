"""A scheduler process of one side (prefill or decode) for ``test_sglang_backend.py``, run with the
SGLang venv's python: ``python sglang_worker.py '<json config>'``.

It loads SGLang's plugins the way SGLang does (``load_plugins``: kvxfer's entry point), joins a
gloo world with the other processes of its side (each instance's TP group is a gloo group of it),
starts the bootstrap server of each prefill instance whose TP rank 0 it holds, builds one
``sglang_engine.Side`` per instance rank it holds, reports ``ready``, then runs what stdin asks,
one JSON line per command; each answer is one JSON line on stdout (library output goes to stderr).

    {"op": "run", "inst": name, "reqs": [{"room", "n", "prefix"}], "fault": {...}}
        drives the instance's requests as SGLang's schedulers do (``sglang_sides``) -> "done"
    {"op": "prefix_valid"}  the unified pool's prefix-valid commit (``sglang_engine.prefix_valid_check``)
    {"op": "exit"}
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def resolve_all():
    """Every backend SGLang knows, resolved by SGLang's own get_kv_class: class names or the error."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    out = {}
    for b in TransferBackend:
        try:
            out[b.value] = [getattr(get_kv_class(b, c), "__qualname__", None) for c in KVClassType]
        except Exception as e:   # an optional dependency of SGLang's (e.g. mori) is missing
            out[b.value] = f"{type(e).__name__}: {e}"
    return out


def plugin_facts(before: dict) -> dict:
    """What SGLang's plugin loader did with kvxfer's entry point."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMHATokenToKVPool

    from kvxfer.integrations.sglang import plugin
    wrapped = {name: getattr(fn, "__wrapped__", None) is not None for name, fn in (
        ("get_kv_class", utils.get_kv_class), ("decode._init_kv_manager", decode.DecodePreallocQueue._init_kv_manager),
        ("prefill._init_kv_manager", prefill.PrefillBootstrapQueue._init_kv_manager),
        ("_send_kv_metadata", decode.DecodePreallocQueue._send_kv_metadata),
        ("prefix_valid", UnifiedMHATokenToKVPool.set_kv_buffer_prefix_valid))}
    return {"choices": list(DISAGG_TRANSFER_BACKEND_CHOICES), "before": before, "after": resolve_all(),
            "kvxfer": utils.TransferBackend("kvxfer").name, "rebound": decode.TransferBackend is utils.TransferBackend
            and prefill.TransferBackend is utils.TransferBackend and decode.get_kv_class is utils.get_kv_class,
            "wrapped": wrapped, "installed_by_loader": plugin._installed}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # whatever a library prints goes to stderr; stdout carries our JSON lines

    def emit(**kw):
        out.write(json.dumps(kw) + "\n")

    before = resolve_all()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang_engine
    import sglang_sides
    import torch.distributed as dist

    from kvxfer.control.channel import Heartbeat
    from kvxfer.endpoint.base import Timeouts
    from kvxfer.integrations.sglang.config import BackendConfig
    facts = plugin_facts(before)
    t = cfg["timeouts"]
    config = BackendConfig(transport="zmq", register_timeout=60.0,
                           timeouts=Timeouts(bootstrap=t["bootstrap"], waiting=t["waiting"], transfer=t["transfer"],
                                             lease=t["lease"], handshake=5.0, registry=1.0,
                                             heartbeat=Heartbeat(interval=0.2, timeout=t["heartbeat"])))
    role, world, me = cfg["role"], cfg["world"], cfg["proc"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=me, world_size=len(world["procs"]))
    groups, servers, sides = {}, [], {}
    for name in sorted(cfg["instances"]):
        side = cfg["instances"][name][role]
        if side["world"] != world["name"]:
            continue
        members = [world["procs"].index(p) for p in side["procs"]]
        groups[name] = dist.new_group(members, backend="gloo")   # every process of the world makes every group
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    for _name, inst in sorted(cfg["instances"].items()):
        side = inst[role]
        if role == "prefill" and side["procs"][0] == cfg["name"]:
            server = get_kv_class(TransferBackend("kvxfer"), KVClassType.BOOTSTRAP_SERVER)
            servers.append(server(host="127.0.0.1", port=inst["bport"], config=config))
    for name, inst in sorted(cfg["instances"].items()):
        side = inst[role]
        if cfg["name"] in side["procs"]:
            sides[name] = sglang_engine.Side(side["kind"], role, len(side["procs"]), side["procs"].index(cfg["name"]),
                                            side["page"], inst["bport"], config)
    emit(ev="ready", plugin=facts, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "prefix_valid":
            emit(ev="done", **sglang_engine.prefix_valid_check())
            continue
        started = time.monotonic()
        side, group = sides[cmd["inst"]], groups[cmd["inst"]]
        run = sglang_sides.run_prefill if role == "prefill" else sglang_sides.run_decode
        result = run(side, group, cmd["reqs"], cmd.get("fault", {}), emit)
        emit(ev="done", seconds=round(time.monotonic() - started, 2), **result)
    for side in sides.values():
        side.mgr.close()
    for server in servers:
        server.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything above is closed. What is left is the interpreter's final collection of SGLang's and
    # torch's objects: seconds per process (as tests/vllm_engine.py, which ends the same way)
    os._exit(0)


if __name__ == "__main__":
    main()
