"""W4A16 from 17 rows up on Hopper as a CUDA kernel with wgmma, on the packed layout of
`pagoda.kernels.w4a16` (`w4a16_wgmma.cu`'s header says how).

Past 16 rows a 4-bit layer stops being a pure stream of bytes: at 64 rows the Llama-3-8B
layers need as many tensor-core cycles as the 3.7 GB of packed weights need DRAM time, and the
Triton kernels (`w4a16_skinny.py`: wgmma on weights unpacked through shared memory, one
warpgroup waiting on each of its MMAs) reach about half of cuBLAS's tensor rate. Here each
weight is unpacked once in registers, scaled, and is wgmma's A operand as it is (A may come
from registers; B, the activations, from shared memory), and the MMAs of one K step run while
the next step's weights are unpacked. The activations are written once per call (`tile_x`)
in the order the weights' nibbles give and in the B operand's swizzled tiles, so that a K
step's tile is one contiguous bulk copy (the TMA unit) with no address arithmetic in the loop;
an act-order layer's gather is folded into the same pass. The copies complete on mbarriers and
each warp releases a stage as its wgmmas end, so no barrier spans the CTA: its warpgroups
drift apart and take the tensor cores in turn (a barrier a K step kept them in lockstep, all
unpacking at once and then all waiting on the MMAs: 20-25% slower at 256-1024 rows).

It covers: sm_90 (wgmma needs the sm_90a target, `compute_capability="90a"` for NVRTC), 16-bit
x (bf16 or fp16), scales bf16 or fp16, K a multiple of 128, groups a multiple of 128 inputs
or one group per row, act order, bias. Compiled at first use with NVRTC, once per variant,
never during CUDA-graph capture. `formats.dequantize_*` + F.linear and the Triton kernels stay
its reference in the tests, `tile_x_reference` that of `tile_x`. A K step is ~240
instructions a warp, half of them the unpacking (`w4a16.wgmma_config` says where it wins);
`a_buffers` and `ctas_per_sm` trade its overlap for occupancy, tiles of any 32 rows up to 256
(`BN_VALUES`) let one CTA cover all the rows of a decode step.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels import cuda_launch, pdl_enabled, w4a16_gemv
from pagoda.kernels.triton_pdl import dependent_start

_SOURCE = Path(__file__).with_name("w4a16_wgmma.cu")
_HEADER = Path(__file__).with_name("w4a16_device.cuh")  # helpers of both kernels
_WGMMA_HEADER = Path(__file__).with_name("wgmma_device.cuh")  # wgmma and its descriptors
_KERNEL_NAME = "pagoda_w4a16_wgmma"
STEP = 128  # inputs per K step (one group at most)
SMEM_LIMIT = 227 * 1024  # shared memory of a CTA on sm_90
# Activation rows of a CTA (wgmma's N, 32-row slabs for `tile_x`). At 256 two A buffers take
# all 255 registers, without spilling (nvcc 13.0 for sm_90a, every variant).
BN_VALUES = (32, 64, 96, 128, 160, 192, 224, 256)


class WgmmaConfig(NamedTuple):
    """bn: activation rows of a CTA (wgmma's N: `BN_VALUES`);
    warpgroups: 1, 2 or 4, 64 weight rows each; stages: x tiles in shared memory (>= 3, each
    refilled as soon as every warp is done with it); depth: K steps of weights each lane has
    in flight (2 or 4); split_k: K split over this many CTAs per output tile (fp32 partials
    summed by the last to arrive), 0 to take `split_for`'s choice; a_buffers: 2 to unpack a K
    step's weights while the step before's wgmmas run, 1 to wait for them first (fewer
    registers); ctas_per_sm: the launch bound's minimum CTAs per SM (2 caps registers at
    65536 / (2 x threads))."""

    bn: int = 64
    warpgroups: int = 2
    stages: int = 4
    depth: int = 2
    split_k: int = 0
    a_buffers: int = 2
    ctas_per_sm: int = 1


def rows_per_cta(cfg: WgmmaConfig) -> int:
    """Weight rows (outputs) a CTA covers."""
    return 64 * cfg.warpgroups


def smem_bytes(cfg: WgmmaConfig) -> int:
    """Dynamic shared memory of a CTA: `stages` x tiles of bn rows x 128 inputs (16-bit), and
    1 KB to align them to the 128-byte swizzle's 1024-byte atoms."""
    return cfg.stages * cfg.bn * STEP * 2 + 1024


def config_reason(cfg: WgmmaConfig) -> str | None:
    """Why `cfg` is not a valid config, or None."""
    if cfg.bn not in BN_VALUES:
        return f"bn {cfg.bn} not in {BN_VALUES}"
    if cfg.warpgroups not in (1, 2, 4):
        return f"warpgroups {cfg.warpgroups} not 1, 2 or 4"
    if cfg.warpgroups * cfg.ctas_per_sm > 4:
        return (
            f"{cfg.ctas_per_sm} CTAs of {cfg.warpgroups} warpgroups: under 128 registers a thread"
        )
    if cfg.depth not in (2, 4):
        return f"depth {cfg.depth} not 2 or 4"
    if cfg.stages < 3:
        return f"stages {cfg.stages} < 3"
    if smem_bytes(cfg) > SMEM_LIMIT:
        return f"{smem_bytes(cfg)} bytes of shared memory > {SMEM_LIMIT}"
    if cfg.split_k < 0:
        return f"split_k {cfg.split_k} < 0"
    if cfg.a_buffers not in (1, 2) or cfg.ctas_per_sm not in (1, 2):
        return f"a_buffers {cfg.a_buffers} / ctas_per_sm {cfg.ctas_per_sm} not 1 or 2"
    if cfg.ctas_per_sm * smem_bytes(cfg) > SMEM_LIMIT:
        return f"{cfg.ctas_per_sm} CTAs of {smem_bytes(cfg)} bytes of shared memory > {SMEM_LIMIT}"
    return None


def unsupported_reason(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> str | None:
    """Why these inputs cannot take the wgmma kernel, or None when they can (the checks of the
    CUDA decode kernel, bar its row limit, and sm_90)."""
    if not w4a16_gemv.enabled():
        return "PAGODA_W4A16_CUDA=0"
    if not x.is_cuda or torch.version.cuda is None:
        return "not a CUDA tensor"
    if w4a16_gemv._capability(x.device.index or 0) != (9, 0):
        return "wgmma needs sm_90"
    return w4a16_gemv.unsupported_reason(x, qweight, scales, bias, group_size, max_m=None)


def _wgmma_function(bn: int, bf16: bool) -> str:
    """WGMMA(acc, a0, a1, a2, a3, desc): wgmma m64n{bn}k16 with A from registers, B (K-major,
    not transposed) from shared memory by `desc`, accumulating into acc[bn / 2] (fp32)."""
    regs = bn // 2
    dtype = "bf16" if bf16 else "f16"
    d = ", ".join(f"%{i}" for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void WGMMA(float (&d)[{regs}], unsigned a0, unsigned a1,\n"
        "    unsigned a2, unsigned a3, unsigned long long desc) {\n"
        f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{dtype}.{dtype} '
        f'{{{d}}}, {{{a}}}, %{regs + 4}, 1, 1, 1, 0;"\n'
        f'      : {outs}\n      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));\n}}\n'
    )


# `SPLIT` of the kernel: K not split, split with partials through global memory, split among
# the CTAs of a thread-block cluster (partials through distributed shared memory).
SPLIT_NONE, SPLIT_GLOBAL, SPLIT_CLUSTER = 0, 1, 2
MAX_CLUSTER = 8  # CTAs of a cluster without the non-portable size attribute


def split_mode(cfg: WgmmaConfig, split: int) -> int:
    """How a tile's `split` K ranges are summed: among a cluster where `split` is at most
    PAGODA_W4A16_CLUSTER_SPLIT (2 by default) and `MAX_CLUSTER`, and the stages' shared memory
    holds a CTA's accumulators (warpgroups <= stages); else through global memory. On an H100
    the cluster took a decode step of 256 rows (down split in two) from 7.44-7.56 to 7.13-7.15
    ms (`benchmarks/results/h200/run103-cluster-two/`), and made steps of 48-128 rows (splits of
    4 and 8, every rank held until the first has read its partials) slower, 4.03-6.05 ms
    against 3.61-5.12 (`run102-x-smem/`)."""
    if split <= 1:
        return SPLIT_NONE
    limit = min(envs.PAGODA_W4A16_CLUSTER_SPLIT, MAX_CLUSTER)
    if split <= limit and cfg.warpgroups <= cfg.stages:
        return SPLIT_CLUSTER
    return SPLIT_GLOBAL


def _compile(
    bf16: bool, scales_bf16: bool, cfg: WgmmaConfig, has_bias: bool, split: int
) -> Any | None:
    """The compiled kernel (torch's _CudaKernel), or None (logged once) where NVRTC cannot
    build it. `split`: a `split_mode`."""
    defines = {
        "BF16": int(bf16),
        "SCALES_BF16": int(scales_bf16),
        "BN": cfg.bn,
        "WG": cfg.warpgroups,
        "STAGES": cfg.stages,
        "DEPTH": cfg.depth,
        "A_BUFFERS": cfg.a_buffers,
        "CTAS_PER_SM": cfg.ctas_per_sm,
        "HAS_BIAS": int(has_bias),
        "SPLIT": int(split),
        "PDL": 1,  # griddepcontrol is a no-op in a launch without the attribute
    }
    source = _HEADER.read_text() + _WGMMA_HEADER.read_text()
    source += _SOURCE.read_text().replace("// @WGMMA@", _wgmma_function(cfg.bn, bf16))
    what = "CUDA W4A16 wgmma kernel"
    return cuda_launch.build(source, _KERNEL_NAME, defines, what, smem_bytes(cfg), "90a")


_KERNELS = cuda_launch.KernelCache(_compile)


def get_kernel(
    x: torch.Tensor, scales: torch.Tensor, cfg: WgmmaConfig, has_bias: bool, split: int
) -> Any | None:
    """The kernel for these inputs and `split_mode` `split`, or None. Never compiles during
    CUDA-graph capture (the eager warm-up before a capture builds what the capture needs)."""
    if config_reason(cfg) is not None:
        return None
    key = (
        x.dtype == torch.bfloat16,
        scales.dtype == torch.bfloat16,
        WgmmaConfig(*cfg)._replace(split_k=0),
        has_bias,
        split,
    )
    return _KERNELS.get(key)


@functools.cache
def _step_order(device: torch.device) -> torch.Tensor:
    """Position p of a K step holds input order[p] (`w4a16_wgmma.cu`): p = 16c + 8hi + 2t + e
    holds 32t + 4c + 2hi + e, the k-slots of k-chunk c as the weights' nibbles fill them."""
    p = torch.arange(STEP)
    c, hi, t, e = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
    return (32 * t + 4 * c + 2 * hi + e).to(device=device, dtype=torch.int32)


@functools.cache
def k_order(k: int, device: torch.device) -> torch.Tensor:
    """int32 [k]: the input each position of the kernel's reordered x holds (k a multiple of
    128)."""
    steps = torch.arange(0, k, STEP, device=device, dtype=torch.int32)
    return (steps[:, None] + _step_order(device)[None, :]).reshape(-1)


def reorder_x(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] gathered into the kernel's k order (act order's perm folded in)."""
    order = k_order(x.shape[1], x.device)
    if perm is not None:
        order = perm.index_select(0, order)
    return x.index_select(1, order)


def tile_x_reference(x: torch.Tensor, perm: torch.Tensor | None, bn: int) -> torch.Tensor:
    """The kernel's B tiles in torch: xt [M tiles, K steps, bn x 128] where tile (mt, s) holds
    rows [bn mt, +bn) (zero past M) of `reorder_x`'s step s as two 64-input halves, each bn
    rows of eight 16-byte chunks, chunk c of row r stored at chunk c ^ (r % 8)."""
    m, k = x.shape
    m_tiles, steps = -(-m // bn), k // STEP
    xr = torch.zeros(m_tiles * bn, k, dtype=x.dtype, device=x.device)
    xr[:m] = reorder_x(x, perm)
    tiles = xr.view(m_tiles, bn, steps, 2, 8, 8).permute(0, 2, 3, 1, 4, 5)  # [mt, s, h, r, c, e]
    r = torch.arange(bn, device=x.device)[:, None]
    chunk = (torch.arange(8, device=x.device)[None, :] ^ (r % 8)).view(1, 1, 1, bn, 8, 1)
    swizzled = torch.empty_like(tiles)
    swizzled.scatter_(4, chunk.expand_as(tiles), tiles)
    return swizzled.reshape(m_tiles, steps, bn * STEP)


@triton.jit
def _tile_x_kernel(
    x_ptr,
    order_ptr,
    perm_ptr,
    out_ptr,
    M,
    steps,
    stride_x: tl.int64,
    BN: tl.constexpr,
    HAS_PERM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (mt, s, slab) writes rows [32 slab, +32) of tile (mt, s) of `tile_x_reference`
    in both halves, in the tile's order (16-byte runs), reading x through the k order (and an
    act-order layer's perm)."""
    mt, s, slab = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, 32 * 128)  # half h = d // 2048, row 32 slab + (d // 64) % 32, 16-bit e
    r = slab * 32 + (d // 64) % 32
    h = d // (32 * 64)
    pos = s * 128 + h * 64 + (((d // 8) % 8) ^ (r % 8)) * 8 + d % 8
    col = tl.load(order_ptr + pos)  # constants: read before the wait
    if HAS_PERM:
        col = tl.load(perm_ptr + col)
    dependent_start(PDL)
    row = mt * BN + r
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=row < M, other=0.0)
    dst = (mt * steps + s).to(tl.int64) * (BN * 128) + h * (BN * 64) + r * 64 + d % 64
    tl.store(out_ptr + dst, v)


def tile_x(x: torch.Tensor, perm: torch.Tensor | None, bn: int) -> torch.Tensor:
    """`tile_x_reference` in one kernel (x's rows may be strided, its columns are contiguous:
    `w4a16_supported`)."""
    m, k = x.shape
    m_tiles, steps = -(-m // bn), k // STEP
    out = torch.empty(m_tiles, steps, bn * STEP, dtype=x.dtype, device=x.device)
    order = k_order(k, x.device)
    pdl = pdl_enabled(x)
    _tile_x_kernel[(m_tiles, steps, bn // 32)](
        x, order, perm if perm is not None else order, out, m, steps, x.stride(0), BN=bn,
        HAS_PERM=perm is not None, PDL=pdl, launch_pdl=pdl, num_warps=8,
    )  # fmt: skip
    return out


def split_for(m: int, n: int, k: int, cfg: WgmmaConfig, num_sms: int) -> int:
    """K splits for a grid of fewer tiles than can run at once (`ctas_per_sm` a SM): until
    the grid covers them, each split keeping at least 4 K steps."""
    tiles = -(-m // cfg.bn) * -(-n // rows_per_cta(cfg))
    split = 1
    while tiles * split * 2 <= num_sms * cfg.ctas_per_sm and (k // STEP) // (split * 2) >= 4:
        split *= 2
    return split


def w4a16_wgmma(
    kernel_for: Any,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
    cfg: WgmmaConfig,
    num_sms: int,
) -> torch.Tensor | None:
    """x [M, K] @ W^T (+ bias), or None where the kernel is not built (`kernel_for(mode)`
    gives it for a `split_mode`: `get_kernel` with the inputs bound); the caller has checked the inputs
    (`w4a16_linear`, `unsupported_reason`)."""
    from pagoda.kernels.skinny_gemm import split_k_buffers

    m, k = x.shape
    n = qweight.shape[0]
    steps = k // STEP
    split = cfg.split_k or split_for(m, n, k, cfg, num_sms)
    steps_per_split = -(-steps // split)
    split = -(-steps // steps_per_split)  # no empty splits
    mode = split_mode(cfg, split)
    kernel = kernel_for(mode)
    if kernel is None:
        return None
    xt = tile_x(x, perm, cfg.bn)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (-(-m // cfg.bn), -(-n // rows_per_cta(cfg)), split)
    counters, partials = split_k_buffers(y, grid[0] * grid[1], split if mode == SPLIT_GLOBAL else 1)
    args = [
        y, xt, qweight, scales, zeros, bias if bias is not None else x, partials, counters,
        m, n, k, min(group_size, k), y.stride(0), steps_per_split,
    ]  # fmt: skip
    block = 128 * cfg.warpgroups
    cluster = (1, 1, split) if mode == SPLIT_CLUSTER else None
    cuda_launch.launch(
        kernel.func, grid, block, smem_bytes(cfg), args, x.device, pdl_enabled(x), cluster
    )
    return y
