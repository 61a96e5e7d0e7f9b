"""SwiGLU's gate (Shazeer, 2020): silu(gate) * up on a fused [.., 2 * d] gate_up projection.

Unless `fused_ops` is off, one kernel replaces the slice, the silu and the product: Triton on
CUDA (`pagoda.kernels.silu_and_mul`), C on CPU (`pagoda.kernels.cpu.silu_and_mul`); the torch
line is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu as cpu_ops
from pagoda.kernels import silu_and_mul
from pagoda.kernels.scaled_mm import QuantizedRows


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused_ops = True  # use the fused kernel on CUDA / the C op on CPU

    def forward(
        self, x: torch.Tensor, quant_dtype: torch.dtype | None = None
    ) -> torch.Tensor | QuantizedRows:
        """silu(gate) * up; with `quant_dtype` (the 8-bit layer after asks for it,
        `LinearBase.input_quantization`) quantized per token as the kernel writes it (on a CPU
        the torch reference, then the reference row quantization)."""
        if self.fused_ops and quant_dtype is not None:
            return silu_and_mul(x, quant_dtype)
        return swiglu(x, self.fused_ops)


def swiglu(x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """silu(gate) * up of x [.., 2 * d]: where `fused`, the kernel of x's device (Triton on
    CUDA, the C op on a CPU where it supports x), else the torch reference."""
    if fused:
        if x.is_cuda:
            return silu_and_mul(x)
        if cpu_ops.elementwise_supported(x):
            return cpu_ops.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
