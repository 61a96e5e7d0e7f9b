"""Triton W4A16 GEMM on CUDA: y[M, N] = x[M, K] @ W^T (+ bias) with 4-bit weights kept packed,
W[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], g(k) = k // G (the last group may be shorter).

The layout (AWQ and GPTQ checkpoints are repacked into it once at load, on the device:
`pagoda.model.quantization.w4_layout`):
- qweight [N, ceil(K/8)] int32: word j of row n holds inputs 8j..8j+7 of row n, input
  8j + AWQ_ORDER[s] in nibble s (AWQ's interleave 0, 2, 4, 6, 1, 3, 5, 7, here along K), K
  padded with zeros to a multiple of 8;
- scales [ceil(K/G), N] (the checkpoint's fp16): group-major, a tile's scales are one
  coalesced row of BLOCK_N values;
- zeros [ceil(K/G), N] uint8: the zero points (GPTQ's stored zero - 1, plus 1: up to 16);
- perm [K] int32 or none: a GPTQ act-order layer's inputs sorted by group; packed input k is
  x[:, perm[k]] (the kernel gathers it), so groups are k // G again.
About K*N/2 bytes, plus 3 bytes per group and output (2.3% more at G = 128).

Swap-AB tiles as in `skinny_gemm.py`: each program computes acc[BLOCK_N, BLOCK_M] =
W_tile[BLOCK_N, BLOCK_K] @ x_tile[BLOCK_M, BLOCK_K]^T, so the weight rows fill the MMA's 64-row
side and a decode's few rows its N side; the words are loaded once per 8 inputs (evict_first:
read once) and pipelined over K. The weight tile is built in registers with no int-to-float
conversion: one shift and one AND-OR put inputs 2s and 2s + 1 (nibbles s and s + 4, hence the
interleave) into the mantissas of two 16-bit floats of value 16 + q, exactly (`_unpack`). Where
G is a multiple of BLOCK_K (the usual case: G = 128 or 64 and BLOCK_K <= G) a tile has one
scale and zero per row, applied to the tile's fp32 product:
    sum_k (q - z) s x = s * (sum_k (16 + q) x - (16 + z) sum_k x),
so the MMA takes the raw 16 + q and nothing is done per element but the unpacking; the tile's
sum of x is reduced in the kernel for up to 32 rows, and summed once beforehand
(`chunk_sums`) for larger row tiles. Other groups take a per-element (q - z) * s in fp32.
A grid over M blocks serves prefill (BLOCK_M up to 128); grids that would not cover the SMs
split K as the skinny GEMM does (the last split to arrive sums the fp32 partials in split
order, with the same per-device counters: `skinny_gemm.prepare` before CUDA-graph capture).
`formats.dequantize_*` + F.linear stay the reference (tests compare them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels import w4a16_gemv, w4a16_wgmma
from pagoda.kernels.skinny_gemm import (
    SMEM_BUDGET,
    check_tiles,
    split_k_buffers,
    split_k_plan,
    store_tile,
)
from pagoda.kernels.w4a16_gemv import GemvConfig
from pagoda.kernels.w4a16_wgmma import WgmmaConfig

MAX_BLOCK_M = 128
# The exponent bits of 16.0 in both halves of a word (bf16, fp16); fp32 converts instead.
NIBBLE_MAGIC = {torch.bfloat16: 0x41804180, torch.float16: 0x4C004C00, torch.float32: 0}


@triton.jit
def _shift_right(words, s: tl.constexpr):
    if s >= 0:
        return words >> s
    else:
        return words << -s


@triton.jit
def _unpack(words, magic, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """words [BLOCK_N, BLOCK_K/8] -> [BLOCK_N, BLOCK_K] values 16 + q in `dtype`, k in order.
    Nibbles s and s + 4 of a word are inputs 2s and 2s + 1: one shift and one AND-OR put both
    into the mantissas of a pair of 16-bit floats in [16, 32) (16 + q exactly). `magic` holds
    the two exponents (NIBBLE_MAGIC): a runtime value, so that it sits in a register and the
    AND and the OR are one LOP3."""
    if dtype == tl.bfloat16:  # 16.0 = 0x4180, 7 mantissa bits: q at bits 3..6
        LSB2: tl.constexpr = 3
    elif dtype == tl.float16:  # 16.0 = 0x4C00, 10 mantissa bits: q at bits 6..9
        LSB2: tl.constexpr = 6
    else:
        LSB2: tl.constexpr = 0
    t = tl.join(
        tl.join(_shift_right(words, -LSB2), _shift_right(words, 8 - LSB2)),
        tl.join(_shift_right(words, 4 - LSB2), _shift_right(words, 12 - LSB2)),
    )  # [BLOCK_N, BLOCK_K/8, 2, 2]: nibble pair i at [i // 2, i % 2]
    t = t & ((0xF << LSB2) * 0x10001)
    if dtype == tl.float32:
        lo = (t & 0xFFFF).to(tl.float32)
        hi = (t >> 16).to(tl.float32)
        q = tl.join(lo, hi) + 16.0
    else:
        t = t | magic
        lo = tl.cast(t.to(tl.int16), dtype, bitcast=True)
        hi = tl.cast((t >> 16).to(tl.int16), dtype, bitcast=True)
        q = tl.join(lo, hi)  # [BLOCK_N, BLOCK_K/8, 2, 2, 2]
    return tl.reshape(q, (BLOCK_N, BLOCK_K))


# M = 1 (single-stream decode) must stay a runtime value: Triton would otherwise specialize it
# into a constant, which has no `.to` (the split-K offsets).
@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    x_sums_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    magic,
    stride_x: tl.int64,
    stride_qw: tl.int64,
    stride_y: tl.int64,
    stride_xs,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr,  # TILE_GROUPS only: zero and scale on the tile's product
    PRE_SUMS: tl.constexpr,  # the tiles' sums of x come from x_sums [M, ceil(K / BLOCK_K)]
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # A tile within one group: a scale and a zero per row.
    TILE_GROUPS: tl.constexpr = GROUP_SIZE % BLOCK_K == 0
    pid_m = tl.program_id(0)  # M fastest: programs running together share weight tiles
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    m_ok = offs_m < M
    n_ok = offs_n < N
    num_words = (K + 7) // 8
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        wk = k0 // 8 + offs_w
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            w_mask = n_ok[:, None] & (wk < num_words)[None, :]
            x_mask = m_ok[:, None] & (kk < K)[None, :]
        # Weights are read once: do not let them evict what the next kernels reuse.
        words = tl.load(qw_rows + wk[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
        q16 = _unpack(words, magic, BLOCK_N, BLOCK_K, dtype)  # 16 + q
        if HAS_PERM:
            xk = tl.load(perm_ptr + kk, mask=kk < K, other=0)
        else:
            xk = kk
        x = tl.load(x_rows + xk[None, :], mask=x_mask, other=0.0)
        if TILE_GROUPS:
            g = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z16 = tl.load(zeros_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.float32) + 16.0
            s = s[:, None]
            z16 = z16[:, None]
        else:
            gk = (kk // GROUP_SIZE)[None, :] * N + offs_n[:, None]
            gk_mask = n_ok[:, None] & (kk < K)[None, :]
            s = tl.load(scales_ptr + gk, mask=gk_mask, other=0.0).to(tl.float32)
            z16 = tl.load(zeros_ptr + gk, mask=gk_mask, other=0).to(tl.float32) + 16.0
        if SCALE_AFTER_DOT:
            # sum_k (q - z) s x = s (sum_k (16 + q) x - (16 + z) sum_k x): nothing per element
            # but the unpacking, the product exact in fp32.
            if PRE_SUMS:  # summed once by the caller, not by every N tile
                x_sums_k = x_sums_ptr + offs_m * stride_xs + k0 // BLOCK_K
                x_sum = tl.load(x_sums_k, mask=m_ok, other=0.0)
            else:
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
            part = tl.dot(q16, tl.trans(x), input_precision=DOT_PRECISION)
            acc += s * (part - z16 * x_sum[None, :])
        else:
            w = ((q16.to(tl.float32) - z16) * s).to(dtype)  # (q - z) s, rounded once
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)

    counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
    store_tile(
        acc, y_ptr, bias_ptr, partial_ptr, counter, offs_m, offs_n, m_ok, n_ok,
        M, N, stride_y, pid_k, split_k, HAS_BIAS, SPLIT,
    )  # fmt: skip


def block_m_for(m: int) -> int:
    """The activation-row tile: the next power of two >= m, at least 16 (the MMA's minimum),
    at most MAX_BLOCK_M (more rows take more M blocks)."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def tile_block_k(group_size: int, k: int, want: int = 128) -> int:
    """The largest power of two <= `want` (>= 16) that divides the group, so each K tile has one
    scale per row; `want` when none does (odd groups: per-element scales)."""
    if group_size >= k:  # one group
        return want
    bk = want
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk if group_size % bk == 0 else want


class W4A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    scale_after_dot: bool  # zero and scale on each tile's product (groups a multiple of block_k)
    pre_sums: bool  # with scale_after_dot: x's tile sums made once before the kernel


def default_config(
    m: int, n: int, k: int, group_size: int, num_sms: int = 132, *, elem_bytes: int = 2
) -> W4A16Config:
    """A first guess, not yet timed (`python benchmarks/w4a16_bench.py` sweeps the
    alternatives), from the instructions per weight of sm_90 builds (the issue rate bounds a
    decode here: ~36 weights per SM and clock stream in at 4.8 TB/s). Up to 64 rows the layer
    streams its packed weights: zero and scale on each tile's product, deep pipelines (a
    128 x 128 tile is 8 KB), 128-row weight tiles up to 32 rows (3.2 warp-instructions per 32
    weights, 4.4 with 64 rows), the kernel's own tile sums of x; 64 x 64 tiles and sums made
    before at 64 rows; more rows, 128 x 128 x 64 tiles dequantized per element (no second
    accumulator to hold). K is split until the grid covers the SMs about twice."""
    block_m = block_m_for(m)
    block_k = tile_block_k(group_size, k)
    if block_m <= 32:
        block_n, num_warps, num_stages = 128, 4, 6 if block_m <= 16 else 4
    elif block_m == 64:
        block_n, num_warps, num_stages = 64, 4, 4
    else:
        block_n, block_k, num_warps, num_stages = 128, min(block_k, 64), 8, 3
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = max(1, min(8, (2 * num_sms) // tiles))
    stage_bytes = block_n * block_k // 2 + block_m * block_k * elem_bytes
    num_stages = max(2, min(num_stages, SMEM_BUDGET // (2 * stage_bytes)))
    split_k = split_k_plan(k, block_k, split_k)[1]
    after_dot = block_m <= 64 and _tile_groups(k, group_size, block_k)
    return W4A16Config(
        block_m, block_n, block_k, split_k, num_warps, num_stages, after_dot, block_m == 64
    )


def _group_arg(k: int, group_size: int, block_k: int) -> int:
    """The kernel's GROUP_SIZE: one group (G >= K) becomes a multiple of BLOCK_K >= K, so every
    tile is in group 0."""
    return triton.cdiv(k, block_k) * block_k if group_size >= k else group_size


def _tile_groups(k: int, group_size: int, block_k: int) -> bool:
    return _group_arg(k, group_size, block_k) % block_k == 0


def w4a16_supported(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """K-contiguous x [M, K] (fp16, bf16, fp32) and a packed qweight [N, ceil(K/8)] on one
    device (CUDA, unless the caller runs Triton elsewhere: `w4a16_enabled` decides)."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and qweight.dtype == torch.int32
        and qweight.device == x.device
        and qweight.dim() == 2
        and qweight.shape[1] == triton.cdiv(x.shape[1], 8)
        and qweight.stride(1) == 1
        and (bias is None or (bias.shape == (qweight.shape[0],) and bias.is_contiguous()))
    )


def chunk_sums(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[M, K] -> [M, ceil(K / chunk)] float32 sums of each row's chunks (the last may be
    shorter)."""
    m, k = x.shape
    full = k // chunk
    sums = torch.empty((m, triton.cdiv(k, chunk)), dtype=torch.float32, device=x.device)
    if full:
        head = x[:, : full * chunk].reshape(m, full, chunk)
        torch.sum(head, dim=-1, dtype=torch.float32, out=sums[:, :full])
    if k % chunk:
        torch.sum(x[:, full * chunk :], dim=-1, dtype=torch.float32, out=sums[:, full])
    return sums


# What w4a16_linear runs by row count, from the H200 measurement of the Llama-3-8B layers
# (`benchmarks/w4a16_skinny_bench.py`, benchmarks/README.md; the bulk ring's rule from an
# H100's): the CUDA decode kernel (`w4a16_gemv`) up to GEMV_MAX_M rows (its bulk ring, sm_90;
# GEMV_REGISTER_MAX_M with the register kernel before sm_90), the Triton few-row kernel
# (`w4a16_skinny._pairs_kernel`) up to SKINNY_MAX_M rows; then the same kernel in its many-row
# modes (`many_rows_config`: x reordered into the nibble planes' order, zero and scale per
# weight, one accumulator) up to MANY_ROWS_MAX_M rows, and up to MANY_ROWS_WIDE_MAX_M for
# layers of at least SKINNY_WIDE_N outputs: they won over this module's kernel and
# dequantize-then-cuBLAS on every layer but o at 64 rows (23.3 vs 21.0 us), 5.06 vs 6.34 ms a
# decode step at 64 rows, 7.62 vs 9.15 at 128, gate_up 169 vs 192 us at 256.
# Dequantize-then-cuBLAS from DEQUANT_MIN_M rows otherwise (192 rows: 11.4 vs 15.5 ms a
# decode step with this module's kernel, 256: 11.9 vs 15.8). Where the groups do not hold
# whole 128-input tiles: the few-row kernel on 64-input tiles up to SKINNY_WIDE_MAX_M rows
# for wide layers, else this module's kernel up to MAX_BLOCK_M rows. On sm_90 the wgmma
# kernel (`w4a16_wgmma`) takes the layers and rows where it won on an H100 (`wgmma_config`).
GEMV_MAX_M = 16
GEMV_REGISTER_MAX_M = 8
GEMV_SC_RING = 0  # the ring's `GemvConfig.sc_ring` where N allows (see `gemv_config`)
GEMV_MIN_WARPS = 0  # the ring's resident warps an SM up to 8 rows (`GemvConfig.min_warps`)
SKINNY_MAX_M = 32
SKINNY_WIDE_MAX_M = 64
SKINNY_WIDE_N = 16384
MANY_ROWS_MAX_M = 128
MANY_ROWS_WIDE_MAX_M = 256
DEQUANT_MIN_M = MAX_BLOCK_M + 1
DEQUANT = "dequant"


def skinny_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132):
    """The few-row kernel's config (`w4a16_skinny.SkinnyConfig`), or None where the groups
    do not hold whole K tiles of 128 or 64 inputs. From the H200 sweep (4 GEMMs of
    Llama-3-8B, M = 1..16): 128 x 128 weight tiles, 4 warps and 3 stages everywhere (4 and 6
    stages and 256-row tiles were slower but for gate_up, by 3%); K split until about two
    programs per SM run (qkv 8, o 8, gate_up 2), twice that for a deep layer whose splits
    would still hold 12+ K tiles (down: 16 splits, 18.7 vs 20.2 us). 32-row x tiles (17-32
    rows) split neither a grid of about a wave (gate_up: 48.2 vs 56.4 us in 2 splits) nor a
    deep layer twice (down: 26.1 vs 33.8 us in 16): 3.26 / 3.33 vs 3.78 / 3.89 ms a decode step
    at 24 / 32 rows. 64-row x tiles (wide layers where the many-row modes cannot run): 256-row
    weight tiles, 8 warps, about one program per SM."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig, skinny_supported

    block_k = next((bk for bk in (128, 64) if skinny_supported(k, group_size, bk)), None)
    if block_k is None:
        return None
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    programs = triton.next_power_of_2(2 * num_sms + 1) // 2  # 256 for 132 SMs
    if block_m <= 32:
        block_n, num_warps = 128, 4
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        split_k = triton.next_power_of_2(triton.cdiv(programs, tiles))
        if block_m == 32:  # twice the fp32 partials per split of a 16-row tile
            split_k = 1 if 2 * tiles >= programs else split_k
        elif triton.cdiv(k, block_k) // split_k >= 12 and 2 * split_k * tiles <= 2 * programs:
            split_k *= 2
    else:
        block_n, num_warps = 256, 8
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        split_k = max(1, programs // tiles)
    split_k = split_k_plan(k, block_k, min(16, split_k))[1]
    return SkinnyConfig(block_m, block_n, block_k, split_k, num_warps, 3)


def many_rows_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132):
    """The few-row kernel in its many-row modes (`SkinnyConfig` with `planar` and `scale_w`),
    or None where K is not whole 128-input tiles within groups. From the H200 sweep of the
    Llama-3-8B layers at 64, 128 and 256 rows (8 tiles each): 64-row x tiles against 128-row
    weight tiles up to 64 rows and past 128, 128-row x tiles against 64-row weight tiles in
    between (down 64.1 vs 74.2 us at 128 rows); 4 warps, 3 stages (4 were as fast or up to
    1.4x slower); K split until the grid covers the SMs about twice."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig, skinny_supported

    if k % 128 or not skinny_supported(k, group_size, 128):
        return None
    block_m = 128 if 64 < m <= 128 else 64
    block_n = 8192 // block_m
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = split_k_plan(k, 128, max(1, min(8, (2 * num_sms) // tiles)))[1]
    return SkinnyConfig(block_m, block_n, 128, split_k, 4, 3, planar=True, scale_w=True)


def gemv_config(
    m: int, n: int, k: int, group_size: int, bulk: bool = True, num_sms: int = 132
) -> GemvConfig | None:
    """The CUDA decode kernel's config (`w4a16_gemv`) for these shapes, or None where it is
    not chosen: more than GEMV_MAX_M rows (GEMV_REGISTER_MAX_M without `bulk`), or its shape
    rules say no (the inputs' own checks come at the call: `unsupported_reason`). Every
    config is launched as a programmatic dependent (`pdl`, where `pdl_enabled`).

    With `bulk` (sm_90): the weights through the shared-memory ring, from the H100 sweep of the
    Llama-3-8B layers (`benchmarks/w4a16_skinny_bench.py`, 208 configs, M = 1..16): 32-row
    tiles, but 16-row ones for deep layers (K >= 8192) up to 4 rows; 4 warps for layers of
    >= 16384 outputs, 8 for the others; 2 stages of 2 K steps per warp; the zero point on the
    product (sums by mma) for the wide layers up to 8 rows. 1.74 ms a decode step at 1 row
    against 2.04 with the register rule below, 2.40 at 16 rows against the Triton few-row
    kernel's 2.70. The producer asks for the CTA's scale and zero-point rows into L2 at its
    start (`sc_prefetch`; the consumers load them a step ahead, and waited ~10% of their stall
    samples on that load from memory): whole steps 2.0-2.6% faster at 1-16 rows on the H100
    (1.713 / 1.724 / 1.901 / 2.136 ms against 1.758 / 1.759 / 1.946 / 2.184 at 1 / 4 / 8 / 16
    rows, `results/h200/run94-sc-prefetch/`; a third ring stage was slower). The scales and
    zero points through the ring (`sc_ring`, where
    GEMV_SC_RING and N allow) are off: they cut the loop's instructions a K step by 12-16%
    but made whole steps 13-20% slower on the H200 (a stage then also waits for the small
    copies of its scales and zero points); so is the ring without a producer warp
    (`producer=0`), 13-28% slower (`benchmarks/README.md`). So are the registers held to 20
    resident warps an SM (`min_warps`, GEMV_MIN_WARPS up to 8 rows where > 0: gate_up's
    5-warp CTAs 4 an SM at 96 registers instead of 3): 2-3% faster at 1-4 rows on the H100
    while a K step's group took a division, 5-9% slower (spilling) since it is a shift and its
    scales and zero points sit at fixed offsets. Past 8 rows (two B tiles) a 9-warp CTA's
    registers hold it to one an SM, so a layer of more 32-row tiles than SMs takes 4 warps
    and 3 stages instead, two an SM in one round (qkv at 16 rows: 9.1 vs 11.5 us on the H100).
    With PAGODA_W4A16_SC_EARLY its consumers load their first scales before the PDL wait.

    Without (before sm_90), the register kernel, from the H200 sweep (43 configs, M = 1..32):
    2 K steps per batch; 16-row tiles up to 4 rows, 32-row ones above; 4 warps for layers of
    >= 16384 outputs (gate_up 25.1 vs 27.5 us at 1 row: more CTAs per SM), 8 for the others;
    x's loads issued early; the zero point on the product for deep layers with 16-row tiles
    (down 16.2 vs 18.3 us at 1 row; slower elsewhere); no L2 prefetch (10% slower on
    average). Past 8 rows the Triton few-row kernel won (2.39 vs 2.82 ms a decode step at 16
    rows)."""
    if m > (GEMV_MAX_M if bulk else GEMV_REGISTER_MAX_M) or k % w4a16_gemv.STEP:
        return None
    if group_size % w4a16_gemv.STEP and group_size < k:
        return None
    warps = 4 if n >= SKINNY_WIDE_N else 8
    if bulk:
        stages = 2
        sc_ring = int(bool(GEMV_SC_RING) and n % 16 == 0)
        if m > 8 and warps == 8 and -(-n // 32) > num_sms:  # 9-warp CTAs one an SM: 2 rounds
            warps, stages = 4, 3
        return GemvConfig(
            row_tiles=1 if k >= 8192 and m <= 4 else 2,
            warps=warps,
            sum_mma=int(n >= SKINNY_WIDE_N and m <= 8),
            bulk=1,
            stages=stages,
            chunk=2 * warps,
            pdl=1,
            sc_ring=sc_ring,
            min_warps=GEMV_MIN_WARPS if m <= 8 else 0,
            sc_prefetch=int(not sc_ring),
            sc_early=int(envs.PAGODA_W4A16_SC_EARLY),
        )
    row_tiles = 1 if m <= 4 else 2
    return GemvConfig(
        row_tiles=row_tiles,
        warps=warps,
        depth=2,
        l2_prefetch=0,
        sum_mma=int(row_tiles == 1 and k >= 8192),
        x_early=1,
        pdl=1,
    )


def choose_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132, elem_bytes=2):
    """What `w4a16_linear` runs by default (see SKINNY_MAX_M): a `GemvConfig` or a
    `WgmmaConfig` (16-bit x, the CUDA kernels; the call falls back to `fallback_config` where
    they cannot run), a `SkinnyConfig`, `DEQUANT` (16-bit x only), or a `W4A16Config` of this
    module's kernel."""
    if elem_bytes == 2:
        cfg = gemv_config(m, n, k, group_size, num_sms=num_sms)
        cfg = cfg or wgmma_config(m, n, k, group_size)
        if cfg is not None:
            return cfg
    return fallback_config(m, n, k, group_size, num_sms, elem_bytes)


WGMMA_MAX_M = 1024  # rows up to which the wgmma kernel was measured to win
WGMMA_MIN_N = 4096


def wgmma_config(m: int, n: int, k: int, group_size: int) -> WgmmaConfig | None:
    """The wgmma kernel's config (`w4a16_wgmma`, sm_90; elsewhere the call falls back to
    `fallback_config`) where it beat the other kernels, or None. From the H100 sweeps of the
    Llama-3-8B layers (`benchmarks/w4a16_skinny_bench.py`, ~35-70 configs each) in
    `benchmarks/results/h200/`: run39-split-epilogue (4-h100 at 32-512 rows, 7-h100 at 96-192
    with tiles of 96, 160 and 192 rows, 5-h100 at 1024) and run44-split-sum (64-256 rows, with
    the split-K sum that keeps 4 splits' loads in flight); us per layer against the rule
    before (the same run):
    - wide layers (gate_up): one activation tile of all the rows up to 256 (32: 38.0 vs 39.3;
      64: 41.3 vs 46.7; 96: 46.9 vs 61.6 with 4 warpgroups; 128: 65.3 vs 77.2; 160: 71.1 vs
      106.6; 192: 77.8 vs 108.2; 256: 101.1 vs 125.9), below cuBLAS on bf16 weights from 96
      rows (107.3 / 98.2 / 110.1 at 96 / 192 / 256); 256-row tiles to 512 (200.3 vs 245.5);
    - deep ones (down, K >= 2N) from 33 rows: 64-row tiles, 2 warpgroups, two CTAs a SM to 64
      rows (37.5 vs 38.4), 4 warpgroups to 128 (50.8 vs 50.9), one tile of all the rows at
      129-192 (160: 69.2 vs 79.2; 192: 59.5 vs 70.7), 128-row tiles past 192 (256: 70.4 vs
      72.4; 512: 107.3 vs 129.8);
    - the others (qkv, o) from 33 rows: to 64 rows 64-row tiles and two CTAs a SM, qkv with 2
      warpgroups and one A buffer (20.3 vs 24.7 at 64), o with one warpgroup and 4 K steps of
      weights in flight (18.1 vs 28.7 for the Triton kernels); to 256 rows 64-row tiles, one
      warpgroup, 4 K steps in flight (qkv 25.5 / 34.3 at 128 / 256 rows, o 23.8 / 24.8 /
      27.1 at 128 / 160 / 256), qkv with one tile of all the rows at 129-192 (26.4 / 28.2 at
      160 / 192 vs 31.3 / 31.9) and one A buffer past 192 (34.3 vs 46.8 at 256), o with two
      (27.1 vs 32.0); to 512 256-row tiles for qkv (51.6 vs 63.1) and 128-row tiles for o
      (34.0 vs 41.2);
    - every layer from 513 rows to 1024: 256-row tiles (1024 rows: gate_up 350.8 vs 428.0
      dequantizing for cuBLAS, down 178.4 vs 205.4, o 53.4 vs 62.5; qkv 100.4 vs 94.3). Past
      1024 rows (prefill) dequantizing for cuBLAS, unmeasured."""
    if k % w4a16_wgmma.STEP or (group_size % w4a16_wgmma.STEP and group_size < k):
        return None
    if m < 17 or m > WGMMA_MAX_M or n < WGMMA_MIN_N:
        return None
    if m > 512:
        return WgmmaConfig(bn=256, stages=3, a_buffers=1)
    if n >= SKINNY_WIDE_N:
        if m <= 32:
            return WgmmaConfig(bn=32, a_buffers=1, ctas_per_sm=2)
        if m <= 64:
            return WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2)
        if m <= 96:
            return WgmmaConfig(bn=96, warpgroups=4, a_buffers=1)
        if m <= 192:
            return WgmmaConfig(bn=32 * -(-m // 32))  # 128, 160 or 192
        return WgmmaConfig(bn=256, stages=3, a_buffers=1)
    if k >= 2 * n:
        if m <= 32:
            return None
        if m <= 64:
            return WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2)
        if m <= 128:
            return WgmmaConfig(bn=64, warpgroups=4, a_buffers=1)
        if m <= 192:
            return WgmmaConfig(bn=32 * -(-m // 32), a_buffers=1)  # 160 or 192
        return WgmmaConfig(bn=128)
    if m > 256:
        return WgmmaConfig(bn=256, stages=3, a_buffers=1) if n >= 6144 else WgmmaConfig(bn=128)
    if n >= 6144 and 128 < m <= 192:
        return WgmmaConfig(bn=32 * -(-m // 32), warpgroups=1)  # 160 or 192
    if m > 64:
        one_buffer = m > 128 and n >= 6144
        return WgmmaConfig(bn=64, warpgroups=1, depth=4, a_buffers=1 if one_buffer else 2)
    if m > 32:
        if n >= 6144:
            return WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2)
        return WgmmaConfig(bn=64, warpgroups=1, depth=4, ctas_per_sm=2)
    return None


def fallback_config(m: int, n: int, k: int, group_size: int, num_sms: int = 132, elem_bytes=2):
    """`choose_config` without the CUDA kernel: the Triton kernels' choice."""
    if m <= SKINNY_MAX_M:
        cfg = skinny_config(m, n, k, group_size, num_sms)
        if cfg is not None:
            return cfg
    if m <= MANY_ROWS_MAX_M or (m <= MANY_ROWS_WIDE_MAX_M and n >= SKINNY_WIDE_N):
        cfg = many_rows_config(m, n, k, group_size, num_sms)
        if cfg is None and m <= SKINNY_WIDE_MAX_M and n >= SKINNY_WIDE_N:
            cfg = skinny_config(m, n, k, group_size, num_sms)
        if cfg is not None:
            return cfg
    if m >= DEQUANT_MIN_M and elem_bytes == 2:
        return DEQUANT
    return default_config(m, n, k, group_size, num_sms, elem_bytes=elem_bytes)


def _check_inputs(
    what: str,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
) -> None:
    """ValueError, naming `what`, where the inputs do not make a W4A16 product."""
    if not w4a16_supported(x, qweight, bias):
        raise ValueError(
            f"{what}: unsupported inputs x {tuple(x.shape)} {x.dtype} {x.device}, "
            f"qweight {tuple(qweight.shape)} {qweight.dtype} {qweight.device}"
        )
    k, n = x.shape[1], qweight.shape[0]
    groups = triton.cdiv(k, group_size)
    if scales.shape != (groups, n) or zeros.shape != (groups, n) or zeros.dtype != torch.uint8:
        raise ValueError(
            f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} {zeros.dtype}: "
            f"expected ({groups}, {n}) and uint8 zeros for K={k}, G={group_size}"
        )
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError(f"perm must be int32 of shape ({k},), got {tuple(perm.shape)}")


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    *,
    config=None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, W in the packed layout above (qweight,
    scales and zeros of the same device; perm for an act-order layer). `config` defaults to
    `choose_config`: a `GemvConfig` runs the CUDA decode kernel (`w4a16_gemv`), a
    `WgmmaConfig` the CUDA wgmma kernel (`w4a16_wgmma`, sm_90), a `W4A16Config` this
    module's kernel (with `pre_sums`, x's tile sums and an act-order x's gather are made once
    before it instead of in every N tile), a `w4a16_skinny.SkinnyConfig` the few-row kernel,
    `DEQUANT` the dequantized weight and cuBLAS. Raises ValueError where `w4a16_supported`
    says no or the config cannot run."""
    _check_inputs("w4a16_linear", x, qweight, scales, zeros, group_size, bias, perm)
    m, k = x.shape
    n = qweight.shape[0]
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    cfg = config or choose_config(
        m, n, k, group_size, _num_sms(x.device), elem_bytes=x.element_size()
    )
    if isinstance(cfg, GemvConfig) and config is None and cfg.bulk and x.is_cuda:
        if not w4a16_gemv.bulk_capable(x.device):  # before sm_90: the register kernel's rule
            cfg = gemv_config(m, n, k, group_size, bulk=False) or fallback_config(
                m, n, k, group_size, _num_sms(x.device), x.element_size()
            )
    if isinstance(cfg, GemvConfig):
        kernel, reason = _gemv_kernel(x, qweight, scales, zeros, group_size, bias, perm, cfg)
        if kernel is not None:
            return w4a16_gemv.w4a16_gemv(
                kernel, x, qweight, scales, zeros, group_size, bias, perm, cfg
            )
        if config is not None:
            raise ValueError(f"{cfg}: the CUDA kernel cannot run: {reason}")
        cfg = fallback_config(m, n, k, group_size, _num_sms(x.device), x.element_size())
    if isinstance(cfg, WgmmaConfig):
        y = _run_wgmma(x, qweight, scales, zeros, group_size, bias, perm, cfg, config is not None)
        if y is not None:
            return y
        cfg = fallback_config(m, n, k, group_size, _num_sms(x.device), x.element_size())
    if cfg == DEQUANT or not isinstance(cfg, W4A16Config):
        from pagoda.kernels import w4a16_skinny

        if cfg == DEQUANT:
            return w4a16_skinny.dequantize_linear(x, qweight, scales, zeros, group_size, bias, perm)
        return w4a16_skinny.skinny_w4a16(x, qweight, scales, zeros, group_size, bias, perm, cfg)
    block_m, block_n, block_k = cfg.block_m, cfg.block_n, cfg.block_k
    check_tiles(cfg.split_k, block_m=block_m, block_n=block_n, block_k=block_k)
    k_per_split, split_k = split_k_plan(k, block_k, cfg.split_k)
    group_arg = _group_arg(k, group_size, block_k)
    after_dot = cfg.scale_after_dot
    if after_dot and group_arg % block_k:
        raise ValueError(
            f"scale_after_dot needs groups of whole K blocks: G={group_size}, block_k={block_k}"
        )
    pre_sums = after_dot and cfg.pre_sums
    x_sums = x  # unused unless pre_sums
    if pre_sums:
        if perm is not None:  # gathered once here, not by every N tile
            x, perm = x.index_select(1, perm), None
        x_sums = chunk_sums(x, block_k)
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    counters, partials = split_k_buffers(y, m_tiles * n_tiles, split_k)
    _w4a16_kernel[(m_tiles, n_tiles, split_k)](
        x,
        qweight,
        scales,
        zeros,
        perm if perm is not None else qweight,
        x_sums,
        bias if bias is not None else x,
        y,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        split_k,
        NIBBLE_MAGIC[x.dtype],
        x.stride(0),
        qweight.stride(0),
        y.stride(0),
        x_sums.stride(0),
        GROUP_SIZE=group_arg,
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        SCALE_AFTER_DOT=after_dot,
        PRE_SUMS=pre_sums,
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


def w4a16_silu_and_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor | None:
    """silu(gate) * up -> [M, N/2] for a merged gate_up layer, W = [gate; up] in the packed
    layout above, in one launch of the CUDA decode kernel with the activation on its sums
    (`w4a16_gemv.w4a16_gemv`'s `silu_mul`), where the rule (or `config`) takes that kernel's
    ring with two row tiles for these shapes (sm_90, up to GEMV_MAX_M rows); else None, and
    the caller runs `w4a16_linear` and then the activation. ValueError as `w4a16_linear` for
    inputs that make no W4A16 product, and where an explicit `config` cannot run."""
    _check_inputs("w4a16_silu_and_mul", x, qweight, scales, zeros, group_size, bias, perm)
    m, k = x.shape
    n = qweight.shape[0]
    if m == 0 or not x.is_cuda or x.element_size() != 2:
        return None
    cfg = config or gemv_config(m, n, k, group_size, num_sms=_num_sms(x.device))
    if cfg is None:
        return None
    kernel, reason = _gemv_kernel(x, qweight, scales, zeros, group_size, bias, perm, cfg, True)
    if kernel is None:
        if config is not None:
            raise ValueError(f"{cfg}: the CUDA kernel cannot run silu_and_mul: {reason}")
        return None
    return w4a16_gemv.w4a16_gemv(
        kernel, x, qweight, scales, zeros, group_size, bias, perm, cfg, silu_mul=True
    )


def _gemv_kernel(
    x, qweight, scales, zeros, group_size, bias, perm, cfg: GemvConfig, silu_mul: bool = False
) -> tuple[Any, str]:
    """The CUDA decode kernel for these inputs and `cfg` and "", or None and why not."""
    m, n = x.shape[0], qweight.shape[0]
    reason = w4a16_gemv.unsupported_reason(x, qweight, scales, bias, group_size)
    reason = reason or w4a16_gemv.config_reason(cfg, x.device)
    reason = reason or w4a16_gemv.layout_reason(cfg, scales, zeros)
    reason = reason or w4a16_gemv.shape_reason(m, n, cfg, silu_mul)
    if reason:
        return None, reason
    has_perm, has_bias = perm is not None, bias is not None
    kernel = w4a16_gemv.get_kernel(x, scales, cfg, has_perm, has_bias, group_size, silu_mul)
    if kernel is None:
        return None, "not compiled (CUDA-graph capture, or NVRTC failed)"
    return kernel, ""


def _run_wgmma(x, qweight, scales, zeros, group_size, bias, perm, cfg, explicit: bool):
    """The wgmma kernel's output, or None where it cannot run (ValueError for an `explicit`
    config)."""
    reason = w4a16_wgmma.unsupported_reason(x, qweight, scales, bias, group_size)
    reason = reason or w4a16_wgmma.config_reason(cfg)
    y = None
    if reason is None:
        y = w4a16_wgmma.w4a16_wgmma(
            lambda split: w4a16_wgmma.get_kernel(x, scales, cfg, bias is not None, split),
            x, qweight, scales, zeros, group_size, bias, perm, cfg, _num_sms(x.device),
        )  # fmt: skip
        reason = "not compiled (CUDA-graph capture, or NVRTC failed)"
    if y is None and explicit:
        raise ValueError(f"{cfg}: the wgmma kernel cannot run: {reason}")
    return y


def _num_sms(device: torch.device) -> int:
    from pagoda.kernels.skinny_gemm import _num_sms as num_sms

    return num_sms(device)
