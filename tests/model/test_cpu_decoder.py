"""The one-call C decoder stack of CPU decode steps (`pagoda.model.models.llama_cpu_decoder`)
against the layer-by-layer path it replaces (`PAGODA_CPU_DECODER=0`): the same kernels in the
same order, so greedy tokens and every reported log-probability must be bitwise equal, for
batches of several decoding requests, with the stack shown to have run.

Cases: the embedded GGUF model (blocks kept quantized; its fused layers mix Q4_1 and Q8_0
parts), AWQ and act-order GPTQ checkpoints (their layers GGUF blocks, act order gathering each
layer's inputs), and tiny transformers checkpoints in float32 (skinny GEMM on plain weights; over the
default float16 cache, a float32, a bf16 and an fp8 e5m2 one) and bf16 (packed GEMM) covering GQA/MQA,
q/k/v/o/MLP biases, q/k norms, partial LongRoPE and sliding windows.
"""

from __future__ import annotations

import pytest
import torch
from model_testing import make_tiny_checkpoint

from pagoda.kernels import cpu as cpu_ops
from pagoda.kernels.cpu import decoder as cdec

_RUN = cdec.CpuDecoderStack.run

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available(), reason="the C CPU ops do not build here"
)


def _generate(monkeypatch, enabled: bool, model: str | None, prompts, max_tokens: int, **kw):
    from pagoda import LLM, SamplingParams

    monkeypatch.setenv("PAGODA_CPU_DECODER", "1" if enabled else "0")
    calls = []

    def counting_run(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return _RUN(self, x, *args, **kwargs)

    monkeypatch.setattr(cdec.CpuDecoderStack, "run", counting_run)
    llm = LLM(model, max_num_seqs=4, enable_prefix_caching=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = [
        (o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs
    ]
    return result, calls


def _check_equal(monkeypatch, model, prompts, max_tokens, **kw):
    ref, ref_calls = _generate(monkeypatch, False, model, prompts, max_tokens, **kw)
    got, calls = _generate(monkeypatch, True, model, prompts, max_tokens, **kw)
    assert ref_calls == []
    assert max(calls) > 1  # batches of several rows went through the stack
    assert len(calls) >= max_tokens - 1
    for (ref_tokens, ref_lps), (tokens, lps) in zip(ref, got, strict=True):
        assert tokens == ref_tokens
        for ref_lp, lp in zip(ref_lps, lps, strict=True):
            assert [(t, x.logprob) for t, x in lp] == [(t, x.logprob) for t, x in ref_lp]


def test_embedded_gguf_model_decodes_as_layer_by_layer(monkeypatch):
    prompts = [list(range(1000, 1000 + n)) for n in (5, 17, 40)]
    _check_equal(monkeypatch, None, prompts, 12, max_model_len=256)


@pytest.mark.parametrize(
    "dtype,kv_cache_dtype",
    [
        ("float32", "auto"),
        ("float32", "float32"),
        ("float32", "bfloat16"),
        ("float32", "fp8_e5m2"),
        ("bfloat16", "auto"),
    ],
    ids=["float32", "float32-f32cache", "float32-bf16cache", "float32-e5m2cache", "bfloat16"],
)
@pytest.mark.parametrize(
    "case",
    [
        "llama_gqa_tied_llama3_rope",
        "llama_mqa_attention_bias",
        "mistral_sliding_window",
        "phi3",
        "qwen2",
        "qwen3",
    ],
)
def test_tiny_models_decode_as_layer_by_layer(tmp_path, monkeypatch, case, dtype, kv_cache_dtype):
    hf = make_tiny_checkpoint(tmp_path, case)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 30)
    ]
    _check_equal(
        monkeypatch,
        str(tmp_path),
        prompts + [prompts[0] + prompts[1]],
        10,
        skip_tokenizer_init=True,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=128,
        block_size=8,
        kv_cache_memory_bytes=4 << 20,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_awq_gptq_blocks_decode_as_layer_by_layer(tmp_path, monkeypatch, method, act_order, dtype):
    # Their layers are GGUF blocks on a CPU; act order gathers each layer's inputs first.
    from quant_testing import quantized_checkpoint

    hf, path = quantized_checkpoint(tmp_path, method, 4, act_order)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 30)
    ]
    _check_equal(
        monkeypatch,
        str(path),
        prompts + [prompts[0] + prompts[1]],
        10,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=128,
        block_size=8,
        kv_cache_memory_bytes=4 << 20,
    )


def test_unsupported_models_keep_the_layer_path(tmp_path, monkeypatch):
    make_tiny_checkpoint(tmp_path, "mixtral")
    _, calls = _generate(
        monkeypatch,
        True,
        str(tmp_path),
        [[1, 2, 3]],
        4,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        kv_cache_memory_bytes=1 << 20,
    )
    assert calls == []
