"""The README's engine integration example runs as written and checks its bytes (it asserts that
every decode rank holds exactly its heads of what prefill wrote, the aux token and every
release), in its own process so its servers and threads end with it."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def integration_example() -> str:
    text = README.read_text()
    section = text[text.index("## Integrating with a serving engine"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow   # a subprocess
def test_the_integration_example_runs_and_moves_the_kv_byte_exact(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(integration_example())
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("KV moved byte-exact")
