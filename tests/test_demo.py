"""The main job, small: a real P -> D run (separate processes, bootstrap server, TP 1 -> 2,
page-major -> token-major) whose every request must equal a single-process run. The default
TP 2 -> 4 is what ``scripts/demo`` runs; fewer ranks keep the suite quick on 2 cores."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.deps import need

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_demo_verifies_every_request(transport, tmp_path):
    need(transport)
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--transport", transport, "--requests", "5",
                           "--prefill-tp", "1", "--decode-tp", "2", "--max-prompt", "40", "--gen-len", "4",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["verified"] == summary["requests"] == 5
    assert summary["bytes_moved"] > 0 and not summary["mismatched"] and not summary["slot_leak"]
    assert "every request verified" in proc.stdout
