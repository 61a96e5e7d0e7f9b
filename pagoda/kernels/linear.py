"""Which kernel computes a dense linear layer's `x @ W^T`: the one place that chooses.

Model code calls these on its fused path and `F.linear` on its reference path; the rules:

- CUDA, one row (single-stream decode): the Triton GEMV (`pagoda.kernels.gemv`), which streams
  the weight faster than cuBLAS's split-K kernels; it can fuse SiLU-and-mul into its input
  (`silu_and_mul_linear`) and write float32 (logits).
- CUDA, 2..32 rows (64 for wide outputs), no dtype change: the Triton skinny GEMM
  (`pagoda.kernels.skinny_gemm`), where it beat cuBLAS.
- CUDA, float32 out of a bf16/fp16 weight (logits): cuBLAS writing float32 straight from its
  accumulators (no bf16 rounding, no extra pass).
- CPU, a weight packed after loading (bf16 layers, `pagoda.kernels.cpu.gemm`): the packed C GEMM
  at every row count (it beats oneDNN at all of them, so no plain copy is kept); the LM head
  keeps its plain weight (tied embeddings, tensor parallelism) and gets a packed copy at first
  use (`lm_head_logits`).
- CPU, a plain weight and few rows (float32 decode; bf16 without the packed kernel): the C skinny
  GEMM (`pagoda.kernels.cpu.linear`), one streaming pass over the weight, cheaper than oneDNN's
  setup.
- Everything else: `F.linear` (cuBLAS, oneDNN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu as cpu_ops
from pagoda.kernels import few_rows_linear, one_row_linear
from pagoda.kernels.cpu import gemm as cpu_gemm

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _kernel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor | None:
    """The product by one of Pagoda's kernels (or cuBLAS's float32 output) where the rules of
    the module docstring pick one, else None: the caller's torch op."""
    if x.is_cuda:
        y = one_row_linear(x, weight, bias, out_dtype=out_dtype)
        if y is None and out_dtype is None:  # the skinny GEMM writes x's dtype only
            y = few_rows_linear(x, weight, bias)
        if (
            y is None
            and out_dtype is torch.float32
            and weight.dtype in _HALF_DTYPES
            and bias is None
            and x.dim() == 2
        ):
            y = torch.mm(x, weight.t(), out_dtype=torch.float32)
        return y
    if cpu_gemm.is_packed(weight):
        if cpu_gemm.packed_linear_supported(x, weight):
            return cpu_gemm.packed_linear(x, weight, bias, out_dtype=out_dtype)
        return None
    if cpu_ops.linear_supported(x, weight):
        return cpu_ops.linear(x, weight, bias, out_dtype=out_dtype)
    return None


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] in x's dtype, or `out_dtype` (float32
    for logits), by the kernel the module docstring's rules pick. `weight` may be packed
    (`cpu_gemm.pack_weight`); where the packed kernel does not apply, `F.linear` runs on an
    unpacked copy."""
    y = _kernel_linear(x, weight, bias, out_dtype)
    if y is not None:
        return y
    if cpu_gemm.is_packed(weight):
        weight = cpu_gemm.unpack_weight(weight)  # a copy per call: the packed kernel said no
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def silu_and_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """silu(gate) * up @ weight^T (+ bias) for gate_up [..., 2 * K] = cat(gate, up) in one
    kernel, the activation read inside the Triton GEMV, where that applies (one CUDA row), else
    None: the caller runs the activation and then its down projection. `weight` None (a
    quantized layer kept packed has no dense weight) gives None."""
    if weight is None:
        return None
    return one_row_linear(gate_up, weight, bias, silu_and_mul=True)


def lm_head_logits(hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """[N, hidden_size] -> float32 logits [N, vocab_size] of an LM head (`ParallelLMHead`: its
    `weight`, `tp_size` and `compute_logits`), straight from the kernels' fp32 accumulators (no
    rounding to the model dtype on the way).

    A GGUF LM head kept quantized (`weight.quant`) takes the quantized GEMM
    (`lm_head.compute_logits`); with tensor parallelism, the head's own product and all-gather.
    Otherwise a bf16 CPU weight gets a packed copy, made at first use and kept
    (`cpu_gemm.packed_copy`), for the packed GEMM; then `dense_linear`'s kernels on the plain
    weight; then the head's `compute_logits` (`F.linear`)."""
    weight = lm_head.weight
    if getattr(weight, "quant", None) is None and lm_head.tp_size == 1:
        packed = cpu_gemm.packed_copy(lm_head)
        if packed is not None and cpu_gemm.packed_linear_supported(hidden_states, packed):
            return cpu_gemm.packed_linear(hidden_states, packed, out_dtype=torch.float32)
        y = _kernel_linear(hidden_states, weight, None, torch.float32)
        if y is not None:
            return y
    return lm_head.compute_logits(hidden_states).float()


__all__ = ["dense_linear", "lm_head_logits", "silu_and_mul_linear"]
