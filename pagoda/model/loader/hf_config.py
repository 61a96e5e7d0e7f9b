"""Checks of a checkpoint's config.json (or the GGUF metadata it is built from): every field the
model code reads has the type and range that code needs, so that a bad file fails once, at
start-up, with a `ValueError` naming the file and the field, rather than as `invalid literal for
int()` or a zero-sized tensor somewhere inside the model's construction.

Only the fields Pagoda reads are checked; the others are left as the file has them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_REQUIRED_COUNTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# None (or absent) means "derive it": from num_attention_heads, hidden_size, or 2048.
_OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "max_position_embeddings",
                    # mixtures of experts (Mixtral, Qwen3-MoE)
                    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")  # fmt: skip
_OPTIONAL_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
                   "norm_topk_prob")  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_hf_config(
    config: Mapping[str, Any], source: str, keys: Mapping[str, str] | None = None
) -> None:
    """Raise ValueError("{source}: {field} ...") for the first field Pagoda cannot use.

    `keys` maps a field to where it came from (a GGUF metadata key) for the message."""

    def fail(field: str, what: str) -> None:
        where = f"{field} ({keys[field]})" if keys and field in keys else field
        raise ValueError(f"{source}: {where} {what}, got {config.get(field)!r:.100}")

    for field in _REQUIRED_COUNTS:
        if field not in config:
            fail(field, "is missing (a positive integer)")
    for field in _REQUIRED_COUNTS + _OPTIONAL_COUNTS:
        value = config.get(field)
        if value is None and field in _OPTIONAL_COUNTS:
            continue
        if not (_is_int(value) and value > 0):
            fail(field, "must be a positive integer")
    for field in _OPTIONAL_POSITIVE_NUMBERS:
        value = config.get(field)
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            fail(field, "must be a positive number")
    for field in _OPTIONAL_BOOLS:
        if config.get(field) is not None and not isinstance(config[field], bool):
            fail(field, "must be true or false")

    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        fail("num_key_value_heads", f"must divide num_attention_heads ({heads})")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        fail("hidden_size", f"must be a multiple of num_attention_heads ({heads}) without head_dim")

    archs = config.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)
    ):
        fail("architectures", "must be a non-empty list of names")
    eos = config.get("eos_token_id")
    if eos is not None and not (
        (_is_int(eos) and eos >= 0)
        or (isinstance(eos, list) and eos and all(_is_int(t) and t >= 0 for t in eos))
    ):
        fail("eos_token_id", "must be a token id or a list of them")
    quant = config.get("quantization_config")
    if quant is not None and not (
        isinstance(quant, dict) and isinstance(quant.get("quant_method"), str)
    ):
        fail("quantization_config", 'must be an object naming its "quant_method"')
    sliding_window = config.get("sliding_window")
    if sliding_window is not None and not (_is_int(sliding_window) and sliding_window >= 0):
        fail("sliding_window", "must be a non-negative integer or null")
    for field in ("rope_scaling", "rope_parameters"):
        scaling = config.get(field)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            fail(field, "must be an object or null")
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            value = scaling.get(key)
            if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
                fail(field, f"needs a positive number as {key}")
        original = scaling.get("original_max_position_embeddings")
        if original is not None and not (_is_int(original) and original > 0):
            fail(field, "needs a positive integer as original_max_position_embeddings")


def _architecture(config: Mapping[str, Any]) -> str:
    """config.json's `architectures[0]` (Llama's where it lists none, as `ModelConfig` reads it)."""
    return (config.get("architectures") or ["LlamaForCausalLM"])[0]


def tied_word_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the LM head is the token embedding: `tie_word_embeddings`, which Gemma's models
    default to true and the others to false (as each model class reads it)."""
    tied = config.get("tie_word_embeddings")
    return _architecture(config).startswith("Gemma") if tied is None else bool(tied)


def num_experts(config: Mapping[str, Any]) -> int:
    """The experts of a mixture of experts' sparse layer (Mixtral's `num_local_experts`, Qwen's
    `num_experts`), 0 for a dense model."""
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def expert_intermediate_size(config: Mapping[str, Any]) -> int:
    """An expert's intermediate size: Qwen's `moe_intermediate_size`, Mixtral's experts of the
    config's `intermediate_size`."""
    return int(config.get("moe_intermediate_size") or config["intermediate_size"])


def sparse_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which decoder layers are mixture-of-experts ones, by the rule of
    `pagoda.model.models.moe.is_moe_layer` (that module imports torch): a layer not in
    `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step` (Qwen2-MoE,
    Qwen3-MoE; Mixtral's configs have neither field, so every layer); none of a dense model's."""
    layers = int(config["num_hidden_layers"])
    if not num_experts(config):
        return [False] * layers
    dense_only = config.get("mlp_only_layers") or []
    step = int(config.get("decoder_sparse_step") or 1)
    return [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]


def shared_expert_size(config: Mapping[str, Any]) -> int:
    """The intermediate size of the dense shared expert on each sparse layer (Qwen2-MoE's
    `shared_expert_intermediate_size`), 0 for a family without one."""
    if _architecture(config) != "Qwen2MoeForCausalLM":
        return 0
    return int(config.get("shared_expert_intermediate_size") or 0)


@dataclass(frozen=True)
class WeightParams:
    """The parameters of a (checked) config's model as Pagoda builds it, by kind: the linear
    layers that AWQ / GPTQ / W8A8 / FP8 checkpoints quantize, and those every checkpoint keeps
    in the model's dtype."""

    embeddings: int  # the token embeddings, and the LM head unless tied
    linear: int  # q/k/v/o, dense MLPs, routed experts and Qwen2-MoE's shared experts
    replicated: int  # MoE routers (`mlp.gate`) and Qwen2-MoE's `shared_expert_gate`
    vectors: int  # biases and norm weights

    @property
    def total(self) -> int:
        return self.embeddings + self.linear + self.replicated + self.vectors


def _attention_biases(config: Mapping[str, Any], arch: str) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as the model classes' `flags` read them."""
    if arch == "Qwen2ForCausalLM":
        return True, False
    if arch == "Qwen2MoeForCausalLM":  # transformers 5's `qkv_bias`; released configs lack it
        return bool(config.get("qkv_bias", True)), False
    if arch in ("MixtralForCausalLM", "Phi3ForCausalLM"):
        return False, False
    bias = bool(config.get("attention_bias", False))  # Llama, Gemma, Qwen3(-MoE), Granite, OLMo2
    return bias, bias


def weight_params(config: Mapping[str, Any]) -> WeightParams:
    """The parameter counts of the model Pagoda builds from a (checked) config, one rank's at
    tensor_parallel_size 1: per decoder layer q/k/v/o (with biases where the family has them),
    the norms (per head for Qwen3's and Gemma 3's q/k norms, over the whole projections for
    OLMo 2's; four a layer for Gemma), and the MLP: a dense gated one of `intermediate_size`
    (with `mlp_bias`), or on a mixture of experts' sparse layers (`sparse_layers`) the router
    and every expert's gated MLP (`moe_intermediate_size`), plus Qwen2-MoE's shared expert
    and its one-output gate; then the embeddings, the LM head unless tied and the final norm."""
    arch = _architecture(config)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    gemma = arch.startswith("Gemma")
    qkv_bias, o_bias = _attention_biases(config, arch)

    attention = hidden * (q + 2 * kv) + q * hidden
    vectors = (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
    if arch == "Olmo2ForCausalLM":  # post-attention and post-MLP norms, q/k norms over all heads
        vectors += 2 * hidden + q + kv
    elif gemma:  # before and after attention and the MLP; Gemma 3's per-head q/k norms
        vectors += 4 * hidden + (2 * head_dim if arch == "Gemma3ForCausalLM" else 0)
    else:  # input and post-attention norms; Qwen3's per-head q/k norms
        vectors += 2 * hidden + (2 * head_dim if arch.startswith("Qwen3") else 0)
    layers = int(config["num_hidden_layers"])
    linear, replicated, vectors = layers * attention, 0, layers * vectors

    inter = int(config["intermediate_size"])
    experts = num_experts(config)
    moe_inter = expert_intermediate_size(config)
    shared = shared_expert_size(config)
    mlp_bias = not gemma and bool(config.get("mlp_bias", False))
    for sparse in sparse_layers(config):
        if sparse:
            linear += experts * 3 * hidden * moe_inter + 3 * hidden * shared
            replicated += experts * hidden + (hidden if shared else 0)
        else:
            linear += 3 * hidden * inter
            vectors += 2 * inter + hidden if mlp_bias else 0
    embeddings = vocab * hidden * (1 if tied_word_embeddings(config) else 2)
    return WeightParams(embeddings, linear, replicated, vectors + hidden)


def estimated_weight_bytes(config: Mapping[str, Any], bytes_per_param: int) -> int:
    """The size of a (checked) config's model with every parameter `bytes_per_param` bytes
    (`weight_params`): the dense weights Pagoda holds for it, the rotary tables aside."""
    return weight_params(config).total * bytes_per_param


def layer_sliding_windows(config: Mapping[str, Any]) -> list[int | None]:
    """Each layer's sliding window (a query at p sees keys (p - window, p]), None for a layer
    with full attention, as Hugging Face reads the config: `layer_types` where the config lists
    them, else Gemma 2's alternation (even layers local), Gemma 3's `sliding_window_pattern`
    (every n-th layer global), Qwen2/3's `use_sliding_window` from `max_window_layers` on, and
    every layer otherwise (Mistral, Phi-3)."""
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return [None] * num_layers
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return [window if t == "sliding_attention" else None for t in layer_types]
    arch = (config.get("architectures") or [""])[0]
    if arch.startswith("Gemma2"):
        return [window if i % 2 == 0 else None for i in range(num_layers)]
    if arch.startswith("Gemma3"):
        pattern = int(config.get("sliding_window_pattern") or 6)
        return [window if (i + 1) % pattern else None for i in range(num_layers)]
    if arch.startswith("Qwen"):
        if not config.get("use_sliding_window"):
            return [None] * num_layers
        first = int(config.get("max_window_layers") or 0)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers


def kv_cache_sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window every layer attends within (the KV cache manager frees blocks behind it),
    or None when some layer attends to the whole context."""
    windows = layer_sliding_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
