"""Triton W8A16 GEMM on CUDA: y[M, N] = x[M, K] @ W^T (+ bias) with 8-bit weights kept 8-bit,
W[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], g(k) = k // G (the last group may be shorter),
16-bit (or fp32) activations, fp32 accumulation.

The layout (8-bit GPTQ checkpoints are repacked into it once at load, on the device:
`pagoda.model.quantization.w8_layout`): qweight [N, K] uint8 codes, scales [groups, N] (the
checkpoint's fp16), zeros [groups, N] int16 holding z - 128 or none (every z = 128: GPTQ's
symmetric checkpoints), perm [K] int32 or none (an act-order layer's inputs sorted by group:
packed input k is x[:, perm[k]], gathered by the kernel).

The kernel multiplies the centered codes q - 128, which are exact in fp16 and bf16, and made
without an int-to-float conversion (a quarter-rate instruction on sm_90, too slow for a weight
stream): a byte ORed under the exponent of 1024.0 (fp16) or 2^23 (fp32, then rounded to bf16,
exactly) reads 1024 + q or 2^23 + q; one subtraction centers it (`_centered`). Swap-AB tiles
as in `w4a16.py`: acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, the weight rows on the MMA's
64-row side and a decode's few rows on its N side, weights loaded evict_first (read once) and
pipelined over K. Where a K tile lies in one group (G a multiple of BLOCK_K: 32, 64, 128 or
one group per row) its scale and zero apply to the tile's fp32 product:
    sum_k (q - z) s x = s * (sum_k (q - 128) x - (z - 128) sum_k x),
the zero term dropped for symmetric weights; otherwise each element is dequantized in fp32
first. Grids that would not cover the SMs split K (the last split to arrive sums the fp32
partials in split order: `skinny_gemm.store_tile`, counters made by `skinny_gemm.prepare`
before CUDA-graph capture). From DEQUANT_MIN_M rows `w8a16_linear` writes the dense weight
(one pass: K*N bytes read, 2*K*N written) and calls cuBLAS instead, whose matrix rate the
fused kernel does not reach. `w8_layout.dequantize_w8` + F.linear stay the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda.kernels.skinny_gemm import (
    SMEM_BUDGET,
    _num_sms,
    check_tiles,
    split_k_buffers,
    split_k_plan,
    store_tile,
)
from pagoda.kernels.w4a16 import tile_block_k

MAX_BLOCK_M = 128
# What `w8a16_linear` runs by row count: this module's kernel up to DEQUANT_MIN_M - 1 rows (one
# 128-row block at most), the dequantized weight and cuBLAS from there, as the 4-bit path
# does. A first guess from the 4-bit measurements: `benchmarks/w8a16_bench.py` times both at
# every row count and prints where the kernel stops winning.
DEQUANT_MIN_M = MAX_BLOCK_M + 1
DEQUANT = "dequant"


@triton.jit
def _centered(q, dtype: tl.constexpr):
    """q [R, C] uint8 codes -> q - 128 in `dtype`, exactly, with integer ops and one float
    subtraction (no int-to-float conversion): the byte ORed into the low mantissa bits of
    1024.0 (fp16, 10 mantissa bits) or 2^23 (fp32; bf16 then keeps its 8 significant bits)."""
    if dtype == tl.float16:
        t = q.to(tl.int16) | 0x6400  # 1024 + q
        return tl.cast(t, tl.float16, bitcast=True) - 1152.0
    else:
        t = q.to(tl.int32) | 0x4B000000  # 2^23 + q
        c = tl.cast(t, tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
        return c.to(dtype)


# M = 1 (single-stream decode) must stay a runtime value: Triton would otherwise specialize it
# into a constant, which has no `.to` (the split-K offsets).
@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_x: tl.int64,
    stride_qw: tl.int64,
    stride_y: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr,  # K tiles within groups: zero and scale on the product
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # M fastest: programs running together share weight tiles
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            w_mask = n_ok[:, None] & (kk < K)[None, :]
            x_mask = m_ok[:, None] & (kk < K)[None, :]
        # Weights are read once: do not let them evict what the next kernels reuse. Inputs
        # past K read code 0 against x = 0: nothing added.
        q = tl.load(qw_rows + kk[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
        c = _centered(q, dtype)  # [BLOCK_N, BLOCK_K]: q - 128
        if HAS_PERM:
            xk = tl.load(perm_ptr + kk, mask=kk < K, other=0)
        else:
            xk = kk
        x = tl.load(x_rows + xk[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCALE_AFTER_DOT:
            g = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            part = tl.dot(c, tl.trans(x), input_precision=DOT_PRECISION)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.float32)
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                part -= z[:, None] * x_sum[None, :]
            acc += s[:, None] * part
        else:
            gk = (kk // GROUP_SIZE)[None, :] * N + offs_n[:, None]
            gk_mask = n_ok[:, None] & (kk < K)[None, :]
            s = tl.load(scales_ptr + gk, mask=gk_mask, other=0.0).to(tl.float32)
            w = c.to(tl.float32)
            if HAS_ZEROS:
                w -= tl.load(zeros_ptr + gk, mask=gk_mask, other=0).to(tl.float32)
            w = (w * s).to(dtype)  # (q - z) s, rounded once
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)

    counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
    store_tile(
        acc, y_ptr, bias_ptr, partial_ptr, counter, offs_m, offs_n, m_ok, n_ok,
        M, N, stride_y, pid_k, split_k, HAS_BIAS, SPLIT,
    )  # fmt: skip


@triton.jit
def _dequant_kernel(
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    w_ptr,
    N,
    K,
    stride_qw: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w[n, k] = (q - z) s in w's dtype, one [BLOCK_N, BLOCK_K] tile per program (inputs in
    packed order: an act-order layer's x is gathered instead)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(
        qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw + offs_k[None, :],
        mask=mask,
        other=0,
        eviction_policy="evict_first",
    )
    w = _centered(q, tl.float32)
    gk = (offs_k // GROUP_SIZE)[None, :] * N + offs_n[:, None]
    if HAS_ZEROS:
        w -= tl.load(zeros_ptr + gk, mask=mask, other=0).to(tl.float32)
    w *= tl.load(scales_ptr + gk, mask=mask, other=0.0).to(tl.float32)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty), mask=mask)


class W8A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    scale_after_dot: bool  # zero and scale on each tile's product (groups of whole K tiles)


def block_m_for(m: int) -> int:
    """The activation-row tile: the next power of two >= m, at least 16 (the MMA's minimum),
    at most MAX_BLOCK_M (more rows take more M blocks)."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def _group_arg(k: int, group_size: int, block_k: int) -> int:
    """The kernel's GROUP_SIZE: one group (G >= K) becomes a multiple of BLOCK_K >= K, so every
    tile is in group 0."""
    return triton.cdiv(k, block_k) * block_k if group_size >= k else group_size


def default_config(
    m: int, n: int, k: int, group_size: int, num_sms: int = 132, *, elem_bytes: int = 2
) -> W8A16Config:
    """The tile by row count (`benchmarks/w8a16_bench.py --sweep` times the alternatives on a
    GPU). Up to 64 rows the layer streams its weights with zero and scale on each tile's
    product: to 32 rows 64-row weight tiles, three stages and K split until the grid covers
    the SMs about four times (the best of the sweep on an H200 for the Llama-3-8B layers at
    1 and 16 rows, 1.3x the default it replaced); at 64 rows 64 x 64 tiles, the grid twice
    over the SMs. From 65 rows 128 x 128 x 64 tiles and 8 warps, dequantized per element (no
    second accumulator to hold)."""
    block_m = block_m_for(m)
    block_k = tile_block_k(group_size, k)
    if block_m <= 32:
        block_n, num_warps, num_stages = 64, 4, 3
    elif block_m == 64:
        block_n, num_warps, num_stages = 64, 4, 4
    else:
        block_n, block_k, num_warps, num_stages = 128, min(block_k, 64), 8, 3
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if block_m <= 32:
        split_k = max(1, min(8, triton.cdiv(4 * num_sms, tiles)))
    else:
        split_k = max(1, min(8, (2 * num_sms) // tiles))
    stage_bytes = block_n * block_k + block_m * block_k * elem_bytes
    num_stages = max(2, min(num_stages, SMEM_BUDGET // (2 * stage_bytes)))
    split_k = split_k_plan(k, block_k, split_k)[1]
    after_dot = block_m <= 64 and _group_arg(k, group_size, block_k) % block_k == 0
    return W8A16Config(block_m, block_n, block_k, split_k, num_warps, num_stages, after_dot)


def choose_config(
    m: int, n: int, k: int, group_size: int, num_sms: int = 132, elem_bytes: int = 2
) -> W8A16Config | str:
    """What `w8a16_linear` runs by default: `DEQUANT` from DEQUANT_MIN_M rows (16-bit x only:
    cuBLAS's fp32 GEMM gains nothing over the kernel's), else a `W8A16Config`."""
    if m >= DEQUANT_MIN_M and elem_bytes == 2:
        return DEQUANT
    return default_config(m, n, k, group_size, num_sms, elem_bytes=elem_bytes)


def w8a16_supported(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """K-contiguous x [M, K] (fp16, bf16, fp32) and a uint8 qweight [N, K] with contiguous rows
    on one device (CUDA, unless the caller runs Triton elsewhere: `w8a16_enabled` decides)."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and qweight.dtype == torch.uint8
        and qweight.device == x.device
        and qweight.dim() == 2
        and qweight.shape[1] == x.shape[1]
        and qweight.stride(1) == 1
        and (bias is None or (bias.shape == (qweight.shape[0],) and bias.is_contiguous()))
    )


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`, inputs in packed order (one memory-bound pass)."""
    n, k = qweight.shape
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 64, 128
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        zeros if zeros is not None else scales,
        w,
        n,
        k,
        qweight.stride(0),
        GROUP_SIZE=min(group_size, k),
        HAS_ZEROS=zeros is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return w


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    *,
    config: W8A16Config | str | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, W in the layout above (qweight, scales,
    zeros of the same device; perm for an act-order layer). `config` defaults to
    `choose_config`: a `W8A16Config` runs this module's kernel, `DEQUANT` the dequantized
    weight and cuBLAS. Raises ValueError where `w8a16_supported` says no or the config cannot
    run."""
    if not w8a16_supported(x, qweight, bias):
        raise ValueError(
            f"w8a16_linear: unsupported inputs x {tuple(x.shape)} {x.dtype} {x.device}, "
            f"qweight {tuple(qweight.shape)} {qweight.dtype} {qweight.device}"
        )
    m, k = x.shape
    n = qweight.shape[0]
    groups = triton.cdiv(k, group_size)
    if scales.shape != (groups, n) or (
        zeros is not None and (zeros.shape != (groups, n) or zeros.dtype != torch.int16)
    ):
        raise ValueError(
            f"scales {tuple(scales.shape)} / zeros "
            f"{None if zeros is None else (tuple(zeros.shape), zeros.dtype)}: expected "
            f"({groups}, {n}) and int16 zeros (or none) for K={k}, G={group_size}"
        )
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError(f"perm must be int32 of shape ({k},), got {tuple(perm.shape)}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    cfg = config or choose_config(m, n, k, group_size, _num_sms(x.device), x.element_size())
    if cfg == DEQUANT:
        w = dequantize_weight(qweight, scales, zeros, group_size, x.dtype)
        if perm is not None:
            x = x.index_select(1, perm)
        return F.linear(x, w, bias)
    if not isinstance(cfg, W8A16Config):
        raise ValueError(f"config must be a W8A16Config or {DEQUANT!r}, got {cfg!r}")
    check_tiles(cfg.split_k, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k)
    block_m, block_n, block_k = cfg.block_m, cfg.block_n, cfg.block_k
    k_per_split, split_k = split_k_plan(k, block_k, cfg.split_k)
    group_arg = _group_arg(k, group_size, block_k)
    if cfg.scale_after_dot and group_arg % block_k:
        raise ValueError(
            f"scale_after_dot needs groups of whole K blocks: G={group_size}, block_k={block_k}"
        )
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    counters, partials = split_k_buffers(y, m_tiles * n_tiles, split_k)
    _w8a16_kernel[(m_tiles, n_tiles, split_k)](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        perm if perm is not None else qweight,
        bias if bias is not None else x,
        y,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        split_k,
        x.stride(0),
        qweight.stride(0),
        y.stride(0),
        GROUP_SIZE=group_arg,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        SCALE_AFTER_DOT=cfg.scale_after_dot,
        EVEN_K=k % block_k == 0,
        SPLIT=split_k > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=cfg.num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
    )
    return y
