"""Triton GEMV for one-row products on CUDA: y[1, N] = x[1, K] @ W[N, K]^T (+ bias).

Single-stream decode reads every weight once per token, so its linear layers are pure weight
streaming. cuBLAS picks split-K kernels plus a reduce kernel for some of these shapes and
reaches 2.5–3.5 TB/s on the smaller ones; this kernel has each program stream BLOCK_N whole
rows (fp32 accumulation in a [BLOCK_N, BLOCK_K] tile, one reduction at the end, loads
pipelined over K) and reaches 3.2–4.35 TB/s. Measured on the H200 with Llama-3-8B shapes,
cold weights, in CUDA graphs (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336): 14.2 / 10.4 / 54.0 / 28.7 µs vs cuBLAS 15.7 / 13.4 / 55.3 / 33.2 µs
(`python benchmarks/gemv_sweep.py`).
`F.linear` stays the reference (tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_w: tl.int64,
    SILU_AND_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        k_ok = kk < K
        # Weights are read once: do not let them evict what the next kernels reuse.
        w = tl.load(
            w_rows + kk[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        if SILU_AND_MUL:
            # x holds [gate | up] of 2K values: the MLP activation on the fly, rounded to the
            # model dtype as the separate silu_and_mul kernel stores it.
            gate = x.to(tl.float32)
            up = tl.load(x_ptr + K + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, silu_and_mul: bool = False) -> bool:
    """One row (x [..., K] with numel K; [..., 2K] with `silu_and_mul`) times a row-major CUDA
    weight [N, K] of x's dtype."""
    k = weight.shape[-1] * (2 if silu_and_mul else 1)
    return (
        x.is_cuda
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dim() == 2
        and x.shape[-1] == k
        and x.numel() == k
        and weight.stride(1) == 1
    )


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_and_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] (one row) @ weight[N, K].T (+ bias) -> [..., N] in `out_dtype` (default x's:
    float32 gives logits without a bf16 rounding). With `silu_and_mul`, x is the gate/up
    projection [..., 2K] and the product is silu(x[..., :K]) * x[..., K:] @ weight.T, the MLP's
    down projection without its separate activation kernel."""
    n, k = weight.shape
    x1 = x.reshape(-1)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype, device=x.device)
    # Tile shapes from the H200 sweep: short rows of long K (down) and small N (o) take 8 rows
    # of 512, the rest 16 rows of 256.
    block_n, block_k = (8, 512) if (k >= 8192 or n <= 4096) else (16, 256)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x1,
        weight,
        bias if bias is not None else x1,
        y,
        n,
        k,
        weight.stride(0),
        SILU_AND_MUL=silu_and_mul,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=4,
        num_warps=4,
    )
    return y
