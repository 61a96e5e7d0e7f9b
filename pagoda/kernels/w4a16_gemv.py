"""W4A16 for decode batches (up to 64 rows) as a CUDA kernel with tensor-core dots, on the
packed layout of `pagoda.kernels.w4a16` (`w4a16_gemv.cu`'s header says how).

At few rows a 4-bit layer is a stream of K*N/2 bytes and the kernel's whole job is to keep
enough of them in flight. The Triton few-row kernel (`w4a16_skinny.py`) goes through shared
memory and waits on each tile's wgmma, and read the Llama-3-8B layers at 1.0-1.9 TB/s on the
H200. Here every lane loads the 16-byte pieces that are exactly its own mma operands, several
K steps at once, straight into registers; a CTA owns its rows over all of K, so the split over
K is summed in shared memory inside the CTA, with no workspace, counter or second pass.
`GemvConfig.bulk` streams the weights through a shared-memory ring filled by the copy engine
instead (cp.async.bulk from one producer warp, sm_90): the bytes in flight no longer cost
registers, and on the H100 it beat the register kernel at 1-16 rows. Each launch is also a
programmatic dependent of the kernel before it (`GemvConfig.pdl`): its first weights load
while that kernel finishes.

It covers: 16-bit x (bf16 or fp16), scales bf16 or fp16, K a multiple of 128, groups a
multiple of 128 inputs or one group per row, act order, bias, M <= 64, sm_80 or newer (run
and measured on sm_90 only); `w4a16.choose_config` takes it up to 16 rows with the ring (8
rows with registers before sm_90), where it beat the Triton kernels (`w4a16.gemv_config`
says by how much). The rest keeps the Triton
kernels, which stay its reference in the tests along with
`formats.dequantize_*` + F.linear. The source is compiled at first use with NVRTC
(`torch.cuda._compile_kernel`), once per variant, never during CUDA-graph capture (the caller
falls back to Triton then). `PAGODA_W4A16_CUDA=0` turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagoda import envs
from pagoda.kernels import cuda_launch, pdl_enabled

_SOURCE = Path(__file__).with_name("w4a16_gemv.cu")
_HEADER = Path(__file__).with_name("w4a16_device.cuh")  # helpers of both kernels
_KERNEL_NAME = "pagoda_w4a16_gemv"
MAX_M = 64
SMEM_LIMIT = 48 * 1024  # static shared memory of a CTA (the warps' tiles, summed at the end)
RING_LIMIT = 200 * 1024  # dynamic shared memory of a CTA (the bulk ring)
CTA_SMEM_LIMIT = 227 * 1024  # static + dynamic shared memory of a CTA on sm_90
STEP = 128  # inputs per K step of the kernel


class GemvConfig(NamedTuple):
    """row_tiles: 16-row weight tiles per warp (a CTA owns 16 * row_tiles rows); warps: warps
    of a CTA, which take the K steps in turn; depth: K steps a warp loads before using the
    first; l2_prefetch: 1 to have the CTA's rows prefetched into L2 at its start (sm_90);
    sum_mma: 1 to apply the zero point to the product (sums of x by an extra mma) instead of
    subtracting it from every weight; x_early: 1 to issue a K step's x loads before its first
    mma (with bulk: a K step ahead, else each word's at its turn, which holds 16 registers a
    B tile fewer); bulk: 1 to stream the weights through a shared-memory ring filled by the
    copy engine (one more warp issues the copies; sm_90; depth and l2_prefetch do not apply),
    `stages` chunks of `chunk` K steps (a multiple of `warps`) each; pdl: 1 to launch it as a
    programmatic dependent of the kernel before it where `pdl_enabled` (sm_90, PAGODA_PDL;
    elsewhere a plain launch): its first weights load while that kernel finishes
    (`w4a16_gemv.cu`'s `grid_wait`); sc_ring (with bulk): 1 to bring each step's scales and
    zero points through the ring with its weights instead of loading them from global memory
    a step ahead (N a multiple of 16, scales and zeros contiguous and 16-byte aligned:
    `layout_reason`); producer (with bulk): 0 for no producer warp, the consumer that
    releases a stage last refilling it (fewer registers a CTA, so more CTAs an SM);
    min_warps (with bulk): > 0 to keep to the registers that let that many warps reside on an
    SM (whole CTAs; the launch bounds' minimum), 0 for the kernel's own bound; sc_prefetch
    (with bulk and the producer warp, without sc_ring): 1 to have the producer ask for the
    CTA's scale and zero-point rows into L2 at its start; splits (with bulk): the K steps of a
    tile split among a thread-block cluster of that many CTAs (up to 8), whose partial tiles
    one sums through distributed shared memory: more CTAs, each shorter, for layers with fewer
    tiles than the SMs hold; sc_early (with bulk): 1 to have each consumer load its first K
    step's scales and zero points before it waits for the kernel before (PDL), so that only
    x's load follows that wait."""

    row_tiles: int = 1
    warps: int = 8
    depth: int = 2
    l2_prefetch: int = 0
    sum_mma: int = 0
    x_early: int = 1
    bulk: int = 0
    stages: int = 4
    chunk: int = 8
    pdl: int = 0
    sc_ring: int = 0
    producer: int = 1
    min_warps: int = 0
    sc_prefetch: int = 0
    splits: int = 1
    sc_early: int = 0


def enabled() -> bool:
    return envs.PAGODA_W4A16_CUDA


def m_tiles(m: int) -> int:
    """8-column B tiles the kernel computes for m activation rows."""
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


def smem_bytes(mt: int, cfg: GemvConfig) -> int:
    """Static shared memory of a CTA: every warp's fp32 tiles, summed in warp order at the
    end (with `bulk`, and the ring's mbarriers)."""
    return cfg.warps * cfg.row_tiles * mt * 4 * 32 * 4 + 16 * cfg.stages * cfg.bulk


def ring_bytes(cfg: GemvConfig) -> int:
    """Dynamic shared memory of a CTA: with `bulk`, the ring of weight chunks (each row of a
    chunk padded by 64 bytes; with `sc_ring` also a chunk's scales and zero points)."""
    rows = 16 * cfg.row_tiles
    return cfg.bulk * cfg.stages * rows * (cfg.chunk * 64 + 64 + cfg.sc_ring * 3 * cfg.chunk)


def threads(cfg: GemvConfig) -> int:
    """Threads of a CTA: the consumer warps and, with `bulk` and `producer`, the producer
    warp."""
    return 32 * (cfg.warps + cfg.bulk * cfg.producer)


def unsupported_reason(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    max_m: int | None = MAX_M,
) -> str | None:
    """Why these inputs cannot take the CUDA kernel, or None when they can (the shapes and
    dtypes `w4a16_linear` has already checked are not repeated); `max_m` None for no row
    limit (the wgmma kernel, which shares these checks)."""
    if not enabled():
        return "PAGODA_W4A16_CUDA=0"
    if not x.is_cuda or torch.version.cuda is None:
        return "not a CUDA tensor"
    if _capability(x.device.index or 0) < (8, 0):
        return "needs sm_80 or newer"
    m, k = x.shape
    if max_m is not None and m > max_m:
        return f"{m} rows > {max_m}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype}"
    if scales.dtype not in (torch.bfloat16, torch.float16):
        return f"scales dtype {scales.dtype}"
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype}"
    if k % STEP:
        return f"K={k} is not a multiple of {STEP}"
    if group_size % STEP and group_size < k:
        return f"group size {group_size} is not a multiple of {STEP}"
    if x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * 2) % 16:
        return "x is not 16-byte aligned with contiguous rows"
    if qweight.data_ptr() % 16 or not qweight.is_contiguous():
        return "qweight is not contiguous and 16-byte aligned"
    if k * max(qweight.shape[0], m) >= 2**31:
        return "too large for 32-bit indices"
    return None


def bulk_capable(device: torch.device) -> bool:
    """Whether `device` has the copy engine's bulk copies (sm_90) for `GemvConfig.bulk`."""
    return _capability(device.index or 0) >= (9, 0)


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def config_reason(cfg: GemvConfig, device: torch.device) -> str | None:
    """Why `cfg` cannot run on `device`, or None."""
    if cfg.bulk and not bulk_capable(device):
        return "bulk copies need sm_90"
    if cfg.sc_ring and not cfg.bulk:
        return "sc_ring needs the bulk ring"
    if not cfg.producer and not cfg.bulk:
        return "producer=0 needs the bulk ring"
    if cfg.sc_prefetch and (not cfg.bulk or not cfg.producer or cfg.sc_ring):
        return "sc_prefetch needs the bulk ring's producer warp and no sc_ring"
    if cfg.sc_early and not cfg.bulk:
        return "sc_early needs the bulk ring (the register kernel loads its first batch early)"
    if cfg.splits != 1 and (not cfg.bulk or not 1 <= cfg.splits <= 8):
        return f"splits={cfg.splits}: 2-8 with the bulk ring (a cluster of CTAs)"
    if cfg.bulk and (cfg.chunk % cfg.warps or cfg.chunk % 2 or cfg.stages < 1):
        return f"chunk {cfg.chunk} must be an even multiple of warps {cfg.warps}"
    if cfg.sc_ring and cfg.chunk > 32:
        return f"sc_ring copies a chunk's scales a lane a step: chunk {cfg.chunk} > 32"
    if ring_bytes(cfg) > RING_LIMIT:
        return f"a ring of {ring_bytes(cfg)} bytes > {RING_LIMIT}"
    return None


def layout_reason(cfg: GemvConfig, scales: torch.Tensor, zeros: torch.Tensor) -> str | None:
    """Why `cfg` cannot read these scales and zero points, or None: with `sc_ring` the
    producer copies a group's row of each for a tile as whole 16-byte units."""
    if not cfg.sc_ring:
        return None
    n = scales.shape[-1]
    if n % 16:
        return f"sc_ring needs N a multiple of 16, got {n}"
    for name, t in (("scales", scales), ("zeros", zeros)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"sc_ring needs {name} contiguous and 16-byte aligned"
    return None


def group_steps(group_size: int, k: int) -> int:
    """K steps a group (the kernel's GROUP_STEPS, compiled in): 0 for one group a row."""
    return 0 if group_size >= k else group_size // STEP


def shape_reason(m: int, n: int, cfg: GemvConfig, silu_mul: bool = False) -> str | None:
    """Why `cfg` cannot take m activation rows and n weight rows, or None; with `silu_mul`,
    as a merged gate_up layer whose output is silu(gate) * up (see `w4a16_gemv`)."""
    smem = smem_bytes(m_tiles(m), cfg)
    if smem > SMEM_LIMIT:
        return f"{m} rows need {smem} bytes of static shared memory > {SMEM_LIMIT}"
    if smem + ring_bytes(cfg) > CTA_SMEM_LIMIT:
        return f"{smem + ring_bytes(cfg)} bytes of shared memory a CTA > {CTA_SMEM_LIMIT}"
    if cfg.bulk and n < 16 * cfg.row_tiles:
        return f"N={n} < the {16 * cfg.row_tiles} rows of a CTA (bulk)"
    if silu_mul:
        if not cfg.bulk or cfg.row_tiles != 2 or cfg.sc_ring:
            return "silu_and_mul needs the bulk ring, 2 row tiles and no sc_ring"
        if n % 2 or n < 32:
            return f"silu_and_mul needs gate and up halves of >= 16 rows, got N={n}"
    return None


def defines(
    bf16: bool,
    scales_bf16: bool,
    mt: int,
    cfg: GemvConfig,
    has_perm: bool,
    has_bias: bool,
    group_steps: int,
    silu_mul: bool,
) -> dict[str, int]:
    """The source's compile-time constants (`w4a16_gemv.cu`'s header) for one variant."""
    return {
        "BF16": int(bf16),
        "SCALES_BF16": int(scales_bf16),
        "M_TILES": mt,
        "ROW_TILES": cfg.row_tiles,
        "WARPS": cfg.warps,
        "DEPTH": cfg.depth,
        "L2_PREFETCH": cfg.l2_prefetch,
        "SUM_MMA": cfg.sum_mma,
        "X_EARLY": cfg.x_early,
        "BULK": cfg.bulk,
        "STAGES": cfg.stages,
        "CHUNK": cfg.chunk,
        "PDL": cfg.pdl,
        "SC_RING": cfg.sc_ring,
        "PRODUCER": cfg.producer,
        "MIN_WARPS": cfg.min_warps,
        "SC_PREFETCH": cfg.sc_prefetch,
        "SPLITS": cfg.splits,
        "SC_EARLY": cfg.sc_early,
        "GROUP_STEPS": group_steps,
        "SILU_MUL": int(silu_mul),
        "HAS_PERM": int(has_perm),
        "HAS_BIAS": int(has_bias),
    }


def source() -> str:
    """The kernel's source as NVRTC compiles it: the shared device helpers, then the kernel."""
    return _HEADER.read_text() + _SOURCE.read_text()


def _compile(
    bf16: bool,
    scales_bf16: bool,
    mt: int,
    cfg: GemvConfig,
    has_perm: bool,
    has_bias: bool,
    group_steps: int,
    silu_mul: bool,
) -> Any | None:
    """The compiled kernel (torch's _CudaKernel), or None (logged once) where NVRTC cannot
    build it."""
    d = defines(bf16, scales_bf16, mt, cfg, has_perm, has_bias, group_steps, silu_mul)
    what = "CUDA W4A16 kernel (the Triton kernels run instead)"
    kernel = cuda_launch.build(source(), _KERNEL_NAME, d, what, ring_bytes(cfg))
    if kernel is not None and cfg.bulk:
        device = torch.cuda.current_device()
        cuda_launch.fit_shared_carveout(kernel.func, threads(cfg), ring_bytes(cfg), device)
    return kernel


_KERNELS = cuda_launch.KernelCache(_compile)


def get_kernel(
    x: torch.Tensor,
    scales: torch.Tensor,
    cfg: GemvConfig,
    has_perm: bool,
    has_bias: bool,
    group_size: int,
    silu_mul: bool = False,
) -> Any | None:
    """The kernel for these inputs (groups of `group_size`; `silu_mul` as in
    `w4a16_gemv`), or None; the caller has found no `config_reason` or `shape_reason`. Never
    compiles while a CUDA graph is being captured (loading a module is not a stream
    operation): the eager warm-up run before each capture (`cuda_graphs`) builds what that
    capture needs."""
    key = (
        x.dtype == torch.bfloat16,
        scales.dtype == torch.bfloat16,
        m_tiles(x.shape[0]),
        GemvConfig(*cfg),
        has_perm,
        has_bias,
        group_steps(group_size, x.shape[1]),
        silu_mul,
    )
    return _KERNELS.get(key)


def w4a16_gemv(
    kernel: Any,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
    cfg: GemvConfig,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with `kernel` (from `get_kernel`); the caller has checked the
    inputs (`w4a16_linear`, `unsupported_reason`). With `silu_mul` (a kernel built for it) the
    layer is a merged gate_up projection, W = [gate; up], and y [M, N/2] is silu(gate) * up:
    each CTA takes 16 gate rows and the same 16 up rows and applies the activation to its sums
    (`w4a16_gemv.cu`'s SILU_MUL)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n // 2 if silu_mul else n), dtype=x.dtype, device=x.device)
    args = [
        y, x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else x, m, n, k, x.stride(0), y.stride(0),
    ]  # fmt: skip
    tiles = -(-n // 2 // 16) if silu_mul else -(-n // (16 * cfg.row_tiles))
    pdl = bool(cfg.pdl) and pdl_enabled(x)
    cluster = (1, cfg.splits, 1) if cfg.splits > 1 else None
    cuda_launch.launch(
        kernel.func, (tiles, cfg.splits, 1), threads(cfg), ring_bytes(cfg), args, x.device, pdl,
        cluster,
    )  # fmt: skip
    return y
