"""The code samples of two Chinese vLLM tuning articles (PagedAttention, KV cache, continuous
batching, speculative decoding, AWQ/GPTQ, Prometheus), run as printed with only `vllm` ->
`pagoda` and the model path -> a local model (the embedded SmolLM2-135M GGUF file, or an
AWQ/GPTQ checkpoint of it made by `pagoda quantize`). GPU-only settings are kept as written:
on a CPU they are ignored with a warning (`gpu_memory_utilization`) or have nothing to turn off
(`enforce_eager`). Where a sample stops at building the engine, one short generate call
follows, marked as not in the article.

Fast: the offline samples on the embedded model and the server command. Slow: the samples that
need a quantized checkpoint (quantizing takes a minute), the 100-prompt template and Prometheus.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagoda.config import embedded_model_path

# The one substitution of every sample's model path: the embedded model's GGUF file.
MODEL = embedded_model_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a1_paged_attention_settings(warnings) -> None:
    """Article 1, "配置vLLM的PagedAttention时，关键参数是gpu_memory_utilization"."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=MODEL,
        gpu_memory_utilization=0.92,  # 留8%给CUDA上下文和临时缓冲
        max_model_len=4096,  # 限制最大序列长度，减少预分配
        enforce_eager=True,  # 关闭CUDA Graph，调试阶段方便
    )

    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        max_tokens=512,
    )
    # Not in the article: the engine runs with those settings.
    assert llm.llm_engine.config.model_config.max_model_len == 4096
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 512)
    [out] = llm.generate(["什么是PagedAttention？"], SamplingParams(max_tokens=8, seed=0))
    assert len(out.outputs[0].token_ids) == 8
    messages = [r.getMessage() for r in warnings]
    assert any("gpu_memory_utilization=0.92 is ignored on a CPU" in m for m in messages), messages


def test_a2_fp8_kv_cache() -> None:
    """Article 1, "vLLM目前支持KV Cache FP8"."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=MODEL,
        kv_cache_dtype="fp8_e5m2",  # KV Cache使用FP8存储
        gpu_memory_utilization=0.9,
    )
    # Not in the article.
    assert llm.llm_engine.config.cache_config.cache_dtype == "fp8_e5m2"
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out.outputs[0].text


def test_a4_speculative_decoding_with_a_draft_model() -> None:
    """Article 1, "投机解码：用小模型加速大模型" (vLLM <= 0.6's keywords; the draft is the same
    model: there is one local model). Greedy output is the target's alone."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=MODEL,
        speculative_model=MODEL,  # draft model
        num_speculative_tokens=5,  # 每次预测5个token
        speculative_max_model_len=4096,
        gpu_memory_utilization=0.9,
    )
    # Not in the article.
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    spec = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    del llm
    assert spec == [o.outputs[0].text for o in LLM(model=MODEL).generate(prompts, greedy)]


def test_b1_prefix_caching() -> None:
    """Article 2, "配置方法也很简单" (enable_prefix_caching=True), as printed."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=MODEL,
        enable_prefix_caching=True,  # 开启前缀缓存
        max_num_batched_tokens=4096,
    )

    prompts = [
        "你是一个AI助手。请回答：什么是机器学习？",
        "你是一个AI助手。请回答：什么是深度学习？",
        "你是一个AI助手。请回答：什么是强化学习？",
    ]

    sampling_params = SamplingParams(temperature=0.7, max_tokens=100)
    outputs = llm.generate(prompts, sampling_params)
    # Not in the article: one answer a prompt; run again, each prompt finds its shared prefix.
    assert [o.prompt for o in outputs] == prompts
    assert all(o.outputs[0].token_ids for o in outputs)
    again = llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=1))
    assert all(o.num_cached_tokens > 0 for o in again)


class Server:
    """`python -m pagoda.entrypoints.openai.api_server ARGS --port P`, ready to serve."""

    def __init__(self, args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", *args]
        cmd += ["--port", str(self.port), "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 120:
                self.stop()
                raise RuntimeError("server did not answer /health within 120 s")
            time.sleep(0.05)

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        return out.decode()


def _complete(url: str, model: str) -> dict:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
    response = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a3_server_with_continuous_batching_flags() -> None:
    """Article 1, "# vLLM启动参数" (its inline comments taken out of the continued lines; the
    article's --scheduler-policy, which vLLM spells --scheduling-policy, is taken too)."""
    server = Server(
        ["--model", MODEL, "--max-num-seqs", "128", "--max-num-batched-tokens", "8192"]
        + ["--scheduler-policy", "fcfs", "--gpu-memory-utilization", "0.9"]
    )
    try:
        result = _complete(server.url, MODEL)  # the path the server was started with
        assert result["choices"][0]["text"].startswith(" Paris")
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert "pagoda:time_to_first_token_seconds_count" in metrics
    finally:
        server.stop()


def test_a3_server_command_pasted_as_printed() -> None:
    """The same command as the article prints it: each continued line ends in a backslash, a
    space and a '# comment', so the shell passes ' ' as an argument and ends the command there.
    Pagoda says so in one line (before loading anything)."""
    script = (
        f"{sys.executable} -m pagoda.entrypoints.openai.api_server     --model {MODEL}"
        "     --max-num-seqs 128 \\         # 单batch最大序列数\n"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "unrecognized arguments: ' ' (an argument that is only whitespace" in last, last
    assert "a backslash followed by a space" in last


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, str]:
    """AWQ and GPTQ checkpoints of the embedded model, by `pagoda quantize` (the article's
    AutoAWQ settings: zero point, groups of 128, 4 bits, GEMM)."""
    out = tmp_path_factory.mktemp("seed_quantized")
    paths = {}
    for method in ("awq", "gptq"):
        paths[method] = str(out / f"smollm2-{method}-int4")
        cmd = [sys.executable, "-m", "pagoda.cli", "quantize", "--method", method, "--bits", "4"]
        cmd += ["--group-size", "128", "--num-samples", "4", "--output", paths[method]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return paths


@pytest.mark.slow
def test_b2_awq(quantized) -> None:
    """Article 2, "在 vLLM 中使用 AWQ 模型很简单", as printed."""
    from pagoda import LLM, SamplingParams

    # 直接加载 AWQ 量化后的模型
    llm = LLM(
        model=quantized["awq"],
        quantization="awq",  # 指定量化方式
        dtype="auto",
    )

    prompt = "用简单的语言解释一下量子计算。"
    output = llm.generate([prompt], SamplingParams(max_tokens=200))
    print(output[0].outputs[0].text)
    # Not in the article.
    assert llm.llm_engine.config.model_config.quantization == "awq"
    assert output[0].outputs[0].token_ids


@pytest.mark.slow
def test_b3_gptq(quantized) -> None:
    """Article 2, "GPTQ 模型在 vLLM 中的用法类似"."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=quantized["gptq"],
        quantization="gptq",
        dtype="auto",
    )
    # Not in the article.
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out.outputs[0].text


@pytest.mark.slow
def test_a6_serve_an_awq_checkpoint(quantized) -> None:
    """Article 1, "部署时vLLM直接加载AWQ模型" (its server command)."""
    server = Server(
        ["--model", quantized["awq"], "--quantization", "awq", "--gpu-memory-utilization", "0.85"]
    )
    try:
        assert _complete(server.url, quantized["awq"])["choices"][0]["text"]
    finally:
        log = server.stop()
    assert log.count("gpu_memory_utilization=0.85 is ignored on a CPU") == 1, log


@pytest.mark.slow
def test_b4_the_combined_template(quantized) -> None:
    """Article 2, "我分享一个我常用的配置模板" (100 prompts of 512 tokens: minutes on 2 cores)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=quantized["awq"],
        quantization="awq",
        dtype="auto",
        max_model_len=4096,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.95,  # 显存利用率拉到95%
    )

    sampling_params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        max_tokens=512,
    )

    # 模拟高并发请求
    prompts = ["讲个笑话"] * 100
    outputs = llm.generate(prompts, sampling_params)
    # Not in the article.
    assert len(outputs) == 100 and all(o.outputs[0].token_ids for o in outputs)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary")
def test_a7_prometheus_scrapes_the_server(tmp_path) -> None:
    """Article 1, "用Prometheus + Grafana搭建监控" (its prometheus.yml; the target's port is the
    test server's, and a 1 s scrape interval is added so that the test waits seconds)."""
    server = Server(["--model", MODEL])
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: 'vllm'\n"
        "    static_configs:\n"
        f"      - targets: ['localhost:{server.port}']\n"
        "    metrics_path: /metrics\n"
    )
    prom_port = _free_port()
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}"]
        + [f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _complete(server.url, MODEL)
        query = 'pagoda:generation_tokens_total{job="vllm"}'
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            try:
                result = httpx.get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": query}
                ).json()["data"]["result"]
            except (httpx.HTTPError, KeyError):
                result = []
            if result and float(result[0]["value"][1]) >= 8:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus did not scrape {query}")
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        server.stop()


def test_samples_need_no_model_hub() -> None:
    """A sample run with its Hugging Face name left in (no substitution) says in one error
    that the model is not found and that Pagoda never downloads, before loading anything."""
    from pagoda import LLM

    with pytest.raises(
        ValueError, match="'TheBloke/Llama-2-7b-Chat-AWQ' not found.*never downloads"
    ):
        LLM(model="TheBloke/Llama-2-7b-Chat-AWQ", quantization="awq", dtype="auto")
    assert not os.path.exists("TheBloke")
