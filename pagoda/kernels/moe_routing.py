"""Top-k routing of a mixture of experts in one Triton launch: per token, the softmax over the
router's logits, the top_k experts, renormalized to sum 1 where the family does (Mixtral always,
where it is the softmax over the chosen logits; Qwen3-MoE with `norm_topk_prob`).

The torch code it replaces (`pagoda.model.layers.fused_moe.softmax_topk` / `topk_softmax`, the
references) is five to seven small launches per layer, which a decode step at batch 1 pays 48
times over on Qwen3-30B-A3B. One program per token: the row's E logits fit in registers, and
top_k rounds of arg-max pick the experts in descending order (ties to the lowest index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l: tl.int64,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + row * stride_l + experts, mask=experts < num_experts,
                other=-float("inf")).to(tl.float32)  # fmt: skip
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.argmax(p, axis=0, tie_break_left=True)
        weights = tl.where(slots == i, best, weights)
        ids = tl.where(slots == i, idx, ids)
        p = tl.where(experts == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    if ROUND_WEIGHTS:  # to the logits' dtype, as transformers' Qwen3-MoE router rounds them
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    mask = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=mask)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=mask)


def softmax_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int32), experts in
    descending order of probability."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        raise ValueError("softmax_topk_triton needs contiguous rows of logits")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    _softmax_topk_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0),
        TOP_K=top_k, K_PAD=max(triton.next_power_of_2(top_k), 2),
        E_PAD=max(triton.next_power_of_2(num_experts), 16), RENORMALIZE=renormalize,
        ROUND_WEIGHTS=round_weights, num_warps=1 if num_experts <= 256 else 4,
    )  # fmt: skip
    return weights, ids
