"""The heterogeneous-TP matrix under torchrun, over real ZMQ and UCX transports.

Each launch, one per (P TP, D TP) pair, runs every sub-configuration of that pair (models x
layouts x transports); all launches run one after the other in one torchrun world (as many
ranks as the largest launch), so interpreters and torch start once for the whole matrix, which
fits in a minute or two on 2 cores; each sub-configuration is still its own pytest test, checked
on every rank of its launch."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.deps import missing
from support.ports import free_port

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

WORKER = Path(__file__).with_name("hetero_tp_worker.py")
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
MODELS = ["mha8", "gqa2", "mla"]
PAIRINGS = {"same": ("token_major", 4, 4), "page_to_token": ("page_major", 4, 4)}


@functools.cache
def transports() -> tuple[str, ...]:
    """The transports whose optional dependencies are here (a broken one fails, it is not left out)."""
    return tuple(name for name in ("zmq", "ucx") if missing(name) is None)


def _subs(models, pairings, transports_):
    return [{"name": f"{m}-{p}-{t}", "model": m, "p_layout": PAIRINGS[p][0], "p_page": PAIRINGS[p][1],
             "d_page": PAIRINGS[p][2], "transport": t} for m in models for p in pairings for t in transports_]


LAUNCHES = {f"tp{p}to{d}": {"p_tp": p, "d_tp": d, "subs": _subs(MODELS, PAIRINGS, ("zmq", "ucx"))}
            for p, d in TP_PAIRS}
LAUNCHES["pp2"] = {"p_tp": 2, "p_pp": 2, "d_tp": 2, "subs": _subs(["mha8", "gqa2"], ["same"], ("zmq", "ucx"))}
PAIRINGS["page16to64"] = ("token_major", 16, 64)
PAIRINGS["page64to16"] = ("page_major", 64, 16)
LAUNCHES["pages"] = {"p_tp": 2, "d_tp": 4, "subs": _subs(["mha8"], ["page16to64", "page64to16"], ("zmq", "ucx"))}


@functools.cache
def _launch_all() -> dict[tuple[str, str], list[dict]] | AssertionError:
    """Run every launch in one torchrun world (as many ranks as the largest launch; see the
    worker's docstring); per (launch, sub-configuration), every taking-part rank's result. A
    failed run is returned (cached) as the error, so it is not run again for every test."""
    launches = {name: {**cfg, "subs": [s for s in cfg["subs"] if s["transport"] in transports()]}
                for name, cfg in LAUNCHES.items()}
    n = max(cfg["p_tp"] * cfg.get("p_pp", 1) + cfg["d_tp"] for cfg in launches.values())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = {"launches": launches, "bootstrap_port": free_port(), "out_dir": out_dir}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                               f"--master_port={free_port()}", str(WORKER), "--config", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=900, env=env)
        lines = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    if proc.returncode != 0 or len(lines) != n:
        return AssertionError(f"torchrun exited {proc.returncode} with {len(lines)}/{n} rank reports:\n"
                              f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    out: dict[tuple[str, str], list[dict]] = {}
    for line in lines:
        for r in line["results"]:
            out.setdefault((r["launch"], r["name"]), []).append({**r, "rank": line["rank"]})
    return out


def launch(name: str) -> dict[str, list[dict]]:
    """One launch's results: per sub-configuration name, every rank's result."""
    got = _launch_all()
    if isinstance(got, AssertionError):
        raise got
    return {sub: ranks for (launch_name, sub), ranks in got.items() if launch_name == name}


CASES = [(launch_name, sub["name"], sub["transport"]) for launch_name, cfg in LAUNCHES.items()
         for sub in cfg["subs"]]


@pytest.mark.timeout(900)   # the first test runs the whole matrix (one torchrun world)
@pytest.mark.parametrize("launch_name,sub,transport", CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_hetero_tp(launch_name, sub, transport):
    if transport not in transports():
        pytest.skip(str(missing(transport)))
    ranks = launch(launch_name)[sub]
    cfg = LAUNCHES[launch_name]
    assert len(ranks) == cfg["p_tp"] * cfg.get("p_pp", 1) + cfg["d_tp"]
    bad = [f"rank {r['rank']} ({r['role']}): {r['why']}" for r in ranks if not r["ok"]]
    assert not bad, "\n".join(bad)
