"""The Triton fused MoE (token -> expert sort/align, grouped GEMMs) against the per-expert loop:
under the Triton interpreter in float32 when there is no GPU; on a GPU also bf16 at the
Qwen3-30B-A3B shape and inside a CUDA graph (replayed on new routing without a host sync)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels.fused_moe import fused_experts  # noqa: E402
from pagoda.kernels.moe_align import moe_align_block_size  # noqa: E402
from pagoda.model.layers.fused_moe import moe_experts_ref, softmax_topk  # noqa: E402

DEV = kernel_device()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = softmax_topk(logits, top_k, renormalize=True)
    return weights.to(DEV), ids.to(DEV)


# 2, 15 and 64 pairs: the one-launch path; 65 and 1200: count, prefix, scatter.
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (5, 3), (16, 4), (13, 5), (300, 4)])
@pytest.mark.parametrize("num_experts", [4, 8, 130])
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_groups_pairs_by_expert(num_tokens, top_k, num_experts, block_m):
    if top_k > num_experts:
        pytest.skip("more picks than experts")
    _, topk_ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens + num_experts)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, num_experts)
    flat = topk_ids.reshape(-1).cpu()
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_post) == int(padded.sum())
    used = sorted_ids[: int(num_post)].cpu().long()
    assert (sorted_ids[int(num_post) :].cpu() == numel).all()  # sentinel past the end
    valid = used[used < numel]
    assert sorted(valid.tolist()) == list(range(numel))  # every pair exactly once
    start = 0
    for e in range(num_experts):
        run = used[start : start + int(padded[e])]
        blocks = expert_ids[start // block_m : (start + int(padded[e])) // block_m].cpu()
        assert (blocks == e).all()
        pairs = run[run < numel]
        assert pairs.numel() == counts[e] and (flat[pairs] == e).all()
        assert (pairs[1:] > pairs[:-1]).all()  # stable: pairs in their original order
        assert (run[pairs.numel() :] == numel).all()  # padding after the expert's pairs
        start += int(padded[e])


# (tokens, experts, top_k, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K): 2 * inter and inter not
# multiples of BLOCK_N / BLOCK_K (ragged columns and K tail), more blocks than GROUP_M.
CASES = [
    (1, 8, 2, 64, 40, 16, 32, 32),
    (7, 8, 3, 64, 40, 16, 32, 32),
    (33, 4, 2, 48, 24, 16, 32, 16),
    (40, 16, 4, 64, 32, 32, 64, 32),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_experts_matches_per_expert_loop(case):
    t, e, k, h, inter, bm, bn, bk = case
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(DEV)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(DEV)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(DEV)
    weights, ids = _routing(t, e, k, seed=t + 1)
    config = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, num_warps=4, num_stages=2)
    out = fused_experts(x, w13, w2, weights, ids, config)
    ref = moe_experts_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 1000])
def test_fused_experts_bf16_qwen3_moe_shape(num_tokens):
    """Qwen3-30B-A3B's experts (128 of 768, top 8, hidden 2048) in bf16 with the default tiles."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, inter = 128, 2048, 768
    x = torch.randn(num_tokens, h, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    logits = torch.randn(num_tokens, e, device="cuda", generator=g)
    weights, ids = softmax_topk(logits, 8, renormalize=True)
    out = fused_experts(x, w13, w2, weights, ids).float()
    ref = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_fused_experts_in_cuda_graph():
    """Captured once, replayed on new inputs and new routing: the same as eager each time."""
    e, k, h, inter, t = 16, 4, 256, 128, 24
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g).bfloat16() / 16
    w2 = torch.randn(e, h, inter, device="cuda", generator=g).bfloat16() / 11
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g)

    def step():
        weights, ids = softmax_topk(logits, k, renormalize=True)
        return fused_experts(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed + 10)
        x.copy_(torch.randn(t, h, device="cuda", generator=gen))
        logits.copy_(torch.randn(t, e, device="cuda", generator=gen) * 3)
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (16, 1)])
@pytest.mark.parametrize("rule", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized"])
def test_triton_routing_matches_torch(num_experts, top_k, rule):
    from pagoda.kernels.moe_routing import softmax_topk_triton
    from pagoda.model.layers.fused_moe import topk_softmax

    g = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(37, num_experts, generator=g) * 2).to(DEV)
    if rule == "mixtral":
        want_w, want_ids = topk_softmax(logits, top_k)
    else:
        want_w, want_ids = softmax_topk(logits, top_k, rule == "qwen3_moe")
    weights, ids = softmax_topk_triton(logits, top_k, rule != "qwen3_moe_unnormalized",
                                       rule != "mixtral")  # fmt: skip
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
