"""The C kernel libraries a CPU engine loads, named without importing their loaders (which
import torch), and `start_build`, which compiles them in the background ahead of those loaders.

Each is (source, headers it includes, ISA level; None: the selected one), the arguments of
`cpu_build.build_library`; the loaders (`pagoda.attention.cpu.library`, `pagoda.kernels.cpu`'s
`ops`, `quant`, `pool`, `decoder`) take their SOURCE and HEADERS from here. A first start spends most of
its time compiling them (~10 CPU-s of gcc -O3); started before torch is imported and the model
loaded, the build runs beside that work, and each loader waits only for its own library."""

from __future__ import annotations

import os
from pathlib import Path

from pagoda import envs
from pagoda.utils.cpu_build import Library, prebuild

_PKG = Path(__file__).resolve().parents[1]
QUANT: Library = (
    _PKG / "kernels/cpu/quant_gemm.c",
    ("quant_blocks.h", "quant_rows.h", "quant_x8.h", "quant_amx.h", "amx.h"),
    None,
)
ATTENTION: Library = (_PKG / "attention/cpu/paged_attention.c", ("vec.h", "tile.h"), None)
OPS: Library = (
    _PKG / "kernels/cpu/cpu_ops.c",
    ("simd.h", "parallel.h", "gemv.h", "gemm.h", "gemm_bf16dp.h", "gemm_amx.h", "amx.h"),
    None,
)
POOL: Library = (_PKG / "kernels/cpu/pool.c", (), "portable")  # no arithmetic: one build
# llama.cpp's arithmetic op for op (the ggml numerics mode): portable C, any level.
GGML_NUMERICS: Library = (_PKG / "kernels/cpu/ggml_numerics.c", ("parallel.h",), None)
# The one-call decoder stack calls the other libraries' kernels: no arithmetic either.
DECODER: Library = (_PKG / "kernels/cpu/decoder.c", (), "portable")

# Device nodes of the GPU drivers torch's CUDA (NVIDIA; AMD's ROCm, which torch also reports as
# CUDA; WSL's) needs: without any, `torch.cuda.is_available()` is False.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def engine_libraries(gguf: bool) -> list[Library]:
    """The libraries a CPU engine loads, longest build first (`prebuild` starts them in this
    order): the quantized GEMM for a GGUF model, attention, the fused ops and the decoder
    stack unless `$PAGODA_CPU_FAST_OPS` (or `$PAGODA_CPU_DECODER`) is 0, the thread pool."""
    libraries = [QUANT] if gguf else []
    libraries.append(ATTENTION)
    if envs.PAGODA_CPU_FAST_OPS:
        libraries.append(OPS)
        if envs.PAGODA_CPU_DECODER:
            libraries.append(DECODER)
    libraries.append(POOL)
    return libraries


def runs_on_cpu(device: str) -> bool:
    """Whether an engine given `device` ("auto", "cpu", "cuda") runs on the CPU, told without
    torch: "auto" is the CPU where no GPU driver's device node exists. Where one does, False
    (the engine then starts the build once torch has said)."""
    if device != "auto":
        return device == "cpu"
    return not any(os.path.exists(node) for node in _GPU_DEVICE_NODES)


def start_build(gguf: bool) -> None:
    """Compile the engine's libraries in the background (once per process; a no-op when they
    are in the cache or there is no compiler)."""
    prebuild(engine_libraries(gguf), wait=False)
