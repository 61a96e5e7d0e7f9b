"""Checks of a checkpoint's config.json (or the GGUF metadata it is built from): every field the
model code reads has the type and range that code needs, so that a bad file fails once, at
start-up, with a `ValueError` naming the file and the field, rather than as `invalid literal for
int()` or a zero-sized tensor somewhere inside the model's construction.

Only the fields Pagoda reads are checked; the others are left as the file has them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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


def estimated_weight_bytes(config: Mapping[str, Any], bytes_per_param: int) -> int:
    """The dense weights' size of a (checked) Llama-family config: embeddings, the LM head
    unless tied, and per layer q/k/v/o and the gated MLP, or for a mixture of experts (Mixtral's
    `num_local_experts`, Qwen3-MoE's `num_experts`) the router and every expert's gated MLP
    (norms are negligible; Qwen3-MoE's dense `mlp_only_layers` are counted as sparse)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * (2 * heads + 2 * kv_heads) * head_dim
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if experts:
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        per_layer += experts * (3 * hidden * inter + hidden)
    else:
        per_layer += 3 * hidden * config["intermediate_size"]
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return (embeddings + config["num_hidden_layers"] * per_layer) * bytes_per_param


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
