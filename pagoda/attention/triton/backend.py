"""`TritonAttentionBackend`: the GPU implementation of `pagoda.attention.backend.AttentionBackend`.

Per layer and step it runs two kernels: `reshape_and_cache` (this step's k/v into the paged
cache, quantizing for an FP8/INT8 cache) and `unified_attention` (one launch for the whole
mixed prefill/decode batch, with the split-KV path for small decode batches); given unrotated
q and k (`forward_with_rope`), RoPE and the cache write are one kernel instead,
`rotary_embedding_and_cache`. Nothing here synchronizes with the device or reads device values
on the host, so a decode step can be captured in a CUDA graph. Without a cache (memory profiling) the step's own k/v are viewed as
a cache of block size 1 and the same kernel runs.
"""

from __future__ import annotations

import dataclasses

import torch

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    sliding_window_of,
    soft_cap_of,
)
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.triton.common import QUANT_NONE, cache_quant_mode
from pagoda.attention.triton.reshape_and_cache import (
    reshape_and_cache,
    rotary_embedding_and_cache,
)
from pagoda.attention.triton.unified_attention import unified_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        # Layers keep k_scale / v_scale as floats; the kernels read one-element tensors.
        # Keep one per (value, device) so steps allocate nothing (CUDA graphs, allocator).
        self._scales: dict[tuple[float, torch.device], torch.Tensor] = {}

    def _scale(self, value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        key = (float(value), device)
        t = self._scales.get(key)
        if t is None:
            t = self._scales[key] = torch.full(
                (1,), float(value), dtype=torch.float32, device=device
            )
        return t

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
        if kv_cache is None or kv_cache.numel() == 0:
            out = self._new_out(q, attn_metadata)
            return self._forward_without_cache(
                q, k, v, out, attn_metadata, scale, sliding_window_of(layer), soft_cap_of(layer)
            )
        return self._write_and_attend(layer, q, k, v, kv_cache, attn_metadata, scale)

    def forward_with_rope(
        self,
        layer: AttentionLayer,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor | None:
        if kv_cache is None or kv_cache.numel() == 0:
            return None  # memory profiling: rotate, then `forward`
        rope = (positions, cos_sin_cache)
        return self._write_and_attend(layer, q, k, v, kv_cache, attn_metadata, scale, rope)

    def _write_and_attend(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (positions, cos_sin_cache)
    ) -> torch.Tensor:
        n = md.num_actual_tokens
        out = self._new_out(q, md)
        k_scale = v_scale = None
        if cache_quant_mode(kv_cache.dtype) != QUANT_NONE:
            k_scale = self._scale(getattr(layer, "k_scale", 1.0), q.device)
            v_scale = self._scale(getattr(layer, "v_scale", 1.0), q.device)
        if rope is None:
            reshape_and_cache(k[:n], v[:n], kv_cache, md.slot_mapping[:n], k_scale, v_scale)
        else:
            positions, cos_sin_cache = rope
            rotary_embedding_and_cache(
                positions, q, k, v, cos_sin_cache, kv_cache, md.slot_mapping, n, k_scale, v_scale
            )
        return unified_attention(
            q,
            kv_cache,
            out,
            md,
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window_of(layer),
            soft_cap=soft_cap_of(layer),
        )

    @staticmethod
    def _new_out(q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        out = q.new_empty(q.shape)
        if md.num_actual_tokens < q.shape[0]:
            out[md.num_actual_tokens :].zero_()
        return out

    def _forward_without_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        # Every request starts at position 0 and sees only its own rows: row t of the step is
        # "block" t of a block-size-1 cache, and request b's block table is its row range.
        n = md.num_actual_tokens
        if n == 0:
            return out
        cache = torch.stack((k[:n], v[:n])).unsqueeze(2)  # [2, n, 1, num_kv_heads, head_size]
        qsl = md.query_start_loc
        rows = torch.arange(max(md.max_query_len, 1), device=q.device, dtype=torch.int32)
        block_tables = (qsl[:-1, None] + rows[None, :]).clamp_(max=n - 1)
        self_md = dataclasses.replace(
            md, seq_lens=(qsl[1:] - qsl[:-1]).to(torch.int32), block_tables=block_tables
        )
        return unified_attention(
            q, cache, out, self_md, scale, sliding_window=window, soft_cap=soft_cap
        )
