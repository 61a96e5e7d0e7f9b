"""The CPU kernels' thread pool (`pool.c`): a job's caller starts at once and waits only for
workers that joined, never for one still waking up (what each OpenMP region costs).

Built like the kernels (`pagoda.utils.cpu_build`, portable: it holds no arithmetic) and loaded
once per process; `parallel_run_pointer()` is what a kernel library is given. Without a
compiler, or with `PAGODA_CPU_POOL=0`, there is no pool and the kernels keep their OpenMP
regions, which stay the reference.
"""

from __future__ import annotations

import ctypes
import functools

from pagoda import envs
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import CpuKernelUnavailable, build_library

SOURCE, _, ISA = cpu_kernels.POOL  # ISA: portable, it holds no arithmetic
_ABI = 1
DEFAULT_SPIN_US = 100


@functools.cache
def load_pool() -> ctypes.CDLL | None:
    """The pool library, or None when it is switched off or does not build."""
    if not envs.PAGODA_CPU_POOL:
        return None
    try:
        lib = ctypes.CDLL(str(build_library(SOURCE, (), ISA)))
    except (CpuKernelUnavailable, OSError):
        return None
    if lib.pagoda_pool_abi() != _ABI:
        return None
    lib.pagoda_pool_set_spin_ns.argtypes = [ctypes.c_int64]
    spin_us = envs.PAGODA_CPU_POOL_SPIN_US or DEFAULT_SPIN_US
    lib.pagoda_pool_set_spin_ns(spin_us * 1000)
    return lib


def parallel_run_pointer() -> int | None:
    """The address of `pagoda_parallel_run`, for a kernel library's setter; None without a pool."""
    lib = load_pool()
    if lib is None:
        return None
    return ctypes.cast(lib.pagoda_parallel_run, ctypes.c_void_p).value
