"""ctypes wrappers of `ggml_numerics.c`: llama.cpp's CPU arithmetic op for op (quantized
linear layers, RMSNorm, RoPE, attention over an f16 cache, SwiGLU), which the ggml numerics mode
of Llama models (`pagoda.model.models.llama_ggml`) runs.

ggml's summation orders and its exp depend on the vector width its build targets, so each op
that depends on it takes a variant: "avx512" (llama.cpp built with AVX512F/DQ) or "avx2" (AVX2 +
FMA). `default_variant()` is the one a native llama.cpp build uses on this CPU. The library is
portable C (every variant on any CPU), built like the other CPU kernels
(`pagoda.utils.cpu_build`, cached on disk); the products and attention run on Pagoda's thread
pool (`pool.c`), with torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagoda.kernels.cpu import pool
from pagoda.kernels.cpu.quant import unpack_x8
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import build_with_fallback, cpu_flags, open_library

SOURCE, HEADERS, _ = cpu_kernels.GGML_NUMERICS
_ABI = 3
VARIANTS = {"avx512": 0, "avx2": 1}
GGML_Q4_1, GGML_Q8_0 = 3, 8
SUPPORTED_TYPES = {GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0"}
# How GCC fused RoPE's a*b - c*d in ggml's build (ggml_numerics.c, gn_rope): the first product.
_ROPE_CONTRACTION = 1


def default_variant(flags: str | None = None) -> str | None:
    """The variant of a llama.cpp built natively for a CPU with these /proc/cpuinfo flags
    (default: this one's): "avx512" with AVX512F and AVX512DQ, "avx2" with AVX2 and FMA, else
    None (ggml's scalar code, which this module does not reproduce)."""
    have = set((cpu_flags() if flags is None else flags).split())
    if {"avx512f", "avx512dq"} <= have:
        return "avx512"
    if {"avx2", "fma"} <= have:
        return "avx2"
    return None


@functools.cache
def load_library(isa: str | None = None) -> ctypes.CDLL:
    """The library built for ISA level `isa` (default: the selected one; the quantized products
    take AVX2 vectors where it has them, else a loop over ggml's lanes, with the same bits),
    built on first call (~1 s). Raises `cpu_build.CpuKernelUnavailable`."""
    lib = open_library(build_with_fallback(SOURCE, HEADERS, isa)[0], "gn_abi", _ABI)
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "gn_linear": [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32],
        "gn_rms_norm": [ptr, i64, ptr, f32, i64, i64, ptr, i64],
        "gn_rope": [ptr, i64, ptr, i64, i32, i32, f32, i32],
        "gn_swiglu": [i32, ptr, i64, i64, i64, ptr, i64],
        "gn_attention": [i32, ptr, i64, i32, i32, i32, ptr, ptr, i64, i64, i64, ptr, i64]
        + [ptr, ptr, i32, i32, f32, ptr, i64, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.gn_isa.restype = ctypes.c_char_p
    lib.gn_set_parallel_run.argtypes = [ctypes.c_void_p]
    lib.gn_set_parallel_run(pool.parallel_run_pointer())  # NULL: OpenMP regions
    return lib


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} rejected its arguments (a bug in the Python-side checks)")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows of unit stride (a view when it already is)."""
    if x.dtype is not torch.float32:
        raise TypeError(f"ggml numerics take float32 activations, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def linear(
    x: torch.Tensor,
    data: torch.Tensor,
    ggml_type: int,
    n: int,
    x8: bool,
    out: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T for W's GGUF blocks `data` ([n, row bytes], or the x8 layout's
    [ceil(n/8), 8 * row bytes], unpacked to rows here: the model mode unpacks once at load)
    -> [M, n] (or into `out`, a [M, n] view with unit column stride), by the library built for
    `isa` (default: the selected level)."""
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"ggml numerics multiply Q4_1 and Q8_0 weights, not ggml type {ggml_type}")
    x = _rows(x)
    if x8:
        data = unpack_x8(data, ggml_type, n, x.shape[1])
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    rc = load_library(isa).gn_linear(
        ggml_type, data.data_ptr(), data.stride(0), n, k,
        x.data_ptr(), x.stride(0), m, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "gn_linear")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = _rows(x)
    m, k = x.shape
    w = weight.detach().float().contiguous()
    out = torch.empty(m, k, dtype=torch.float32)
    rc = load_library().gn_rms_norm(
        x.data_ptr(), x.stride(0), w.data_ptr(), eps, m, k, out.data_ptr(), k
    )
    _check(rc, "gn_rms_norm")
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, heads: int, head_dim: int, base: float) -> None:
    """RoPE in place on x [T, heads * head_dim] (row stride free, unit column stride), each
    head in Hugging Face's rotate-half order."""
    if x.stride(-1) != 1:
        raise ValueError("rope_ needs rows of unit stride")
    pos = positions.to(torch.int64).contiguous()
    rc = load_library().gn_rope(
        x.data_ptr(), x.stride(0), pos.data_ptr(), x.shape[0], heads, head_dim, base,
        _ROPE_CONTRACTION,
    )  # fmt: skip
    _check(rc, "gn_rope")


def swiglu(gate_up: torch.Tensor, variant: str) -> torch.Tensor:
    """[M, 2I] (gate, up) -> silu(gate) * up [M, I]."""
    gu = _rows(gate_up)
    m, i = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    rc = load_library().gn_swiglu(
        VARIANTS[variant], gu.data_ptr(), gu.stride(0), m, i, out.data_ptr(), i
    )
    _check(rc, "gn_swiglu")
    return out


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
    head_dim: int,
    scale: float,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    variant: str,
) -> torch.Tensor:
    """q [T, num_heads * head_dim] (RoPE applied) over an f16 cache [2, blocks, block_size,
    kv_heads, head_dim] that already holds this step's keys and values -> [T, heads * dim]."""
    if kv_cache.dtype is not torch.float16:
        raise ValueError(f"ggml numerics read an f16 KV cache, got {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache[0].numel():
        raise ValueError("the KV cache must be [2, blocks, block_size, kv_heads, head_dim]")
    q = _rows(q)
    kvh = kv_cache.shape[3]
    qsl = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=torch.float32)
    k, v = kv_cache[0], kv_cache[1]
    rc = load_library().gn_attention(
        VARIANTS[variant], q.data_ptr(), q.stride(0), num_heads, kvh, head_dim,
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        bt.data_ptr(), bt.stride(0), qsl.data_ptr(), lens.data_ptr(), lens.shape[0],
        kv_cache.shape[2], scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "gn_attention")
    return out
