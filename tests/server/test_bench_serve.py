"""`pagoda bench serve` against a live HTTP server (uvicorn in a thread, fake engine)."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import pytest
import uvicorn
from fake_engine import FakeEngine

from pagoda.bench.datasets import ServerTokenizer, prefix_repetition_dataset, random_dataset
from pagoda.bench.serve import (
    RequestFuncOutput,
    add_bench_serve_args,
    calculate_metrics,
    parse_goodput,
    run_bench_serve,
)
from pagoda.engine.async_llm import AsyncLLM
from pagoda.server.app import build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    llm = AsyncLLM(FakeEngine(max_model_len=256, max_num_seqs=8, step_delay=0.002))
    port = _free_port()
    config = uvicorn.Config(build_app(llm), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(5)
    llm.shutdown()


def test_server_tokenizer_finds_vocab_and_prompts_have_the_requested_length(server_url):
    tok = ServerTokenizer(server_url, None, {})
    assert tok.vocab_size == 258
    reqs = random_dataset(tok, 5, input_len=20, output_len=4, range_ratio=0.5, seed=0)
    assert all(10 <= r.prompt_len <= 30 for r in reqs)
    assert all(abs(len(tok.encode(r.prompt)) - r.prompt_len) == 0 for r in reqs)
    reqs = prefix_repetition_dataset(tok, 6, 16, 8, 2, 4, seed=0)
    assert len({r.prompt[:4] for r in reqs}) == 2  # two shared prefixes


def test_bench_serve_reports_like_vllm(server_url, tmp_path, capsys):
    parser = add_bench_serve_args(argparse.ArgumentParser())
    out = tmp_path / "res.json"
    args = parser.parse_args([
        "--base-url", server_url, "--num-prompts", "6", "--random-input-len", "16",
        "--random-output-len", "5", "--max-concurrency", "3", "--ignore-eos",
        "--goodput", "ttft:10000", "e2el:10000", "--result-filename", str(out),
    ])  # fmt: skip
    assert run_bench_serve(args) == 0
    text = capsys.readouterr().out
    for label in ("Successful requests:", "Benchmark duration (s):", "Request throughput",
                  "Output token throughput", "Total token throughput", "Mean TTFT (ms):",
                  "Median TPOT (ms):", "P99 ITL (ms):", "P90 E2EL (ms):", "Request goodput"):  # fmt: skip
        assert label in text
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_output_tokens"] == 30 and res["output_lens"] == [5] * 6
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])


def test_metrics_math():
    outs = [
        RequestFuncOutput(True, "", 10, 5, ttft=0.1, itl=[0.1] * 4, latency=0.5),
        RequestFuncOutput(True, "", 10, 1, ttft=0.2, itl=[], latency=0.2),
        RequestFuncOutput(False, error="boom"),
    ]
    m = calculate_metrics(outs, 2.0, [50], {"ttft": 150})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["output_throughput"] == 3.0 and m["total_token_throughput"] == 13.0
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # only requests with > 1 token
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["request_goodput"] == 0.5  # only the first meets ttft <= 150 ms
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])
