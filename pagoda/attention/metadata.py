"""The paged KV-cache layout and the per-step metadata every attention backend reads.

Layout (shared by the torch reference, the Triton and the CUDA kernels):
    kv_cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_size]
    kv_cache[0] holds keys, kv_cache[1] values. Token t of a request lives in physical block
    block_table[t // block_size] at offset t % block_size, i.e. at slot
    block_table[t // block_size] * block_size + t % block_size.
That is the logical shape; kernels address it through strides. On CUDA the memory is
head-major within each block ([2, num_blocks, num_kv_heads, block_size, head_size], viewed
with dims 2 and 3 swapped: `pagoda.worker.kv_cache.kv_cache_layout`).
For an FP8/INT8 cache the tensor has that dtype and `k_scale` / `v_scale` (float32 scalars,
per layer) convert: stored = round(x / scale), x = stored * scale.

A step's batch is flat: the scheduled tokens of all requests laid end to end, request b owning
query rows query_start_loc[b] : query_start_loc[b + 1]. Query row i of request b sits at
position seq_lens[b] - query_len_b + i and attends causally to keys 0 ..= that position
(its cached prefix plus the rows of this step before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens in this step (rows of q); trailing padding rows ignored
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new K/V goes; -1 = skip
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, tokens in cache after this step (context + query)
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # CPU copies, for backends that loop or pick paths in Python.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    num_decodes: int = 0  # requests with query_len == 1 come first in the batch when > 0
    # INT8 cache on a GPU: this (eager) step sets each layer's K/V scales from its own K/V,
    # on the device, before writing the cache (`Attention.forward`).
    calibrate_kv_scales: bool = False
    # Backend-specific precomputed values (e.g. gather indices shared by all layers).
    extra: dict | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def from_lists(
        cls,
        specs: list[tuple[int, int]],
        slot_mapping: list[int],
        block_tables: list[list[int]],
    ) -> AttentionMetadata:
        """Metadata for requests given as (context_len, query_len) pairs, on the CPU (tests,
        benchmarks); block_tables rows must be padded to one length."""
        query_start_loc = [0]
        for _, n in specs:
            query_start_loc.append(query_start_loc[-1] + n)
        seq_lens = [c + n for c, n in specs]
        return cls(
            num_actual_tokens=query_start_loc[-1],
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(block_tables, dtype=torch.int32),
            max_query_len=max(n for _, n in specs),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
