"""Rotary position embeddings (RoPE, Su et al. 2021) in the Hugging Face / GPT-NeoX convention.

Each head vector is split in two halves (x1, x2) rotated as (x1 cos - x2 sin, x2 cos + x1 sin),
Hugging Face's `rotate_half`. The inverse frequencies follow Hugging Face's rope types exactly:
`default`, `linear` (position interpolation), `llama3` (Llama 3.1's frequency-dependent
scaling) and `longrope` / `su` (Phi-3's per-frequency short/long factors and attention factor).
Partial rotary (`partial_rotary_factor`, Phi-4-mini) rotates the first rotary_dim dims of each
head and passes the rest through. The cos/sin table covers `max_position` positions and is
built once, in float32.
With `fused=True` one kernel rotates q and k in place, in float32: Triton on CUDA
(`pagoda.kernels.rotary_embedding`), C on CPU (`pagoda.kernels.cpu.rotary_embedding`); the torch
code (rounding like Hugging Face) is the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.kernels import cpu as cpu_ops
from pagoda.kernels import rotary_embedding


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the middle band smoothed.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _longrope_inv_freq(
    rotary_dim: int, base: float, max_position: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (Ding et al. 2024, arXiv:2402.13753): inverse frequencies divided by
    per-frequency factors, and cos/sin scaled by an attention factor. The long factors apply
    when the model's context (max_position_embeddings) exceeds the pre-training one, fixed at
    start-up as vLLM does, so every position of every request rotates the same way (Hugging
    Face picks them per forward, by that forward's length)."""
    original = int(scaling["original_max_position_embeddings"])
    long = max_position > original
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(
            f"rope_scaling: longrope factors need {rotary_dim // 2} entries, got {len(factors)}"
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (factors * base**exponents)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor") or max_position / original)
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        )
    return inv_freq, float(attention_factor)


def rope_params(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config.json of transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters`)."""
    params = hf_config.get("rope_parameters") or {}
    theta = float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = hf_config.get("rope_scaling") or params or None
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return theta, scaling


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim = rotary_dim or head_size
        # Built on the CPU in float32 whatever the default device/dtype, then moved.
        with torch.device("cpu"):
            inv_freq = _default_inv_freq(rotary_dim, base)
            rope_type = (rope_scaling or {}).get("rope_type", "default")
            attention_factor = 1.0
            if rope_type == "linear":
                inv_freq = inv_freq / float(rope_scaling["factor"])
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type in ("longrope", "su"):
                inv_freq, attention_factor = _longrope_inv_freq(
                    rotary_dim, base, max_position, rope_scaling
                )
            elif rope_type != "default":
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported; "
                    "supported: default, linear, llama3, longrope"
                )
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq.float())  # [max_position, rotary_dim / 2]
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        self.register_buffer(
            "cos_sin_cache", cache.to(torch.get_default_device()), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_size], k: [T, num_kv_heads, head_size] -> rotated copies, or
        q and k rotated in place when `fused` (on CUDA, or on CPU with the C ops)."""
        if fused:
            if q.is_cuda:
                return rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_size)
            if cpu_ops.rotary_embedding_supported(q, k, self.cos_sin_cache, self.head_size):
                return cpu_ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_size)
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_size / 2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary: the dims past rotary_dim pass through
        return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(hf_config: dict[str, Any], head_size: int) -> RotaryEmbedding:
    """The rotary embedding for a config; layers share one instance (one cos/sin table)."""
    theta, scaling = rope_params(hf_config)
    params = hf_config.get("rope_parameters") or {}
    partial = hf_config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_size * float(partial))
    if scaling is not None and scaling.get("rope_type") in ("longrope", "su"):
        # transformers 4 keeps original_max_position_embeddings beside rope_scaling.
        original = scaling.get("original_max_position_embeddings") or hf_config.get(
            "original_max_position_embeddings"
        )
        scaling = {**scaling, "original_max_position_embeddings": original}
    max_position = int(hf_config.get("max_position_embeddings") or 2048)
    key = (
        head_size,
        rotary_dim,
        max_position,
        theta,
        repr(sorted((scaling or {}).items())),
        str(torch.get_default_device()),
    )
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _ROPE_CACHE[key] = RotaryEmbedding(
            head_size, max_position, theta, scaling, rotary_dim
        )
    return rope
