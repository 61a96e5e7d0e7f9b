"""Memory profiling on CUDA, the measurements `pagoda.worker.memory_plan` splits memory with.

`profile_peak_memory`: one forward at the largest batch the scheduler may build
(max_num_batched_tokens tokens, no KV cache) plus the logits and the sampler's copies of them,
to learn the peak activation memory that must stay free beside the cache.
`estimate_cuda_graph_memory`: one decode forward at the largest CUDA-graph batch over a
two-block cache; the graphs' shared pool holds about that much (every bucket reuses the
largest one's memory), plus each graph's output and the driver's per-graph overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.worker.graph_buckets import (  # noqa: F401 - TP_PER_GRAPH_BYTES re-exported
    TP_PER_GRAPH_BYTES,
    decode_graph_reserve_bytes,
)
from pagoda.worker.kv_cache import allocate_kv_caches

if TYPE_CHECKING:
    from pagoda.worker.model_runner import ModelRunner


def profile_peak_memory(runner: ModelRunner) -> tuple[int, int]:
    """(peak bytes torch allocated during a full-batch forward + logits beyond what was
    allocated before it (the weights), bytes used on the device outside torch's allocator:
    CUDA context, other processes)."""
    device = runner.device
    sc, max_len = runner.scheduler_config, runner.model_config.max_model_len
    num_tokens = sc.max_num_batched_tokens
    # Requests of at most max_model_len tokens, each starting at position 0 (no cache).
    lens = [max_len] * (num_tokens // max_len) + (
        [num_tokens % max_len] if num_tokens % max_len else []
    )
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(lens), 1), dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=lens,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = runner.model(input_ids, positions, None, md)
    # The sampler holds a few [max_num_seqs, vocab] float32 copies of the logits.
    rows = min(sc.max_num_seqs, num_tokens)
    logits = runner.model.compute_logits(hidden[:rows])
    _ = logits.softmax(-1) + logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, logits, _
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    return peak, non_torch


def estimate_cuda_graph_memory(runner: ModelRunner, capture_sizes: Sequence[int]) -> int:
    """Bytes to reserve for the decode graphs of `capture_sizes` (see the module docstring)."""
    if not capture_sizes:
        return 0
    device = runner.device
    size = max(capture_sizes)
    caches = allocate_kv_caches(runner.get_kv_cache_spec(), 2, device)
    inputs = runner.inputs
    inputs.prepare_padding_only(size)
    md = inputs.decode_metadata(size, runner.model_config.max_model_len)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    hidden = runner.model(inputs.input_ids.dev[:size], inputs.positions.dev[:size], caches, md)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    row_bytes = hidden.shape[-1] * hidden.element_size()
    del hidden, caches
    torch.cuda.empty_cache()
    return decode_graph_reserve_bytes(peak, capture_sizes, row_bytes)
