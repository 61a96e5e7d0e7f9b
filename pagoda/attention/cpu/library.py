"""Build (through `pagoda.utils.cpu_build`) and load the paged-attention C kernel."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagoda.kernels.cpu import pool
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import build_with_fallback, log_isa, open_library

SOURCE, HEADERS, _ = cpu_kernels.ATTENTION  # HEADERS: included by SOURCE, part of the cache key
_ABI = 5  # pagoda_paged_attention_abi() of the source this loader can call
# The kernel's dtype codes (vec.h): q and out take DTYPE_CODES, the cache CACHE_DTYPE_CODES.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e5m2: 3}


@functools.cache
def load_library(isa: str | None = None) -> ctypes.CDLL:
    """The paged-attention kernel built for `isa` (default: the selected level, falling back
    to portable), on first call (~2 s) and cached on disk afterwards.

    Raises CpuKernelUnavailable when there is no compiler or the build or load fails (see
    `pagoda.utils.cpu_build.build_library`)."""
    lib_path, built = build_with_fallback(SOURCE, HEADERS, isa)
    # torch is imported first, so an OpenMP build links the libgomp torch already loaded and the
    # kernel shares torch's worker threads instead of spinning up a second pool.
    lib = open_library(lib_path, "pagoda_paged_attention_abi", _ABI)
    fn = lib.pagoda_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32]
    f32 = ctypes.c_float
    fn.argtypes += [i32, i32, i32, i32, i32, i32, f32, f32, f32, i32, f32, i32]
    fn.restype = ctypes.c_int
    write = lib.pagoda_write_kv
    write.argtypes = [ptr, ptr, i64, i32, ptr, ptr, i32, ptr, i64, i64, f32, f32]
    write.restype = ctypes.c_int
    lib.pagoda_paged_attention_set_parallel_run.argtypes = [ctypes.c_void_p]
    lib.pagoda_paged_attention_set_parallel_run(pool.parallel_run_pointer())  # NULL: OpenMP
    if isa is None:
        log_isa(built)
    return lib
