"""The CUDA-graph buckets and the memory reserved for them, without torch: the engine's
`cuda_graphs` and `profiling` use them at start-up and `pagoda plan` to predict that start-up
from a config alone (`pagoda.worker.memory_estimate`).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_CAPTURE_SIZE = 512
# Mixed graphs: token buckets, and request buckets per token bucket (capped at the token
# bucket and max_num_seqs, the cap included). Padding tokens cost little while the linear
# layers are bound by weight reads (up to ~190 tokens on an H200 in bf16), so the buckets double
# up to 128; past it they are compute-bound and padded rows cost their FLOPs, so the buckets
# are 64 tokens apart (at most ~1.5 ms of padded GEMMs for Llama-3-8B, against ~14 ms of
# launches for an eager step). The attention grid has a program per request slot, so a step
# with few requests should not run in a graph with hundreds of empty ones; a factor of 4
# between request buckets keeps the spare slots below 3/4. With max_num_seqs=256 that is 36
# graphs (~0.1 s each to capture for Llama-3-8B, next to 35 decode graphs).
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
MIXED_REQ_SIZES = (4, 16, 64, 256)
# Device memory of one instantiated graph outside torch's allocator (kernel nodes, launch
# parameters).
PER_GRAPH_OVERHEAD_BYTES = 2 << 20


def cuda_graph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to
    min(max_num_seqs, max_num_batched_tokens, 512), which is always included."""
    cap = min(max_num_seqs, max_num_batched_tokens, MAX_CAPTURE_SIZE)
    if cap < 1:
        return []
    sizes = [s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def _buckets(sizes: Sequence[int], cap: int) -> list[int]:
    out = [s for s in sizes if s <= cap]
    if not out or out[-1] != cap:
        out.append(cap)
    return out


def mixed_graph_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The (num_tokens, num_reqs) buckets of the mixed graphs, ascending: token buckets
    `MIXED_TOKEN_SIZES` up to min(max_num_batched_tokens, 512) (the cap included), and for each
    request buckets `MIXED_REQ_SIZES` up to min(token bucket, max_num_seqs) (the cap included:
    every scheduled request has a token, so no step needs more)."""
    token_cap = min(max_num_batched_tokens, MIXED_TOKEN_SIZES[-1])
    if token_cap < 2 or max_num_seqs < 1:  # a step that is not pure decode has >= 2 tokens
        return []
    return [
        (t, r)
        for t in _buckets(MIXED_TOKEN_SIZES, token_cap)
        for r in _buckets(MIXED_REQ_SIZES, min(t, max_num_seqs))
    ]


def mixed_graph_reserve_bytes(
    forward_peak_bytes: int, shapes: Sequence[tuple[int, int]], row_bytes: int
) -> int:
    """Memory to reserve for the mixed graphs: the activations of the largest one (the pool
    shares them), every graph's output (`row_bytes` per token row) and per-graph overhead."""
    if not shapes:
        return 0
    outputs = sum(t for t, _ in shapes) * row_bytes
    return forward_peak_bytes + outputs + len(shapes) * PER_GRAPH_OVERHEAD_BYTES


# The pool's segments are rounded up by the caching allocator, and the first capture in a
# process also allocates the capture stream's cuBLAS workspaces (0.21 GiB measured in all for
# 35 Llama-3-8B graphs on an H200 against 0.07 GiB for a later capture).
POOL_SLACK_BYTES = 256 << 20
# With tensor parallelism each graph also holds NCCL's captured all-reduces: two H200s at tp=2
# took 0.77 GiB for 71 Llama-3-8B graphs against 0.55 GiB estimated without this,
# ~3.2 MiB more a graph.
TP_PER_GRAPH_BYTES = 4 << 20


def decode_graph_reserve_bytes(
    forward_peak_bytes: int, capture_sizes: Sequence[int], row_bytes: int
) -> int:
    """Memory to reserve for the decode graphs: the largest one's activations (the pool shares
    them), every graph's output, per-graph overhead and the pool's slack."""
    if not capture_sizes:
        return 0
    outputs = sum(capture_sizes) * row_bytes
    return (
        forward_peak_bytes
        + outputs
        + len(capture_sizes) * PER_GRAPH_OVERHEAD_BYTES
        + POOL_SLACK_BYTES
    )
