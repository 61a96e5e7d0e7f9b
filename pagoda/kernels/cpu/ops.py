"""ctypes wrappers of the C CPU ops (`cpu_ops.c`): skinny linear, RMSNorm(+residual),
SiLU-and-mul and RoPE, with the checks that pick them over torch.

The library is built at first use by the attention kernel's helper
(`pagoda.utils.cpu_build.build_library`: gcc -O3 -fopenmp with one ISA level's -m flags,
cached on disk), for the level `selected_isa()` picks: the CPU's best of portable / avx2 /
avx512 / avx512_bf16, or `$PAGODA_CPU_ISA`. When that level does not build, the portable one
does (one warning); without a compiler, or with `PAGODA_CPU_FAST_OPS=0`, `cpu_ops_available()`
is False and the model layers keep their torch code, which stays the reference. Each
`*_supported` check is what a layer asks before calling the op; the ops themselves assume it
passed. They run with torch's intra-op thread count (the same libgomp pool).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagoda import envs
from pagoda.kernels.cpu import pool
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import (
    ISA_LEVELS,
    CpuKernelUnavailable,
    build_with_fallback,
    log_isa,
    open_library,
    warn_unavailable,
)

SOURCE, HEADERS, _ = cpu_kernels.OPS
_ABI = 5
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Largest row count (tokens) the skinny GEMM takes on a plain (unpacked) weight; above it
# torch's GEMM (oneDNN for bf16, MKL for float32) is as fast or faster. Measured on a 2-core
# Zen 4 for the SmolLM2 shapes (`python benchmarks/cpu_ops_bench.py [--dtype float32]`).
# bf16 layers loaded on CPU are packed and take `gemm.packed_linear` for every row count.
MAX_GEMV_ROWS = {torch.bfloat16: 16, torch.float32: 32}


def fast_ops_enabled_by_env() -> bool:
    """False when $PAGODA_CPU_FAST_OPS is 0 / false / off (the torch path everywhere)."""
    return envs.PAGODA_CPU_FAST_OPS


@functools.cache
def load_cpu_ops(isa: str | None = None) -> ctypes.CDLL:
    """The ops library built for ISA level `isa` (default: the selected level, or portable
    when that does not build), on first call (~2 s). Raises CpuKernelUnavailable."""
    lib_path, built = build_with_fallback(SOURCE, HEADERS, isa)
    lib = open_library(lib_path, "pagoda_cpu_ops_abi", _ABI)
    if ISA_LEVELS[lib.pagoda_cpu_ops_isa()] != built:  # the -m flags did not take
        raise CpuKernelUnavailable(f"{lib_path} was built for another ISA level than {built}")
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "pagoda_gemv": [ptr, i64, ptr, ptr, ptr, i64, i32, i64, i64, i64, i32, i32],
        "pagoda_gemm_packed": [ptr, i64, ptr, ptr, ptr, i64, i32, i64, i64, i64, i32],
        "pagoda_gemm_amx": [],
        "pagoda_gemm_set_amx_min_rows": [i32],
        "pagoda_rms_norm": [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32, i32, i32, i32],
        "pagoda_silu_and_mul": [ptr, i64, ptr, i64, i64, i64, i32, i32],
        "pagoda_rotary_embedding": [ptr, ptr, i64, i32, ptr, i64, i32, i32, i32, ptr, i64, i64]
        + [i32, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.pagoda_cpu_ops_set_parallel_run.argtypes = [ctypes.c_void_p]
    lib.pagoda_cpu_ops_set_parallel_run(pool.parallel_run_pointer())  # NULL: OpenMP regions
    if isa is None:
        log_isa(built)
    return lib


def ops_isa() -> str:
    """The ISA level of the ops library in use (builds it on first call)."""
    return ISA_LEVELS[load_cpu_ops().pagoda_cpu_ops_isa()]


@functools.cache
def cpu_ops_available() -> bool:
    """Whether the C ops are on: allowed by $PAGODA_CPU_FAST_OPS and built for this CPU."""
    if not fast_ops_enabled_by_env():
        return False
    try:
        load_cpu_ops()
    except CpuKernelUnavailable as e:
        warn_unavailable(e)
        return False
    return True


def _lib() -> ctypes.CDLL:
    return load_cpu_ops()


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} rejected its arguments (a bug in the Python-side checks)")


# ---- skinny linear ------------------------------------------------------------------------


def linear_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [..., K] with at most MAX_GEMV_ROWS[dtype] rows and weight [N, K] contiguous, both
    bf16 or both float32, on CPU."""
    return (
        x.dtype is weight.dtype
        and x.dtype in MAX_GEMV_ROWS
        and not x.is_cuda
        and x.shape[-1] == weight.shape[-1]  # else F.linear raises the shape error
        and x.numel() <= MAX_GEMV_ROWS[x.dtype] * x.shape[-1]
        and cpu_ops_available()
        and weight.is_contiguous()
        and weight.device.type == "cpu"
    )


def gemm_operands(
    x: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the C GEMMs take for x [..., K] times an [N, K] weight: x as rows of unit stride
    that do not overlap, the output [..., N] (x's dtype or float32), the bias in x's dtype."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be {x.dtype} or torch.float32, got {out_dtype}")
    out = torch.empty((*x.shape[:-1], n), dtype=out_dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    return x2, out, bias


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., K], weight [N, K]: [..., N] in x's dtype, or float32
    (`out_dtype`, for logits); fp32 accumulation either way."""
    n, k = weight.shape
    x2, out, bias = gemm_operands(x, n, k, bias, out_dtype)
    rc = _lib().pagoda_gemv(
        x2.data_ptr(),
        x2.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        out_dtype is torch.float32,
        x2.shape[0],
        n,
        k,
        _DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    _check(rc, "pagoda_gemv")
    return out


# ---- element-wise ops ---------------------------------------------------------------------


def elementwise_supported(x: torch.Tensor) -> bool:
    """A float32 / bf16 CPU tensor with a contiguous last dimension, and the ops built."""
    return x.dtype in _DTYPES and not x.is_cuda and x.stride(-1) == 1 and cpu_ops_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(h), h), h = x + residual, as `pagoda.kernels.reference.rms_norm_ref`.

    With `residual` the op is in place, like vLLM's `fused_add_rms_norm`: `residual` becomes h
    and `x` the normalised output (both must be 2-D rows with a unit last stride). Without, x
    is left alone and a new tensor returned."""
    cols = x.shape[-1]
    if residual is None:
        src = x.reshape(-1, cols)
        if src.stride(-1) != 1:
            src = src.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype).view(-1, cols)
        res_ptr, res_stride = None, 0
    else:
        src = out = x
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    rc = _lib().pagoda_rms_norm(
        src.data_ptr(),
        src.stride(0),
        res_ptr,
        res_stride,
        weight.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        src.shape[0],
        cols,
        eps,
        _DTYPES[x.dtype],
        _DTYPES[weight.dtype],
        torch.get_num_threads(),
    )
    _check(rc, "pagoda_rms_norm")
    if residual is None:
        return out.view(x.shape), x
    return out, residual


def rms_norm_supported(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> bool:
    if not (elementwise_supported(x) and weight.dtype in _DTYPES and weight.is_contiguous()):
        return False
    if residual is None:
        return True
    return (
        x.dim() == 2
        and residual.shape == x.shape
        and residual.dtype is x.dtype
        and residual.stride(-1) == 1
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> silu(x[..., :d]) * x[..., d:], as `silu_and_mul_ref`."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    rc = _lib().pagoda_silu_and_mul(
        x2.data_ptr(),
        x2.stride(0),
        out.data_ptr(),
        d,
        x2.shape[0],
        d,
        _DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    _check(rc, "pagoda_silu_and_mul")
    return out


def _heads_layout(x: torch.Tensor, head_size: int) -> tuple[int, int] | None:
    """(row stride, heads) when x's rows are [T, heads * head_size] or [T, heads, head_size]
    with heads back to back; None otherwise."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2 and x.shape[1] % head_size == 0:
        return x.stride(0), x.shape[1] // head_size
    if x.dim() == 3 and x.shape[2] == head_size and x.stride(1) == head_size:
        return x.stride(0), x.shape[1]
    return None


def rotary_embedding_supported(
    q: torch.Tensor, k: torch.Tensor | None, cos_sin_cache: torch.Tensor, head_size: int
) -> bool:
    return (
        elementwise_supported(q)
        and (k is None or (k.dtype is q.dtype and _heads_layout(k, head_size) is not None))
        and _heads_layout(q, head_size) is not None
        and cos_sin_cache.dtype is torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] <= head_size
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox-style RoPE in place on q / k at `positions` [T], as `rotary_embedding_ref`;
    returns (q, k). Raises ValueError for a position outside the cos/sin table."""
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    q_stride, num_heads = _heads_layout(q, head_size)
    k_stride, num_kv_heads = (0, 0) if k is None else _heads_layout(k, head_size)
    rc = _lib().pagoda_rotary_embedding(
        positions.data_ptr(),
        q.data_ptr(),
        q_stride,
        num_heads,
        None if k is None else k.data_ptr(),
        k_stride,
        num_kv_heads,
        head_size,
        cos_sin_cache.shape[-1],
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        q.shape[0],
        _DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"a position is outside the rotary table [0, {cos_sin_cache.shape[0]}): raise "
            "max_position_embeddings or shorten the request"
        )
    return q, k
