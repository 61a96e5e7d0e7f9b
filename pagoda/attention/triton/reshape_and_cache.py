"""Writing this step's keys and values into the paged KV cache (vLLM's `reshape_and_cache`).

One program per token copies its [num_kv_heads, head_size] key and value to slot
`slot_mapping[t]` of `kv_cache` (layout in `pagoda.attention.metadata`); slot -1 is a padding
token and is skipped. For an FP8 cache the value stored is x / scale clamped to the format's
finite range; for INT8 it is round-half-to-even(x / scale) clamped to [-128, 127], the same
rounding as `torch.round`.

`rotary_embedding_and_cache` is RoPE and this write in one launch (the Triton backend's path when
the layer hands it unrotated q and k): it rotates q and k in place exactly as
`pagoda.kernels.rotary.rotary_embedding_triton` does and stores the rotated k (rounded to k's
dtype first, as the separate kernels would) and v with the same quantization, so it equals
`rotary_embedding_triton` followed by `reshape_and_cache`, the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.attention.triton.common import (
    QUANT_NONE,
    cache_quant_mode,
    cache_value_range,
    scale_tensor,
)
from pagoda.kernels import pdl_enabled
from pagoda.kernels.rotary import heads_view, load_cos_sin, rotary_dim, rotate_heads
from pagoda.kernels.triton_pdl import dependent_start


@triton.jit
def _quantize(x, scale, QUANT: tl.constexpr, Q_MIN: tl.constexpr, Q_MAX: tl.constexpr):
    # IEEE division (plain `/` is div.full, ~2 ulp): the same codes as torch's x / scale.
    y = tl.math.div_rn(x.to(tl.float32), scale)
    if QUANT == 2:  # INT8: round half to even, like torch.round
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r % 2.0 != 0.0), r - 1.0, r)
        y = r
    return tl.minimum(tl.maximum(y, Q_MIN), Q_MAX)


@triton.jit
def _store_to_cache(
    ptr, x, mask, scale_ptr, QUANT: tl.constexpr, Q_MIN: tl.constexpr, Q_MAX: tl.constexpr
):
    if QUANT != 0:
        x = _quantize(x, tl.load(scale_ptr), QUANT, Q_MIN, Q_MAX)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale_ptr,
    v_scale_ptr,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_c_kv: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_slot: tl.int64,
    stride_c_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    QUANT: tl.constexpr,
    Q_MIN: tl.constexpr,
    Q_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    key = tl.load(
        key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    cache_off = (
        (slot // BLOCK_SIZE) * stride_c_blk
        + (slot % BLOCK_SIZE) * stride_c_slot
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    _store_to_cache(kv_cache_ptr + cache_off, key, mask, k_scale_ptr, QUANT, Q_MIN, Q_MAX)
    _store_to_cache(
        kv_cache_ptr + stride_c_kv + cache_off, value, mask, v_scale_ptr, QUANT, Q_MIN, Q_MAX
    )


@triton.jit
def _rotary_and_cache_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_heads, head_size], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_size], rotated in place
    value_ptr,
    cos_sin_ptr,  # [max_position, rotary_dim] float32
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [>= num_actual_tokens] int64
    num_actual_tokens,
    num_q_heads,
    k_scale_ptr,
    v_scale_ptr,
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_cs: tl.int64,
    stride_c_kv: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_slot: tl.int64,
    stride_c_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2
    HALF_PADDED: tl.constexpr,
    TAIL: tl.constexpr,  # head_size - rotary_dim: dims copied unrotated (partial rotary)
    TAIL_PADDED: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr,
    QUANT: tl.constexpr,
    Q_MIN: tl.constexpr,
    Q_MAX: tl.constexpr,
    PDL: tl.constexpr,  # `pdl_enabled`: launched as a programmatic dependent (`triton_pdl`)
):
    dependent_start(PDL)
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
    k1, k2 = rotate_heads(
        key_ptr,
        stride_k_tok,
        stride_k_head,
        tok,
        cos,
        sin,
        NUM_KV_HEADS,
        KV_HEADS_PADDED,
        HALF,
        HALF_PADDED,
    )
    # Padding rows (tok >= num_actual_tokens, or slot -1) are rotated but not cached.
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_actual_tokens, other=-1).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, KV_HEADS_PADDED)[:, None]
        h_ok = offs_h < NUM_KV_HEADS
        cache = (
            kv_cache_ptr
            + (slot // BLOCK_SIZE) * stride_c_blk
            + (slot % BLOCK_SIZE) * stride_c_slot
            + offs_h * stride_c_head
        )
        offs_r = tl.arange(0, HALF_PADDED)[None, :]
        r_ok = h_ok & (offs_r < HALF)
        _store_to_cache(cache + offs_r, k1, r_ok, k_scale_ptr, QUANT, Q_MIN, Q_MAX)
        _store_to_cache(cache + HALF + offs_r, k2, r_ok, k_scale_ptr, QUANT, Q_MIN, Q_MAX)
        if TAIL > 0:
            offs_t = 2 * HALF + tl.arange(0, TAIL_PADDED)[None, :]
            t_ok = h_ok & (offs_t < HEAD_SIZE)
            k_tail = tl.load(
                key_ptr + tok * stride_k_tok + offs_h * stride_k_head + offs_t, mask=t_ok
            )
            _store_to_cache(cache + offs_t, k_tail, t_ok, k_scale_ptr, QUANT, Q_MIN, Q_MAX)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)[None, :]
        d_ok = h_ok & (offs_d < HEAD_SIZE)
        value = tl.load(value_ptr + tok * stride_v_tok + offs_h * stride_v_head + offs_d, mask=d_ok)
        _store_to_cache(cache + stride_c_kv + offs_d, value, d_ok, v_scale_ptr, QUANT, Q_MIN, Q_MAX)


def _cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
) -> dict:
    """Validates a cache write; the kernel arguments shared by both kernels."""
    if (
        key.dim() != 3
        or kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[3:] != key.shape[1:]
    ):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match key {tuple(key.shape)}: "
            "expected [2, num_blocks, block_size, num_kv_heads, head_size]"
        )
    if value.shape != key.shape or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need the same shape and a contiguous last dimension")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache needs a contiguous last (head_size) dimension")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    quant = cache_quant_mode(kv_cache.dtype)
    k_scale_t = scale_tensor(k_scale, key.device)
    v_scale_t = scale_tensor(v_scale, key.device)
    if quant != QUANT_NONE and (k_scale_t is None or v_scale_t is None):
        raise ValueError(f"a {kv_cache.dtype} kv_cache needs k_scale and v_scale")
    q_min, q_max = cache_value_range(kv_cache.dtype) if quant != QUANT_NONE else (0.0, 0.0)
    num_kv_heads, head_size = key.shape[1:]
    return dict(
        k_scale_ptr=k_scale_t if k_scale_t is not None else slot_mapping,
        v_scale_ptr=v_scale_t if v_scale_t is not None else slot_mapping,
        stride_c_kv=kv_cache.stride(0),
        stride_c_blk=kv_cache.stride(1),
        stride_c_slot=kv_cache.stride(2),
        stride_c_head=kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        QUANT=quant,
        Q_MIN=q_min,
        Q_MAX=q_max,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_size] at `slot_mapping` ([num_tokens]
    int, -1 = skip) in `kv_cache`; quantized caches need `k_scale` and `v_scale`."""
    num_tokens = key.shape[0]
    args = _cache_args(key, value, kv_cache, slot_mapping, num_tokens, k_scale, v_scale)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        stride_k_tok=key.stride(0),
        stride_k_head=key.stride(1),
        stride_v_tok=value.stride(0),
        stride_v_head=value.stride(1),
        **args,
    )


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_actual_tokens: int,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """RoPE (Neox, `cos_sin_cache` [max_position, rotary_dim] = cat(cos, sin)) applied in place
    to q [T, num_heads, head_size] and key [T, num_kv_heads, head_size] at positions [T], then
    rows [0, num_actual_tokens) of the rotated key and of value stored at `slot_mapping` (-1 =
    skip), in one launch; the same as `rotary_embedding_triton` then `reshape_and_cache`."""
    head_size = key.shape[-1]
    rot = rotary_dim(cos_sin_cache, head_size)
    qh = heads_view(q, head_size, "q")
    num_tokens = qh.shape[0]
    if key.shape[0] != num_tokens or positions.shape[0] < num_tokens:
        raise ValueError(
            f"q has {num_tokens} rows, key {key.shape[0]}, positions {positions.shape[0]}"
        )
    if not 0 <= num_actual_tokens <= num_tokens:
        raise ValueError(f"num_actual_tokens={num_actual_tokens} outside [0, {num_tokens}]")
    args = _cache_args(key, value, kv_cache, slot_mapping, num_actual_tokens, k_scale, v_scale)
    if num_tokens == 0:
        return
    tail = head_size - rot
    _rotary_and_cache_kernel[(num_tokens,)](
        positions,
        qh,
        key,
        value,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        num_actual_tokens,
        qh.shape[1],
        stride_q_tok=qh.stride(0),
        stride_q_head=qh.stride(1),
        stride_k_tok=key.stride(0),
        stride_k_head=key.stride(1),
        stride_v_tok=value.stride(0),
        stride_v_head=value.stride(1),
        stride_cs=cos_sin_cache.stride(0),
        HALF=rot // 2,
        HALF_PADDED=triton.next_power_of_2(rot // 2),
        TAIL=tail,
        TAIL_PADDED=triton.next_power_of_2(tail) if tail else 0,
        Q_HEADS_PADDED=triton.next_power_of_2(qh.shape[1]),
        PDL=pdl_enabled(qh),
        launch_pdl=pdl_enabled(qh),
        **args,
    )
