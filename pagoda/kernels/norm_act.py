"""Triton kernels for the element-wise layers of a Llama block: fused residual add +
RMSNorm (Zhang & Sennrich, 2019) and SwiGLU's silu-and-mul (Shazeer, 2020).

Each saves memory passes over activations that the unfused torch code makes (the add, the
norm's float32 copy, the gate's intermediate). Semantics are those of
`pagoda.kernels.reference`: statistics in float32, sums rounded to the model dtype where
Hugging Face rounds them.

Before an 8-bit (W8A8 / FP8) layer either kernel can also quantize its output per token
(`quant_dtype`): it writes the 8-bit rows and their scales (`QuantizedRows`) instead of the
model-dtype rows, bit for bit what `quantize_rows_triton` makes of those rows, so the layer
runs no quantization kernel of its own and nothing reads the rows twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl_enabled
from pagoda.kernels.scaled_mm import QuantizedRows, qmax_of
from pagoda.kernels.scaled_mm_triton import quantize_values, row_scale
from pagoda.kernels.triton_pdl import dependent_start


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x: tl.int64,
    stride_r: tl.int64,
    stride_o: tl.int64,
    stride_ro: tl.int64,
    scale_ptr,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # `pdl_enabled`: launched as a programmatic dependent (`triton_pdl`)
    QMAX: tl.constexpr,  # > 0: out is the 8-bit rows, scale_ptr their scales (`quant_dtype`)
    IS_INT: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # constant: before the wait
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the model dtype first: it is the residual stream the next layer
        # adds to, and what the unfused torch code would have normalized.
        h = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if QMAX > 0:  # the model-dtype output, quantized: what the unfused kernels would make of it
        model_dtype = x_ptr.dtype.element_ty
        y = ((x * rstd).to(model_dtype).to(tl.float32) * w).to(model_dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=0), QMAX)
        tl.store(scale_ptr + row, scale)
        y = quantize_values(y, scale, QMAX, IS_INT)
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (normed * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(weight * norm(h), h) with h = x + residual, or h = x (returned as is) without one.
    With `quant_dtype` (int8 / float8 e4m3) the first is that output quantized per token, a
    `QuantizedRows`."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape, dtype=quant_dtype or x.dtype, device=x.device)
    scale = _scales(x2, quant_dtype)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = _rows(residual, "residual")
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused
    h = res_out.view(x.shape) if residual is not None else x
    if x2.shape[0] == 0:
        return _output(out, scale, x, quant_dtype), h
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        res_out,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        res_out.stride(0),
        scale,
        hidden,
        eps,
        BLOCK_N=block,
        HAS_RESIDUAL=residual is not None,
        PDL=pdl_enabled(x),
        QMAX=qmax_of(quant_dtype) if quant_dtype else 0.0,
        IS_INT=quant_dtype == torch.int8,
        launch_pdl=pdl_enabled(x),
        num_warps=_num_warps(block),
    )
    return _output(out, scale, x, quant_dtype), h


def _scales(x2: torch.Tensor, quant_dtype: torch.dtype | None) -> torch.Tensor:
    # A quantized output's per-row scales (float32 [M, 1]); otherwise a placeholder.
    if quant_dtype is None:
        return x2
    if quant_dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"quant_dtype must be int8 or float8_e4m3fn, got {quant_dtype}")
    return torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x2.device)


def _output(
    out: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, quant_dtype: torch.dtype | None
) -> torch.Tensor | QuantizedRows:
    # out [M, N] viewed with x's leading dimensions; quantized: with its scales [..., 1].
    lead = x.shape[:-1]
    out = out.view(*lead, out.shape[-1])
    if quant_dtype is None:
        return out
    return QuantizedRows(out, scale.view(*lead, 1), x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x: tl.int64,
    stride_o: tl.int64,
    d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    out = _silu_mul_block(x_ptr + row * stride_x, offs, d)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=offs < d)


# The longest row SiLU-and-mul quantizes in one pass, from registers (16 warps, 32 outputs a
# thread): one program a row, so at one row the program's loads are all in flight at once.
SILU_QUANT_ONE_PASS = 16384


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x: tl.int64,
    stride_q: tl.int64,
    d,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    # One row a program. A row of at most BLOCK outputs is loaded at once and kept in
    # registers; a longer one gives its absolute maximum first, then is read again, quantized
    # (the second pass reads what the first just brought into L2).
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        y = _silu_mul_block(x_ptr + row * stride_x, offs, d)
        scale = row_scale(tl.max(tl.abs(y), axis=0), QMAX)
        tl.store(scale_ptr + row, scale)
        y = quantize_values(y, scale, QMAX, IS_INT)
        tl.store(q_ptr + row * stride_q + offs, y.to(q_ptr.dtype.element_ty), mask=offs < d)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        y = _silu_mul_block(x_ptr + row * stride_x, start + tl.arange(0, BLOCK), d)
        amax = tl.maximum(amax, tl.abs(y))
    scale = row_scale(tl.max(amax, axis=0), QMAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = quantize_values(_silu_mul_block(x_ptr + row * stride_x, offs, d), scale, QMAX, IS_INT)
        tl.store(q_ptr + row * stride_q + offs, y.to(q_ptr.dtype.element_ty), mask=offs < d)


@triton.jit
def _silu_mul_block(row_ptr, offs, d):
    # silu(gate) * up at offs, rounded to the model dtype as `_silu_and_mul_kernel` stores it.
    mask = offs < d
    gate = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + d + offs, mask=mask, other=0.0).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(row_ptr.dtype.element_ty).to(tl.float32)


def silu_and_mul_triton(
    x: torch.Tensor, quant_dtype: torch.dtype | None = None
) -> torch.Tensor | QuantizedRows:
    """[..., 2 * d] -> silu(x[..., :d]) * x[..., d:]; with `quant_dtype` (int8 / float8
    e4m3) that quantized per token, a `QuantizedRows`."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape[0], d, dtype=quant_dtype or x.dtype, device=x.device)
    scale = _scales(x2, quant_dtype)
    if quant_dtype is not None:
        if x2.shape[0] > 0:
            block = triton.next_power_of_2(d)
            one_pass = block <= SILU_QUANT_ONE_PASS
            block = block if one_pass else 2048
            _silu_and_mul_quant_kernel[(x2.shape[0],)](
                x2, out, scale, x2.stride(0), out.stride(0), d,
                QMAX=qmax_of(quant_dtype), IS_INT=quant_dtype == torch.int8, BLOCK=block,
                ONE_PASS=one_pass, PDL=pdl_enabled(x), launch_pdl=pdl_enabled(x),
                num_warps=max(1, min(16, block // 1024)),  # <= 32 outputs a thread
            )  # fmt: skip
        return _output(out, scale, x, quant_dtype)
    if x2.shape[0] > 0:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
            PDL=pdl_enabled(x), launch_pdl=pdl_enabled(x), num_warps=_num_warps(block),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
