"""Triton kernel for rotary position embeddings (RoPE, Su et al. 2021), GPT-NeoX style.

Rotates q and k in place (one program per token, all heads at once) from vLLM's
`cos_sin_cache` [max_position, rotary_dim] = cat(cos, sin); the pairs are (x[i],
x[i + rotary_dim / 2]), Hugging Face's `rotate_half`. Dims past `rotary_dim` are left as they
are (partial rotary). Math in float32; `pagoda.kernels.reference.rotary_embedding_ref` is the
reference. `rotate_heads` is shared with the kernel that also writes the rotated keys to the
paged KV cache (`pagoda.attention.triton.reshape_and_cache.rotary_embedding_and_cache`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_heads(
    x_ptr,
    stride_tok,
    stride_head,
    tok,
    cos,
    sin,
    num_heads,
    HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    """Rotate the first 2 * HALF dims of row `tok`'s heads in place; returns the two rotated
    halves [HEADS_PADDED, HALF_PADDED] in x's dtype (what was stored)."""
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_r = tl.arange(0, HALF_PADDED)
    mask = (offs_h[:, None] < num_heads) & (offs_r[None, :] < HALF)
    ptr1 = x_ptr + tok * stride_tok + offs_h[:, None] * stride_head + offs_r[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    y1 = (x1 * cos - x2 * sin).to(ty)
    y2 = (x2 * cos + x1 * sin).to(ty)
    tl.store(ptr1, y1, mask=mask)
    tl.store(ptr1 + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def load_cos_sin(
    positions_ptr, cos_sin_ptr, tok, stride_cs, HALF: tl.constexpr, HALF_PADDED: tl.constexpr
):
    """cos and sin [1, HALF_PADDED] in float32 at row `tok`'s position."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, HALF_PADDED)
    r_ok = offs_r < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_r, mask=r_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_r, mask=r_ok, other=0.0)
    return cos.to(tl.float32)[None, :], sin.to(tl.float32)[None, :]


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_cs: tl.int64,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr,
    K_HEADS_PADDED: tl.constexpr,
    HAS_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, tok, stride_cs, HALF, HALF_PADDED)
    rotate_heads(
        q_ptr,
        stride_q_tok,
        stride_q_head,
        tok,
        cos,
        sin,
        num_q_heads,
        Q_HEADS_PADDED,
        HALF,
        HALF_PADDED,
    )
    if HAS_K:
        rotate_heads(
            k_ptr,
            stride_k_tok,
            stride_k_head,
            tok,
            cos,
            sin,
            num_k_heads,
            K_HEADS_PADDED,
            HALF,
            HALF_PADDED,
        )


def heads_view(x: torch.Tensor, head_size: int, name: str) -> torch.Tensor:
    """x [T, heads * head_size] or [T, heads, head_size] as [T, heads, head_size]."""
    if x.dim() == 3:
        ok = x.shape[-1] == head_size
    else:
        ok = x.dim() == 2 and x.shape[-1] % head_size == 0
    if not ok or x.stride(-1) != 1:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} must be [T, heads * {head_size}] or "
            f"[T, heads, {head_size}] with a contiguous last dimension"
        )
    return x.view(x.shape[0], -1, head_size)


def rotary_dim(cos_sin_cache: torch.Tensor, head_size: int) -> int:
    """The rotated dims of each head from cos_sin_cache [max_position, rotary_dim] (validated)."""
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 != 0 or rot > head_size or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            f"cos_sin_cache [max_position, rotary_dim] needs an even rotary_dim <= head_size "
            f"({head_size}) and a contiguous last dimension, got shape {tuple(cos_sin_cache.shape)}"
        )
    return rot


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, num_heads(*)head_size] and k in place at positions [T]; returns (q, k)."""
    half = rotary_dim(cos_sin_cache, head_size) // 2
    qh = heads_view(q, head_size, "q")
    kh = heads_view(k, head_size, "k") if k is not None else qh
    num_tokens = qh.shape[0]
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        positions,
        qh,
        kh,
        cos_sin_cache,
        qh.stride(0),
        qh.stride(1),
        kh.stride(0),
        kh.stride(1),
        cos_sin_cache.stride(0),
        qh.shape[1],
        kh.shape[1],
        HALF=half,
        HALF_PADDED=triton.next_power_of_2(half),
        Q_HEADS_PADDED=triton.next_power_of_2(qh.shape[1]),
        K_HEADS_PADDED=triton.next_power_of_2(kh.shape[1]),
        HAS_K=k is not None,
    )
    return q, k
