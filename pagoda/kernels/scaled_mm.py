"""W8A8 GEMMs: y = (q(x) @ w_q^T) * x_scale * w_scale (+ bias), with 8-bit weights quantized
per output channel (int8 or float8 e4m3) and activations quantized per token at run time
(dynamic, symmetric), as SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) and FP8 inference
(Micikevicius et al. 2022, arXiv:2209.05433) serve them.

- CUDA, int8: one Triton kernel quantizes each row of x (absmax / 127), then one Triton GEMM
  multiplies the int8 operands on the tensor cores into int32 accumulators and scales them in
  its epilogue (x_scale * w_scale, + bias), writing the model dtype once; its tiles come from a
  fixed rule by shape (`scaled_mm_triton.choose_w8a8_config`). On sm_90 from 65 rows a CUDA
  kernel takes its place (`w8a8_wgmma.py`: warp-specialized, TMA copies and wgmma, the same
  epilogue). The alternative they replace, `torch._int_mm` (cuBLASLt, an int32 [M, N]
  product in memory, more than 16 rows) and a separate epilogue kernel, stays selectable
  (config="int_mm") for comparison.
- CUDA sm_89+, fp8: the same row quantization (absmax / 448), then up to 64 rows the same
  Triton GEMM on e4m3 operands (float32 accumulators), on sm_90 at 65-128 rows the CUDA
  kernel, past that `torch._scaled_mm` with row-wise scales, which applies both scales and
  the bias in cuBLASLt's epilogue.
- Elsewhere (a CPU, or no triton): the same quantization in torch and the product in float32 on
  the integer / fp8 values (exact for int8 products up to 2^24 per output, a float32 rounding
  beyond): `torch._int_mm` exists on a CPU but runs ~20x slower than a float32 GEMM. A model's
  int8 layers on a CPU take the quantized GGUF GEMM instead (`cpu_blocks.int8_blocks`: Q8_0
  blocks, int8 dot products); this path stays their reference and the fp8 layers' path.

`scaled_mm_ref` (dequantize, then F.linear in float32) is the reference the tests compare all
of them with.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-10  # an all-zero row gets this scale, not a division by zero


def qmax_of(dtype: torch.dtype) -> float:
    return INT8_MAX if dtype == torch.int8 else FP8_MAX


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    # Ties away from zero, as the Triton kernel rounds (torch.round rounds ties to even).
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


class QuantizedRows(NamedTuple):
    """Activations already quantized per token, as `quantize_rows_ref` does, by the kernel that
    produced them (RMSNorm or SiLU-and-mul before an 8-bit layer, `norm_act`): q [..., K] int8
    / e4m3 and scale [..., 1] float32 with x ~= q * scale; dtype is the activations' own (the
    model dtype), the product's output dtype. `scaled_mm` takes one in place of x and runs no
    quantization of its own."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_rows_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of x [M, K]: (q [M, K] int8 / fp8, scale [M, 1] float32)
    with x ~= q * scale, scale = max|x_row| / qmax."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax_of(dtype)).clamp_min(_MIN_SCALE)
    v = xf / scale
    if dtype == torch.int8:
        return _round_half_away(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return v.clamp(-FP8_MAX, FP8_MAX).to(dtype), scale


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a [N, K] weight: (w_q [N, K], scale [N, 1]
    float32). Weight rows are quantized with torch.round (ties to even), as llm-compressor does."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / qmax_of(dtype)).clamp_min(_MIN_SCALE)
    v = w / scale
    if dtype == torch.int8:
        return torch.round(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return v.clamp(-FP8_MAX, FP8_MAX).to(dtype), scale


def scaled_mm_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: x quantized per row like the kernels, both operands dequantized to
    float32, F.linear, the result in x's dtype. x [M, K], w_q [N, K], w_scale [N] or [N, 1]."""
    x_q, x_scale = quantize_rows_ref(x, w_q.dtype)
    xd = x_q.float() * x_scale
    wd = w_q.float() * w_scale.float().reshape(-1, 1)
    y = F.linear(xd, wd, None if bias is None else bias.float())
    return y.to(x.dtype)


def _plain_scaled_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    x_q, x_scale = quantize_rows_ref(x, w_q.dtype)
    return plain_quantized_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def plain_quantized_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The integer (or fp8) values in float32, the scales after the product: what the tensor
    cores compute, up to the float32 rounding of large int8 sums."""
    acc = x_q.float() @ w_q.float().t()
    y = acc * x_scale * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@functools.cache
def fp8_supported(device: torch.device | str | None = None) -> bool:
    """Whether `device` (default: the current CUDA device) has FP8 tensor cores (sm_89+)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _triton_ok(x: torch.Tensor) -> bool:
    from pagoda.kernels import triton_available

    return x.is_cuda and triton_available()


def scaled_mm(
    x: torch.Tensor | QuantizedRows,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) times the 8-bit weight w_q [N, K] (int8 or float8
    e4m3, per-channel w_scale [N] float32), x quantized per token: [..., N] in x's dtype.
    x may come quantized already (`QuantizedRows` of w_q's dtype): then only the product."""
    if isinstance(x, QuantizedRows):
        return _prequantized_mm(x, w_q, w_scale, bias)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if _triton_ok(x2) and x2.shape[0] > 0:
        from pagoda.kernels.scaled_mm_triton import scaled_mm_cuda

        y = scaled_mm_cuda(x2, w_q, w_scale, bias)
    else:
        y = _plain_scaled_mm(x2, w_q, w_scale, bias)
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def _prequantized_mm(
    x: QuantizedRows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.q.dtype != w_q.dtype:
        raise ValueError(
            f"activations quantized to {x.q.dtype} for a weight of {w_q.dtype}: the kernel "
            f"before this layer must quantize to the weight's dtype"
        )
    k = x.q.shape[-1]
    q2, s2 = x.q.reshape(-1, k), x.scale.reshape(-1, 1)
    if _triton_ok(q2) and q2.shape[0] > 0:
        from pagoda.kernels.scaled_mm_triton import quantized_mm_cuda

        y = quantized_mm_cuda(q2, s2, w_q, w_scale, bias, x.dtype)
    else:
        y = plain_quantized_mm(q2, s2, w_q, w_scale, bias, x.dtype)
    return y.reshape(*x.q.shape[:-1], w_q.shape[0])


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "INT8_MAX",
    "QuantizedRows",
    "fp8_supported",
    "plain_quantized_mm",
    "quantize_rows_ref",
    "quantize_weight",
    "scaled_mm",
    "scaled_mm_ref",
]
