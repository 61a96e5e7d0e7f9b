"""Decode attention over the paged KV cache as a CUDA kernel with tensor-core dots.

The Triton kernel (`pagoda.attention.triton.unified_attention`) read an FP8 cache at ~2.4 TB/s
on the H200, not faster than bf16's bytes: each program waits on its loads with one tile in
flight, and each fp8 value is converted and then moved into the dot operand layouts.
`paged_decode.cu` streams every warp's 16-key chunks through a cp.async ring (several chunks in
flight) and lays the operands out so each lane converts the bytes it loaded, with no shuffles
(its header says how): 3.4 TB/s of fp8 and 4.05 TB/s of bf16 at 256 ragged requests
(`python benchmarks/cuda_decode_bench.py` on an H200). It covers the decode steps of the
common shapes: one query token per request, head size 128, up to 8 query heads per KV head,
block sizes that are multiples of 16, bf16/fp16 queries over an e4m3/e5m2 cache or a cache of
their own dtype, on sm_89 or newer. Everything else, and any GPU where the kernel does not
compile, keeps the Triton kernel, which stays the reference its tests compare against.

The source is compiled at first use with NVRTC (`torch.cuda._compile_kernel`), once per
shape, during the warm-up step that precedes a CUDA graph's capture. `PAGODA_CUDA_DECODE=0`
turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda import envs
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels import cuda_launch, pdl_enabled

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.cu")
_KERNEL_NAME = "pagoda_paged_decode"
_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
HEAD_SIZE = 128
MAX_GROUP = 8
# (warps, ring stages) of a CTA by cache kind. Each warp takes every WARPS-th 16-key chunk of
# the CTA's keys, STAGES - 1 of them in flight: 3 stages of 4 KiB chunks over an FP8 cache,
# 2 of 8 KiB over a 16-bit one. Fastest or within 3% of it at 32-256 ragged requests on the
# H200, of warps 2/4/8 x stages 2/3/4 (`python benchmarks/cuda_decode_bench.py --variants`).
_LAUNCH = {"e4m3": (4, 3), "e5m2": (4, 3), "16bit": (4, 2)}
_INT32_MAX = 2**31 - 1


def enabled() -> bool:
    return envs.PAGODA_CUDA_DECODE


def unsupported_reason(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, attn_metadata: AttentionMetadata
) -> str | None:
    """Why this step cannot take the CUDA kernel, or None when it can."""
    if not enabled():
        return "PAGODA_CUDA_DECODE=0"
    if not q.is_cuda or torch.version.cuda is None:
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(q.device) < (8, 9):
        return "needs sm_89 or newer (fp8 conversions)"
    if q.dtype not in (torch.bfloat16, torch.float16) or out.dtype != q.dtype:
        return f"q/out dtype {q.dtype}/{out.dtype}"
    if kv_cache.dtype not in _FP8 and kv_cache.dtype != q.dtype:
        return f"cache dtype {kv_cache.dtype}"
    if attn_metadata.max_query_len != 1:
        return "not a pure decode step"
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_heads = q.shape[1]
    if head_size != HEAD_SIZE or q.shape[2] != HEAD_SIZE:
        return f"head size {head_size}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    if block_size % 16:
        return f"block size {block_size}"
    md = attn_metadata
    for name, t in (("block_tables", md.block_tables), ("seq_lens", md.seq_lens)):
        if t.dtype != torch.int32:
            return f"{name} dtype {t.dtype}"
    if md.query_start_loc.dtype != torch.int32 or md.seq_lens.shape[0] > 65535:
        return "query_start_loc dtype or batch size"
    # 16-byte loads and stores: bases and row strides (in bytes) must be multiples of 16.
    for name, t, dims in (
        ("q", q, (0, 1)),
        ("out", out, (0, 1)),
        ("kv_cache", kv_cache, (1, 2, 3)),
    ):
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned with a contiguous last dimension"
        for d in dims:
            nbytes = t.stride(d) * t.element_size()
            if nbytes % 16 or nbytes > _INT32_MAX:
                return f"{name} stride {d} is {t.stride(d)} elements"
    return None


def cache_kind(cache_dtype: torch.dtype) -> str:
    """ "e4m3" / "e5m2" for an FP8 cache, "16bit" for one of q's dtype."""
    return _FP8.get(cache_dtype, "16bit")


def smem_bytes(warps: int, stages: int, cache: str) -> int:
    """Dynamic shared memory of one CTA: a ring of `stages` chunks (16 keys of K and V) per
    warp, 4 KiB over an FP8 cache, 8 KiB over a 16-bit one."""
    return warps * stages * (8192 if cache == "16bit" else 4096)


def _source(group: int, block_size: int, cache: str, q_bf16: bool, warps: int, stages: int):
    defines = {
        "G": group,
        "BLOCK_SIZE": block_size,
        "E5M2": int(cache == "e5m2"),
        "KV16": int(cache == "16bit"),
        "Q_BF16": int(q_bf16),
        "WARPS": warps,
        "STAGES": stages,
    }
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + _SOURCE.read_text()


@dataclass(frozen=True)
class DecodeKernel:
    """A compiled kernel and the CTA shape it was compiled for."""

    func: Any  # torch.cuda._utils._CudaKernel
    threads: int
    smem: int


def _compile(
    group: int, block_size: int, cache: str, q_bf16: bool, warps: int, stages: int
) -> DecodeKernel | None:
    """The compiled kernel, or None (logged once) where NVRTC cannot build it."""
    src = _source(group, block_size, cache, q_bf16, warps, stages)
    smem = smem_bytes(warps, stages, cache)
    try:
        func = torch.cuda._compile_kernel(src, _KERNEL_NAME, nvcc_options=["--use_fast_math"])
        func.set_shared_memory_config(smem)
        return DecodeKernel(func, 32 * warps, smem)
    except Exception as e:  # no NVRTC, an old toolkit, too little shared memory
        logger.warning("CUDA decode kernel unavailable, using Triton's: %s", e)
        return None


_KERNELS = cuda_launch.KernelCache(_compile)


def get_kernel(
    group: int, block_size: int, cache: str, q_bf16: bool, warps: int | None = None,
    stages: int | None = None,
) -> DecodeKernel | None:  # fmt: skip
    """The kernel for this shape (`cache` from `cache_kind`; warps and stages default to
    `_LAUNCH`'s), or None. Never compiles while a CUDA graph is being captured (loading a
    module is not a stream operation): the caller falls back to Triton then."""
    default_warps, default_stages = _LAUNCH[cache]
    key = (group, block_size, cache, q_bf16, warps or default_warps, stages or default_stages)
    return _KERNELS.get(key)


def paged_decode(
    kernel: DecodeKernel,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    attn_metadata: AttentionMetadata,
    qk_scale_log2: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_segments: int,
    segm: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch `kernel` (from `get_kernel`) for a decode step. With `num_segments` > 1 it
    writes the partials `segm` = (out, max, sum) for `_reduce_segments_kernel` instead of
    `out`. `qk_scale_log2` is the softmax scale times log2(e); `k_scale`/`v_scale` are
    one-element float32 tensors."""
    num_reqs = attn_metadata.seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    segm_out, segm_max, segm_sum = segm if segm is not None else (out, out, out)
    args = [
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        attn_metadata.block_tables,
        attn_metadata.seq_lens,
        attn_metadata.query_start_loc,
        k_scale,
        v_scale,
        segm_out,
        segm_max,
        segm_sum,
        float(qk_scale_log2),
        q.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1) * kv_cache.element_size(),
        kv_cache.stride(2) * kv_cache.element_size(),
        kv_cache.stride(3) * kv_cache.element_size(),
        attn_metadata.block_tables.stride(0),
    ]
    grid = (num_kv_heads, num_reqs, num_segments)
    cuda_launch.launch(
        kernel.func.func, grid, kernel.threads, kernel.smem, args, q.device, pdl_enabled(q)
    )
