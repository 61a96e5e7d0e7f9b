"""The attention layer of a decoder block: holds the head geometry and hands the paged-cache work
to the step's `AttentionBackend` (torch reference on CPU, Triton kernels on GPU)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.backend = backend
        # Quantized KV cache scales (stored = round(x / scale)); 1.0 for a cache in model dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_size], k/v: [T, num_kv_heads, head_size] -> [T, num_heads * hs]."""
        out = self.backend.forward(self, q, k, v, kv_cache, attn_metadata, self.scale)
        return out.view(q.shape[0], self.num_heads * self.head_size)
