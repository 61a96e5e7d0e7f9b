"""Fused ops of the model (RMSNorm(+residual), SiLU-and-mul, RoPE, the one-row GEMV, the
few-row GEMM).

The functions here pick the Triton kernel for CUDA tensors and the torch reference
(`pagoda.kernels.reference`) otherwise, so model code calls them on any device; importing
this package never imports triton. The Triton versions are `*_triton` in `norm_act` and
`rotary`, called directly by the tests (on a CPU through Triton's interpreter). Which of the
linear kernels (these, the C CPU GEMMs, cuBLAS) takes a layer's product is decided in one place,
`pagoda.kernels.linear`.
"""

from __future__ import annotations

import functools

import torch

from pagoda import envs
from pagoda.kernels.reference import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from pagoda.kernels.scaled_mm import QuantizedRows, quantize_rows_ref


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether kernels on x's device use programmatic dependent launch (PAGODA_PDL, sm_90 or
    newer): the W4A16 GEMV and wgmma kernels (and the latter's x tiling), the W8A8 / FP8
    Triton and CUDA GEMMs and the row quantization, RMSNorm, SiLU-and-mul, RoPE + cache write,
    the CUDA decode attention and its segment reduce are launched as dependents of the kernel
    before them (each starts while that one finishes: the W4A16 kernels and the CUDA W8A8
    GEMM load their first weights, the others wait), and at their start let the next one
    launch (`triton_pdl`, `w4a16_device.cuh`)."""
    return x.is_cuda and envs.PAGODA_PDL and _sm90(x.device.index or 0)


@functools.cache
def _sm90(device: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device) >= (9, 0)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(weight * rmsnorm(h), h) with h = x + residual, or h = x when residual is None:
    a decoder layer does `x, residual = rms_norm(x, w, eps, residual)`. With `quant_dtype`
    (int8 / float8 e4m3, before an 8-bit layer) the first comes quantized per token, a
    `QuantizedRows`."""
    if _use_triton(x):
        from pagoda.kernels.norm_act import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, quant_dtype)
    out, h = rms_norm_ref(x, weight, eps, residual)
    return _quantized(out, quant_dtype), h


def silu_and_mul(
    x: torch.Tensor, quant_dtype: torch.dtype | None = None
) -> torch.Tensor | QuantizedRows:
    """[..., 2 * d] -> silu(x[..., :d]) * x[..., d:], quantized per token with
    `quant_dtype` (a `QuantizedRows`)."""
    if _use_triton(x):
        from pagoda.kernels.norm_act import silu_and_mul_triton

        return silu_and_mul_triton(x, quant_dtype)
    return _quantized(silu_and_mul_ref(x), quant_dtype)


def _quantized(out: torch.Tensor, quant_dtype: torch.dtype | None) -> torch.Tensor | QuantizedRows:
    if quant_dtype is None:
        return out
    q, scale = quantize_rows_ref(out, quant_dtype)
    return QuantizedRows(q, scale, out.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox-style RoPE applied in place to q / k ([T, heads * head_size] or [T, heads,
    head_size]) at positions [T] from cos_sin_cache [max_position, rotary_dim] =
    cat(cos, sin); returns (q, k)."""
    if _use_triton(q):
        from pagoda.kernels.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos_sin_cache, head_size)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, head_size)


def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The Triton skinny GEMM (`pagoda.kernels.skinny_gemm`) for the 2..64-row CUDA products
    where it beat cuBLAS on the H200, else None (the caller's cuBLAS)."""
    if not (_use_triton(x) and x.dim() == 2):
        return None
    from pagoda.kernels import skinny_gemm

    m, k = x.shape
    if not skinny_gemm.preferred(m, weight.shape[0], k):
        return None
    return skinny_gemm.skinny_linear(x, weight, bias)


__all__ = ["rms_norm", "rotary_embedding", "silu_and_mul", "triton_available"]


def one_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_and_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The Triton GEMV (`pagoda.kernels.gemv.gemv_triton`) for a single CUDA row where it
    applies, else None (the caller's own path: cuBLAS, the CPU kernels)."""
    if not (_use_triton(x) and x.numel() == x.shape[-1]):
        return None
    from pagoda.kernels.gemv import gemv_supported, gemv_triton

    if not gemv_supported(x, weight, silu_and_mul):
        return None
    return gemv_triton(x, weight, bias, silu_and_mul=silu_and_mul, out_dtype=out_dtype)
