"""SwiGLU's gate (Shazeer, 2020): silu(gate) * up on a fused [.., 2 * d] gate_up projection.

On CUDA (unless `fused_ops` is off) one Triton kernel (`pagoda.kernels.silu_and_mul`) replaces
the slice, the silu and the product; the torch line is the CPU path and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused_ops = True  # use the fused kernel on CUDA tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops and x.is_cuda:
            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
