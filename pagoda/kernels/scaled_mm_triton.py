"""The CUDA side of `pagoda.kernels.scaled_mm`: a Triton kernel that quantizes each row of the
activations (absmax, then the row divided by its scale and rounded to int8 / cast to e4m3, in
one program per row), then the 8-bit product:

- by default, a fused Triton GEMM (`w8a8_gemm`). Both operands K-contiguous as stored
  (x_q [M, K], w_q [N, K]), `tl.dot` int8 x int8 into an int32 accumulator (wgmma
  m64nNk32.s32.s8.s8 on Hopper) or e4m3 x e4m3 into float32, and an epilogue that scales it
  in float32, (acc * x_scale[m]) * w_scale[n] (+ bias[n]), and writes the output once in the
  model dtype. `torch._int_mm` + a separate epilogue writes and reads an int32 [M, N] product
  in between and needs more than 16 rows (fewer are padded); the fused kernel needs neither.
  Tiles come from a fixed rule by shape (`choose_w8a8_config`; no run-time autotuning, so it
  is deterministic and CUDA-graph capturable): for decode-sized M a swap-AB layout (the
  weight on the MMA's 64-row side, as `skinny_gemm.py` does for bf16) with split-K for the
  deep down projection (partials summed in split order by the last split to arrive; the
  per-tile counters are `skinny_gemm.prepare`'s), for larger M 64/128 x 64/128 tiles with a
  GROUP_M swizzle so that weight tiles are reused from L2. The same product with both
  operands' tiles brought by the copy engine (TMA, `_w8a8_tma_kernel`; one program a tile or
  persistent) is among the configs `w8a8_config_candidates` gives a sweep from 65 rows; the
  rule does not take it until a sweep says so.
- on sm_90 from 65 rows, int8 at every row count and fp8 to 128 rows: the CUDA kernel of
  `w8a8_wgmma.py` (a producer warp issuing TMA copies, consumer warpgroups issuing wgmma, the
  epilogue through shared memory), faster there than every Triton tile and than cuBLASLt's fp8
  GEMM (`PAGODA_W8A8_CUDA=0`: those instead).
- int8 with config=INT_MM: `torch._int_mm` (cuBLASLt, int32 out) and the epilogue kernel,
  kept so that benchmarks/w8a8_bench.py can compare the two.
- fp8 with config=SCALED_MM, the default from 65 rows: `torch._scaled_mm` with row-wise
  scales (both scales and the bias in cuBLASLt's epilogue).

FP8 products accumulate as `fp8_fast_accum` says (PAGODA_FP8_FAST_ACCUM, on by default): in
the tensor cores' own precision across K (Hopper's fp8 MMA adds with fewer mantissa bits than
float32), as vLLM's FP8 kernels do, or with each K tile's sum promoted to float32 (cuBLASLt's
`use_fast_accum=False`, the Triton GEMM's `max_num_imprecise_acc=BLOCK_K`).

Semantics are `scaled_mm_ref`'s; the tests also run the kernels on a CPU through Triton's
interpreter."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels import pdl_enabled, w8a8_wgmma
from pagoda.kernels.scaled_mm import FP8_MAX, INT8_MAX, _plain_scaled_mm, plain_quantized_mm
from pagoda.kernels.skinny_gemm import (
    MAX_SPLIT_TILES,
    SMEM_BUDGET,
    _num_sms,
    check_tiles,
    prepare,
    split_k_plan,
    sum_splits,
)
from pagoda.kernels.triton_pdl import dependent_start
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config


@triton.jit
def row_scale(amax, QMAX: tl.constexpr):
    """A row's quantization scale from its absolute maximum (`quantize_rows_ref`'s)."""
    return tl.maximum(amax / QMAX, 1e-10)


@triton.jit
def quantize_values(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """x / scale rounded (int8: ties away from zero) and clamped to +-QMAX, in float32: the
    caller casts to the 8-bit type."""
    v = x / scale
    if IS_INT:
        v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
    return tl.minimum(tl.maximum(v, -QMAX), QMAX)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_x: tl.int64,
    stride_q: tl.int64,
    K,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the row fits one block: read once, held for its quantization
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0), QMAX)
        tl.store(s_ptr + row, scale)
        v = quantize_values(x, scale, QMAX, IS_INT)
        tl.store(q_ptr + row * stride_q + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0), QMAX)
        tl.store(s_ptr + row, scale)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < K
            v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            v = quantize_values(v, scale, QMAX, IS_INT)
            tl.store(q_ptr + row * stride_q + offs, v.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_epilogue_kernel(
    acc_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_acc: tl.int64,
    stride_out: tl.int64,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    mask = mm[:, None] & mn[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    acc = tl.load(acc_ptr + rows * stride_acc + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    xs = tl.load(xs_ptr + offs_m, mask=mm, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=mn, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows * stride_out + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
    )


def quantize_rows_triton(
    x: torch.Tensor, dtype: torch.dtype, min_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` in one kernel: (q [max(M, min_rows), K] `dtype`, scale [M, 1]
    float32); rows past M are left unwritten (padding whose products nobody reads). A row of
    up to 4096 values is read once and held in registers (the same bits as reading it twice,
    one pass over memory fewer); a longer one twice, for its maximum and then to quantize
    it. Launched plainly, not as a programmatic dependent of the kernel before: its M
    programs, resident early and waiting, held back that kernel's last CTAs (the GEMM before
    it, 8-bit steps up to 10% slower; a chain of quantizations twice as slow)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((max(m, min_rows), k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    _quant_rows_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        k,
        QMAX=qmax,
        IS_INT=dtype == torch.int8,
        BLOCK=block,
        ONE_PASS=k <= block,
        PDL=False,
        num_warps=min(max(block // 256, 1), 8),
    )
    return q, scale


def int8_epilogue(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    rows: int,
) -> torch.Tensor:
    """The first `rows` rows of acc [M', N] int32 * x_scale [rows, 1] * w_scale [N] (+ bias)."""
    n = acc.shape[1]
    out = torch.empty((rows, n), dtype=out_dtype, device=acc.device)
    bm, bn = 32, 128
    _int8_epilogue_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
        acc,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        rows,
        n,
        acc.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=4,
    )
    return out


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,
    b_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    c_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_a: tl.int64,
    stride_b: tl.int64,
    stride_c: tl.int64,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT: tl.constexpr,
    ACC_INT: tl.constexpr,
    IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """c[M, N] = (a[M, K] @ b[N, K]^T) * xs[M] * ws[N] (+ bias[N]); a and b both int8 (an
    int32 accumulator, ACC_INT) or both float8 e4m3 (float32; Hopper's fp8 MMA adds with
    fewer mantissa bits: IMPRECISE, Triton's max_num_imprecise_acc, is BLOCK_K where each K
    tile's sum is promoted to the float32 accumulator, None for int8 and for fp8 fast
    accumulation, `fp8_fast_accum`). PDL: launched as a programmatic dependent of the kernel
    before it (`triton_pdl`)."""
    dependent_start(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N load a valid row again (no mask on the hot loads); they are not stored.
    a_rows = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_a
    b_rows = b_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_b
    k_start = pid_k * k_per_split  # a multiple of BLOCK_K: only the last block can be ragged
    k_end = tl.minimum(k_start + k_per_split, K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32 if ACC_INT else tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if ACC_INT else tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        a = _load_k_tile(a_rows, kk, K, EVEN_K, False)
        # Swap-AB (one row tile) reads each weight tile once: keep it from evicting what the
        # next kernels reuse. Other tiles share weight tiles across GROUP_M rows through L2.
        b = _load_k_tile(b_rows, kk, K, EVEN_K, SWAP_AB)
        if SWAP_AB:  # weight rows on the MMA's 64-row side, the few activation rows on N
            acc = tl.dot(b, tl.trans(a), acc, out_dtype=acc.dtype, max_num_imprecise_acc=IMPRECISE)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=acc.dtype, max_num_imprecise_acc=IMPRECISE)

    if SWAP_AB:  # acc[n, m]
        rows_m = offs_m[None, :]
        cols_n = offs_n[:, None]
    else:  # acc[m, n]
        rows_m = offs_m[:, None]
        cols_n = offs_n[None, :]
    if not SPLIT:
        _w8a8_scale_store(
            acc, xs_ptr, ws_ptr, bias_ptr, c_ptr, rows_m, cols_n, M, N, stride_c, HAS_BIAS
        )
    else:
        # Each split writes its partial tile; the one that arrives last at this tile's counter
        # sums them in split order (int32: exact; float32: the same order on every run),
        # scales, stores, resets the counter.
        mask = (rows_m < M) & (cols_n < N)
        tile = rows_m.to(tl.int64) * N + cols_n
        split_size = N.to(tl.int64) * M
        tl.store(partial_ptr + pid_k * split_size + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial store before the one thread's release
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = sum_splits(partial_ptr, tile, mask, split_size, split_k, tl.zeros_like(acc))
            _w8a8_scale_store(
                total, xs_ptr, ws_ptr, bias_ptr, c_ptr, rows_m, cols_n, M, N, stride_c, HAS_BIAS
            )
            tl.store(counter_ptr + pid, 0)


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Tile order: GROUP_M row tiles sweep the N tiles together, so B tiles are reused from L2.
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_rows, (tile % in_group) // group_rows


@triton.jit
def _w8a8_tma_kernel(
    a_desc,
    b_desc,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_c: tl.int64,
    HAS_BIAS: tl.constexpr,
    ACC_INT: tl.constexpr,
    IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_w8a8_gemm_kernel`'s product (tiles not swapped, K not split) with both operands'
    tiles brought by the copy engine (TMA, through host tensor descriptors: rows and columns
    past M, N and K arrive as zeros) instead of per-thread loads. A program takes tiles
    program_id, + programs, ...: persistent when launched with fewer programs than tiles."""
    dependent_start(PDL)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if ACC_INT else tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            b = b_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=acc.dtype, max_num_imprecise_acc=IMPRECISE)
        rows_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
        cols_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        _w8a8_scale_store(
            acc, xs_ptr, ws_ptr, bias_ptr, c_ptr, rows_m, cols_n, M, N, stride_c, HAS_BIAS
        )


@triton.jit
def _load_k_tile(rows, kk, K, EVEN_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    # rows [R, 1] row pointers, kk [BLOCK_K] columns; a ragged last K block reads zeros.
    if EVEN_K:
        if EVICT_FIRST:
            t = tl.load(rows + kk[None, :], eviction_policy="evict_first")
        else:
            t = tl.load(rows + kk[None, :])
    else:
        # Read as bytes, masked lanes 0, then back to the operand type: a zero byte is a zero
        # int8 and a zero e4m3 (a masked fp8 load cannot be filled with a constant).
        byte_rows = rows.to(tl.pointer_type(tl.int8))
        if EVICT_FIRST:
            t = tl.load(
                byte_rows + kk[None, :],
                mask=(kk < K)[None, :],
                other=0,
                eviction_policy="evict_first",
            )
        else:
            t = tl.load(byte_rows + kk[None, :], mask=(kk < K)[None, :], other=0)
        t = t.to(rows.dtype.element_ty, bitcast=True)
    return t


@triton.jit
def _w8a8_scale_store(
    acc, xs_ptr, ws_ptr, bias_ptr, c_ptr, rows_m, cols_n, M, N, stride_c, HAS_BIAS: tl.constexpr
):
    # (acc * x_scale) * w_scale (+ bias) in float32, in that order (the tests' exact reference).
    m_ok = rows_m < M
    n_ok = cols_n < N
    mask = m_ok & n_ok
    xs = tl.load(xs_ptr + rows_m, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + cols_n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * xs * ws
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)
    c_ptrs = c_ptr + rows_m.to(tl.int64) * stride_c + cols_n
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask)


INT_MM = "int_mm"  # the config name of the torch._int_mm + separate epilogue path (int8)
SCALED_MM = "scaled_mm"  # the config name of torch._scaled_mm, cuBLASLt's fp8 GEMM (fp8)
# Programs a tile size must give to fill the H200's 132 SMs (two resident CTAs each at the
# tiles' stage counts, less a ragged last wave); below it a smaller tile is taken.
_MIN_PROGRAMS = 190
# Programs of one wave, about one a SM of the 132: where no tile gives _MIN_PROGRAMS, one CTA an
# SM with a deeper pipeline beats two of a smaller tile; a few programs past the SMs leave a
# second wave almost empty (on the H100 qkv at 384 rows, 144 programs of 128 x 128 tiles: 41.6
# against 35.0 us for 288 of 64 x 128).
_ONE_WAVE_PROGRAMS = range(120, 133)


class W8A8Config(NamedTuple):
    """Tiles of the fused 8-bit GEMM. swap_ab: acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T (for
    few rows: the weight on the MMA's 64-row side, BLOCK_M activation rows on its N side).
    split_k > 1 cuts K into that many ranges of whole BLOCK_K blocks (one program each).
    tma: the operands' tiles by the copy engine (`_w8a8_tma_kernel`, sm_90; neither swapped
    nor split); persistent: with it, `PERSISTENT_CTAS_PER_SM` programs an SM, each looping
    over tiles, instead of one program a tile."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 4
    num_warps: int = 4
    swap_ab: bool = False
    split_k: int = 1
    tma: bool = False
    persistent: bool = False

    @property
    def name(self) -> str:
        kind = "swap" if self.swap_ab else "tile"
        name = f"{kind}{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}"
        name += f"_s{self.num_stages}w{self.num_warps}"
        name += f"_k{self.split_k}" if self.split_k > 1 else ""
        return name + ("_tma" if self.tma else "") + ("_persistent" if self.persistent else "")


def rows_tile(m: int) -> int:
    """The activation-row tile of a swap-AB config: the next power of two >= m, at least 16
    (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(m))


def choose_w8a8_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.int8,
    wgmma: bool = False,
    num_sms: int = 132,
) -> W8A8Config | WgmmaW8A8Config | str:
    """The 8-bit GEMM of an [m, k] x [n, k]^T product: a `W8A8Config` of the fused kernel,
    `SCALED_MM` (fp8 from 65 rows: cuBLASLt's fp8 GEMM was faster there on the H200), or with
    `wgmma` (sm_90, `w8a8_wgmma.available`) from 65 rows the CUDA kernel's
    (`w8a8_wgmma.choose_config` for `num_sms` SMs): int8 at every such row count (faster than
    every Triton tile there), fp8 where `w8a8_wgmma.fp8_takes_kernel` says (up to
    `w8a8_wgmma.FP8_MAX_ROWS`, and past it the layers whose tiles are few). A fixed
    rule (deterministic, nothing measured at run time, so CUDA graphs capture it), fitted to
    `benchmarks/w8a8_bench.py --sweep` on the Llama-3-8B shapes (within 5% of the best config
    per shape at every row count):

    - m <= 64 (decode): weight streaming. Swap-AB; 64 weight rows x 256-deep K tiles, 6 stages;
      wide N (>= 16384: gate_up) 128 x 128 tiles, 4 stages (3 from 64 rows); the deep down
      projection (k >= 2n) splits K in 2, so its few programs fill the SMs' memory pipes.
    - larger: the largest of 128 x 128 (3 stages) and 64 x 128 (4) tiles, K 128, that still
      gives `_MIN_PROGRAMS` programs, stage counts that keep two CTAs resident per SM (96 KB
      of shared memory each; one more stage and one CTA per SM was up to 1.4x slower there).
      Where the larger tile gives fewer (the 4096-wide o and down projections at 256-512
      rows) one CTA an SM with a deeper pipeline, 128 x 128 with 4 stages or 64 x 128 with
      5, as long as the tile gives one wave, `_ONE_WAVE_PROGRAMS` (on the H100 down at 256
      rows 50.5 against 55.8 us for 64 x 64 tiles, at 512 75.4 against 82.2 for 64 x 128
      ones); else 64 x 64 with 5 stages (80 KB). GROUP_M 8 swizzle, so row tiles reuse
      weight tiles from L2.

    `w8a8_config_candidates` lists the neighbours the sweep times."""
    if m <= 64:
        bm = rows_tile(m)
        wide = n >= 16384
        bn, bk = (128, 128) if wide else (64, 256)
        stages = (3 if bm >= 64 else 4) if wide else 6
        split = 2 if k >= 2 * n else 1
        return W8A8Config(bm, bn, bk, 1, stages, 4, True, split)
    if wgmma:
        cfg = w8a8_wgmma.choose_config(m, n, k, num_sms)
        if dtype == torch.int8 or w8a8_wgmma.fp8_takes_kernel(m, cfg):
            return cfg
    if dtype != torch.int8:
        return SCALED_MM
    many = range(_MIN_PROGRAMS, 1 << 31)
    for bm, bn, stages, programs in (
        (128, 128, 3, many),
        (128, 128, 4, _ONE_WAVE_PROGRAMS),
        (64, 128, 4, many),
        (64, 128, 5, _ONE_WAVE_PROGRAMS),
    ):
        if triton.cdiv(m, bm) * triton.cdiv(n, bn) in programs:
            return W8A8Config(bm, bn, 128, 8, stages, 4)
    return W8A8Config(64, 64, 128, 8, 5, 4)


def w8a8_config_candidates(
    m: int, n: int, k: int, dtype: torch.dtype = torch.int8, wgmma: bool = False
) -> list[W8A8Config | WgmmaW8A8Config | str]:
    """The configs a sweep times for [m, k] x [n, k]^T: the chosen one first, then the
    library GEMM (`INT_MM` for int8, `SCALED_MM` for fp8), with `wgmma` int8 from 65 rows the
    CUDA kernel's tiles (`w8a8_wgmma.CANDIDATES`), and the Triton rule's neighbours (tile
    sizes, stages, warps, swap-AB, split-K) that fit an SM's shared memory."""
    library = INT_MM if dtype == torch.int8 else SCALED_MM
    out: list[W8A8Config | WgmmaW8A8Config | str] = [choose_w8a8_config(m, n, k, dtype, wgmma)]
    if library not in out:
        out.append(library)
    if wgmma and dtype == torch.int8 and m > 64:
        triton_rule = choose_w8a8_config(m, n, k, dtype)
        out += [c for c in (*w8a8_wgmma.CANDIDATES, triton_rule) if c not in out]
    cands: list[W8A8Config] = []
    if m <= 128:
        bm = rows_tile(m)
        for bn, bk, split, stages in itertools.product(
            (32, 64, 128), (128, 256), (1, 2, 4), (3, 4, 6)
        ):
            cands.append(W8A8Config(bm, bn, bk, 1, stages, 4, True, split))
    if m > 16:
        for bm, bn, bk, stages, group in itertools.product(
            (64, 128), (64, 128, 256), (64, 128), (3, 4, 5), (8,)
        ):
            if bm > max(64, triton.next_power_of_2(m)) or (m > 512 and bm == 64 and bn < 128):
                continue
            warps = 8 if bm * bn >= 128 * 256 else 4
            cands.append(W8A8Config(bm, bn, bk, group, stages, warps))
            if bm * bn == 128 * 128:
                cands.append(W8A8Config(bm, bn, bk, group, stages, 8))
            if bm == 128 and bk == 128 and stages == 3 and m > 128:
                # Whole 128-row tiles, K split to fill the SMs where they give few programs.
                cands += [W8A8Config(bm, bn, bk, group, stages, warps, False, s) for s in (2, 4)]
    if m > 64:  # the copy engine's tiles (sm_90), one program a tile or persistent
        for bm, bn, stages, warps in ((128, 128, 3, 4), (128, 128, 4, 8), (128, 256, 3, 8)):
            for persistent in (False, True):
                cands.append(W8A8Config(bm, bn, 128, 8, stages, warps, tma=True,
                                        persistent=persistent))  # fmt: skip
    for cfg in cands:
        stage_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k
        if cfg.split_k > 1 and split_k_plan(k, cfg.block_k, cfg.split_k)[1] != cfg.split_k:
            continue
        if cfg.num_stages * stage_bytes <= SMEM_BUDGET - 32 * 1024 and cfg not in out:
            out.append(cfg)
    return out


def w8a8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: W8A8Config | WgmmaW8A8Config | None = None,
) -> torch.Tensor:
    """(x_q [M, K] @ w_q [N, K]^T) * x_scale [M(, 1)] * w_scale [N] (+ bias [N]) -> [M, N]
    `out_dtype`, in one kernel (`choose_w8a8_config` unless `config`). The operands are both
    int8 (an exact int32 product) or both float8 e4m3 (a float32 one); both K-contiguous (w_q
    as stored); any K (a ragged last K block is masked)."""
    if x_q.dtype != w_q.dtype or w_q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(
            f"w8a8_gemm takes two int8 or two float8_e4m3fn operands, got {x_q.dtype} and "
            f"{w_q.dtype}"
        )
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k or x_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError(
            f"w8a8_gemm needs K-contiguous x_q [M, K] and w_q [N, K], got {tuple(x_q.shape)} "
            f"(strides {x_q.stride()}) and {tuple(w_q.shape)} (strides {w_q.stride()})"
        )
    cfg = config or choose_w8a8_config(m, n, k, w_q.dtype)
    if isinstance(cfg, str):
        raise ValueError(f"w8a8_gemm runs the fused kernel; {cfg} is scaled_mm_cuda's choice")
    if isinstance(cfg, WgmmaW8A8Config):  # the CUDA kernel, asked for by name
        reason = w8a8_wgmma.unsupported_reason(x_q, w_q, out_dtype, bias)
        if reason is not None:
            raise ValueError(f"{cfg.name}: {reason}")
        y = w8a8_wgmma.w8a8_wgmma(x_q, x_scale, w_q, w_scale, bias, out_dtype, cfg)
        if y is None:
            raise RuntimeError(f"{cfg.name}: the CUDA kernel is not built (see the warning)")
        return y
    check_tiles(cfg.split_k, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k)
    if cfg.block_k < 32:
        raise ValueError(f"block_k must be >= 32 for 8-bit tensor cores, got {cfg.block_k}")
    k_per_split, split_k = split_k_plan(k, cfg.block_k, cfg.split_k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if cfg.tma:
        _launch_tma(x_q, x_scale, w_q, w_scale, bias, out, cfg, tiles)
        return out
    if split_k > 1:
        if tiles > MAX_SPLIT_TILES:
            raise ValueError(f"split_k > 1 takes one counter per tile: {tiles} > {MAX_SPLIT_TILES}")
        counters = prepare(x_q.device)
        acc_dtype = torch.int32 if w_q.dtype == torch.int8 else torch.float32
        partials = torch.empty((split_k, m, n), dtype=acc_dtype, device=x_q.device)
    else:
        counters = partials = out  # placeholders the kernel does not touch
    _w8a8_gemm_kernel[(tiles, split_k)](
        x_q,
        w_q,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        split_k,
        x_q.stride(0),
        w_q.stride(0),
        out.stride(0),
        EVEN_K=k % cfg.block_k == 0,
        SWAP_AB=cfg.swap_ab,
        SPLIT=split_k > 1,
        **_launch_args(cfg, x_q, w_q, bias),
    )
    return out


def fp8_fast_accum() -> bool:
    """Whether FP8 products accumulate in the tensor cores' own precision across K
    (PAGODA_FP8_FAST_ACCUM, the default) rather than promoting each K tile's sum to float32."""
    return envs.PAGODA_FP8_FAST_ACCUM


def _launch_args(
    cfg: W8A8Config, x_q: torch.Tensor, w_q: torch.Tensor, bias: torch.Tensor | None
) -> dict:
    # The constexprs and launch options both GEMM kernels take from a config. IMPRECISE: the
    # fp8 MMA's additions between float32 promotions (None: Triton's default, none on sm_90).
    is_int = w_q.dtype == torch.int8
    return dict(
        HAS_BIAS=bias is not None,
        ACC_INT=is_int,
        IMPRECISE=None if is_int or fp8_fast_accum() else cfg.block_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_STAGES=cfg.num_stages,
        PDL=pdl_enabled(x_q),
        launch_pdl=pdl_enabled(x_q),
        num_warps=cfg.num_warps,
    )


# Programs an SM of a persistent TMA config: two CTAs resident an SM at the stage counts of
# the 128 x 128 tiles (as `choose_w8a8_config`'s tiles assume).
PERSISTENT_CTAS_PER_SM = 2


def _launch_tma(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: W8A8Config,
    tiles: int,
) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if cfg.swap_ab or cfg.split_k > 1:
        raise ValueError(f"{cfg.name}: TMA tiles are neither swapped nor split")
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        if t.stride(0) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{cfg.name}: TMA needs {name}'s rows 16-byte aligned")
    m, k = x_q.shape
    programs = tiles
    if cfg.persistent:
        # The interpreter takes one SM, so that its programs loop over tiles as on a GPU.
        sms = _num_sms(x_q.device) if x_q.is_cuda else 1
        programs = min(tiles, PERSISTENT_CTAS_PER_SM * sms)
    _w8a8_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(w_q, [cfg.block_n, cfg.block_k]),
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        m,
        w_q.shape[0],
        k,
        out.stride(0),
        **_launch_args(cfg, x_q, w_q, bias),
    )


def _cuda_path(
    m: int, w_q: torch.Tensor, config: W8A8Config | WgmmaW8A8Config | str | None
) -> W8A8Config | WgmmaW8A8Config | str | None:
    """The product's kernel for m rows: a `W8A8Config` of the fused GEMM, a `WgmmaW8A8Config`
    of the CUDA 8-bit kernel (sm_90, from 65 rows: int8, and fp8 with fast accumulation),
    `INT_MM` or `SCALED_MM`; None where none runs these operands (the plain path)."""
    from pagoda.kernels.scaled_mm import fp8_supported

    n, k = w_q.shape
    is_int = w_q.dtype == torch.int8
    if config is None and (is_int or fp8_supported(w_q.device)):
        wgmma = m > 64 and (is_int or fp8_fast_accum()) and w8a8_wgmma.available(w_q.device)
        config = choose_w8a8_config(m, n, k, w_q.dtype, wgmma, _num_sms(w_q.device))
    if is_int:
        if config != INT_MM and w_q.stride(1) == 1:
            return config
        if k % 8 == 0 and n % 8 == 0:
            return INT_MM
    elif fp8_supported(w_q.device):
        if config != SCALED_MM and w_q.stride(1) == 1:
            return config
        if k % 16 == 0 and n % 16 == 0:
            return SCALED_MM
    return None


def _product(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    rows: int,
    cfg: W8A8Config | WgmmaW8A8Config | str,
) -> torch.Tensor:
    # x_q may hold padding rows past `rows` (torch._int_mm's); x_scale has `rows`.
    if isinstance(cfg, WgmmaW8A8Config):
        y = None
        if w8a8_wgmma.unsupported_reason(x_q, w_q, out_dtype, bias) is None:
            y = w8a8_wgmma.w8a8_wgmma(x_q, x_scale, w_q, w_scale, bias, out_dtype, cfg)
        if y is not None:
            return y
        # Operands it does not take, or not built (no NVRTC; a CUDA-graph capture before the
        # warm-up built it): the Triton GEMM's rule, cuBLASLt's for fp8 past 64 rows where its
        # shapes allow it, else the Triton GEMM (any shape).
        n, k = w_q.shape
        cfg = choose_w8a8_config(rows, n, k, w_q.dtype)
        if cfg == SCALED_MM and (k % 16 or n % 16):
            cfg = W8A8Config(128, 128, 128, 8, 3, 4)
    if cfg == INT_MM:
        acc = torch._int_mm(x_q, w_q.t())  # [M', N] int32; w_q.t() column-major, as cuBLAS likes
        return int8_epilogue(acc, x_scale, w_scale, bias, out_dtype, rows)
    if cfg == SCALED_MM:
        # Row-wise scaling (scale_a [M, 1], scale_b [1, N]) wants a bfloat16 output; the bias is
        # added after (not every torch version takes one with row-wise scales; Llamas have none).
        y = torch._scaled_mm(
            x_q,
            w_q.t(),
            scale_a=x_scale,
            scale_b=w_scale.reshape(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=fp8_fast_accum(),
        )
        y = y if y.dtype == out_dtype else y.to(out_dtype)
        return y if bias is None else y + bias
    return w8a8_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype, cfg)


# cuBLASLt's int8 GEMM in torch._int_mm wants more than 16 rows: fewer are padded to 32 (rows
# of garbage int8 whose products the epilogue does not read).
_INT_MM_MIN_ROWS = 32


def scaled_mm_cuda(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: W8A8Config | WgmmaW8A8Config | str | None = None,
) -> torch.Tensor:
    """x [M, K] on CUDA times w_q [N, K] (int8 or fp8, w_scale [N] float32): x quantized per
    row (`quantize_rows_triton`), then the tensor-core product where the shapes allow it, the
    plain path otherwise. The fused Triton GEMM with `config` (a `W8A8Config`; None:
    `choose_w8a8_config`); int8 with config=INT_MM `torch._int_mm` + the epilogue kernel (K
    and N multiples of 8); fp8 (sm_89+) with config=SCALED_MM `torch._scaled_mm` (K and N
    multiples of 16)."""
    m = x.shape[0]
    cfg = _cuda_path(m, w_q, config)
    if cfg is None:
        return _plain_scaled_mm(x, w_q, w_scale, bias)
    min_rows = _INT_MM_MIN_ROWS if cfg == INT_MM and m <= 16 else 0
    x_q, x_scale = quantize_rows_triton(x, w_q.dtype, min_rows=min_rows)
    return _product(x_q, x_scale, w_q, w_scale, bias, x.dtype, m, cfg)


def quantized_mm_cuda(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: W8A8Config | WgmmaW8A8Config | str | None = None,
) -> torch.Tensor:
    """`scaled_mm_cuda` on x quantized already (x_q [M, K] of w_q's dtype, x_scale [M, 1]
    float32): the same product kernels, no quantization."""
    m = x_q.shape[0]
    cfg = _cuda_path(m, w_q, config)
    if cfg is None:
        return plain_quantized_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    if x_q.stride(1) != 1:
        x_q = x_q.contiguous()
    if cfg == INT_MM and m <= 16:
        padded = x_q.new_zeros((_INT_MM_MIN_ROWS, x_q.shape[1]))
        padded[:m] = x_q
        x_q = padded
    return _product(x_q, x_scale, w_q, w_scale, bias, out_dtype, m, cfg)
