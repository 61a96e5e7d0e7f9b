"""GGUF architectures laid out differently from Llama: Gemma 2, Gemma 3 (text), Phi-3, Granite,
OLMo 2 and Qwen2-MoE's shared expert.

What llama.cpp's `convert_hf_to_gguf.py` writes for them, and how it maps back to the Hugging
Face config fields and parameters that `gemma.py`, `granite.py`, `olmo2.py` and `llama.py`'s
`Phi3ForCausalLM` read:
- Gemma 2/3: every `*norm.weight` is stored as 1 + weight (Gemma's RMSNorm scales by
  1 + weight, ggml's by the weight), so `norm_offset` gives the 1 to subtract; four norms a
  block (`post_attention_norm`, `ffn_norm` = pre-feed-forward, `post_ffw_norm`); no
  query_pre_attn_scalar key: llama.cpp scales queries by head_dim ** -0.5, or by
  (hidden_size / heads) ** -0.5 for the 27B models (recognised by their layer count);
- Gemma 2: local layers every other one from layer 0; attention and final logit soft caps
  (llama.cpp's defaults 50 and 30 where the keys are absent);
- Gemma 3: every 6th layer global, local layers with RoPE base 10000 and no scaling (llama.cpp
  hard-codes both), global ones with `rope.freq_base` and the file's rope scaling;
- Phi-3: `attn_qkv` and `ffn_up` (gate and up) fused as HF stores them; partial rotary from
  `rope.dimension_count`; LongRoPE's factors as the tensors `rope_factors_long/short` and its
  attention factor as `rope.scaling.attn_factor`; `sliding_window` 0 for none (Phi-4);
- Granite: Llama's tensors (Q/K rows permuted by the converter as Llama's, undone in gguf.py)
  and its multipliers as `embedding_scale`, `residual_scale`, `attention.scale` and
  `logit_scale`; llama.cpp reads an absent (or zero) one as no scaling, and so no attention
  scale as head_dim ** -0.5;
- OLMo 2: no pre-norms; `post_attention_norm` and `post_ffw_norm` after the sublayers, q/k norms
  over the whole projections as HF stores them (the converter permutes nothing);
- Qwen2-MoE: beside the routed experts (gguf.py, as Qwen3-MoE's, but top-k weights not
  renormalized) the shared expert `ffn_{gate,up,down}_shexp` of
  `expert_shared_feed_forward_length` (llama.cpp: `feed_forward_length` where absent) and its
  one-output sigmoid gate `ffn_gate_inp_shexp`, [1, hidden] as HF stores it or [hidden] from
  older converters (reshaped in gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# Layer tensor names that differ from the Llama ones (gguf.py's _LAYER_NAMES).
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": {
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    "olmo2": {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Granite's GGUF keys -> its config.json fields.
_GRANITE_SCALES = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
# Tensors read into the config rather than loaded as parameters.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's 27B Gemmas (by layer count) scale queries by (hidden_size / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_GLOBAL_EVERY = 6


def norm_offset(arch: str, name: str) -> float:
    """What to add to a GGUF tensor to get HF's value: -1 for a Gemma norm (see above)."""
    return -1.0 if arch in ("gemma2", "gemma3") and name.endswith("norm.weight") else 0.0


def arch_config(
    arch: str,
    config: Mapping[str, Any],
    get: Callable[[str], Any],
    read_tensor: Callable[[str], np.ndarray] | None,
    tensor_names: set[str] | None,
) -> dict[str, Any]:
    """The config fields an architecture adds to or changes in the Llama-style `config`.

    `get(key)` reads `{arch}.{key}` (None when absent); `read_tensor` reads a tensor as float32
    (None when only the metadata is known)."""
    if arch in ("gemma2", "gemma3"):
        return _gemma_config(arch, config, get)
    if arch == "phi3":
        return _phi3_config(config, get, read_tensor, tensor_names)
    if arch == "granite":
        out = {field: _number(get, key, arch) or 1.0 for key, field in _GRANITE_SCALES.items()}
        if not get("attention.scale"):
            out["attention_multiplier"] = config["head_dim"] ** -0.5
        return out
    return {}


def _number(get: Callable[[str], Any], key: str, arch: str) -> float | None:
    value = get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"GGUF key {arch}.{key} must be a number, got {value!r:.100}")
    return float(value)


def _gemma_config(arch: str, config: Mapping[str, Any], get: Callable[[str], Any]) -> dict:
    value_length = get("attention.value_length")
    if value_length is not None and value_length != config["head_dim"]:
        raise ValueError(
            f"GGUF key {arch}.attention.value_length ({value_length}) differs from "
            f"{arch}.attention.key_length ({config['head_dim']}): Pagoda needs them equal"
        )
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    window = get("attention.sliding_window")
    if not window:
        raise ValueError(
            f"GGUF metadata lacks {arch}.attention.sliding_window: Gemma's local layers need it"
        )
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
        "sliding_window": int(window),
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _number(get, "attn_logit_softcapping", arch) or 50.0
        out["final_logit_softcapping"] = _number(get, "final_logit_softcapping", arch) or 30.0
        out["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    else:
        if get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"GGUF key {arch}.attn_logit_softcapping is set: Gemma 3 has no attention soft cap"
            )
        out["final_logit_softcapping"] = _number(get, "final_logit_softcapping", arch)
        out["rope_local_base_freq"] = 10000.0
        out["sliding_window_pattern"] = _GEMMA3_GLOBAL_EVERY
        out["layer_types"] = [
            "sliding_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY else "full_attention"
            for i in range(layers)
        ]
    return out


def _phi3_config(
    config: Mapping[str, Any],
    get: Callable[[str], Any],
    read_tensor: Callable[[str], np.ndarray] | None,
    tensor_names: set[str] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"sliding_window": int(get("attention.sliding_window") or 0) or None}
    head_dim = config["head_dim"]
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        out["partial_rotary_factor"] = int(rope_dims) / head_dim
    if config.get("rope_scaling") is not None:
        raise ValueError(
            f"GGUF key phi3.rope.scaling.type is {config['rope_scaling']['rope_type']!r}: "
            "Pagoda reads Phi-3's rope scaling only as LongRoPE factor tensors"
        )
    if tensor_names is None or ROPE_FACTOR_TENSORS[0] not in tensor_names:
        return out  # no LongRoPE: a 4k-context Phi-3 or a Phi-4
    if ROPE_FACTOR_TENSORS[1] not in tensor_names:
        raise ValueError(f"GGUF file has {ROPE_FACTOR_TENSORS[0]} but no {ROPE_FACTOR_TENSORS[1]}")
    if read_tensor is None:
        raise ValueError("Phi-3 LongRoPE factors are tensors: pass the GGUFReader, not metadata")
    original = get("rope.scaling.original_context_length")
    if original is None:
        raise ValueError(
            "GGUF metadata lacks phi3.rope.scaling.original_context_length: LongRoPE needs it"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "original_max_position_embeddings": int(original),
        "long_factor": read_tensor(ROPE_FACTOR_TENSORS[0]).reshape(-1).tolist(),
        "short_factor": read_tensor(ROPE_FACTOR_TENSORS[1]).reshape(-1).tolist(),
    }
    attn_factor = _number(get, "rope.scaling.attn_factor", "phi3")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    out["rope_scaling"] = scaling
    out["original_max_position_embeddings"] = int(original)
    return out
