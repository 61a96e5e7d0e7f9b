"""`$PAGODA_CPU_NUMERICS=ggml` on the embedded model against llama.cpp itself: the greedy tokens
and the logits (their SHA-256, bit for bit) that llama.cpp produced on the same GGUF file.

The recorded values come from llama-cpp-python 0.3.36 on a Zen 4, built natively (AVX-512) and
with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF (an AVX2 CPU's build), f16 KV cache, flash
attention off, n_batch 512 (as `benchmarks/cpu_vs_llamacpp.py` runs it): what the "avx512" and
"avx2" variants must reproduce on any CPU, each being plain C. The logits are those of the
prompt's last row (step 0) and of the 16th generated token's step (step 15); the two builds'
differ, so each variant is told apart.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from model_testing import PagedRunner

from pagoda.config import ModelConfig, embedded_model_path
from pagoda.kernels.cpu import ggml_numerics as gn
from pagoda.model.loader import get_model_config_dict, load_model

try:
    gn.load_library()
except Exception as e:
    pytest.skip(f"ggml numerics library unavailable: {e}", allow_module_level=True)

PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [788, 216, 33, 41, 32, 37, 28, 14338, 16211, 2587],  # "In 1905, Albert Einstein published"
]
TOKENS = [
    [7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33, 33],
    [650, 4248, 8345, 414, 45, 21445, 19133, 28, 527, 553, 1675, 1438, 253, 24604, 282, 2148],
]
# variant -> per prompt: llama.cpp's 16 greedy tokens (the two builds agree on these), and the
# sha256[:16] of its float32 logits at steps 0 and 15
LLAMACPP = {
    "avx512": [
        (TOKENS[0], {0: "1e6159cb73323909", 15: "daca2ad915a6c420"}),
        (TOKENS[1], {0: "f0996ab37d98d47f", 15: "90f0abc838ae5eac"}),
    ],
    "avx2": [
        (TOKENS[0], {0: "1e6159cb73323909", 15: "f5e2699604419dc7"}),
        (TOKENS[1], {0: "6c638fad1b1f6661", 15: "da92e06afefdbf56"}),
    ],
}


def _digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    path = embedded_model_path()
    cfg = get_model_config_dict(path)
    m = load_model(
        ModelConfig(
            model=path, hf_config=cfg, dtype="float32", max_model_len=256, quantization="gguf"
        )
    )
    m.cfg_for_test = cfg
    return m


@pytest.mark.parametrize("variant", sorted(LLAMACPP))
@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_logits_and_greedy_tokens_are_llama_cpps(
    model: torch.nn.Module, case: int, variant: str
) -> None:
    model.enable_ggml_numerics(variant)
    prompt, (tokens, digests) = PROMPTS[case], LLAMACPP[variant][case]
    runner = PagedRunner(model, model.cfg_for_test, num_blocks=16, cache_dtype=torch.float16)
    logits = runner.step(prompt, 0)[-1]
    got, start = [], len(prompt)
    for step in range(len(tokens)):
        if step in digests:
            assert _digest(logits) == digests[step], f"logits differ at step {step}"
        got.append(int(logits.argmax()))
        if step + 1 < len(tokens):
            logits = runner.step([got[-1]], start)[-1]
            start += 1
    assert got == tokens


def test_pagodas_numerics_differ_from_llama_cpps_by_int8_noise_only(model: torch.nn.Module) -> None:
    """The default kernels and the ggml numerics compute the same model: on one 128-token
    context their logits differ about as much as either differs from the dequantized float32
    model (~0.17 on average: where the int8 activations round), the top token almost always
    the same. A wrong scale, block or lane in either path would be far outside."""
    from pagoda.model.quantization.gptq import BUILTIN_CALIBRATION
    from pagoda.tokenizer import get_tokenizer

    ids = get_tokenizer(embedded_model_path()).encode(BUILTIN_CALIBRATION)[:128]
    path = embedded_model_path()
    cfg = model.cfg_for_test
    plain = load_model(
        ModelConfig(
            model=path, hf_config=cfg, dtype="float32", max_model_len=256, quantization="gguf"
        )
    )
    model.enable_ggml_numerics("avx512")
    out = []
    for m in (plain, model):
        runner = PagedRunner(m, cfg, num_blocks=40, cache_dtype=torch.float16)
        out.append(runner.step(ids, 0))
    diff = (out[0] - out[1]).abs()
    assert diff.mean() < 0.3 and diff.max() < 3.0
    assert (out[0].argmax(1) == out[1].argmax(1)).float().mean() >= 0.9


def test_engine_batches_requests_without_changing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both prompts in one engine, scheduled into the same steps, give llama.cpp's tokens (each
    request's attention is its own; linear layers work row by row)."""
    from pagoda import LLM, SamplingParams

    monkeypatch.setenv("PAGODA_CPU_NUMERICS", "ggml-avx512")
    llm = LLM(model=embedded_model_path(), max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == TOKENS


def test_bad_settings_fail_at_load_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda import LLM

    monkeypatch.setenv("PAGODA_CPU_NUMERICS", "llamacpp")
    with pytest.raises(ValueError, match="PAGODA_CPU_NUMERICS must be one of"):
        LLM(model=embedded_model_path(), max_model_len=64)
    monkeypatch.setenv("PAGODA_CPU_NUMERICS", "ggml")
    with pytest.raises(ValueError, match="--kv-cache-dtype float16"):
        LLM(model=embedded_model_path(), max_model_len=64, kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="drop speculative_config"):
        LLM(
            model=embedded_model_path(),
            max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="GGUF blocks kept quantized"):
        LLM(
            model=embedded_model_path(),
            max_model_len=64,
            dtype="bfloat16",  # the blocks are dequantized for bfloat16 activations
            kv_cache_dtype="float16",
        )


def test_act_order_blocks_are_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPTQ act-order checkpoint's layers are Q4_1 blocks on a CPU, but read a permutation of
    # their inputs, which llama.cpp's graph has no op for.
    from quant_testing import quantized_checkpoint

    from pagoda import LLM

    _, path = quantized_checkpoint(tmp_path, "gptq", 4, act_order=True)
    monkeypatch.setenv("PAGODA_CPU_NUMERICS", "ggml")
    with pytest.raises(ValueError, match="without an input permutation"):
        LLM(
            model=str(path),
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_dtype="float16",
            max_model_len=64,
            kv_cache_memory_bytes=1 << 20,
        )
