"""``kvxfer demo --model llama|qwen2``: a HuggingFace model's KV moved P -> D by kvxfer and
generation continued from it, equal token for token to the model's own ``generate``.

The in-process test checks the HF adapter alone (cache in and out of kvxfer pools, heads
placed per rank); the slow ones run the whole demo as a subprocess, heterogeneous TP both
ways (``python -m kvxfer.cli.hf``, what ``kvxfer demo --model`` hands its arguments to).
Skipped without transformers (the ``hf`` extra), except the check of the message saying so."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # processes, waits of seconds (the full tier)

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed: pip install 'kvxfer[hf]'")


def test_without_transformers_says_how_to_install(monkeypatch):
    from kvxfer.cli import hf
    monkeypatch.setitem(sys.modules, "transformers", None)     # import transformers -> ImportError
    with pytest.raises(SystemExit, match=r"kvxfer\[hf\]"):
        hf.main(["--model", "llama"])


@needs_hf
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_cache_through_pools_continues_generate(model):
    """Prefill's HF cache, split by rank into page-major pools, read back per rank and reassembled
    (as decode does after the transfer), continues greedy generation exactly."""
    import torch

    from kvxfer.allocator import PageAllocator
    from kvxfer.cli import hf_model as hf
    from kvxfer.topology import heads_held

    cfg = hf.HFDemoConfig(model=model, max_prompt=40, gen_len=5)
    m = hf.build_model(cfg)
    prompt = hf.make_requests(cfg)[0][1]
    want = hf.greedy(m, prompt, cfg.gen_len)
    kv, first = hf.prefill(m, prompt)
    assert first == want[0]
    for tp in (1, 2, 4, 8):       # 8 > kv_heads: heads replicated
        parts = []
        for rank in range(tp):
            pool = hf.make_pool(cfg, tp, rank, "page_major", len(prompt), 1)
            slots = PageAllocator(pool.layout.spaces[0].num_pages, cfg.page_size).alloc(len(prompt))
            slots = np.ascontiguousarray(slots[::-1])          # slots in any order
            hf.write_prefill_kv(kv, pool, slots, heads_held(cfg.kv_heads, tp, rank))
            parts.append(torch.stack([torch.stack(pool.get_kv_buffer(layer, slots)) for layer in range(cfg.layers)]))
        cache = hf.cache_from_parts(cfg, parts)
        assert [first] + hf.greedy(m, prompt + [first], cfg.gen_len - 1, cache) == want, tp


@needs_hf
@pytest.mark.slow
@pytest.mark.parametrize("model, prefill_tp, decode_tp", [("llama", 2, 4), ("qwen2", 4, 2)])
def test_hf_demo_verifies_every_request(model, prefill_tp, decode_tp, tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--model", model, "--transport", "zmq",
                           "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--requests", "3",
                           "--max-prompt", "40", "--gen-len", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["verified"] == summary["requests"] == 3
    assert summary["bytes_moved"] > 0 and not summary["mismatched"] and not summary["slot_leak"]
    assert f"prefill TP {prefill_tp} (page_major) -> decode TP {decode_tp} (token_major) over zmq" in proc.stdout
    assert "verified token for token   3/3" in proc.stdout
    assert "every request verified" in proc.stdout
