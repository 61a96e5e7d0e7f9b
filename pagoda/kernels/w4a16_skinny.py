"""Triton W4A16 for few activation rows (decode) and a dequantizing kernel for many (then
cuBLAS), on the packed layout of `pagoda.kernels.w4a16` (qweight [N, ceil(K/8)] int32, word j
of a row holding input 8j + 2s in nibble s and 8j + 2s + 1 in nibble s + 4; scales and uint8
zeros [groups, N]; an optional act-order perm). `w4a16.w4a16_linear` picks between them.

At few rows a 4-bit layer is a stream of packed words (K*N/2 bytes), so the kernel must spend
few instructions per weight: an H200 SM takes ~36 weights a clock at 4.3 TB/s and issues 128
thread-instructions a clock, ~3.5 per weight. `_pairs_kernel` reads qweight as int16 halves
(half 0 of a word: inputs 8j + 0, 2, 4, 6; half 1: 8j + 1, 3, 5, 7) and takes nibble T of
every half as a plane: a [BLOCK_N, BLOCK_K / 4] operand whose columns 2j, 2j + 1 are inputs
8j + 2T, 8j + 2T + 1, the pair one MMA operand register holds. One shift and one LOP3 on the
32-bit register make both halves 16-bit floats OFFSET + q (inline PTX, elementwise and unary,
so Triton loads the halves from the pipeline's shared memory straight into the wgmma
operand's register layout: no reshape or join of unpacked values, no shared-memory round
trip; about 0.9 SASS instructions per weight). A K tile is 4 dots, one per plane, against x's
matching strided columns (gathered by address arithmetic, through perm for act order).
Swap-AB: the weight rows are the MMA's 64-row side, the activation rows (16, 32 or 64) its N
side. Each tile lies in one group, so zero and scale apply to its fp32 product:
    sum_k (q - z) s x = s * (sum_k (OFFSET + q) x - (OFFSET + z) sum_k x).
K is split so that short grids cover the SMs (the last split to arrive sums the partials in
split order: `skinny_gemm.store_tile`). Weights are loaded evict_first (read once).
From a few dozen rows the kernel runs in its many-row modes (`SkinnyConfig.planar`,
`scale_w`): x is reordered once (`planar_x`) so that each plane's inputs are contiguous columns
(16-byte loads instead of pairs of inputs 8 apart), and zero and scale are applied to the
unpacked weights by one packed subtract and one packed multiply per two weights, rounded as
the dequantized weight is, so the MMA accumulates into one accumulator in place (no second
[BLOCK_N, BLOCK_M] product per K tile, no sums of x).
`formats.dequantize_*` + F.linear stay the reference (tests compare them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda.kernels.skinny_gemm import split_k_buffers, split_k_plan, store_tile
from pagoda.kernels.w4a16 import NIBBLE_MAGIC, _unpack

# A nibble q in the low mantissa bits of a 16-bit float whose last mantissa bit is worth 1
# reads OFFSET + q exactly: bf16 128.0 (0x4300, 7 mantissa bits), fp16 1024.0 (0x6400, 10).
BF16_MAGIC, FP16_MAGIC = 0x4300, 0x6400
OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0, torch.float32: 16.0}


def _plane_asm(magic: int) -> tuple[str, ...]:
    """The PTX of `_plane` for nibble T = 0..3 of both halves of a 32-bit register: a shift
    and one LOP3 ((t & mask) | magic, the magic in a register: LOP3 takes one immediate)."""
    out = []
    for t in range(4):
        shift = f"shr.u32 t, $1, {4 * t};" if t else "mov.b32 t, $1;"
        out.append(
            f"{{ .reg .b32 t, m; mov.b32 m, {magic * 0x10001:#x}; {shift} "
            f"lop3.b32 $0, t, 0xf000f, m, 0xea; }}"
        )
    return tuple(out)


_BF16_ASM0, _BF16_ASM1, _BF16_ASM2, _BF16_ASM3 = map(tl.constexpr, _plane_asm(BF16_MAGIC))
_FP16_ASM0, _FP16_ASM1, _FP16_ASM2, _FP16_ASM3 = map(tl.constexpr, _plane_asm(FP16_MAGIC))


@triton.jit
def _asm(h, asm: tl.constexpr, dtype: tl.constexpr):
    """One instance per 32-bit register: the two int16 halves of a word in, two 16-bit floats
    out."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _plane(h, T: tl.constexpr, dtype: tl.constexpr, USE_ASM: tl.constexpr):
    """h [R, C] int16, the halves of packed words -> [R, C] OFFSET + q of nibble T of each
    half, in dtype. Half 0 of word j holds inputs 8j + 0, 2, 4, 6 in nibbles 0..3, half 1
    inputs 8j + 1, 3, 5, 7: plane T is inputs 8j + 2T (even columns), 8j + 2T + 1 (odd ones).
    On a GPU, inline PTX over the two halves of a register at once (a shift and a LOP3:
    nothing crosses between the halves under the mask). Being elementwise and unary, Triton
    applies it in the MMA operand's register layout, loaded straight from the pipeline's
    shared memory (no shared-memory round trip of the unpacked tile)."""
    # One if/elif/else chain: Triton compiles the code after a constexpr branch's return too,
    # and a float32 x reaching the 16-bit PTX below failed to build.
    if dtype == tl.float32:
        return ((h.to(tl.int32) >> (4 * T)) & 0xF).to(tl.float32) + 16.0
    elif USE_ASM:
        if dtype == tl.bfloat16:
            if T == 0:
                return _asm(h, _BF16_ASM0, dtype)
            elif T == 1:
                return _asm(h, _BF16_ASM1, dtype)
            elif T == 2:
                return _asm(h, _BF16_ASM2, dtype)
            else:
                return _asm(h, _BF16_ASM3, dtype)
        else:
            if T == 0:
                return _asm(h, _FP16_ASM0, dtype)
            elif T == 1:
                return _asm(h, _FP16_ASM1, dtype)
            elif T == 2:
                return _asm(h, _FP16_ASM2, dtype)
            else:
                return _asm(h, _FP16_ASM3, dtype)
    else:
        if dtype == tl.bfloat16:
            MAGIC: tl.constexpr = 0x4300
        else:
            MAGIC: tl.constexpr = 0x6400
        t = ((h >> (4 * T)) & 0xF) | MAGIC  # arithmetic shift: the kept bits are the nibble's
        return tl.cast(t.to(tl.int16), dtype, bitcast=True)


# (a - z) * s on both 16-bit halves of a register: the difference exact, the product rounded once.
_BF16_SCALE = tl.constexpr("{ .reg .b32 t; sub.rn.bf16x2 t, $1, $2; mul.rn.bf16x2 $0, t, $3; }")
_FP16_SCALE = tl.constexpr("{ .reg .b32 t; sub.rn.f16x2 t, $1, $2; mul.rn.f16x2 $0, t, $3; }")


@triton.jit
def _scale_plane(a, z, s, dtype: tl.constexpr, USE_ASM: tl.constexpr):
    """a [R, C] OFFSET + q, z [R, 1] OFFSET + zero, s [R, 1] scale, all in dtype -> (q - z) s in
    dtype, rounded once as the dequantized weight is. On a GPU one packed subtract and one
    packed multiply per two weights (inline PTX, in the MMA operand's register layout)."""
    z = tl.broadcast_to(z, a.shape)
    s = tl.broadcast_to(s, a.shape)
    if USE_ASM and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            _BF16_SCALE, "=r,r,r,r", [a, z, s], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    elif USE_ASM and dtype == tl.float16:
        return tl.inline_asm_elementwise(
            _FP16_SCALE, "=r,r,r,r", [a, z, s], dtype=tl.float16, is_pure=True, pack=2
        )
    else:
        return ((a.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(dtype)


@triton.jit
def _planar_x_kernel(
    x_ptr,
    perm_ptr,
    out_ptr,
    M,
    stride_x: tl.int64,
    stride_o: tl.int64,
    HAS_PERM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, k0 + t H + c] = x[m, k0 + 8 (c // 2) + 2 t + c % 2] (through perm for act order),
    H = BLOCK_K / 4: each K tile's inputs in the order of the kernel's four nibble planes."""
    H: tl.constexpr = BLOCK_K // 4
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1) * BLOCK_K
    c = j % H
    src = k0 + 8 * (c // 2) + 2 * (j // H) + c % 2
    if HAS_PERM:
        src = tl.load(perm_ptr + src)
    ok = (rows < M)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r64 * stride_x + src[None, :], mask=ok)
    tl.store(out_ptr + r64 * stride_o + (k0 + j)[None, :], v, mask=ok)


def planar_x(x: torch.Tensor, perm: torch.Tensor | None, block_k: int) -> torch.Tensor:
    """x [M, K] (K a multiple of block_k) with each K tile's inputs reordered to the nibble
    planes' order (`_planar_x_kernel`), gathered through perm first for an act-order layer."""
    m, k = x.shape
    out = torch.empty_like(x)
    block_r = 16
    _planar_x_kernel[(triton.cdiv(m, block_r), k // block_k)](
        x,
        perm if perm is not None else x,
        out,
        m,
        x.stride(0),
        out.stride(0),
        HAS_PERM=perm is not None,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _pairs_kernel(
    x_ptr,
    qh_ptr,  # qweight viewed as int16 [N, 2 ceil(K/8)]
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
    offset,  # OFFSET[dtype]: what _plane adds to q
    stride_x: tl.int64,
    stride_qh: tl.int64,
    stride_y: tl.int64,
    GROUP_SIZE: tl.constexpr,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_ASM: tl.constexpr,  # inline PTX unpacking (not under the interpreter)
    PLANAR_X: tl.constexpr = False,  # x in planar order (`planar_x`): contiguous plane columns
    SCALE_W: tl.constexpr = False,  # (q - z) s per weight, one accumulator (many rows)
):
    BLOCK_H: tl.constexpr = BLOCK_K // 4  # word halves per row and tile
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    # Column c of plane T is half c % 2 of word c // 2: input 8 (c // 2) + 2 T + c % 2.
    col_k = 8 * (offs_h // 2) + offs_h % 2
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Rows past M or N read other rows instead of being masked (no masks in the loop); their
    # outputs are never stored. Past M, row m reads row m % M: distinct rows (all reading row
    # M - 1 made every program's loads of a K tile hit the same lines at once: 96 rows of
    # gate_up in 128-row tiles took 148 us against 107 for 128 rows).
    x_rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_x
    n_rows = tl.minimum(offs_n, N - 1)
    qh_rows = qh_ptr + n_rows.to(tl.int64)[:, None] * stride_qh
    num_halves = 2 * ((K + 7) // 8)
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The group's scales and zeros are loaded one K tile ahead (the pipeliner leaves these
    # small loads synchronous: a tile's own would stall it for a memory latency).
    g = k_start // GROUP_SIZE
    sc = tl.load(scales_ptr + g * N + n_rows)
    zp = tl.load(zeros_ptr + g * N + n_rows)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        hk = k0 // 4 + offs_h
        # Weights are read once: do not let them evict what the next kernels reuse.
        if EVEN_K:
            halves = tl.load(qh_rows + hk[None, :], eviction_policy="evict_first")
        else:
            h_mask = (hk < num_halves)[None, :]
            halves = tl.load(
                qh_rows + hk[None, :], mask=h_mask, other=0, eviction_policy="evict_first"
            )
        g_next = tl.minimum(k0 + BLOCK_K, k_end - 1) // GROUP_SIZE
        sc_next = tl.load(scales_ptr + g_next * N + n_rows)
        zp_next = tl.load(zeros_ptr + g_next * N + n_rows)
        if SCALE_W:  # OFFSET + z and s per weight row, in x's dtype (both exact: z <= 16)
            z_w = (zp.to(tl.float32) + offset).to(dtype)[:, None]
            s_w = sc.to(dtype)[:, None]
        else:
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_tile = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for t in tl.static_range(4):
            a = _plane(halves, t, dtype, USE_ASM)  # [BLOCK_N, BLOCK_H]: OFFSET + q
            if PLANAR_X:  # plane t's inputs are columns k0 + t BLOCK_H + [0, BLOCK_H)
                x = tl.load(x_rows + (k0 + t * BLOCK_H + offs_h)[None, :])
            else:
                kk = k0 + 2 * t + col_k
                k_ok = kk < K
                if HAS_PERM:
                    kk = tl.load(perm_ptr + kk, mask=k_ok, other=0)
                if EVEN_K:
                    x = tl.load(x_rows + kk[None, :])  # [BLOCK_M, BLOCK_H]
                else:
                    x = tl.load(x_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            if SCALE_W:
                # (OFFSET + q) - (OFFSET + z) is exact; times s rounds once, as the
                # dequantized weight does
                w = _scale_plane(a, z_w, s_w, dtype, USE_ASM)
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                x_tile += x.to(tl.float32)
                part = tl.dot(a, tl.trans(x), part, input_precision=DOT_PRECISION)
        if not SCALE_W:
            # sum_k (q - z) s x = s (sum_k (OFFSET + q) x - (OFFSET + z) sum_k x)
            x_sum = tl.sum(x_tile, axis=1)  # [BLOCK_M]
            z_off = zp.to(tl.float32) + offset
            acc += sc.to(tl.float32)[:, None] * (part - z_off[:, None] * x_sum[None, :])
        sc, zp = sc_next, zp_next

    counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
    store_tile(
        acc, y_ptr, bias_ptr, partial_ptr, counter, offs_m, offs_n, m_ok, n_ok,
        M, N, stride_y, pid_k, split_k, HAS_BIAS, SPLIT,
    )  # fmt: skip


class SkinnyConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    # Many rows: x reordered once into the planes' order (contiguous loads instead of pairs of
    # inputs 8 apart), and zero and scale applied per weight so the MMA accumulates in place.
    planar: bool = False
    scale_w: bool = False


def skinny_supported(k: int, group_size: int, block_k: int) -> bool:
    """Whether every K tile of `block_k` inputs lies in one group (the kernel's one scale per
    row and tile): groups a multiple of block_k, or one group for the whole row."""
    return group_size >= k or group_size % block_k == 0


def group_arg(k: int, group_size: int, block_k: int) -> int:
    """The kernel's GROUP_SIZE: one group (G >= K) becomes a multiple of BLOCK_K >= K."""
    return triton.cdiv(k, block_k) * block_k if group_size >= k else group_size


def skinny_w4a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
    cfg: SkinnyConfig,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with `_pairs_kernel`; the caller (`w4a16_linear`) has checked
    the inputs."""
    m, k = x.shape
    n = qweight.shape[0]
    if cfg.block_m < 16 or cfg.block_k < 64 or not skinny_supported(k, group_size, cfg.block_k):
        raise ValueError(
            f"{cfg}: block_m >= 16, block_k >= 64 and K tiles within groups (G={group_size}) needed"
        )
    k_per_split, split_k = split_k_plan(k, cfg.block_k, cfg.split_k)
    m_tiles, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    counters, partials = split_k_buffers(y, m_tiles * n_tiles, split_k)
    halves = qweight.view(torch.int16)
    planar = cfg.planar and k % cfg.block_k == 0
    if planar:
        x, perm = planar_x(x, perm, cfg.block_k), None
    _pairs_kernel[(m_tiles, n_tiles, split_k)](
        x,
        halves,
        scales,
        zeros,
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
        OFFSET[x.dtype],
        x.stride(0),
        halves.stride(0),
        y.stride(0),
        GROUP_SIZE=group_arg(k, group_size, cfg.block_k),
        HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None,
        EVEN_K=k % cfg.block_k == 0,
        SPLIT=split_k > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_ASM=x.is_cuda,
        PLANAR_X=planar,
        SCALE_W=cfg.scale_w,
        num_warps=cfg.num_warps,
    )
    return y


@triton.jit
def _dequant_kernel(
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    w_ptr,
    N,
    K,
    magic,
    stride_qw: tl.int64,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w[n, k] = (q - z) s in w's dtype, one [BLOCK_N, BLOCK_K] tile per program (inputs in
    packed order: an act-order layer's x is gathered instead)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    n_ok = offs_n < N
    k_ok = offs_k < K
    words = tl.load(
        qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw + offs_w[None, :],
        mask=n_ok[:, None] & (offs_w < (K + 7) // 8)[None, :],
        other=0,
        eviction_policy="evict_first",
    )
    dtype = w_ptr.dtype.element_ty
    q16 = _unpack(words, magic, BLOCK_N, BLOCK_K, dtype).to(tl.float32)  # 16 + q
    gk = (offs_k // GROUP_SIZE)[None, :] * N + offs_n[:, None]
    mask = n_ok[:, None] & k_ok[None, :]
    s = tl.load(scales_ptr + gk, mask=mask, other=0.0).to(tl.float32)
    z16 = tl.load(zeros_ptr + gk, mask=mask, other=0).to(tl.float32) + 16.0
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(w_ptrs, ((q16 - z16) * s).to(dtype), mask=mask)


def dequantize_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
) -> torch.Tensor:
    """Many rows: the dense weight [N, K] made in x's dtype (one memory-bound pass, N*K*2 bytes
    written), then cuBLAS, whose matrix rate a fused 4-bit kernel does not reach in Triton."""
    m, k = x.shape
    n = qweight.shape[0]
    w = torch.empty((n, k), dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 128
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        zeros,
        w,
        n,
        k,
        NIBBLE_MAGIC[x.dtype],
        qweight.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    if perm is not None:
        x = x.index_select(1, perm)
    return torch.nn.functional.linear(x, w, bias)
