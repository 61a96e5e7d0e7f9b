"""The CUDA side of `pagoda.kernels.scaled_mm`: a Triton kernel that quantizes each row of the
activations (absmax, then the row divided by its scale and rounded to int8 / cast to e4m3, in
one program per row), cuBLASLt for the 8-bit product (`torch._int_mm` for int8,
`torch._scaled_mm` with row-wise scales for fp8), and for int8 a Triton epilogue that turns the
int32 products into the model dtype (x_scale * w_scale, + bias) in one pass. Semantics are
`scaled_mm_ref`'s; the tests also run the kernels on a CPU through Triton's interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.scaled_mm import FP8_MAX, INT8_MAX, _plain_scaled_mm


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
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / QMAX, 1e-10)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < K
        v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32) / scale
        if IS_INT:
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))  # ties away from zero
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
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
    float32); rows past M are left unwritten (padding whose products nobody reads)."""
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


def _int8_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    m = x.shape[0]
    # cuBLASLt's int8 GEMM in torch._int_mm wants more than 16 rows: fewer are padded to 32
    # (rows of garbage int8 whose products the epilogue does not read).
    x_q, x_scale = quantize_rows_triton(x, torch.int8, min_rows=32 if m <= 16 else 0)
    acc = torch._int_mm(x_q, w_q.t())  # [M', N] int32; w_q.t() column-major, as cuBLAS likes
    return int8_epilogue(acc, x_scale, w_scale, bias, x.dtype, m)


def _fp8_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    x_q, x_scale = quantize_rows_triton(x, w_q.dtype)
    # Row-wise scaling (scale_a [M, 1], scale_b [1, N]) wants a bfloat16 output; the bias is
    # added after (not every torch version takes one with row-wise scales; Llamas have none).
    y = torch._scaled_mm(
        x_q,
        w_q.t(),
        scale_a=x_scale,
        scale_b=w_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if bias is None else y + bias


def scaled_mm_cuda(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] on CUDA times w_q [N, K] (int8 or fp8, w_scale [N] float32): the tensor-core
    path where the shapes allow it (int8: K and N multiples of 8; fp8: of 16, sm_89+), the
    plain one otherwise."""
    from pagoda.kernels.scaled_mm import fp8_supported

    n, k = w_q.shape
    if w_q.dtype == torch.int8 and k % 8 == 0 and n % 8 == 0:
        return _int8_mm(x, w_q, w_scale, bias)
    if w_q.dtype != torch.int8 and k % 16 == 0 and n % 16 == 0 and fp8_supported(x.device):
        return _fp8_mm(x, w_q, w_scale, bias)
    return _plain_scaled_mm(x, w_q, w_scale, bias)
