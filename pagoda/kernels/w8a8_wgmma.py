"""W8A8 GEMM on Hopper as a warp-specialized CUDA kernel (`w8a8_wgmma.cu`: a producer warp
issuing TMA copies through tensor maps, consumer warpgroups issuing wgmma, mbarriers between
them, the epilogue through shared memory), for the many-row products where the Triton GEMM
(`scaled_mm_triton.w8a8_gemm`: each warp both loads and multiplies) stays near half of the
int8 tensor cores' rate: int8 from 65 rows, fp8 from 65 to `FP8_MAX_ROWS` and past it where
`fp8_takes_kernel` says (cuBLASLt's fp8 GEMM elsewhere). At 129-192 rows the rule takes
thread-block clusters: the CTAs of the two row tiles share the weight tile, each copying half
of it by a TMA multicast into both (`cm`, `cn`). Where a layer's tiles are too few for the SMs
(down at 129-256 rows) the two CTAs of a cluster split its K steps instead (`ck`).

It covers: sm_90 (wgmma and the TMA unit; NVRTC target "90a"), int8 x int8 or e4m3 x e4m3
(with FP8 fast accumulation, `PAGODA_FP8_FAST_ACCUM`: no float32 promotion here), rows
K-contiguous and 16-byte aligned (K a multiple of 16; a ragged last K step is zero-filled by
the copy), N a multiple of 8, a bf16 or fp16 output and bias. Compiled at first use with
NVRTC, once per variant, never during CUDA-graph capture. `scaled_mm.plain_quantized_mm` stays its reference in the
tests. The tensor maps (`cuTensorMapEncodeTiled` through the driver) are made on the host at
each call, cached by what they encode (address, shape, stride, box), so that a decode step's
fixed buffers reuse them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pagoda import envs
from pagoda.kernels import cuda_launch, pdl_enabled

_SOURCE = Path(__file__).with_name("w8a8_wgmma.cu")
_HEADER = Path(__file__).with_name("w4a16_device.cuh")  # typedefs, mbarriers, PDL
_WGMMA_HEADER = Path(__file__).with_name("wgmma_device.cuh")  # wgmma and its descriptors
_KERNEL_NAME = "pagoda_w8a8_wgmma"
STEP = 128  # K bytes a stage holds of each row (the 128-byte swizzle's span)
SM_SMEM = 228 * 1024  # of an SM
CTA_SMEM_EXTRA = 3 * 1024  # a CTA's static shared memory (scales, bias, mbarriers) and the system's


class WgmmaW8A8Config(NamedTuple):
    """bm: x rows of a CTA (64 a consumer warpgroup: 64 or 128); bn: weight rows (wgmma's N:
    64, 128 or 256); stages: K steps of both tiles in shared memory; ctas_per_sm: the launch
    bound's minimum CTAs an SM (2: registers capped at 65536 / (2 x threads)); cm, cn: a
    thread-block cluster of cm x cn CTAs (1, 2 or 4 each), the cm CTAs along M sharing their
    weight tile and the cn along N their x tile, each copied once from L2 and multicast; ck:
    the tile's K steps split among a cluster of ck CTAs (1, 2 or 4; without cm or cn), rank 0
    adding the others' partial sums from their shared memory."""

    bm: int = 128
    bn: int = 128
    stages: int = 4
    ctas_per_sm: int = 1
    cm: int = 1
    cn: int = 1
    ck: int = 1

    @property
    def name(self) -> str:
        return (
            f"wgmma{self.bm}x{self.bn}_s{self.stages}"
            + (f"_c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else "")
            + (f"_m{self.cm}" if self.cm > 1 else "")
            + (f"_n{self.cn}" if self.cn > 1 else "")
            + (f"_k{self.ck}" if self.ck > 1 else "")
        )


def smem_bytes(cfg: WgmmaW8A8Config) -> int:
    """Dynamic shared memory of a CTA: `stages` x (bm + bn) rows of 128 bytes, and 1 KB to
    align them to the swizzle's 1024-byte atoms."""
    return cfg.stages * (cfg.bm + cfg.bn) * STEP + 1024


def config_reason(cfg: WgmmaW8A8Config) -> str | None:
    """Why `cfg` is not a valid config, or None."""
    if cfg.bm not in (64, 128):
        return f"bm {cfg.bm} not 64 or 128"
    if cfg.bn not in (64, 128, 256):
        return f"bn {cfg.bn} not 64, 128 or 256"
    if cfg.stages < 2:
        return f"stages {cfg.stages} < 2"
    if cfg.ctas_per_sm not in (1, 2):
        return f"ctas_per_sm {cfg.ctas_per_sm} not 1 or 2"
    if cfg.ctas_per_sm == 2 and cfg.bn > 128:
        return "two CTAs an SM leave 113 registers a thread, fewer than 256 columns need"
    if cfg.cm not in (1, 2, 4) or cfg.cn not in (1, 2, 4) or cfg.cm * cfg.cn > 8:
        return f"cluster {cfg.cm} x {cfg.cn}: 1, 2 or 4 CTAs each way, at most 8"
    if cfg.ck not in (1, 2, 4):
        return f"K split {cfg.ck} not 1, 2 or 4"
    if cfg.ck > 1 and cfg.cm * cfg.cn > 1:
        return "a K split is not combined with a multicast cluster"
    if cfg.ck > 1 and cfg.bn * (cfg.bm // 64) * 256 > cfg.stages * (cfg.bm + cfg.bn) * STEP:
        return f"a K split's partial sums need more than {cfg.stages} stages' shared memory"
    if cfg.ctas_per_sm * (smem_bytes(cfg) + CTA_SMEM_EXTRA) > SM_SMEM:
        return f"{cfg.ctas_per_sm} CTAs of {smem_bytes(cfg)} bytes of shared memory > {SM_SMEM}"
    return None


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(device: torch.device) -> bool:
    """Whether 8-bit products on `device` may take the kernel (PAGODA_W8A8_CUDA, sm_90)."""
    return (
        envs.PAGODA_W8A8_CUDA
        and device.type == "cuda"
        and torch.version.cuda is not None
        and _is_sm90(device.index if device.index is not None else torch.cuda.current_device())
    )


def unsupported_reason(
    x_q: torch.Tensor, w_q: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> str | None:
    """Why these operands cannot take the kernel, or None when they can."""
    if not envs.PAGODA_W8A8_CUDA:
        return "PAGODA_W8A8_CUDA=0"
    if not x_q.is_cuda or torch.version.cuda is None:
        return "not a CUDA tensor"
    if not available(x_q.device):
        return "wgmma needs sm_90"
    if x_q.dtype != w_q.dtype or w_q.dtype not in (torch.int8, torch.float8_e4m3fn):
        return f"two int8 or two float8_e4m3fn operands, got {x_q.dtype} and {w_q.dtype}"
    if w_q.dtype != torch.int8 and not envs.PAGODA_FP8_FAST_ACCUM:
        return "FP8 without fast accumulation (PAGODA_FP8_FAST_ACCUM=0): no promotion here"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"output {out_dtype}: bf16 or fp16 only"
    if bias is not None and bias.dtype != out_dtype:
        return f"bias {bias.dtype} is not the output's {out_dtype}"
    k = x_q.shape[1]
    if k % 16 or w_q.shape[1] != k or w_q.shape[0] % 8:
        return f"K {k} or N {w_q.shape[0]} not a multiple of 16 / 8"
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        if t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
            return f"{name}'s rows are not contiguous and 16-byte aligned"
    return None


# fp8 products up to this many rows take the kernel (on the H100 at 128 rows qkv 14.7 us against
# cuBLASLt's 16.2, o 12.4 / 16.2, gate_up 50.7 / 59.0, down 37.5 / 44.5); past it cuBLASLt's
# fp8 GEMM (gate_up at 256 rows 55.4 against 58.9, qkv 15.1 / 15.8) but where the kernel's
# tiles are the ones cuBLASLt's leave SMs idle on (`fp8_takes_kernel`).
FP8_MAX_ROWS = 128


def fp8_takes_kernel(m: int, cfg: WgmmaW8A8Config) -> bool:
    """Whether an fp8 product of m rows takes the kernel with `choose_config`'s `cfg` rather
    than cuBLASLt's fp8 GEMM: up to `FP8_MAX_ROWS`, and past it for layers whose tiles are few:
    where the rule takes two CTAs an SM (o to 256 rows: 12.2 us against cuBLASLt's 13.6 at 256,
    H100, `results/h200/run99-w8a8-split/`) or splits K past 192 rows (down at 193-256 rows:
    33.4 against 37.9 at 256). With the second 128-row tile at most half full, at 129-192 rows,
    cuBLASLt's fp8 GEMM in the split down's place made the step faster (fp8 at 160 / 192 rows
    3.93 / 3.86 ms against 4.07 / 3.94, `run100-w8a8-split-rule/`); at 512 rows, where neither
    holds, it won or tied every layer."""
    return m <= FP8_MAX_ROWS or cfg.ctas_per_sm == 2 or (cfg.ck > 1 and m > 192)


def choose_config(m: int, n: int, k: int, num_sms: int = 132) -> WgmmaW8A8Config:
    """The tiles of an 8-bit [m, k] x [n, k]^T product from 65 rows: a fixed rule (CUDA-graph
    capturable), fitted to the Llama-3-8B layers on the H100 with int8 operands
    (`results/h200/run67-w8a8-wgmma/`; fp8 ones took the same tiles,
    `run68-w8a8-wgmma-rule/fp8_probe.log`):

    - up to 128 rows: 64 x 64 tiles, 6 stages, two CTAs an SM (most CTAs where the weights are
      read once); wide layers (>= 16384 outputs: gate_up) 128 x 128, 6 stages;
    - more: 128 x 256 tiles (4 stages, one CTA an SM) where their waves of CTAs take no longer
      than those of 128 x 128 tiles, each of which takes ~0.58 of a 128 x 256 one's time (qkv
      at 384-512 rows, o and down at 1024, gate_up from 256); else where 128 x 128 tiles would
      fill at most half the SMs 64 x 64 ones as above (o at 129-256 rows: 14.0 against 15.9
      us at 192, `run69-w8a8-split/`), but for a deep layer (k >= 2n: down, 54.9 against 50.0
      at 256 rows); else 128 x 128, 4 stages (6 for a deep layer), one CTA an SM. Splitting K
      over two or four CTAs where the tiles are few (partials through global memory, summed by
      the last to arrive) was slower everywhere (o at 256 rows 27.2 against 16.1 us);
    - at 129-192 rows (two 128-row tiles, the second at most half full) the two row tiles'
      CTAs of a 128 x 256 tile, or of a 128 x 128 one but for a deep layer, as a cluster
      sharing the weight tile (and for 128 x 128 pairs of them the x tile): a whole step
      (int8, inputs quantized by the kernel before) at 192 rows 4.11 against 4.76 ms, at 160
      4.80 against 5.13 (H100, `results/h200/run73-w8a8-cluster-rule/`; per layer, in
      `run72-w8a8-cluster/`, gate_up 61.3 against 66.3 us at 192 rows, qkv 19.9 against
      20.2); elsewhere clusters were no faster (1-3% slower at 256 rows) or much slower (four
      CTAs, or 64-row tiles);
    - where tiles of one CTA an SM fill at most half the SMs and each K range keeps at least 8
      steps, K split in two among a cluster (`ck`; `PAGODA_W8A8_SPLIT_K=0` never): down at
      256 rows, 64 tiles of 128 x 128 for 132 SMs, 33.2 against 40.9 us (int8; 36.2-37.2
      against 40.6 at 192 rows); where two CTAs an SM already fill them (64 x 64 tiles at up
      to 128 rows) the split was slower (o at 128 rows 11.6 against 9.4 us; H100,
      `results/h200/run99-w8a8-split/`)."""
    cfg = _tiles(m, n, k, num_sms)
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    if (
        envs.PAGODA_W8A8_SPLIT_K
        and cfg.cm * cfg.cn == 1
        and cfg.ctas_per_sm == 1
        and 2 * tiles <= num_sms
        and k >= 16 * STEP
    ):
        return cfg._replace(ck=2)
    return cfg


def _tiles(m: int, n: int, k: int, num_sms: int = 132) -> WgmmaW8A8Config:
    """The rule's tile and cluster before any K split."""
    if m <= 128:
        return WgmmaW8A8Config(128, 128, 6) if n >= 16384 else WgmmaW8A8Config(64, 64, 6, 2)

    def waves(bn: int) -> int:
        return -(-(-(-m // 128) * -(-n // bn)) // num_sms)

    c = 2 if m <= 192 else 1  # a cluster of the two row tiles' CTAs at 129-192 rows
    if waves(256) <= 0.58 * waves(128):
        return WgmmaW8A8Config(128, 256, 4, cm=c)
    if 2 * -(-m // 128) * -(-n // 128) <= num_sms and k < 2 * n:
        return WgmmaW8A8Config(64, 64, 6, 2)
    if k >= 2 * n:
        return WgmmaW8A8Config(128, 128, 6)
    return WgmmaW8A8Config(128, 128, 4, cm=c, cn=c)


# The tiles a sweep times besides the rule's (`w8a8_bench.py --sweep`), at every shape.
CANDIDATES = tuple(
    WgmmaW8A8Config(*t)
    for t in ((64, 64, 6, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 4, 1),
              (128, 128, 6, 1), (128, 256, 3, 1), (128, 256, 4, 1))
)  # fmt: skip


def _wgmma_function(bn: int, int8: bool = True) -> str:
    """WGMMA(acc, desc_a, desc_b): wgmma m64n{bn}k32 into acc[bn / 2], s8 x s8 into int32 or
    e4m3 x e4m3 into float32, both operands K-major from shared memory."""
    regs = bn // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    kind, acc, con = ("s32.s8.s8", "int", "r") if int8 else ("f32.e4m3.e4m3", "float", "f")
    scales = "1" if int8 else "1, 1, 1"  # scale-d (, imm-scale-a, imm-scale-b for floats)
    outs = ", ".join(f'"+{con}"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void WGMMA({acc} (&d)[{regs}], unsigned long long da,\n"
        "    unsigned long long db) {\n"
        f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{bn}k32.{kind} '
        f'{{{d}}}, %{regs}, %{regs + 1}, {scales};"\n'
        f'      : {outs}\n      : "l"(da), "l"(db));\n}}\n'
    )


def _compile(int8: bool, bf16: bool, cfg: WgmmaW8A8Config, has_bias: bool) -> Any | None:
    defines = {
        "INT8": int(int8),
        "BF16": int(bf16),
        "BM": cfg.bm,
        "BN": cfg.bn,
        "STAGES": cfg.stages,
        "CTAS_PER_SM": cfg.ctas_per_sm,
        "HAS_BIAS": int(has_bias),
        "CM": cfg.cm,
        "CN": cfg.cn,
        "CK": cfg.ck,
        "PDL": 1,  # griddepcontrol is a no-op in a launch without the attribute
    }
    source = _HEADER.read_text() + _WGMMA_HEADER.read_text()
    source += _SOURCE.read_text().replace("// @WGMMA@", _wgmma_function(cfg.bn, int8))
    what = "CUDA W8A8 wgmma kernel"
    return cuda_launch.build(source, _KERNEL_NAME, defines, what, smem_bytes(cfg), "90a")


_KERNELS = cuda_launch.KernelCache(_compile)


def tensor_map(ptr: int, rows: int, k: int, row_stride: int, box_rows: int) -> ctypes.Array:
    """The CUtensorMap of an 8-bit [rows, k] matrix at `ptr` with `row_stride` bytes between
    rows, read in boxes of 128 inputs x `box_rows` rows into the 128-byte swizzle."""
    return cuda_launch.tensor_map(
        ptr, cuda_launch.TMAP_UINT8, (k, rows), (row_stride,), (STEP, box_rows),
        cuda_launch.TMAP_SWIZZLE_128B,
    )  # fmt: skip


def _round_up(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def w8a8_wgmma(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    cfg: WgmmaW8A8Config,
) -> torch.Tensor | None:
    """(x_q [M, K] @ w_q [N, K]^T) * x_scale [M(, 1)] * w_scale [N] (+ bias) -> [M, N]
    `out_dtype`, or None where the kernel is not built (NVRTC missing, during a capture before
    its warm-up). The caller has checked `unsupported_reason`."""
    reason = config_reason(cfg)
    if reason is not None:
        raise ValueError(f"{cfg.name}: {reason}")
    int8 = w_q.dtype == torch.int8
    kernel = _KERNELS.get((int8, out_dtype == torch.bfloat16, cfg, bias is not None))
    if kernel is None:
        return None
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    x_map = tensor_map(x_q.data_ptr(), m, k, x_q.stride(0), cfg.bm // cfg.cn)
    w_map = tensor_map(w_q.data_ptr(), n, k, w_q.stride(0), cfg.bn // cfg.cm)
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()  # views as the callers give
    args = [
        x_map, w_map, y, x_scale, w_scale, bias if bias is not None else y, m, n, k, y.stride(0),
    ]  # fmt: skip
    # Whole clusters: CTAs past M or N read zeros and store nothing.
    grid = (_round_up(-(-m // cfg.bm), cfg.cm), _round_up(-(-n // cfg.bn), cfg.cn), cfg.ck)
    threads = 128 * (cfg.bm // 64) + 32  # the consumer warpgroups and the producer warp
    cluster = (cfg.cm, cfg.cn, cfg.ck) if cfg.cm * cfg.cn * cfg.ck > 1 else None
    cuda_launch.launch(kernel.func, grid, threads, smem_bytes(cfg), args, x_q.device,
                       pdl_enabled(x_q), cluster)  # fmt: skip
    return y
