"""Writing this step's keys and values into the paged KV cache (vLLM's `reshape_and_cache`).

One program per token copies its [num_kv_heads, head_size] key and value to slot
`slot_mapping[t]` of `kv_cache` (layout in `pagoda.attention.metadata`); slot -1 is a padding
token and is skipped. For an FP8 cache the value stored is x / scale clamped to the format's
finite range; for INT8 it is round-half-to-even(x / scale) clamped to [-128, 127], the same
rounding as `torch.round`.
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
    HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    QUANT: tl.constexpr,
    Q_MIN: tl.constexpr,
    Q_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PADDED)
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
    if QUANT != 0:
        key = _quantize(key, tl.load(k_scale_ptr), QUANT, Q_MIN, Q_MAX)
        value = _quantize(value, tl.load(v_scale_ptr), QUANT, Q_MIN, Q_MAX)
    cache_off = (
        (slot // BLOCK_SIZE) * stride_c_blk
        + (slot % BLOCK_SIZE) * stride_c_slot
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    dst_ty = kv_cache_ptr.dtype.element_ty
    tl.store(kv_cache_ptr + cache_off, key.to(dst_ty), mask=mask)
    tl.store(kv_cache_ptr + stride_c_kv + cache_off, value.to(dst_ty), mask=mask)


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
    num_tokens, num_kv_heads, head_size = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
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
    if num_tokens == 0:
        return
    quant = cache_quant_mode(kv_cache.dtype)
    k_scale_t = scale_tensor(k_scale, key.device)
    v_scale_t = scale_tensor(v_scale, key.device)
    if quant != QUANT_NONE and (k_scale_t is None or v_scale_t is None):
        raise ValueError(f"a {kv_cache.dtype} kv_cache needs k_scale and v_scale")
    q_min, q_max = cache_value_range(kv_cache.dtype) if quant != QUANT_NONE else (0.0, 0.0)
    dummy = slot_mapping
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale_t if k_scale_t is not None else dummy,
        v_scale_t if v_scale_t is not None else dummy,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        QUANT=quant,
        Q_MIN=q_min,
        Q_MAX=q_max,
    )
