"""Shared test set-up: make the helpers next to the tests (``xfer_peer``, ``request_peer``,
``waiting``) importable in any pytest import mode, the ``transport`` fixture of the request
tests (each network transport, skipped only where its optional dependency is missing;
``parametrize`` overrides it), and
the two tiers.

Tiers: ``scripts/test --fast`` runs ``-m "not slow"``, the in-process tier (under 90 s on 2
cores); ``scripts/test`` runs everything. A test is slow when it carries ``@pytest.mark.slow``,
lives in one of ``SLOW_FILES`` (torchrun launches, killed processes, the demo and bench
subprocesses, test hosts in network namespaces) or is one of ``SLOW_TESTS`` (each takes
seconds: it kills or stops a peer mid-transfer and waits for the deadline), or runs in other
processes: a subprocess started for it (``SUBPROCESS_TESTS``) or the ``pair`` of a network
transport in ``test_transport_conformance.py`` (each end a ``PeerProcess``; the in-process
``local`` and ``faulty`` pairs stay fast, and zmq and ucx stay in the fast tier through the
in-process endpoints of ``test_request.py`` and ``test_ucx.py``).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SLOW_FILES = {"test_hetero_tp.py", "test_offload_tp.py", "test_request_faults.py", "test_demo.py", "test_bench.py",
              "test_soak.py", "test_multihost.py", "test_hosts.py", "test_hostile_control.py", "test_hostile_data.py",
              "test_hostile_registry.py", "test_hostile_ucx.py", "test_rank_cli.py", "test_hf_demo.py", "test_fence.py",
              "test_ucx_guards.py", "test_recovery.py", "test_multihost_recovery.py", "test_zmq_hosts.py",
              "test_zmq_connect.py", "test_ucx_disconnect.py", "test_ucx_runs.py", "test_ucx_staged.py",
              "test_ucx_far_failure.py", "test_ucx_eager.py"}
SLOW_TESTS = {"test_source_released_only_when_nothing_reads_it", "test_receiver_killed_mid_transfer",
              "test_sender_killed_mid_transfer", "test_close_frees_ucx_resources_without_the_garbage_collector",
              "test_a_replayed_hello_does_not_make_peers", "test_doctor_is_a_command_and_reports_this_machine",
              "test_doctor_works_without_ucxx", "test_gpu_check_dry_run_on_cpu_passes",
              "test_incoming_transfers_per_peer_are_capped", "test_a_restarted_decode_rank_leaves_one_data_peer",
              "test_registration_start_takes_over_well_before_the_ttl", "test_no_ucx_warning_noise_at_start_up",
              "test_both_run_paths", "test_disconnect_frees_the_peer", "test_eager_writes_end_to_end"}

SUBPROCESS_TESTS = {"test_import_kvxfer_loads_no_transport",
                    "test_the_integration_example_runs_and_moves_the_kv_byte_exact", "test_cli_serves_until_sigterm",
                    "test_gpu_check_skips_cleanly_without_cuda", "test_cma_fatal_line_is_stopped_and_counted"}
IN_PROCESS_PAIRS = {"local", "faulty"}   # test_transport_conformance.IN_PROCESS


def _multi_process(item) -> bool:
    if item.originalname in SUBPROCESS_TESTS:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return Path(str(item.fspath)).name == "test_transport_conformance.py" and \
        params.get("pair", "local") not in IN_PROCESS_PAIRS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).name in SLOW_FILES or item.originalname in SLOW_TESTS or _multi_process(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", params=["zmq", "ucx"])
def transport(request):
    from support.deps import need
    need(request.param)   # skipped only when its optional dependency is missing
    return request.param
