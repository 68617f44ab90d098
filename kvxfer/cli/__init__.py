"""The ``kvxfer`` command: a thin dispatcher; each subcommand lives in its own module."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("kvxfer.cli.demo", "a real prefill -> decode run on loopback, verified token for token"),
    "bench": ("kvxfer.cli.bench", "planner, transport, heterogeneous-TP and offload benchmarks"),
    "compat": ("kvxfer.cli.compat", "the layout x capability table, computed from the code"),
    "doctor": ("kvxfer.cli.doctor", "torch, CUDA, devices, UCX transports and memory types, RDMA on this machine"),
    "bootstrap": ("kvxfer.control.bootstrap", "run a bootstrap (rank registry) server"),
    "rank": ("kvxfer.cli.rank", "start one prefill or decode rank, pool from flags (--check, --selftest, --serve)"),
    "proxy": ("kvxfer.cli.proxy", "the HTTP router in front of vLLM prefill and decode servers (KvxferConnector)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: kvxfer {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:10s} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
