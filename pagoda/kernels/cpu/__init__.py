"""Native CPU ops for small-batch decode: a skinny bf16 GEMM and fused element-wise ops in C.

At decode on a CPU the per-call overhead of torch's small GEMMs (oneDNN setup, OpenMP
fork/join) and of the unfused element-wise ops (each a pass and an allocation) dominates the
step, not the arithmetic. `cpu_ops.c` does each linear layer's product as one streaming pass
over the weights (AVX512_BF16 `vdpbf16ps`, fp32 accumulation) and RMSNorm(+residual),
SiLU-and-mul and RoPE as one pass each; `ops.py` builds it (with the attention kernel's build
helper), checks when an op applies and calls it through ctypes. The model layers call these on
CPU tensors when `cpu_ops_available()`; their torch code stays the reference.
"""

from pagoda.kernels.cpu.ops import (
    MAX_GEMV_ROWS,
    cpu_ops_available,
    elementwise_supported,
    linear,
    linear_supported,
    rms_norm,
    rms_norm_supported,
    rotary_embedding,
    rotary_embedding_supported,
    silu_and_mul,
)

__all__ = [
    "MAX_GEMV_ROWS",
    "cpu_ops_available",
    "elementwise_supported",
    "linear",
    "linear_supported",
    "rms_norm",
    "rms_norm_supported",
    "rotary_embedding",
    "rotary_embedding_supported",
    "silu_and_mul",
]
