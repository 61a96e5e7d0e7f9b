"""Token -> expert sort/align for the fused MoE GEMMs (`pagoda.kernels.fused_moe`), as vLLM's
`moe_align_block_size`: the T * top_k (token, expert) pairs grouped by expert, each expert's run
padded to a multiple of BLOCK_M, so that each BLOCK_M block of sorted rows belongs to one expert.

Decode steps of a few tokens (at most CHUNK pairs) take one launch; larger batches three: count
each chunk's pairs per expert, prefix the counts over chunks and experts, scatter. The sort is
stable (pairs of one expert keep their order) and nothing is read back on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs handled by one program of the count and scatter kernels (its rank matrix is CHUNK^2).
_CHUNK = 64
# Chunk histograms prefixed per iteration of the offsets kernel.
_PREFIX_ROWS = 16


# Sizes that follow the batch are not specialized on (one compiled kernel for every batch).
@triton.jit(do_not_specialize=["numel"])
def _moe_count_kernel(
    topk_ids_ptr, counts_ptr, numel, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr
):
    """counts[c, e] = pairs of chunk c routed to expert e."""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    hist = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * num_experts + experts, hist, mask=experts < num_experts)


@triton.jit(do_not_specialize=["numel", "num_chunks", "max_padded", "num_blocks"])
def _moe_offsets_kernel(
    counts_ptr,
    expert_starts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_ptr,
    numel,
    num_experts,
    num_chunks,
    max_padded,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: each chunk's histogram becomes the count of its expert's pairs in earlier
    chunks; each expert's run starts at the padded total of the experts before it; every
    BLOCK_M block gets its expert; the sorted ids are filled with the sentinel `numel`."""
    experts = tl.arange(0, E_PAD)
    emask = experts < num_experts
    rows = tl.arange(0, ROWS)
    running = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        ptrs = counts_ptr + (c0 + rows)[:, None] * num_experts + experts[None, :]
        mask = ((c0 + rows)[:, None] < num_chunks) & emask[None, :]
        tile = tl.load(ptrs, mask=mask, other=0)
        before = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(ptrs, before, mask=mask)
        running += tl.sum(tile, axis=0)
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(expert_starts_ptr + experts, ends - padded, mask=emask)
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    # Block b (rows b * BLOCK_M ..) belongs to the first expert whose run ends after it; blocks
    # past the end get the last expert (their programs exit before reading it).
    ends = tl.where(emask, ends, 2147483647)
    blocks = tl.arange(0, 64)
    for b0 in range(0, num_blocks, 64):
        b = b0 + blocks
        e = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.minimum(e, num_experts - 1), mask=b < num_blocks)
    fill = tl.arange(0, FILL)
    for s in range(0, max_padded, FILL):
        tl.store(sorted_ids_ptr + s + fill, numel + tl.zeros((FILL,), tl.int32),
                 mask=s + fill < max_padded)  # fmt: skip


@triton.jit(do_not_specialize=["numel"])
def _moe_scatter_kernel(
    topk_ids_ptr, counts_ptr, expert_starts_ptr, sorted_ids_ptr, numel, num_experts,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Pair p goes to its expert's start + the expert's pairs in earlier chunks + those before
    it in its own chunk: a stable sort by expert."""
    pid = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    offs = pid * CHUNK + lane
    valid = offs < numel
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    earlier = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    safe = tl.where(valid, ids, 0)
    base = tl.load(counts_ptr + pid * num_experts + safe, mask=valid, other=0)
    base += tl.load(expert_starts_ptr + safe, mask=valid, other=0)
    tl.store(sorted_ids_ptr + base + rank, offs.to(tl.int32), mask=valid)


@triton.jit(do_not_specialize=["numel", "max_padded", "num_blocks"])
def _moe_align_one_chunk_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_ptr,
    numel,
    num_experts,
    max_padded,
    num_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    FILL: tl.constexpr,
):
    """All three steps in one program, for at most CHUNK pairs (a decode step of a few tokens)."""
    lane = tl.arange(0, CHUNK)
    valid = lane < numel
    ids = tl.load(topk_ids_ptr + lane, mask=valid, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    ends = tl.where(experts < num_experts, ends, 2147483647)
    blocks = tl.arange(0, 64)
    for b0 in range(0, num_blocks, 64):
        b = b0 + blocks
        e = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.minimum(e, num_experts - 1), mask=b < num_blocks)
    fill = tl.arange(0, FILL)
    for s in range(0, max_padded, FILL):
        tl.store(sorted_ids_ptr + s + fill, numel + tl.zeros((FILL,), tl.int32),
                 mask=s + fill < max_padded)  # fmt: skip
    tl.debug_barrier()  # the sentinel everywhere before any pair lands (other threads' stores)
    earlier = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(onehot * starts[None, :], axis=1)  # each pair's expert's start
    tl.store(sorted_ids_ptr + start + rank, lane, mask=valid)


def max_padded_pairs(numel: int, num_experts: int, block_m: int) -> int:
    """The sorted length's bound: every expert's run padded by at most block_m - 1 rows."""
    return numel + num_experts * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] -> (sorted_ids [max_padded] int32: pair indices grouped by expert,
    each expert's run padded to a multiple of block_m with the sentinel T * top_k;
    expert_ids [max_padded / block_m] int32: each block's expert; num_tokens_post_padded [1]
    int32: the padded length in use). One launch up to 64 pairs, else three; no host sync."""
    numel = topk_ids.numel()
    device = topk_ids.device
    max_padded = max_padded_pairs(numel, num_experts, block_m)
    num_blocks = triton.cdiv(max_padded, block_m)
    num_chunks = triton.cdiv(numel, _CHUNK)
    e_pad = max(triton.next_power_of_2(num_experts), 16)
    ids = topk_ids.reshape(-1)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    if numel <= _CHUNK:
        _moe_align_one_chunk_kernel[(1,)](
            ids, sorted_ids, expert_ids, num_post, numel, num_experts, max_padded, num_blocks,
            BLOCK_M=block_m, CHUNK=_CHUNK, E_PAD=e_pad, FILL=1024,
        )  # fmt: skip
        return sorted_ids, expert_ids, num_post
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    expert_starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _moe_count_kernel[(num_chunks,)](ids, counts, numel, num_experts, CHUNK=_CHUNK, E_PAD=e_pad)
    _moe_offsets_kernel[(1,)](
        counts, expert_starts, sorted_ids, expert_ids, num_post, numel, num_experts,
        num_chunks, max_padded, num_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, ROWS=_PREFIX_ROWS, FILL=1024,
    )  # fmt: skip
    _moe_scatter_kernel[(num_chunks,)](
        ids, counts, expert_starts, sorted_ids, numel, num_experts, CHUNK=_CHUNK
    )
    return sorted_ids, expert_ids, num_post
