"""Fused mixture-of-experts on the GPU in Triton: the token -> expert sort/align and one grouped
GEMM per projection over all experts, as vLLM's `fused_moe` does.

A layer's T tokens each pick top_k experts: T * top_k (token, expert) pairs. `moe_align_block_size`
(`pagoda.kernels.moe_align`) sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M, so every block of
BLOCK_M sorted rows belongs to one expert (`expert_ids`); padding rows hold the sentinel
T * top_k. The grouped GEMM then runs one program per (row block, column block): it gathers its
rows of the input (pair p reads token p // top_k), multiplies by its expert's weight and
scatters the result to rows p of a [T * top_k, N] output. The first GEMM takes the fused
gate/up weight w13 [E, 2I, H], SiLU-and-mul follows, the second GEMM takes w2 [E, H, I] and
multiplies each row by its routing weight; the top_k rows of a token are summed last.

Nothing here reads a device value on the host, and every shape follows from T, top_k and the
weights: the grid is an upper bound on the blocks in use (min(T * top_k, blocks of the padded
length)) and programs past `num_tokens_post_padded` exit at once, so the whole path can be
captured in a CUDA graph for decode. The reference is `pagoda.model.layers.fused_moe`'s
per-expert loop.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pagoda.kernels import silu_and_mul
from pagoda.kernels.moe_align import moe_align_block_size

__all__ = ["default_config", "fused_experts", "invoke_fused_moe_kernel", "moe_align_block_size"]


@triton.jit(do_not_specialize=["num_valid", "num_pid_m"])
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_ptr,
    N,
    K,
    num_valid,
    num_pid_m,
    stride_am: tl.int64,
    stride_be: tl.int64,
    stride_bn: tl.int64,
    stride_cm: tl.int64,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """C[p, :] = A[p // TOP_K, :] @ B[expert(p)]^T (times p's routing weight) for the sorted
    pairs p of this program's row block; A [*, K] row-major, B [E, N, K], C [num_valid, N]."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Row blocks in groups of GROUP_M share their weight columns in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = pairs < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K)[:, None] * stride_am + offs_k[None, :]
    # Columns past N wrap around (read, never stored): no mask on the weight's rows.
    b_ptrs = b_ptr + expert * stride_be + (offs_n % N)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n < N)[None, :])


def default_config(num_tokens: int) -> dict[str, int]:
    """Tile sizes by the number of tokens: 16-row blocks while most experts see a token or two
    (decode), larger ones as each expert's rows grow (prefill). Near vLLM's H200 tables for
    E=128, N=768 (Qwen3-30B-A3B)."""
    if num_tokens <= 32:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if num_tokens <= 128:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    if num_tokens <= 256:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2)
    if num_tokens <= 768:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def invoke_fused_moe_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    top_k: int,
    config: dict[str, int],
) -> None:
    """c [T * top_k, N] = the grouped GEMM of a [T or T * top_k, K] by b [E, N, K] (see
    `_fused_moe_kernel`); `top_k` is how many sorted pairs share one row of `a`."""
    num_valid, (n, k) = c.shape[0], b.shape[1:]
    block_m = config["BLOCK_M"]
    # A block holds at least one valid pair: no more blocks in use than pairs.
    num_pid_m = min(triton.cdiv(sorted_ids.numel(), block_m), num_valid)
    grid = (num_pid_m * triton.cdiv(n, config["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        a, b, c, topk_weights if topk_weights is not None else c, sorted_ids, expert_ids,
        num_post, n, k, num_valid, num_pid_m, a.stride(0), b.stride(0), b.stride(1),
        c.stride(0),
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"], TOP_K=top_k, MUL_ROUTED_WEIGHT=topk_weights is not None,
        IEEE=a.dtype == torch.float32, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = topk_ids[t, k].

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_weights / topk_ids [T, top_k] -> [T, H] in the dtype of hidden_states."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if hidden_states.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts needs contiguous rows in its input and weights")
    config = config or default_config(num_tokens)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config["BLOCK_M"],
                                                            num_experts)  # fmt: skip
    num_pairs = num_tokens * top_k
    dtype, device = hidden_states.dtype, hidden_states.device
    gate_up = torch.empty(num_pairs, two_inter, dtype=dtype, device=device)
    invoke_fused_moe_kernel(hidden_states, w13, gate_up, None, sorted_ids, expert_ids, num_post,
                            top_k, config)  # fmt: skip
    act = silu_and_mul(gate_up)  # [T * top_k, I]
    down = torch.empty(num_pairs, hidden, dtype=dtype, device=device)
    weights = topk_weights.reshape(-1)
    invoke_fused_moe_kernel(act, w2, down, weights, sorted_ids, expert_ids, num_post, 1, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
