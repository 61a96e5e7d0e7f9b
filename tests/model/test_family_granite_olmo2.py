"""Granite (embedding / residual / attention multipliers, logits scaling; tied and untied LM
head) and OLMo 2 (q/k norms over the whole projections, post-norms only) end to end against
`transformers`, as tests/model/test_model_families.py checks the other families: through `LLM`
with batching, chunked prefill and prefix caching on, greedy tokens equal to transformers' and
each token's log-probability within 1e-3, twice over the same prompts.

Also: both families keep off the C decoder stack of CPU steps and refuse llama.cpp's numerics;
OLMo 2's norm weights are sharded with the heads, and two tensor-parallel ranks (gloo) compute
the one-rank logits, KV heads split or replicated; AWQ checkpoints of both run like their
dequantized references; GGUF files of both, written as llama.cpp's convert_hf_to_gguf.py writes
them (Granite's Q/K rows permuted, its multipliers as GGUF keys), give transformers' logits.
"""

from __future__ import annotations

import model_testing
import numpy as np
import pytest
import torch
from model_testing import PagedRunner, assert_two_ranks_match_one, make_tiny_checkpoint
from test_model_families import _prompts, assert_matches_transformers, engine

from pagoda.config import ModelConfig
from pagoda.kernels.cpu import decoder as cdec
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.parallel import set_tensor_parallel

_GRANITE = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0078,
    logits_scaling=8.0,
    initializer_range=0.1,
)
# name -> (transformers config class, model class, overrides of model_testing.TINY_CONFIG)
CASES = {
    "granite_tied": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {**_GRANITE, "tie_word_embeddings": True},
    ),
    "granite_untied": ("GraniteConfig", "GraniteForCausalLM", _GRANITE),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(initializer_range=0.1)),
}


@pytest.fixture
def tiny(monkeypatch):
    """make_tiny_checkpoint with this file's cases added (the norms perturbed there too)."""
    for name, case in CASES.items():
        monkeypatch.setitem(model_testing.TINY_CASES, name, case)
    return make_tiny_checkpoint


def _load(path, **kw):
    cfg = get_model_config_dict(str(path))
    mc = ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=256, **kw)
    return load_model(mc, "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers(tmp_path, monkeypatch, tiny, case):

    stack_calls = []
    run = cdec.CpuDecoderStack.run

    def counting_run(self, *args, **kwargs):
        stack_calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(cdec.CpuDecoderStack, "run", counting_run)
    hf = tiny(tmp_path, case)
    prompts = _prompts(hf.config.vocab_size)
    llm = engine(tmp_path)
    assert_matches_transformers(llm, hf, prompts)
    assert stack_calls == []  # layer by layer: the C stack runs plain Llama layers only


@pytest.mark.parametrize("case", ["granite_tied", "olmo2"])
def test_c_decoder_stack_and_ggml_numerics_refuse_the_model(tmp_path, tiny, case):
    from pagoda.kernels import cpu as cpu_ops
    from pagoda.model.models import llama_cpu_decoder

    tiny(tmp_path, case)
    model = _load(tmp_path)
    if cpu_ops.cpu_ops_available():
        with pytest.raises(llama_cpu_decoder._Unsupported, match="DecoderLayer layers"):
            llama_cpu_decoder._spec(model.model)
    with pytest.raises(ValueError, match="ggml numerics run plain Llama models"):
        model.enable_ggml_numerics("avx2")


def test_granite_scales_and_tied_head(tmp_path, tiny):
    tiny(tmp_path, "granite_tied")
    model = _load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.multiplier == 12.0
    assert model.logits_scaling == 8.0
    for layer in model.model.layers:
        assert layer.self_attn.attn.scale == 0.0078
        assert layer.residual_multiplier == 0.22


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_olmo2_norm_weights_are_sharded_with_the_heads(tmp_path, tiny, num_kv_heads):
    hf = tiny(tmp_path, "olmo2", num_key_value_heads=num_kv_heads)
    ref = hf.state_dict()
    q_norm, k_norm = (ref[f"model.layers.1.self_attn.{n}_norm.weight"] for n in "qk")
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            attn = _load(tmp_path).model.layers[1].self_attn
            half = q_norm.shape[0] // 2
            assert torch.equal(attn.q_norm.weight, q_norm[rank * half : (rank + 1) * half])
            # One KV head on two ranks: each holds all of k, and all of k_norm.
            kv = k_norm.chunk(2)[rank] if num_kv_heads == 2 else k_norm
            assert torch.equal(attn.k_norm.weight, kv)
    finally:
        set_tensor_parallel(0, 1)


@pytest.mark.parametrize("case,num_kv_heads", [("olmo2", 2), ("olmo2", 1), ("granite_tied", 2)])
def test_two_rank_forward_matches_one_rank(tmp_path, tiny, case, num_kv_heads):
    tiny(tmp_path, case, num_key_value_heads=num_kv_heads)
    assert_two_ranks_match_one(tmp_path)


@pytest.mark.parametrize("case", ["granite_tied", "olmo2"])
def test_awq_checkpoint_runs_like_its_dequantized_reference(tmp_path, monkeypatch, tiny, case):
    """quant_testing's AWQ checkpoint of this family (its Llama case swapped for ours),
    dequantized at load: the reference's logits to float rounding."""
    from quant_testing import quantized_checkpoint

    monkeypatch.setitem(model_testing.TINY_CASES, "llama_gqa_tied_llama3_rope", CASES[case])
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    hf, path = quantized_checkpoint(tmp_path, "awq", tie_word_embeddings=True)
    model = _load(path, quantization="awq")
    runner = PagedRunner(model, dict(model.config))
    tokens = list(range(5, 14))
    ours = runner.step(tokens, 0)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


def _write_gguf(hf, path: str, arch: str) -> None:
    """`hf` as llama.cpp's converter writes it: the metadata of its set_gguf_parameters, Granite's
    Q/K rows permuted (LlamaModel.permute), no output tensor for a tied head."""
    gguf = pytest.importorskip("gguf")
    from moe_testing import _permute, finish_gguf
    from test_gguf_archs import _LAYER_NAMES

    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_file_type(0)  # all F32
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    names = {
        **_LAYER_NAMES,
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm" if arch == "granite" else "post_attention_norm",
    }
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                w.add_tensor("output.weight", t)
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor("token_embd.weight" if "embed" in name else "output_norm.weight", t)
            continue
        layer, module = name.split(".")[2], name.split(".", 3)[3].rsplit(".", 1)[0]
        if arch == "granite" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
            t = _permute(t, heads)
        w.add_tensor(f"blk.{layer}.{names[module]}.weight", np.ascontiguousarray(t))
    finish_gguf(w)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_logits_match_transformers(tmp_path, tiny, case):
    arch = case.split("_")[0]
    hf = tiny(tmp_path / "hf", case)
    path = str(tmp_path / "model.gguf")
    _write_gguf(hf, path, arch)
    cfg = get_model_config_dict(path)
    assert cfg["architectures"] == [type(hf).__name__]
    assert cfg["tie_word_embeddings"] == hf.config.tie_word_embeddings
    if arch == "granite":
        for field in _GRANITE:
            if field != "initializer_range":
                assert cfg[field] == pytest.approx(getattr(hf.config, field))
    model = _load(path)
    tokens = list(range(5, 35))
    logits = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (logits - want).abs().max().item() < 1e-4


def test_gguf_granite_without_scale_keys_reads_llama_cpp_defaults():
    from pagoda.model.loader.gguf import gguf_to_hf_config

    meta = {"general.architecture": "granite", "granite.vocab_size": 128}
    for key, value in [("embedding_length", 64), ("block_count", 2), ("feed_forward_length", 96),
                       ("attention.head_count", 4)]:  # fmt: skip
        meta[f"granite.{key}"] = value
    cfg = gguf_to_hf_config(meta)
    assert cfg["attention_multiplier"] == 16**-0.5  # head_dim 64 / 4
    assert cfg["embedding_multiplier"] == cfg["residual_multiplier"] == cfg["logits_scaling"] == 1.0
