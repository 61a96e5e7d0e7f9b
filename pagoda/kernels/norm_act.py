"""Triton kernels for the element-wise layers of a Llama block: fused residual add +
RMSNorm (Zhang & Sennrich, 2019) and SwiGLU's silu-and-mul (Shazeer, 2020).

Each saves memory passes over activations that the unfused torch code makes (the add, the
norm's float32 copy, the gate's intermediate). Semantics are those of
`pagoda.kernels.reference`: statistics in float32, sums rounded to the model dtype where
Hugging Face rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl_enabled
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
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # `pdl_enabled`: launched as a programmatic dependent (`triton_pdl`)
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
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(h), h) with h = x + residual, or h = x (returned as is) without one."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = _rows(residual, "residual")
        res_out = torch.empty_like(out)
    else:
        r2 = res_out = x2  # unused
    if x2.shape[0] == 0:
        return out.view(x.shape), (res_out.view(x.shape) if residual is not None else x)
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
        hidden,
        eps,
        BLOCK_N=block,
        HAS_RESIDUAL=residual is not None,
        PDL=pdl_enabled(x),
        launch_pdl=pdl_enabled(x),
        num_warps=_num_warps(block),
    )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else x)


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
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> silu(x[..., :d]) * x[..., d:]."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
            PDL=pdl_enabled(x), launch_pdl=pdl_enabled(x), num_warps=_num_warps(block),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
