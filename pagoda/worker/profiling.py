"""Memory profiling on CUDA: one forward at the largest batch the scheduler may build, without a
KV cache, to learn the peak activation memory that must stay free beside the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagoda.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagoda.worker.model_runner import ModelRunner


def profile_peak_memory(runner: ModelRunner) -> tuple[int, int]:
    """(peak bytes torch allocated during a full-batch forward + logits, bytes used on the
    device outside torch's allocator: CUDA context, other processes)."""
    device = runner.device
    sc, max_len = runner.scheduler_config, runner.model_config.max_model_len
    num_tokens = sc.max_num_batched_tokens
    # Requests of at most max_model_len tokens, each starting at position 0 (no cache).
    lens = [max_len] * (num_tokens // max_len) + (
        [num_tokens % max_len] if num_tokens % max_len else []
    )
    torch.cuda.empty_cache()
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
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, logits, _
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    return peak, non_torch
