"""CPU dry run of benchmarks/gpu_serve_bench.py (issue 15): every part the H200 run takes
(`pagoda serve` of a dummy config without a tokenizer, bench serve at inf and at rates, the
long-prompt mix, multi-turn with and without prefix caching, the offline throughput of the same
requests) on a 2-layer config, so that the one GPU run works the first time. Numbers measured
here mean nothing; the assertions are on the results' shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}  # fmt: skip


@pytest.mark.slow
def test_dry_run_measures_every_part(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "gpu_serve_bench.py"), "--dry-run",
           "--model", str(config), "--out", str(out), "--time-budget", "400", "--only", "a,b,c,d"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_serve_bench.json").read_text())
    assert res["errors"] == {}
    parts = res["parts"]
    inf, offline = parts["a_inf"], parts["b_offline"]
    assert inf["failed"] == 0 and inf["completed"] == 16
    assert inf["total_output_tokens"] == offline["output_tokens"]  # the same requests
    assert inf["total_input_tokens"] == offline["input_tokens"]
    assert inf["api_cpu_ms_per_output_token"] > 0
    assert {"a_rate_0.5", "a_rate_0.7", "c_idle", "d1_long_mix"} <= set(parts)
    assert parts["d1_long_mix"]["num_long"] >= 1
    on = parts["d2_multi_turn_prefix_caching"]
    off = parts["d2_multi_turn_no_prefix_caching"]
    assert on["failed"] == off["failed"] == 0
    assert on["prefix_cache_hit_rate"] > 0.3 and not off["prefix_cache_hit_rate"]
    assert "TTFT p50 off / on" in proc.stdout.splitlines()[-1]
