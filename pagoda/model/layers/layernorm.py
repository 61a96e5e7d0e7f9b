"""RMSNorm (Zhang & Sennrich, 2019), with the residual add fused in as vLLM/HF Llama do it.

The torch code below is the reference; unless `fused_ops` is turned off, one kernel does the
add, the statistics and the scaling with the same rounding points: Triton on CUDA
(`pagoda.kernels.rms_norm`), C on CPU (`pagoda.kernels.cpu.rms_norm`, in place on x and the
residual like vLLM's `fused_add_rms_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import cpu as cpu_ops
from pagoda.kernels import rms_norm
from pagoda.kernels.scaled_mm import QuantizedRows

Normed = torch.Tensor | QuantizedRows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.fused_ops = True  # use the fused kernel on CUDA / the C op on CPU

    def divide_output_(self, scales: torch.Tensor) -> None:
        """Divide the norm's output by `scales` [hidden] per channel from now on, in place (AWQ
        and SmoothQuant fold their input scales into the norm before a linear)."""
        with torch.no_grad():
            self.weight.div_(scales)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the model dtype, as Hugging Face computes them.
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        quant_dtype: torch.dtype | None = None,
    ) -> Normed | tuple[Normed, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual). With
        `quant_dtype` (the 8-bit layer after asks for it, `LinearBase.input_quantization`)
        norm(...) comes quantized per token as the kernel writes it, a `QuantizedRows` (on a
        CPU by the torch reference, then the reference row quantization)."""
        if self.fused_ops:
            if x.is_cuda or quant_dtype is not None:
                out, h = rms_norm(x, self.weight, self.variance_epsilon, residual, quant_dtype)
                return out if residual is None else (out, h)
            if x.dtype is self.weight.dtype and cpu_ops.rms_norm_supported(
                x, self.weight, residual
            ):
                out, h = cpu_ops.rms_norm(x, self.weight, self.variance_epsilon, residual)
                return out if residual is None else (out, h)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
