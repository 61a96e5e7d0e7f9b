"""AWQ / GPTQ checkpoints of the embedded model (SmolLM2-135M: 9 heads, 3 KV heads, hidden 576,
intermediate 1536), written by `pagoda quantize` with groups of 64 (192 and 512 inputs per
rank: whole groups), served with tensor_parallel_size=3: three gloo workers, each loading its
shards of the packed tensors, give tensor_parallel_size=1's greedy tokens."""

from __future__ import annotations

import pytest
from quant_testing import quantized_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.cli import main

SMALL = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=1, intermediate_size=192)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "你是一个AI助手。请回答：什么是机器学习？",
    "The three primary colors are",
]
CASES = {  # pagoda quantize flags
    "awq": ["--method", "awq"],
    "gptq4": [],
    "gptq4-act-order": ["--act-order"],
    "gptq8-sym": ["--bits", "8", "--sym"],
}
KWARGS = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=256)


def _quantize(path, flags: list[str]) -> str:
    argv = ["quantize", "--group-size", "64", "--num-samples", "1", "--seq-len", "64"]
    assert main([*argv, *flags, "--output", str(path)]) == 0
    return str(path)


def _run(path: str, tp: int, params: SamplingParams) -> list:
    llm = LLM(path, tensor_parallel_size=tp, num_gpu_blocks_override=64, **KWARGS)
    try:
        return [o for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.llm_engine.executor.shutdown()


def _prompt_logprobs(outs) -> list[float]:
    return [
        lp[t].logprob for o in outs for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])
    ]


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tp3_greedy_tokens_equal_one_rank(tmp_path, monkeypatch, case) -> None:
    path = _quantize(tmp_path / case, CASES[case])
    params = SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=0)
    # Dequantized at load, each rank from its own packed shards: exactly the one-rank weights,
    # so only the order of the row-parallel sums differs.
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    exact = _run(path, 1, params)
    assert [o.outputs[0].token_ids for o in _run(path, 3, params)] == [
        o.outputs[0].token_ids for o in exact
    ]
    # Kept quantized (GGUF blocks, activations rounded to int8 per 32 inputs), each rank its
    # shards: the rounding makes both runs differ from the exact one by ~0.1 in a prompt
    # token's logprob, and the ranks' reordered sums move it, so greedy paths may part at a
    # near tie (as with a GGUF file's blocks, tests/executor/test_multiproc.py). Three ranks
    # must be as close to the exact run as one rank is (a wrong shard is off by nats).
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "1")
    ref = _prompt_logprobs(exact)
    one = _mean_abs_diff(_prompt_logprobs(_run(path, 1, params)), ref)
    three = _mean_abs_diff(_prompt_logprobs(_run(path, 3, params)), ref)
    assert three < 1.5 * one + 0.02 and three < 0.25, (one, three)


@pytest.mark.slow
def test_tp3_refuses_a_group_split_between_ranks(tmp_path) -> None:
    """Groups of 128 on 192 inputs: each rank's 64 inputs of o_proj are half a group."""
    _, path = quantized_checkpoint(tmp_path, "awq", group=128, vocab_size=96, **SMALL)
    with pytest.raises(ValueError, match=r"self_attn.o_proj .*not a whole number of quant"):
        LLM(str(path), tensor_parallel_size=3, skip_tokenizer_init=True, **KWARGS)
