"""The attention layer of a decoder block: holds the head geometry and hands the paged-cache work
to the step's `AttentionBackend` (torch reference on CPU, Triton kernels on GPU). Given the
rotary embedding, it lets the backend rotate q and k where that saves a launch (Triton: RoPE and
the cache write in one kernel) and rotates them itself otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagoda.model.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.backend = backend
        # Read by the backends: keys (p - sliding_window, p] only; cap * tanh(score / cap).
        self.sliding_window = sliding_window or None
        self.logits_soft_cap = logits_soft_cap or None
        # Quantized KV cache scales (stored = round(x / scale)); 1.0 for a cache in model dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self._int8_scales_set = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        rotary_emb: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_size], k/v: [T, num_kv_heads, head_size] -> [T, num_heads * hs].

        With `rotary_emb`, q and k are not rotated yet: they are rotated in place at `positions`
        [T] as `rotary_emb(positions, q, k, fused=True)` does, by the backend's
        `forward_with_rope` where it has one (one kernel for RoPE and the cache write)."""
        if rotary_emb is not None:
            # Setting K/V scales reads the rotated keys before the cache write: rotate first.
            if not self._sets_kv_scales(kv_cache, attn_metadata):
                out = self.backend.forward_with_rope(
                    self,
                    positions,
                    rotary_emb.cos_sin_cache,
                    q,
                    k,
                    v,
                    kv_cache,
                    attn_metadata,
                    self.scale,
                )
                if out is not None:
                    return out.view(q.shape[0], self.num_heads * self.head_size)
            q, k = rotary_emb(positions, q, k, fused=True)
        if self._sets_int8_scales_on_cpu(kv_cache):
            self._set_int8_scales(k[: attn_metadata.num_actual_tokens], v)
        elif attn_metadata.calibrate_kv_scales and isinstance(self.k_scale, torch.Tensor):
            n = attn_metadata.num_actual_tokens
            self.k_scale.copy_(_int8_scale(k[:n]))
            self.v_scale.copy_(_int8_scale(v[:n]))
        out = self.backend.forward(self, q, k, v, kv_cache, attn_metadata, self.scale)
        return out.view(q.shape[0], self.num_heads * self.head_size)

    def _sets_int8_scales_on_cpu(self, kv_cache: torch.Tensor | None) -> bool:
        return (
            not self._int8_scales_set
            and kv_cache is not None
            and kv_cache.dtype == torch.int8
            and kv_cache.device.type == "cpu"
        )

    def _sets_kv_scales(self, kv_cache: torch.Tensor | None, md: AttentionMetadata) -> bool:
        """Whether this step takes the K/V cache scales from its keys and values."""
        return self._sets_int8_scales_on_cpu(kv_cache) or (
            md.calibrate_kv_scales and isinstance(self.k_scale, torch.Tensor)
        )

    def use_device_kv_scales(self, device: torch.device) -> None:
        """Keep K/V scales in one-element device tensors (INT8 cache on a GPU): CUDA graphs
        captured before calibration read them, and the calibrating step (see
        `AttentionMetadata.calibrate_kv_scales`) writes them in place without a host sync."""
        self.k_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(1, dtype=torch.float32, device=device)

    def _set_int8_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """An INT8 cache needs scales fitting the layer's K/V range: take them from the first
        step that writes the cache (as vLLM's calculate_kv_scales does), with 2x headroom for
        later tokens; values past it are clamped. FP8's range makes 1.0 work without this. CPU
        only: on a GPU the scales stay on the device (`use_device_kv_scales`)."""
        n = k.shape[0]
        self.k_scale = max(2.0 * float(k.abs().max()) / 127.0, 1e-4)
        self.v_scale = max(2.0 * float(v[:n].abs().max()) / 127.0, 1e-4)
        self._int8_scales_set = True


def _int8_scale(x: torch.Tensor) -> torch.Tensor:
    """The device-side twin of `_set_int8_scales`: 2x headroom over the first step's range."""
    return (x.abs().amax().float() * (2.0 / 127.0)).clamp_min(1e-4).reshape(1)
