"""CPU dry run of benchmarks/h200_bench.py (issue 4): every code path the H200 run takes, on a
2-layer, 64-wide Llama config, so that the one GPU run works the first time.

The fast tests pin the pure parts (roofline bytes, the table's target logic); the slow ones run
Pagoda's parts, the transformers peer and the whole script (child processes, time boxes, JSON,
table last) on the CPU. Numbers measured here mean nothing; the assertions are on the shape of
the results: token counts, cache hits, recorded errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import h200_bench  # noqa: E402
import pagoda_bench  # noqa: E402

from pagoda.bench.throughput import make_requests  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}
CPU_FLAGS = ["--device", "cpu", "--kv-cache-memory-bytes", str(32 << 20)]
CPU_FLAGS += ["--max-num-batched-tokens", "512"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def test_decode_weight_bytes_gives_the_issue_roofline() -> None:
    with open(os.path.join(REPO, "benchmarks", "presets", "llama-3-8b", "config.json")) as f:
        config = json.load(f)
    weight_bytes = h200_bench.decode_weight_bytes(config)
    # 32 layers of 218.1M parameters, the final norm and the 525M LM head, in bf16; the input
    # embedding is not read (one row per token).
    layer = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336 + 2 * 4096
    assert weight_bytes == 2 * (32 * layer + 4096 + 128256 * 4096) == 2 * 7_504_924_672
    assert 260 < 4.0e12 / weight_bytes < 270  # "about 265" at ~4 TB/s
    assert h200_bench.decode_weight_bytes(config, "float32") == 2 * weight_bytes


def test_summarize_marks_targets_met_and_missed(tiny_dir: str) -> None:
    results = {
        "ceilings": {"copy_GBps": 4000.0},
        "a_offline_throughput": {"output_tokens_per_s": 12500.0},
        "b_single_stream": {"decode_tokens_per_s": 200.0},
        "c_ttft": {"idle_ms": 20.0, "cached_ms": 9.0},
        "peer": {"offline_throughput": {"output_tokens_per_s": 2500.0}},
    }
    args = argparse.Namespace(quick=False, dtype="bfloat16")
    rows = {r[0]: r for r in h200_bench.summarize(results, TINY, args)}
    assert rows["a Pagoda output tok/s"][3] == "yes"
    assert rows["b Pagoda decode tok/s (TTFT excluded)"][3] == "NO"
    assert rows["c TTFT idle ms"][3] == "yes"
    assert rows["c TTFT prefix cached ms"][3] == "NO"
    assert rows["Pagoda / HF, workload a"][1] == "5.00"
    assert rows["d HF decode tok/s (workload b)"][1] == "-"  # missing, not a crash
    args.quick = True
    rows = {r[0]: r for r in h200_bench.summarize(results, TINY, args)}
    assert rows["a Pagoda output tok/s"][3] == "n/a (quick)"


@pytest.mark.slow
def test_ceilings_run_on_cpu() -> None:
    ceilings = h200_bench.measure_ceilings("cpu", "float32", pagoda_bench.QUICK)
    assert ceilings["copy_GBps"] > 0 and ceilings["matmul_bf16_TFLOPs"] >= 0
    env = h200_bench.collect_environment("cpu")
    assert env["torch"] and "dry run" in env["gpu"]


@pytest.mark.slow
def test_pagoda_parts_on_a_tiny_cpu_engine(tiny_dir: str) -> None:
    w = pagoda_bench.QUICK
    args = h200_bench.parse_args(["--model", tiny_dir, "--quick", *CPU_FLAGS])
    llm = pagoda_bench.make_llm(args, w)
    soon = time.perf_counter() + 120

    b = pagoda_bench.bench_single_stream(llm, w, soon)
    assert b["tokens"] == w.stream_output_len and b["decode_tokens_per_s"] > 0

    c = pagoda_bench.bench_ttft(llm, w, soon)
    assert c["expected_num_cached_tokens"] == 48  # 50-token prefix, 16-token blocks
    assert c["min_num_cached_tokens"] >= 48 and c["idle_max_num_cached_tokens"] == 0
    assert len(c["idle_ms_all"]) == w.ttft_repeats

    a = pagoda_bench.bench_offline_throughput(llm, w, soon)
    reqs = make_requests(w.num_requests, w.input_len, w.output_len, 512, 0)
    assert not a["timed_out"] and a["num_finished"] == w.num_requests
    assert a["output_tokens"] == sum(n for _, n in reqs)
    assert a["input_tokens"] == sum(len(p) for p, _ in reqs)
    assert a["requests_with_wrong_length"] == [] and a["num_steps"] > 0

    p = pagoda_bench.profile_decode_step(llm, w, soon)
    assert p["all_decode_batch_reached"] and len(p["step_wall_ms"]) == 5 and p["top_ops"]

    # A passed deadline aborts the rest and leaves the engine idle and reusable.
    late = pagoda_bench.bench_offline_throughput(llm, w, time.perf_counter() - 1)
    assert late["timed_out"] and not llm.llm_engine.has_unfinished_requests()
    assert pagoda_bench.bench_single_stream(llm, w, soon)["tokens"] == w.stream_output_len


@pytest.mark.slow
def test_transformers_peer_runs_the_same_workloads_on_cpu(tiny_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    from hf_peer_bench import run_peer

    model = transformers.AutoModelForCausalLM
    if not hasattr(model, "from_config"):
        pytest.skip("transformers without from_config")
    reqs = make_requests(6, (8, 40), (4, 24), 512, 0)
    recorded: list[dict] = []
    res = run_peer(tiny_dir, "cpu", "bfloat16", reqs, (16, 12, 2), 120, recorded.append)
    assert "error" not in res.get("offline_throughput", {}), res
    assert "error" not in res.get("single_stream", {}), res
    assert res["offline_throughput"]["output_tokens"] == sum(n for _, n in reqs)
    assert res["offline_throughput"]["num_finished"] == 6
    assert res["single_stream"]["tokens"] == 12 and res["single_stream"]["decode_tokens_per_s"] > 0
    assert recorded  # results are handed out after each workload


@pytest.mark.slow
def test_whole_script_quick_on_cpu_writes_json_and_ends_with_the_table(
    tiny_dir: str, tmp_path: os.PathLike
) -> None:
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "h200_bench.py"), "--quick"]
    cmd += ["--model", tiny_dir, *CPU_FLAGS, "--time-budget", "400"]
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("metric"))
    table = [line.split("  ")[0] for line in lines[header + 1 :]]
    assert table[0].startswith("copy bandwidth") and table[-1] == "Pagoda / HF, workload b"
    assert "a host waiting for the GPU s" in table
    with open(os.path.join(tmp_path, "h200_bench.json")) as f:
        res = json.load(f)
    assert h200_bench.find_errors(res) == []
    assert res["pagoda"]["c_ttft"]["min_num_cached_tokens"] >= 48
    assert res["peer"]["peer"]["offline_throughput"]["num_finished"] == 16
    assert {"env", "ceilings"} <= set(res["env"])
    rows = {r[0]: r for r in res["table"]}
    assert rows["c cached tokens (min of runs)"][3] == "yes"
    assert all(rows[k][1] != "-" for k in rows)


@pytest.mark.slow
def test_a_child_past_its_time_box_is_killed_and_reported(tiny_dir: str, tmp_path) -> None:
    argv = ["--model", tiny_dir, "--quick", *CPU_FLAGS, "--only", "d"]
    res = h200_bench.spawn("peer", argv, 1.0, str(tmp_path))
    assert "killed" in str(res["child"]["exit"])
    assert h200_bench.find_errors({"peer": res})
