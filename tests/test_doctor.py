"""``kvxfer doctor`` runs here (no GPU, no RDMA) and reads UCX's own report correctly."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.cli import COMMANDS, doctor

RDMA_HOST = """# Memory domain: mlx5_0
#     Component: ib
#         memory types: host (access,reg,cache), cuda (reg)
#      Transport: rc_mlx5
#         Device: mlx5_0:1
#      Transport: dc_mlx5
#         Device: mlx5_0:1
# Memory domain: cuda_cpy
#     Component: cuda_cpy
#         memory types: host (reg), cuda (access,alloc,reg,cache)
#      Transport: cuda_copy
#         Device: cuda
# Memory domain: cuda_ipc
#         memory types: cuda (access,reg,cache)
#      Transport: cuda_ipc
#         Device: cuda
"""


@pytest.mark.slow   # seconds
def test_doctor_is_a_command_and_reports_this_machine() -> None:
    assert "doctor" in COMMANDS
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for words in ("torch", "CUDA", "UCX", "RDMA", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=", "transports"):
        assert words in out.stdout, words
    report = json.loads(subprocess.run([sys.executable, "-m", "kvxfer.cli", "doctor", "--json"],
                                       capture_output=True, text=True, timeout=120).stdout)
    assert report["ucx"]["found"] and report["ucx"]["version"]
    assert "tcp" in report["ucx"]["transports"]          # the wheel's UCX always has tcp
    assert "verbs" in report["ucx"]["built_without"]     # ... and no RDMA: the doctor says so
    assert report["rdma"]["ucx_transports"] == []


def test_doctor_parses_an_rdma_and_cuda_ucx() -> None:
    got = doctor.parse_ucx_info("# Library version: 1.18.0\n# Library path: /opt/ucx/lib/libucs.so.0\n"
                                "# Configured with: --with-verbs --with-cuda=/usr/local/cuda", RDMA_HOST)
    assert got["version"] == "1.18.0" and got["built_without"] == []
    assert got["memory_domains"]["cuda_cpy"] == ["host", "cuda"]
    assert got["transports"]["rc_mlx5"] == ["mlx5_0:1"] and "cuda_ipc" in got["transports"]
    rdma = doctor.rdma_report(got)
    assert rdma["ucx_transports"] == ["dc_mlx5", "rc_mlx5"]
    text = doctor.render({"torch": doctor.torch_report(), "ucx": {"found": True, "source": "system",
                                                                  "ucxx": False, "modules": ["ib", "cuda"], **got},
                          "rdma": rdma, "prefer_system_ucx": "true"})
    assert "cuda_ipc yes" in text and "falls back to TCP" not in text


def test_doctor_without_ucx_still_reports(monkeypatch, capsys) -> None:
    monkeypatch.setattr(doctor, "find_ucx_info", lambda: None)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "UCX           not found" in out and "falls back to TCP" in out


@pytest.mark.slow   # seconds
def test_doctor_works_without_ucxx() -> None:
    code = ("import sys; sys.modules['ucxx'] = None; from kvxfer.cli import doctor; "
            "sys.exit(doctor.main([]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ucxx        not installed" in out.stdout


def test_doctor_says_how_long_tcp_may_keep_a_partitioned_peers_memory(tmp_path) -> None:
    """TCP's retransmission limit bounds how long memory held for a partitioned peer stays held
    after the link returns: the doctor reads it and says that the ucx transport caps its own
    connections where the kernel can (Linux >= 6.15), and what happens where it cannot."""
    (tmp_path / "tcp_rto_max_ms").write_text("120000\n")
    (tmp_path / "tcp_retries2").write_text("15\n")
    tcp = doctor.tcp_report(tmp_path)
    assert tcp == {"rto_max_ms": 120000, "retries2": 15}
    base = {"torch": {"torch": "x", "cuda_build": None, "cuda_available": False, "devices": []},
            "ucx": {"found": False, "why": "none"}, "prefer_system_ucx": "false",
            "rdma": {"ucx_transports": [], "ucx_built_without": [], "devices": [], "libibverbs": None,
                     "librdmacm": None}}
    said = doctor.render({**base, "tcp": tcp})
    assert "tcp_rto_max_ms = 120000" in said and "caps its own connections at tcp_rto_max" in said
    (tmp_path / "tcp_rto_max_ms").unlink()   # a kernel before 6.15
    assert doctor.tcp_report(tmp_path)["rto_max_ms"] is None
    assert "not in this kernel" in doctor.render({**base, "tcp": doctor.tcp_report(tmp_path)})
