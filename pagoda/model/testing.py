"""Tiny random checkpoints written by `transformers`, for tests of loaders, models and runners.

`make_tiny_checkpoint(path, "qwen3")` saves a two-layer model (safetensors + config.json) whose
norms and biases are perturbed away from HF's 1/0 initialisation, and returns the HF model as
the numerical reference. Needs `transformers` (a test dependency).
"""

from __future__ import annotations

from typing import Any

import torch

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name -> (transformers config class, model class, overrides of TINY_CONFIG)
TINY_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama_gqa_tied_llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0),
    ),
    "llama_untied_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama_mqa_attention_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


def make_tiny_checkpoint(path: Any, case: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, case_overrides = TINY_CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY_CONFIG, **case_overrides, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model
