"""Small host-side helpers shared by the Triton attention kernels (no triton import here).

They map a KV-cache dtype to the quantization the kernels apply, and normalize the per-layer
`k_scale` / `v_scale` arguments (None, a Python float, or a float32 tensor) to what a kernel
reads: a one-element float32 tensor on the cache's device.
"""

from __future__ import annotations

import torch

QUANT_NONE = 0
QUANT_FP8 = 1
QUANT_INT8 = 2

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_quant_mode(cache_dtype: torch.dtype) -> int:
    """QUANT_FP8 / QUANT_INT8 for a quantized cache dtype, QUANT_NONE otherwise."""
    if cache_dtype in FP8_DTYPES:
        return QUANT_FP8
    if cache_dtype == torch.int8:
        return QUANT_INT8
    return QUANT_NONE


def cache_value_range(cache_dtype: torch.dtype) -> tuple[float, float]:
    """(min, max) finite stored value: x / scale is clamped to it before the cast."""
    if cache_dtype == torch.int8:
        return -128.0, 127.0
    info = torch.finfo(cache_dtype)
    return float(info.min), float(info.max)


def scale_tensor(scale: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | None:
    """A one-element float32 tensor on `device` (kernels load it, so CUDA graphs replay
    with the current value). Pass tensors when capturing graphs: a float allocates."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"k_scale/v_scale must hold one value, got shape {tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)
