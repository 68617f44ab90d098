"""Offload across real processes: TP groups over gloo, and prefill -> decode host memory
over the zmq and ucx transports.

The ranks run ``tests/offload_tp_worker.py`` (which also runs under torchrun); they are
launched here as plain processes so that one can die without a launcher tearing the
others down. Torch start-up dominates, so each launch is shared by several tests: one
launch of 4 ranks holds a TP group of 4 and two TP groups of 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.deps import missing
from support.ports import free_port

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

WORKER = Path(__file__).with_name("offload_tp_worker.py")
WORLD = 4


def launch(args: list[list[str]], env_of, timeout: float = 120):
    procs = [subprocess.Popen([sys.executable, str(WORKER), *a], env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                      **env_of(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, a in enumerate(args)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "\n".join(o[-2000:] for o in outs)


def results(out: Path, scenario: str) -> dict:
    return {r: json.loads((out / f"{scenario}-rank{r}.json").read_text())
            for r in range(WORLD) if (out / f"{scenario}-rank{r}.json").exists()}


def members(tp: int, rank: int) -> list[int]:
    return list(range(WORLD)) if tp == WORLD else [rank // 2 * 2, rank // 2 * 2 + 1]


@pytest.fixture(scope="module")
def group_run(tmp_path_factory):
    """One launch of 4 ranks: the "step" scenario, then "kill9" (rank 3 dies) in the same groups."""
    out, port = tmp_path_factory.mktemp("group"), free_port()
    env = lambda r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD),  # noqa: E731
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    codes, logs = launch([["step,kill9", str(out)]] * WORLD, env)
    return codes, results(out, "step"), results(out, "kill9"), logs


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_offload_in_step_and_release_together(group_run, tp):
    codes, res, _, logs = group_run
    assert len(res) == WORLD, logs
    for r in range(WORLD):
        assert not res[r]["error"], res[r]["error"]
        assert res[r]["reload_ok"] and all(res[r]["reload_ok"].values()), res[r]["reload_ok"]
    mha, mla = f"tp{tp}/mha", f"tp{tp}/mla"
    for lead in {members(tp, r)[0] for r in range(WORLD)}:
        group = members(tp, lead)
        first = res[lead]
        for r in group:
            assert res[r]["queued"][mha] == first["queued"][mha]           # the same strides, the same steps
            assert res[r]["released_at"][mha] == first["released_at"][mha]  # the same releases, the same step
            assert res[r]["released_at"][mla] == first["released_at"][mla]
        assert sorted(first["released_at"][mha]) == ["r0", "r1", "r2"]
        for rid, at in first["released_at"][mha].items():
            # nobody released before every rank had its part on host (rank 1 copies slowly)
            assert at >= max(res[r]["ready_at"][mha][rid] for r in group), (rid, at)
        # MLA: each record stored by exactly one rank of the group; every rank reloaded it
        assert sum(res[r]["stored"][mla] for r in group) == first["stored"][mha] == first["records"][mha]


def test_a_rank_dying_mid_offload_releases_nothing(group_run):
    codes, _, res, logs = group_run
    doomed = WORLD - 1
    assert codes[doomed] == -9 and doomed not in res, logs
    for r in range(doomed):
        assert codes[r] == 0, logs
        for tp in (2, 4):
            key = f"tp{tp}/mha"
            if doomed in members(tp, r):   # the group lost a rank: every survivor says so, frees nothing
                err = res[r]["error"].get(key)
                assert err and "no device slots were released" in err, (r, key, err)
                assert not [x for x in res[r]["released"] if x.startswith(key)], res[r]["released"]
                assert res[r]["free_after"][key] == res[r]["free_before"][key]
            else:                          # the other TP-2 group carries on
                assert key not in res[r]["error"] and f"{key}/r0" in res[r]["released"]
                assert res[r]["reload_ok"][f"{key}/r0"] and res[r]["reload_ok"][f"tp{tp}/mla/r0"]
        assert res[r]["seconds"] < 15


@pytest.fixture(scope="module")
def p2h_run(tmp_path_factory):
    usable, why = [], {}
    for name in ("zmq", "ucx"):     # skipped only when its optional dependency is missing
        if missing(name):
            why[name] = missing(name)
        else:
            usable.append(name)
    out = tmp_path_factory.mktemp("p2h")
    if not usable:
        return out, None, why, ""
    codes, logs = launch([["p2h-d", str(out), ",".join(usable)], ["p2h-p", str(out), ",".join(usable)]],
                         lambda i: {}, timeout=150)
    return out, codes, why, logs


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_direct_to_host_receive_over_processes(p2h_run, transport):
    out, codes, why, logs = p2h_run
    if transport in why:
        pytest.skip(why[transport])
    path = out / f"decode-{transport}.json"
    res = json.loads(path.read_text()) if path.exists() else None
    assert codes == [0, 0] and res, logs
    assert "error" not in res, res["error"]
    assert [(p["p_tp"], p["d_tp"]) for p in res["pairs"]] == [(2, 4), (4, 2)]
    for pair in res["pairs"]:
        for d, rank in enumerate(pair["ranks"]):
            assert rank["landed"] and rank["untouched"] and rank["exact"] and not rank["rejected"], (pair, d)
