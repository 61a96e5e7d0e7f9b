"""Native CPU ops for small-batch decode: a bf16 GEMM on packed weights, a skinny GEMM on plain
weights and fused element-wise ops in C.

At decode on a CPU the per-call overhead of torch's small GEMMs (oneDNN setup, OpenMP
fork/join) and of the unfused element-wise ops (each a pass and an allocation) dominates the
step, not the arithmetic; and below AVX512_BF16 torch's bf16 GEMM is several times slower than
its float32 one. `cpu_ops.c` does each linear layer's product as one streaming pass over the
weights with fp32 accumulation (`vdpbf16ps` on AVX512_BF16; elsewhere bf16 widened by a shift
and multiplied with FMAs) and RMSNorm(+residual), SiLU-and-mul and RoPE as one pass each. It is
built once per ISA level (portable, avx2, avx512, avx512_bf16: the CPU's best, or
`$PAGODA_CPU_ISA`) by the attention kernel's build helper; `ops.py` loads it, checks when an op
applies and calls it through ctypes. The model layers call these on CPU tensors when
`cpu_ops_available()`; their torch code stays the reference.
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
