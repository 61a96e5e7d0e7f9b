"""Launching NVRTC-built CUDA kernels (`torch.cuda._compile_kernel`) through the driver API on
the current stream, with programmatic dependent launch (PDL) where asked: leaner per call than
the wrapper's `__call__`, which a decode step would pay once per kernel and layer."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.cache
def libcuda() -> Any:
    return torch.cuda._utils._get_gpu_runtime_library()


# CUtensorMap's enums (cuda.h).
TMAP_UINT8 = 0
TMAP_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3


@functools.lru_cache(maxsize=4096)
def tensor_map(
    ptr: int,
    dtype: int,
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    box: tuple[int, ...],
    swizzle: int,
) -> ctypes.Array:
    """The CUtensorMap (128 bytes, 64-byte aligned) of the tiled tensor at `ptr`: `dims`
    innermost first, `strides` in bytes between the outer dimensions' elements, read in
    boxes of `box`, elements past the edges read as zero. Cached: it depends on nothing
    else."""
    buf = ctypes.create_string_buffer(128 + 64)
    desc = (ctypes.c_uint64 * 16).from_address((ctypes.addressof(buf) + 63) & ~63)
    desc._keep = buf  # type: ignore[attr-defined]  # the memory `desc` lives in
    rank = len(dims)
    err = libcuda().cuTensorMapEncodeTiled(
        ctypes.byref(desc),
        dtype,
        ctypes.c_uint32(rank),
        ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
        (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)),
        0,  # no interleave
        swizzle,
        _L2_PROMOTION_256B,
        0,  # out-of-bounds elements read as zero
    )
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA error {err}")
    return desc


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [(f"{d}Dim{a}", ctypes.c_uint) for d in ("grid", "block") for a in "XYZ"]
    _fields_ += [
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: {x, y, z}


def launch(
    func: Any,
    grid: tuple[int, int, int],
    block: int,
    smem: int,
    args: list,
    device: torch.device,
    pdl: bool = False,
    cluster: tuple[int, int, int] | None = None,
) -> None:
    """Launch `func` (a CUfunction) on `device`'s current stream with `args`: tensors as
    pointers, floats as doubles, ints as 32-bit, ctypes arrays as their bytes (a tensor map;
    the kernel's parameters are declared to match). With `pdl`, as a programmatic dependent
    of the kernel before it in the stream (cuLaunchKernelEx with programmatic stream
    serialization; a programmatic edge in a CUDA graph capture): it may start before that
    kernel ends and must wait for it
    (griddepcontrol.wait) before touching memory that kernel reads or writes. With `cluster`,
    in thread-block clusters of those dimensions (sm_90; they divide `grid`)."""
    cargs = [
        ctypes.c_void_p(a.data_ptr())
        if isinstance(a, torch.Tensor)
        else a
        if isinstance(a, ctypes.Array)
        else ctypes.c_double(a)
        if isinstance(a, float)
        else ctypes.c_int(a)
        for a in args
    ]
    ptrs = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
    stream = torch.cuda.current_stream(device).cuda_stream
    attrs = []
    if pdl:
        attrs.append(_LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION, b"", (1,)))
    if cluster is not None:
        attrs.append(_LaunchAttribute(_CLUSTER_DIMENSION, b"", cluster))
    if attrs:
        array = (_LaunchAttribute * len(attrs))(*attrs)
        config = _LaunchConfig(*grid, block, 1, 1, smem, stream, array, len(attrs))
        err = libcuda().cuLaunchKernelEx(ctypes.byref(config), func, ptrs, None)
    else:
        err = libcuda().cuLaunchKernel(
            func, *grid, block, 1, 1, smem, ctypes.c_void_p(stream), ptrs, None
        )
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def allow_dynamic_smem(func: Any, nbytes: int) -> bool:
    """Let `func` use `nbytes` of dynamic shared memory (needed past 48 KB); False if refused."""
    # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    return libcuda().cuFuncSetAttribute(func, 8, ctypes.c_int(nbytes)) == 0


def fit_shared_carveout(func: Any, threads: int, dynamic_smem: int, device: int) -> None:
    """Ask for the split of each SM's L1 and shared memory that holds as many CTAs of `func` as
    its registers allow (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT): the driver's own
    choice can hold fewer, so that shared memory, not registers, bounds the CTAs an SM."""
    lib = libcuda()
    regs, static = ctypes.c_int(), ctypes.c_int()
    if lib.cuFuncGetAttribute(ctypes.byref(regs), 4, func):  # CU_FUNC_ATTRIBUTE_NUM_REGS
        return
    if lib.cuFuncGetAttribute(ctypes.byref(static), 1, func):  # ..._SHARED_SIZE_BYTES
        return
    dev, sm_smem, sm_regs = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    err = lib.cuDeviceGet(ctypes.byref(dev), device)
    # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, ..._MAX_REGISTERS_PER_...
    err = err or lib.cuDeviceGetAttribute(ctypes.byref(sm_smem), 81, dev)
    err = err or lib.cuDeviceGetAttribute(ctypes.byref(sm_regs), 82, dev)
    if err or not sm_smem.value:
        return
    warps = -(-threads // 32)
    per_warp = -(-regs.value * 32 // 256) * 256  # allocated a warp at a time, 256 at once
    ctas = min(sm_regs.value // (warps * per_warp), 2048 // threads, 32)
    need = ctas * (static.value + dynamic_smem + 1024)  # 1 KiB a CTA for the system
    percent = min(100, -(-100 * need // sm_smem.value))
    lib.cuFuncSetAttribute(func, 9, ctypes.c_int(percent))


def bind_context() -> None:
    """Make the current device's primary context current on this thread if none is: a thread
    that has made no CUDA runtime call yet (a compile worker whose tensors came from the
    caching allocator) has none, and loading a module there fails ("invalid device context")."""
    lib = libcuda()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    err = lib.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device())
    err = err or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    err = err or lib.cuCtxSetCurrent(ctx)
    if err:
        raise RuntimeError(f"no CUDA context for this thread: CUDA error {err}")


class KernelCache:
    """Kernels built by `build(*key)` (NVRTC, module load) once per key, never during CUDA-graph
    capture (loading a module is not a stream operation): there `get` gives None for a key not
    built yet, and the caller falls back to another kernel; the eager warm-up run before each
    capture builds what that capture needs."""

    def __init__(self, build: Callable[..., Any]) -> None:
        self._build = functools.cache(build)
        self._keys: set[tuple] = set()

    def get(self, key: tuple) -> Any | None:
        if key not in self._keys:
            if torch.cuda.is_current_stream_capturing():
                return None
            self._keys.add(key)
        return self._build(*key)


def build(
    source: str,
    name: str,
    defines: dict[str, int],
    what: str,
    smem: int = 0,
    compute_capability: str | None = None,
) -> Any | None:
    """Kernel `name` of `source` compiled by NVRTC (torch's _CudaKernel) with `defines` as
    #define lines before it, allowed `smem` bytes of dynamic shared memory; None, with a
    warning naming `what`, where NVRTC cannot build it (no NVRTC, an old toolkit) or the driver
    refuses the memory. `compute_capability` as NVRTC's target (e.g. "90a"; default: the
    device's)."""
    src = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source
    try:
        bind_context()
        kernel = torch.cuda._compile_kernel(
            src, name, compute_capability=compute_capability, nvcc_options=["--use_fast_math"]
        )
    except Exception as e:
        logger.warning("%s unavailable: %s", what, e)
        return None
    # Set whenever there is any: static + dynamic past 48 KB needs it too.
    if smem and not allow_dynamic_smem(kernel.func, smem):
        logger.warning("%s: %d bytes of shared memory refused", what, smem)
        return None
    return kernel
