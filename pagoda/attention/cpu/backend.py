"""The `"cpu"` attention backend: paged attention by a C kernel that reads K/V in place.

Per step (the plan, built by the first layer and shared by all through `attn_metadata.extra`),
the batch is cut into work items for the kernel (`paged_attention.c`): a decode is one item
per request (all its KV heads) when there are enough requests to keep every thread busy, else
one per (request, KV head); a prompt chunk (with or without a cached prefix) is one item per
(KV head, run of a few query rows). Items go out longest first, so the threads finish
together. New K/V rows are first written with `torch_ref.write_kv_cache`, and the kernel reads
every key from the cache, fresh prompts included (measured ~2x faster than SDPA for a 512-token
prompt on a 2-core Zen 4); only when some row was not written (slot -1) do fresh prompts use
SDPA over the step's own rows. Sliding windows and soft-capped scores are the kernel's too
(from the layer's `sliding_window` / `logits_soft_cap`). The cache holds the model dtype, a
16-bit dtype under a float32 model (the CPU default for a float32 model, see
`pagoda.engine.arg_utils.resolve_kv_cache_dtype`), or fp8 e5m2 (`--kv-cache-dtype fp8_e5m2`,
stored as k / k_scale, v / v_scale); keys and values are widened as they are read. What the
kernel does not cover (no cache yet, an int8 or e4m3 cache, a head size over 256, a non-CPU
tensor) goes to the torch backend, which stays the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda import envs
from pagoda.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    sliding_window_of,
    soft_cap_of,
)
from pagoda.attention.cpu.library import CACHE_DTYPE_CODES, DTYPE_CODES, load_library
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_ref import TorchAttentionBackend, attend, window_mask, write_kv_cache

_PLAN_KEY = "cpu_plan"
_MAX_HEAD_SIZE = 256
# Query vectors (rows x GQA group) an item of a prefill chunk scores against each K/V tile:
# more reuse each key read from memory more often, fewer leave threads idle on short chunks.
_CHUNK_QUERY_VECTORS = 16


def num_threads() -> int:
    """Threads the kernel uses: $PAGODA_CPU_THREADS, else torch's intra-op thread count."""
    return envs.PAGODA_CPU_THREADS or torch.get_num_threads()


@dataclass
class _Plan:
    block_size: int
    group: int  # query heads per KV head
    write_slots: torch.Tensor  # [n] int64 slots of the rows written
    write_rows: torch.Tensor | None  # rows to write when some slots are -1; None: all rows
    items: torch.Tensor  # [num_items, 5] int32: request, kv head range, query row range
    fresh: list[tuple[int, int]]  # query rows [start, end) of prompts left to SDPA
    seq_lens: torch.Tensor  # [num_reqs] int32, contiguous
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, contiguous
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, contiguous
    num_threads: int


def build_items(
    query_start_loc: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    threads: int,
    fresh_to_sdpa: bool = False,
) -> tuple[list[tuple[int, int, int, int, int]], list[tuple[int, int]]]:
    """Work items for the kernel, longest first, and the row ranges of fresh prompts (no cached
    prefix) left to SDPA: none, unless `fresh_to_sdpa` (some rows were not written to the
    cache, so the kernel cannot read them back)."""
    num_reqs = len(seq_lens)
    num_decodes = sum(query_start_loc[b + 1] - query_start_loc[b] == 1 for b in range(num_reqs))
    # Whole requests read their blocks as contiguous runs; split by KV head only when the
    # requests alone are too few to spread over the threads.
    whole = num_decodes >= 4 * threads
    rows_per_item = max(1, _CHUNK_QUERY_VECTORS // group)
    costed, fresh = [], []
    for b in range(num_reqs):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        query_len, seq_len = end - start, seq_lens[b]
        if query_len == 0:
            continue
        if query_len == 1:
            heads = [(0, num_kv_heads)] if whole else [(h, h + 1) for h in range(num_kv_heads)]
            for h0, h1 in heads:
                costed.append((seq_len * (h1 - h0), (b, h0, h1, start, start + 1)))
            continue
        if seq_len == query_len and fresh_to_sdpa:
            fresh.append((start, end))
            continue
        for r0 in range(start, end, rows_per_item):
            r1 = min(end, r0 + rows_per_item)
            keys = seq_len - (end - r1)  # keys the item's last row sees
            for h in range(num_kv_heads):
                costed.append((keys * (r1 - r0), (b, h, h + 1, r0, r1)))
    costed.sort(key=lambda c: -c[0])
    return [item for _, item in costed], fresh


def _build_plan(md: AttentionMetadata, kv_cache: torch.Tensor, group: int) -> _Plan:
    n = md.num_actual_tokens
    qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
    seq_lens = md.seq_lens_cpu or md.seq_lens.tolist()
    slots = md.slot_mapping[:n].long()
    valid = slots >= 0
    write_rows = None
    if not bool(valid.all()):
        write_rows = valid.nonzero().squeeze(1)
        slots = slots.index_select(0, write_rows)
    threads = num_threads()
    items, fresh = build_items(
        qsl, seq_lens, int(kv_cache.shape[3]), group, threads, fresh_to_sdpa=write_rows is not None
    )
    return _Plan(
        block_size=int(kv_cache.shape[2]),
        group=group,
        write_slots=slots,
        write_rows=write_rows,
        items=torch.tensor(items, dtype=torch.int32).reshape(-1, 5),
        fresh=fresh,
        seq_lens=md.seq_lens.to(torch.int32).contiguous(),
        query_start_loc=md.query_start_loc.to(torch.int32).contiguous(),
        block_tables=md.block_tables.to(torch.int32).contiguous(),
        num_threads=threads,
    )


def step_plan(md: AttentionMetadata, kv_cache: torch.Tensor, group: int) -> _Plan:
    """The step's plan, built by the first layer that asks and kept in `md.extra` for the rest
    (and for the one-call decoder stack, which runs the same kernel over it)."""
    if md.extra is None:
        md.extra = {}
    plan = md.extra.get(_PLAN_KEY)
    if plan is None or plan.block_size != kv_cache.shape[2] or plan.group != group:
        plan = md.extra[_PLAN_KEY] = _build_plan(md, kv_cache, group)
    return plan


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on CPU with the C kernel; see the module docstring for the split."""

    name = "cpu"

    def __init__(self) -> None:
        self._lib = load_library()  # raises CpuKernelUnavailable: the registry falls back
        self._kernel = self._lib.pagoda_paged_attention
        self._torch = TorchAttentionBackend()

    def _supports(self, q: torch.Tensor, kv_cache: torch.Tensor | None) -> bool:
        return (
            kv_cache is not None
            and kv_cache.numel() > 0
            and q.device.type == "cpu"
            and q.dtype in DTYPE_CODES
            and kv_cache.dtype in CACHE_DTYPE_CODES
            and (kv_cache.dtype in (q.dtype, torch.float8_e5m2) or q.dtype == torch.float32)
            and q.shape[-1] <= _MAX_HEAD_SIZE
            and kv_cache.is_contiguous()
        )

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not self._supports(q, kv_cache):
            return self._torch.forward(layer, q, k, v, kv_cache, attn_metadata, scale)
        window, soft_cap = sliding_window_of(layer), soft_cap_of(layer)
        md = attn_metadata
        num_tokens, num_heads, head_size = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        plan = step_plan(md, kv_cache, group)

        n = md.num_actual_tokens
        k_new, v_new = k[:n], v[:n]
        if plan.write_rows is not None:
            k_new, v_new = k_new[plan.write_rows], v_new[plan.write_rows]
        k_scale, v_scale = (
            float(getattr(layer, "k_scale", 1.0)),
            float(getattr(layer, "v_scale", 1.0)),
        )
        write_kv_cache(kv_cache, k_new, v_new, plan.write_slots, k_scale, v_scale)

        out = q.new_empty(num_tokens, num_heads, head_size)
        if n < num_tokens:
            out[n:].zero_()
        if q.stride(2) != 1:
            q = q.contiguous()
        if plan.items.shape[0] > 0:
            rc = self._kernel(
                out.data_ptr(),
                q.data_ptr(),
                q.stride(0),
                q.stride(1),
                kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(),
                plan.block_tables.data_ptr(),
                plan.block_tables.stride(0),
                plan.seq_lens.data_ptr(),
                plan.query_start_loc.data_ptr(),
                plan.items.data_ptr(),
                plan.items.shape[0],
                num_heads,
                num_kv_heads,
                head_size,
                plan.block_size,
                DTYPE_CODES[q.dtype],
                CACHE_DTYPE_CODES[kv_cache.dtype],
                scale,
                k_scale,
                v_scale,
                window or 0,
                soft_cap or 0.0,
                plan.num_threads,
            )
            if rc != 0:
                raise RuntimeError(f"CPU paged-attention kernel rejected its arguments (code {rc})")
        for start, end in plan.fresh:
            o = attend(
                q[start:end].transpose(0, 1).unsqueeze(0),  # [1, num_heads, q_len, hs]
                k[start:end].transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, q_len, hs]
                v[start:end].transpose(0, 1).unsqueeze(0),
                window_mask(end - start, 0, 0, window, q.device),
                scale,
                soft_cap,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out
