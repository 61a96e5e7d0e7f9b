"""The weights `pagoda plan` and the CPU memory check count (`hf_config.weight_params`,
`estimated_weight_bytes`, `memory_estimate.weight_bytes` / `linear_layers`) against the models
Pagoda builds from the same config.json: every family's parameters to the byte, split by kind
(embeddings; the linear layers quantized formats pack; routers and Qwen2-MoE's
shared_expert_gate, dense in every checkpoint; biases and norms). The configs are transformers'
(`Config(...).to_dict()`, as a checkpoint's config.json holds them), with the fields that change
the count: Qwen2-MoE's shared expert and q/k/v biases, dense layers of mixtures of experts
(`mlp_only_layers`, `decoder_sparse_step`), OLMo 2's q/k norms over the whole projections,
Granite's tied and untied heads, Qwen3 / Gemma 3 per-head q/k norms, attention and MLP biases.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.model.loader.hf_config import (
    WeightParams,
    estimated_weight_bytes,
    shared_expert_size,
    sparse_layers,
    weight_params,
)
from pagoda.model.models.moe import is_moe_layer
from pagoda.model.registry import get_model_class
from pagoda.worker.memory_estimate import linear_layers, weight_bytes

_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)  # fmt: skip
_QWEN2_MOE = dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)  # fmt: skip
_QWEN3_MOE = dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)

# name -> (transformers config class, architecture, overrides of _TINY)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # layer 1 a dense MLP of intermediate_size; q/k/v biases (the released configs')
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(**_QWEN2_MOE, mlp_only_layers=[1])),
    # layers 0 and 2 dense by the step, no q/k/v biases, tied head
    "qwen2_moe_step": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            **_QWEN2_MOE,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            qkv_bias=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe_all_sparse": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(**_QWEN2_MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**_QWEN3_MOE, mlp_only_layers=[1])),
    "qwen3_moe_step_bias": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            **_QWEN3_MOE,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            attention_bias=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "granite_tied": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
        ),
    ),
    "granite_untied_biases": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo2_mha_bias": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(num_key_value_heads=4, attention_bias=True),
    ),
    "llama_biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, eos_token_id=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, attention_bias=True)),
}


def _config(case: str) -> dict[str, Any]:
    """The case's config.json as transformers writes it."""
    import transformers

    config_cls, arch, overrides = CASES[case]
    config = getattr(transformers, config_cls)(**{**_TINY, **overrides}).to_dict()
    return {**config, "architectures": [arch]}


def _model_params(model: torch.nn.Module) -> WeightParams:
    """The model's parameters (a tied head once) by the kinds `weight_params` counts."""
    kinds = dict(embeddings=0, linear=0, replicated=0, vectors=0)
    for name, p in model.named_parameters():  # shared parameters come once
        if "embed_tokens" in name or name.startswith("lm_head"):
            kind = "embeddings"
        elif p.dim() == 1:  # biases and norm weights
            kind = "vectors"
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            kind = "replicated"
        else:
            kind = "linear"
        kinds[kind] += p.numel()
    return WeightParams(**kinds)


@pytest.mark.parametrize("case", CASES)
def test_estimate_is_the_built_models_parameters(case) -> None:
    cfg = _config(case)
    model = get_model_class(cfg["architectures"][0])(cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_params(cfg) == _model_params(model)
    assert estimated_weight_bytes(cfg, 4) == nbytes
    assert weight_bytes(cfg, 4) == nbytes  # `pagoda plan`'s unquantized weights
    # The dense layers of a mixture of experts as the model class places them.
    layers = int(cfg["num_hidden_layers"])
    assert sparse_layers(cfg) == [is_moe_layer(cfg, i) for i in range(layers)]
    assert sparse_layers(cfg) == [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    # `linear_layers` (the 8-bit and CPU GGUF-block plans) lists the same linear weights.
    params = weight_params(cfg)
    listed = {dense: 0 for dense in (False, True)}
    for layer in linear_layers(cfg):
        listed[layer.dense] += layer.count * layer.n * layer.k
    assert listed == {False: params.linear, True: params.replicated}


def test_qwen2_moe_dense_layers_and_shared_experts_are_counted() -> None:
    """Qwen2-MoE's layers: a dense MLP of intermediate_size on layers off the sparse step or in
    mlp_only_layers; on the others the experts, the router, the shared expert and its gate."""
    cfg = _config("qwen2_moe_step")
    assert sparse_layers(cfg) == [False, True, False, True]
    assert shared_expert_size(cfg) == 48
    hidden, q, kv = 64, 64, 32
    attention = hidden * (q + 2 * kv) + q * hidden
    dense_mlp, experts, shared = 3 * hidden * 96, 8 * 3 * hidden * 32, 3 * hidden * 48
    got = weight_params(cfg)
    assert got.linear == 4 * attention + 2 * dense_mlp + 2 * (experts + shared)
    assert got.replicated == 2 * (8 * hidden + hidden)  # router, shared_expert_gate
    assert got.vectors == 4 * 2 * hidden + hidden  # two norms a layer, the final one; no biases
    assert got.embeddings == 128 * hidden  # tied


def test_qwen1_5_moe_a2_7b_is_14_3b_parameters() -> None:
    """Qwen/Qwen1.5-MoE-A2.7B's config.json: 14.3B parameters (its model card), of which the
    shared experts are 0.83B; Qwen3-MoE's reading of the same config (no shared expert, no
    biases) would miss those."""
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_attention_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632,
        "tie_word_embeddings": False, "vocab_size": 151936,
    }  # fmt: skip
    total = estimated_weight_bytes(cfg, 1)
    assert 14.3e9 <= total < 14.35e9
    shared = 24 * (3 * 2048 * 5632 + 2048)
    qkv_bias = 24 * 3 * 2048
    as_qwen3 = estimated_weight_bytes({**cfg, "architectures": ["Qwen3MoeForCausalLM"]}, 1)
    assert total - as_qwen3 == shared + qkv_bias - 24 * 2 * 128  # Qwen3's per-head q/k norms
    # bf16 AWQ on CUDA: the shared experts packed with the attention and the experts.
    quant = {"bits": 4, "group_size": 128}
    packed = weight_params(cfg).linear
    assert weight_bytes(cfg, 2, 1, quant) == (
        packed // 2 + packed * 3 // 128 + (total - packed) * 2
    )


def test_packed_qwen2_moe_on_cuda_dequantizes_the_routed_experts_only() -> None:
    """GPTQ 4-bit with act order on CUDA, bf16, Qwen1.5-MoE-A2.7B's shape with layer 0 dense:
    the routed experts of the 23 sparse layers dequantized into the MoE kernel's weights, the
    shared experts and the dense layer kept packed; at tp=2 the row-parallel layers (o_proj,
    the dense down_proj, the shared experts' down_proj) dequantized too."""
    from pagoda.plan_weights import estimate_weights

    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_attention_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632,
        "vocab_size": 151936, "mlp_only_layers": [0],
    }  # fmt: skip
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    cfg["quantization_config"] = qc
    experts = 23 * 60 * 3 * 2048 * 1408
    row_parallel = 24 * 2048 * 2048 + 2048 * 5632 + 23 * 2048 * 5632
    nbytes, why = estimate_weights("m", cfg, "bfloat16", 2, "cuda", "gptq", 1)
    assert nbytes == int(weight_bytes(cfg, 2, 1, qc) + experts * 1.5)
    assert why == "gptq 4-bit layers kept packed, MoE experts dequantized"
    nbytes, why = estimate_weights("m", cfg, "bfloat16", 2, "cuda", "gptq", 2)
    assert nbytes == int(weight_bytes(cfg, 2, 2, qc) + experts // 2 * 1.5 + row_parallel // 2 * 1.5)
    assert why.endswith(", act-order o_proj / down_proj dequantized")
