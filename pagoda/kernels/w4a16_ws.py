"""W4A16 from many rows up on Hopper, warp-specialized (`w4a16_ws.cu`): one warpgroup unpacks
each 4-bit weight of a CTA's tile once into shared memory, consumer warpgroups multiply it by
wgmma with both operands from shared memory.

`w4a16_wgmma` unpacks the weights in the registers of the warps that issue the MMAs, once per
tile of activation rows: its narrow layers at 128-256 rows take 64-row tiles (enough CTAs for
the SMs) and so unpack each weight 2-4 times, and the unpacking shares each warp's issue slots
with the MMAs (one or two warps a scheduler at 236-255 registers). Here the unpacking runs in
its own warpgroup, ahead of the MMAs through a ring of stages, and once per weight whatever
the activation tile: a consumer warpgroup needs registers only for its accumulators, and
several of them (`wn`) share each unpacked tile.

It covers what `w4a16_wgmma` covers (sm_90, 16-bit x, bf16 or fp16 scales, K a multiple of
128, groups a multiple of 128 inputs or one group per row, act order, bias), with x tiled in
K's own order (`w4a16_wgmma.tile_x(natural=True)`). `formats.dequantize_*` + F.linear stays
its reference in the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagoda.kernels import cuda_launch, pdl_enabled, w4a16_wgmma

_SOURCE = Path(__file__).with_name("w4a16_ws.cu")
_KERNEL_NAME = "pagoda_w4a16_ws"
KS = 64  # inputs a stage (a 128-byte row of 16-bit values)
SMEM_LIMIT = 227 * 1024  # shared memory of a CTA on sm_90
SM_SMEM = 228 * 1024  # of an SM
CTA_SMEM_EXTRA = 2 * 1024  # a CTA's static shared memory (mbarriers) and the system's
REGISTERS = 65536  # of an SM


class WsConfig(NamedTuple):
    """bn: activation rows of a CTA; wm: 64-row weight blocks of a CTA (1, 2 or 4); wn: consumer
    warpgroups along the activation rows (1 or 2; each takes bn / wn of them, a multiple of 8
    up to 256); stages: stages of 64 inputs in shared memory; depth: stages of weights the
    dequantizing warpgroup has in flight; split_k: K split over this many CTAs per output tile
    (fp32 partials summed by the last to arrive), 0 to take `split_for`'s choice; ctas_per_sm:
    the launch bound's minimum CTAs an SM; ring: 0, or stages of packed weights each
    dequantizing thread copies ahead by cp.async into shared memory (then `depth` counts only
    the scales and zeros in registers); a_regs: 1 for consumers that read the unpacked weights
    into registers by ldmatrix and multiply with A from registers (no async-proxy fence after
    the dequantizing threads' stores), 0 for wgmma reading both operands from shared memory."""

    bn: int = 128
    wm: int = 2
    wn: int = 1
    stages: int = 4
    depth: int = 4
    split_k: int = 0
    ctas_per_sm: int = 1
    ring: int = 0
    a_regs: int = 0

    @property
    def name(self) -> str:
        return (
            f"ws{64 * self.wm}x{self.bn}_n{self.wn}_s{self.stages}_d{self.depth}"
            + (f"_k{self.split_k}" if self.split_k else "")
            + (f"_c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else "")
            + (f"_r{self.ring}" if self.ring else "")
            + ("_a" if self.a_regs else "")
        )


def threads(cfg: WsConfig) -> int:
    """A CTA's threads: the consumer warpgroups and the dequantizing one."""
    return 128 * (cfg.wm * cfg.wn + 1)


def rows_per_cta(cfg: WsConfig) -> int:
    """Weight rows (outputs) a CTA covers."""
    return 64 * cfg.wm


def smem_bytes(cfg: WsConfig) -> int:
    """Dynamic shared memory of a CTA: `stages` x (bn x 64 inputs of x and 64 wm x 64 of
    weights, 16-bit), the packed weights' ring (`ring` x wm x 2 KB), and 1 KB to align the
    tiles to the swizzle's 1024-byte atoms."""
    return cfg.stages * (cfg.bn + 64 * cfg.wm) * KS * 2 + cfg.ring * cfg.wm * 2048 + 1024


def config_reason(cfg: WsConfig) -> str | None:
    """Why `cfg` is not a valid config, or None."""
    if cfg.wm not in (1, 2, 4) or cfg.wn not in (1, 2) or cfg.wm * cfg.wn > 4:
        return f"wm {cfg.wm} / wn {cfg.wn}: 1, 2 or 4 / 1 or 2, at most 4 consumers"
    if cfg.bn % 32 or cfg.bn % (8 * cfg.wn) or not 0 < cfg.bn // cfg.wn <= 256:
        return f"bn {cfg.bn}: a multiple of 32, bn / wn a multiple of 8 up to 256"
    # A consumer holds bn / wn / 2 accumulators and ~32 registers more, a dequantizing thread
    # 6 a stage and weight block in flight and ~40 more (nvcc 13.0, sm_90a: no spills).
    regs = min(255, REGISTERS // (threads(cfg) * cfg.ctas_per_sm) // 8 * 8)
    consumer = cfg.bn // cfg.wn // 2 + 32 + 32 * cfg.a_regs
    need = max(consumer, (2 if cfg.ring else 6) * cfg.depth * cfg.wm + 40)
    if need > regs:
        return f"{need} registers a thread needed, {regs} there"
    if cfg.stages < 2 or cfg.depth < 1 or cfg.ring == 1 or cfg.ring < 0:
        return f"stages {cfg.stages} < 2, depth {cfg.depth} < 1 or ring {cfg.ring} not 0 or > 1"
    if cfg.ctas_per_sm not in (1, 2) or smem_bytes(cfg) > SMEM_LIMIT:
        return f"ctas_per_sm {cfg.ctas_per_sm} / {smem_bytes(cfg)} bytes of shared memory"
    if cfg.ctas_per_sm * (smem_bytes(cfg) + CTA_SMEM_EXTRA) > SM_SMEM:
        return f"{cfg.ctas_per_sm} CTAs of {smem_bytes(cfg)} bytes of shared memory > {SM_SMEM}"
    if cfg.split_k < 0 or cfg.a_regs not in (0, 1):
        return f"split_k {cfg.split_k} < 0 or a_regs {cfg.a_regs} not 0 or 1"
    return None


def _wgmma_function(n: int, bf16: bool) -> str:
    """WGMMA(acc, da, db): wgmma m64n{n}k16 into acc[n / 2] (fp32), A and B K-major from shared
    memory by their descriptors."""
    regs = n // 2
    dtype = "bf16" if bf16 else "f16"
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void WGMMA(float (&d)[{regs}], unsigned long long da,\n"
        "    unsigned long long db) {\n"
        f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} '
        f'{{{d}}}, %{regs}, %{regs + 1}, 1, 1, 1, 0, 0;"\n'
        f'      : {outs}\n      : "l"(da), "l"(db));\n}}\n'
    )


def _compile(
    bf16: bool, scales_bf16: bool, cfg: WsConfig, has_bias: bool, split: bool
) -> Any | None:
    """The compiled kernel (torch's _CudaKernel), or None (logged once) where NVRTC cannot
    build it."""
    defines = {
        "BF16": int(bf16),
        "SCALES_BF16": int(scales_bf16),
        "BN": cfg.bn,
        "WM": cfg.wm,
        "WN": cfg.wn,
        "STAGES": cfg.stages,
        "DEPTH": cfg.depth,
        "CTAS_PER_SM": cfg.ctas_per_sm,
        "RING": cfg.ring,
        "A_REGS": cfg.a_regs,
        "HAS_BIAS": int(has_bias),
        "SPLIT": int(split),
        "PDL": 1,  # griddepcontrol is a no-op in a launch without the attribute
    }
    headers = (w4a16_wgmma._HEADER, w4a16_wgmma._WGMMA_HEADER, w4a16_wgmma._UNPACK_HEADER)
    source = "".join(h.read_text() for h in headers)
    n = cfg.bn // cfg.wn
    rs = w4a16_wgmma._wgmma_function(n, bf16).replace("void WGMMA(", "void WGMMA_RS(")
    source += _SOURCE.read_text().replace("// @WGMMA@", _wgmma_function(n, bf16) + rs)
    what = "CUDA W4A16 warp-specialized kernel"
    return cuda_launch.build(source, _KERNEL_NAME, defines, what, smem_bytes(cfg), "90a")


_KERNELS = cuda_launch.KernelCache(_compile)


def get_kernel(
    x: torch.Tensor, scales: torch.Tensor, cfg: WsConfig, has_bias: bool, split: bool
) -> Any | None:
    """The kernel for these inputs, or None. Never compiles during CUDA-graph capture."""
    if config_reason(cfg) is not None:
        return None
    key = (
        x.dtype == torch.bfloat16,
        scales.dtype == torch.bfloat16,
        cfg._replace(split_k=0),
        has_bias,
        split,
    )
    return _KERNELS.get(key)


def split_for(m: int, n: int, k: int, cfg: WsConfig, num_sms: int) -> int:
    """K splits for a grid of fewer tiles than can run at once: until the grid covers them,
    each split keeping at least 8 stages."""
    tiles = -(-m // cfg.bn) * -(-n // rows_per_cta(cfg))
    split = 1
    while tiles * split * 2 <= num_sms * cfg.ctas_per_sm and (k // KS) // (split * 2) >= 8:
        split *= 2
    return split


def w4a16_ws(
    kernel_for: Any,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    perm: torch.Tensor | None,
    cfg: WsConfig,
    num_sms: int,
) -> torch.Tensor | None:
    """x [M, K] @ W^T (+ bias), or None where the kernel is not built (`kernel_for(split)`
    gives it: `get_kernel` with the inputs bound); the caller has checked the inputs
    (`w4a16_linear`, `w4a16_wgmma.unsupported_reason`)."""
    from pagoda.kernels.skinny_gemm import split_k_buffers

    m, k = x.shape
    n = qweight.shape[0]
    stages = k // KS
    split = cfg.split_k or split_for(m, n, k, cfg, num_sms)
    per_split = -(-stages // split)
    split = -(-stages // per_split)  # no empty splits
    kernel = kernel_for(split > 1)
    if kernel is None:
        return None
    xt = w4a16_wgmma.tile_x(x, perm, cfg.bn, natural=True)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (-(-m // cfg.bn), -(-n // rows_per_cta(cfg)), split)
    counters, partials = split_k_buffers(y, grid[0] * grid[1], split)
    args = [
        y, xt, qweight, scales, zeros, bias if bias is not None else x, partials, counters,
        m, n, k, min(group_size, k), y.stride(0), per_split,
    ]  # fmt: skip
    cuda_launch.launch(
        kernel.func, grid, threads(cfg), smem_bytes(cfg), args, x.device, pdl_enabled(x)
    )
    return y
