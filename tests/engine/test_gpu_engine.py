"""The whole engine on a GPU with dummy weights: decode CUDA graphs and the fused Triton path
give the same greedy tokens as eager execution, as synchronous scheduling and as the plain-torch
reference path (float32, where random weights' near-ties do not flip), programmatic dependent
launch gives the same tokens as plain launches (bf16 and 4-bit), and impossible memory settings
fail at start.
Marked `gpu`: `pytest tests/engine -m gpu`."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PRESET = Path(__file__).parents[2] / "benchmarks/presets/llama-3.2-1b/config.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    cfg = json.loads(PRESET.read_text())
    cfg["num_hidden_layers"] = 4
    path = tmp_path_factory.mktemp("llama-1b-4l")
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=2 << 30,
        **kwargs,
    )


def _generate(model_dir: str, prompts, **kwargs) -> list[list[int]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    llm = _llm(model_dir, **kwargs)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    # The torch reference's attention in plain float32 math (fused SDPA may use TF32).
    with sdpa_kernel(SDPBackend.MATH):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_and_fused_ops_keep_greedy_tokens(model_dir):
    rng = random.Random(0)
    # 11 requests of 8..28 tokens: decode batches shrink through padded buckets as they end.
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(5, 300))] for _ in range(11)]
    graphs = _generate(model_dir, prompts, dtype="float32")
    eager = _generate(model_dir, prompts, dtype="float32", enforce_eager=True)
    reference = _generate(
        model_dir, prompts, dtype="float32", enforce_eager=True, attention_backend="torch"
    )
    synchronous = _generate(model_dir, prompts, dtype="float32", async_scheduling=False)
    assert [len(t) for t in graphs] == [8 + 2 * i for i in range(11)]
    assert graphs == eager
    assert graphs == reference
    assert graphs == synchronous  # async scheduling (the CUDA default) changes no token


@pytest.mark.parametrize("quantization", [None, "awq"])
def test_programmatic_dependent_launch_changes_no_token(model_dir, monkeypatch, quantization):
    # bf16 with CUDA graphs: every kernel between the GEMMs (and the 4-bit GEMV) launched as a
    # programmatic dependent waits for the one before; a missing wait would read a half-written
    # activation or KV-cache slot and change tokens. The same kernels run either way.
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    rng = random.Random(1)
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(5, 300))] for _ in range(11)]
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("PAGODA_PDL", pdl)
        runs[pdl] = _generate(model_dir, prompts, dtype="bfloat16", quantization=quantization)
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize("quantization", [None, "awq"])
def test_l2_weight_prefetch_changes_no_token(model_dir, monkeypatch, quantization):
    # Decode steps of up to 16 rows ask the next weights into L2 from a side stream while the
    # attention runs; the graphs must capture and join it, and the tokens stay the same.
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the L2 prefetch needs sm_90")
    from pagoda.kernels import l2_prefetch

    issued = []
    real = l2_prefetch.prefetch
    monkeypatch.setattr(l2_prefetch, "prefetch", lambda *a: issued.append(1) or real(*a))
    rng = random.Random(2)
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(5, 300))] for _ in range(11)]
    runs = {}
    for mb in ("24", "0"):  # on, off
        monkeypatch.setenv("PAGODA_L2_PREFETCH_MB", mb)
        runs[mb] = _generate(model_dir, prompts, dtype="bfloat16", quantization=quantization)
    assert issued  # with 24 MiB: every layer of every eager decode step (and each capture)
    assert runs["24"] == runs["0"]


def test_start_fails_with_the_numbers_when_weights_do_not_fit(model_dir):
    with pytest.raises(ValueError, match=r"weights take \d+\.\d+ GiB.*--gpu-memory-utilization"):
        LLM(
            model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cuda",
            max_model_len=1024,
            gpu_memory_utilization=0.002,
        )
    gc.collect()
    torch.cuda.empty_cache()


def test_int8_kv_cache_calibrates_its_scales_on_the_device(model_dir):
    from pagoda.model.layers.attention import Attention

    rng = random.Random(1)
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    full = _generate(model_dir, prompts, dtype="float32")
    llm = _llm(model_dir, dtype="float32", kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    layers = [
        m for m in llm.llm_engine.executor.model_runner.model.modules() if isinstance(m, Attention)
    ]
    scales = [float(m.k_scale) for m in layers] + [float(m.v_scale) for m in layers]
    assert all(s != 1.0 and s > 0 for s in scales)  # set by the first (eager) step
    # Quantized to 8 bits with calibrated scales, greedy decoding mostly follows full precision
    # (uncalibrated, scale 1.0 rounded these activations to a few levels: unrelated tokens).
    first = [o.outputs[0].token_ids[0] for o in outs]
    assert sum(a == b[0] for a, b in zip(first, full)) >= 6
