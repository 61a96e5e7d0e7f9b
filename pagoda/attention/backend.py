"""The attention backend interface and a lazy registry that picks an implementation by device.

A backend writes this step's new keys/values into the paged KV cache (at `slot_mapping`) and then
computes causal attention of every query row over its request's cached prefix plus the rows of
this step before it, for a flat mixed batch of prefill chunks and decodes (layout in
`pagoda.attention.metadata`). Implementations: `"torch"` (pure PyTorch, `torch_ref.py`: the test
oracle and the fallback), `"cpu"` (a C kernel built at first use, `pagoda/attention/cpu/`: the
CPU default when a C compiler is present) and `"triton"` (GPU kernels under
`pagoda/attention/triton/`). Backends are imported only when picked, so CPU installs never import
Triton.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from pagoda.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionLayer(Protocol):
    """What a backend may read from the calling layer (`pagoda.model.layers.attention`)."""

    layer_idx: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_size: int
    k_scale: float  # quantized KV cache only: stored = round(x / scale)
    v_scale: float
    # Optional (read with `sliding_window_of` / `soft_cap_of`, absent means off):
    # sliding_window: int | None  -- a query at position p sees keys (p - window, p] only
    #   (Mistral, Gemma's local layers; Hugging Face's `sliding_window` semantics);
    # logits_soft_cap: float | None  -- scores become cap * tanh(score / cap) before the
    #   softmax (Gemma 2's attn_logit_softcapping).


def sliding_window_of(layer: AttentionLayer) -> int | None:
    """The layer's sliding window in tokens, or None for full causal attention."""
    window = getattr(layer, "sliding_window", None)
    return int(window) if window else None


def soft_cap_of(layer: AttentionLayer) -> float | None:
    """The layer's attention logit soft-cap, or None."""
    cap = getattr(layer, "logits_soft_cap", None)
    return float(cap) if cap else None


class AttentionBackend(ABC):
    """Paged attention for one step of a mixed prefill/decode batch.

    `forward(layer, q, k, v, kv_cache, attn_metadata, scale)`:
      every backend honours the layer's sliding window and logit soft-cap (see AttentionLayer).
      q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size], the
      new rows of this step (already rotated). kv_cache: [2, num_blocks, block_size,
      num_kv_heads, head_size], or None (no cache yet, e.g. a memory-profiling run: every request
      then attends only within its own rows, which must start at position 0).
      Writes k/v rows [0, num_actual_tokens) into the cache at slot_mapping (slot -1: skip),
      then returns out: [num_tokens, num_heads, head_size] in q's dtype; rows past
      num_actual_tokens are zero. GQA/MQA: query head h reads KV head h // (num_heads /
      num_kv_heads). Must not synchronise with the device more than needed (CUDA graphs).
    `prepare(attn_metadata)` is called once per step before the first layer: a backend may
      precompute per-step values shared by all layers into `attn_metadata.extra`.
    `forward_with_rope(layer, positions, cos_sin_cache, q, k, v, ...)`: `forward` for q and k
      not yet rotated, rotating them in place first (Neox RoPE) in fewer launches, or None when
      the backend has no such path (the default): the caller then rotates and calls `forward`.
    """

    name: str = "base"

    def prepare(self, attn_metadata: AttentionMetadata) -> None:
        return None

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
        """Rotate q and k in place at positions [num_tokens] by `cos_sin_cache` [max_position,
        rotary_dim] = cat(cos, sin) (GPT-NeoX / Hugging Face `rotate_half` pairs, dims past
        rotary_dim unrotated), then `forward`; None where not implemented, before touching
        anything."""
        return None

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


# name -> (module, class); imported on first use.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("pagoda.attention.torch_ref", "TorchAttentionBackend"),
    "cpu": ("pagoda.attention.cpu.backend", "CpuAttentionBackend"),
    "triton": ("pagoda.attention.triton.backend", "TritonAttentionBackend"),
}


def register_attention_backend(name: str, module: str, class_name: str) -> None:
    _BACKENDS[name] = (module, class_name)


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attn_backend(device: str | torch.device, name: str | None = None) -> AttentionBackend:
    """The backend called `name`, or the best one for `device` (triton on CUDA, the C kernel on
    CPU, torch when those are unavailable)."""
    device_type = torch.device(device).type
    if name is None:
        if device_type == "cuda":
            try:
                return _load("triton")
            except ImportError as e:  # no Triton build for this GPU: the torch path still works
                logger.warning("Triton attention unavailable (%s); using the torch backend", e)
        elif device_type == "cpu":
            from pagoda.utils.cpu_build import CpuKernelUnavailable, warn_unavailable

            try:
                return _load("cpu")
            except CpuKernelUnavailable as e:  # no C compiler or a failed build
                warn_unavailable(e)
        return _load("torch")
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {available_attention_backends()}, got {name!r}"
        )
    if name == "triton" and device_type != "cuda":
        raise ValueError("attention_backend='triton' needs a CUDA device; use 'torch' on CPU")
    if name == "cpu" and device_type != "cpu":
        raise ValueError(f"attention_backend='cpu' needs device 'cpu', got {device_type!r}")
    return _load(name)


def _load(name: str) -> AttentionBackend:
    module, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module), class_name)()
