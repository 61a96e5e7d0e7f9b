"""Plain torch references of the fused Triton ops in `pagoda.kernels`.

They define the semantics the kernels must match (and are the CPU path): Hugging Face Llama's
RMSNorm with the residual add of vLLM's `fused_add_rms_norm`, SwiGLU's `silu(gate) * up`, and
GPT-NeoX / Hugging Face `rotate_half` rotary embeddings read from vLLM's `cos_sin_cache`
layout ([max_position, rotary_dim] = cat(cos, sin)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(h), h) with h = x + residual (or x when residual is None); statistics
    in float32, the sum and the normalized value rounded to x.dtype as Hugging Face does."""
    h = x if residual is None else x + residual
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype), h


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> silu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate the first `rotary_dim` dims of every head of q / k in place (neox style) at
    `positions` [T]; q: [T, num_heads * head_size] or [T, num_heads, head_size]."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rot / 2]
    for x in (q, k):
        if x is None:
            continue
        xh = x.view(x.shape[0], -1, head_size)  # [T, heads, head_size], a view of x
        x1 = xh[..., : rot // 2].float()
        x2 = xh[..., rot // 2 : rot].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        xh[..., :rot] = rotated.to(x.dtype)
    return q, k
