"""ctypes wrapper of the quantized-weight GEMM (`quant_gemm.c`): x @ W^T with W kept in its
GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), activations quantized to int8 on the fly.

A weight is a `QuantWeight`: uint8 blocks of a ggml type in one of two layouts. "rows" is the
GGUF file's, `[N, row_bytes]`, each row the blocks of one output (a row permutation such as the
Q/K un-permutation keeps them valid); "x8" (Q4_0, Q4_1, Q8_0: `pack_x8`) interleaves groups of 8
rows block by block, the same bytes reordered so that one integer dot product serves 8 outputs
(`quant_x8.h`), `[ceil(N/8), 8 * row_bytes]`. The library is built at first use by `pagoda.utils.cpu_build` at the selected ISA level
(AVX-512 VNNI, AVX2 or portable C; `$PAGODA_CPU_ISA` forces one), and `load_quant_library(isa)`
builds any other level the CPU runs (the tests compare them). Threads: torch's intra-op count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.kernels.cpu import pool
from pagoda.utils import cpu_build as build
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import CpuKernelUnavailable

logger = logging.getLogger(__name__)

SOURCE, HEADERS, _ = cpu_kernels.QUANT
_ABI = 3

# ggml type -> (weights per block, bytes per block) of the types the kernel reads.
QUANT_TYPES = {
    2: (32, 18),
    3: (32, 20),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
QUANT_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
X8_TYPES = (2, 3, 8)
_IO_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class QuantWeight:
    """GGUF blocks of an [n, k] weight: `data` uint8, `[n, row_bytes]` or, with `x8`,
    `[ceil(n / 8), 8 * row_bytes]`."""

    data: torch.Tensor
    ggml_type: int
    n: int
    k: int
    x8: bool = False

    def __post_init__(self) -> None:
        if self.ggml_type not in QUANT_TYPES:
            raise ValueError(f"ggml type {self.ggml_type} is not one the quantized GEMM reads")
        rows, width = (
            (-(-self.n // 8), 8 * row_bytes(self.ggml_type, self.k))
            if self.x8
            else (self.n, row_bytes(self.ggml_type, self.k))
        )
        d = self.data
        if d.dtype is not torch.uint8 or d.device.type != "cpu" or tuple(d.shape) != (rows, width):
            raise ValueError(
                f"{QUANT_TYPE_NAMES[self.ggml_type]} blocks of a [{self.n}, {self.k}] weight are "
                f"a uint8 CPU tensor [{rows}, {width}], got {d.dtype} {tuple(d.shape)}"
            )
        if d.stride(1) != 1:
            raise ValueError("quantized weight rows must be contiguous")

    @property
    def type_name(self) -> str:
        return QUANT_TYPE_NAMES[self.ggml_type]


def pack_x8(data: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """GGUF rows [n, row_bytes] of Q4_0 / Q4_1 / Q8_0 -> the x8 layout [ceil(n/8), 8 * row_bytes]
    (quant_x8.h): the same bytes, rows past n zero."""
    if ggml_type not in X8_TYPES:
        raise ValueError(f"the x8 layout holds Q4_0, Q4_1 and Q8_0, not {ggml_type}")
    n, nb, bytes_ = data.shape[0], k // 32, QUANT_TYPES[ggml_type][1]
    groups = -(-n // 8)
    blocks = torch.zeros(groups * 8, nb, bytes_, dtype=torch.uint8)
    blocks[:n] = data.reshape(n, nb, bytes_)
    blocks = blocks.view(groups, 8, nb, bytes_).transpose(1, 2)  # [g, b, row, bytes]
    head = 4 if ggml_type == 3 else 2  # d (and Q4_1's m) as [8] fp16 each, then qs
    parts = [blocks[..., i : i + 2].reshape(groups, nb, 16) for i in range(0, head, 2)]
    qs = blocks[..., head:]  # [g, b, 8, 16 or 32]: vector j = bytes 4j..4j+3 of every row
    qs = qs.reshape(groups, nb, 8, -1, 4).transpose(2, 3).reshape(groups, nb, -1)
    return torch.cat([*parts, qs], dim=-1).reshape(groups, -1).contiguous()


def unpack_x8(data: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """The x8 layout of an [n, k] weight -> its GGUF rows [n, row_bytes] (`pack_x8` undone)."""
    nb, bytes_ = k // 32, QUANT_TYPES[ggml_type][1]
    groups, head = data.shape[0], 4 if ggml_type == 3 else 2
    g = data.reshape(groups, nb, 8 * bytes_)
    parts = [g[..., 8 * i : 8 * (i + 2)].reshape(groups, nb, 8, 2) for i in range(0, head, 2)]
    qs = g[..., 8 * head :].reshape(groups, nb, -1, 8, 4).transpose(2, 3)  # [g, b, row, j, 4]
    blocks = torch.cat([*parts, qs.reshape(groups, nb, 8, -1)], dim=-1)  # [g, b, row, bytes]
    return blocks.transpose(1, 2).reshape(groups * 8, nb * bytes_)[:n].contiguous()


def supported_isas() -> tuple[str, ...]:
    """The ISA levels this CPU runs, lowest first (each builds the kernel differently)."""
    if not hasattr(build, "supported_isas"):  # a build helper without ISA levels: one build
        return ("native",)
    return build.supported_isas()


def _build(isa: str | None) -> Path:
    if not hasattr(build, "build_with_fallback"):
        return build.build_library(SOURCE, HEADERS)
    return build.build_with_fallback(SOURCE, HEADERS, isa)[0]


@functools.cache
def load_quant_library(isa: str | None = None) -> ctypes.CDLL:
    """The kernel built for `isa` (default: the selected level, falling back to portable when
    that build fails). Raises CpuKernelUnavailable when nothing builds or loads."""
    lib = build.open_library(_build(isa), "pagoda_quant_abi", _ABI)
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.pagoda_quant_gemm.argtypes = [ptr, i64, i32, ptr, i64, i32, i32, ptr, ptr, i64, i32]
    lib.pagoda_quant_gemm.argtypes += [i64, i64, i64, i32]
    lib.pagoda_quant_dequantize_rows.argtypes = [ptr, i64, i32, i32, ptr, i64, i64, i64, ptr]
    lib.pagoda_quant_gemm.restype = lib.pagoda_quant_dequantize_rows.restype = ctypes.c_int
    lib.pagoda_quant_isa.restype = ctypes.c_char_p
    lib.pagoda_quant_amx.argtypes, lib.pagoda_quant_amx.restype = [], ctypes.c_int
    lib.pagoda_quant_set_amx_min_rows.argtypes = [i32]
    lib.pagoda_quant_set_amx_min_rows.restype = ctypes.c_int
    lib.pagoda_quant_set_parallel_run.argtypes = [ctypes.c_void_p]
    lib.pagoda_quant_set_parallel_run(pool.parallel_run_pointer())  # NULL: OpenMP regions
    return lib


@functools.cache
def quant_kernel_available() -> bool:
    """Whether the kernel builds and loads here (False with one warning otherwise)."""
    try:
        load_quant_library()
    except CpuKernelUnavailable as e:
        logger.warning("quantized CPU GEMM unavailable (%s)", e)
        return False
    return True


def kernel_isa(isa: str | None = None) -> str:
    """The code path the library built for `isa` runs: avx512vnni, avx2 or portable."""
    return load_quant_library(isa).pagoda_quant_isa().decode()


def amx_active(isa: str | None = None) -> bool:
    """Whether x8 weights (Q4_0, Q4_1, Q8_0) take their integer dots from AMX tiles at batch
    here (`quant_amx.h`, the same bits as the vector tiles; Q8_0 from 32 activation rows, Q4 from
    64): a CPU with AMX, `$PAGODA_CPU_AMX` not 0, the OS's grant."""
    return bool(load_quant_library(isa).pagoda_quant_amx())


def set_amx_min_rows(rows: int, isa: str | None = None) -> int:
    """Activation row count from which Q8_0 x8 weights take the AMX path, Q4 ones from twice
    it (quant_amx.h's `quant_amx_min_rows`, 32 by default); returns the previous one, or -1
    where the build has none. For tests and tuning."""
    return load_quant_library(isa).pagoda_quant_set_amx_min_rows(rows)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of `k` inputs in `ggml_type` blocks."""
    elems, nbytes = QUANT_TYPES[ggml_type]
    if k % elems:
        raise ValueError(f"{QUANT_TYPE_NAMES[ggml_type]} rows need a multiple of {elems} inputs")
    return k // elems * nbytes


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x [..., K] (float32 or bf16) @ W^T (+ bias): [..., N] in x's dtype or `out_dtype`
    (float32 / bf16). `out` may be a column slice of a wider 2-D output (rows of unit stride):
    a fused layer whose shards differ in type writes its parts into one tensor."""
    # A decode step makes ~120 of these calls: the checks stay few and cheap.
    k, n = weight.k, weight.n
    if x.shape[-1] != k or x.dtype not in _IO_DTYPES:
        raise ValueError(f"x must be float32 or bf16 with {k} features, got {x.dtype} {x.shape}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    if out is None:
        out = y2 = torch.empty(x2.shape[0], n, dtype=out_dtype or x.dtype)
        if x.dim() != 2:
            out = y2.view(*x.shape[:-1], n)
    else:
        y2 = out if out.dim() == 2 else out.view(-1, n)
        if y2.dtype not in _IO_DTYPES or y2.stride(1) != 1 or y2.shape != (x2.shape[0], n):
            raise ValueError("out must be float32 or bf16 rows of unit stride, [..., N]")
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    rc = load_quant_library(isa).pagoda_quant_gemm(
        x2.data_ptr(),
        x2.stride(0),
        x2.dtype is torch.bfloat16,
        weight.data.data_ptr(),
        weight.data.stride(0),
        weight.ggml_type,
        weight.x8,
        None if bias is None else bias.data_ptr(),
        y2.data_ptr(),
        y2.stride(0),
        y2.dtype is torch.bfloat16,
        x2.shape[0],
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError("pagoda_quant_gemm rejected its arguments (a bug in quant_linear)")
    return out


def dequantize_rows(weight: QuantWeight, ids: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight, dequantized: [*ids.shape, k] float32 (the
    embedding lookup). Raises ValueError for an id outside the weight's rows."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.numel(), weight.k), dtype=torch.float32)
    rc = load_quant_library(isa).pagoda_quant_dequantize_rows(
        weight.data.data_ptr(),
        weight.data.stride(0),
        weight.ggml_type,
        weight.x8,
        flat.data_ptr(),
        flat.numel(),
        weight.n,
        weight.k,
        out.data_ptr(),
    )
    if rc != 0:
        raise ValueError(f"a token id is outside the embedding's {weight.n} rows")
    return out.view(*ids.shape, weight.k)
