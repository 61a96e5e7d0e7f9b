"""The paged KV cache's shape and allocation (layout in `pagoda.attention.metadata`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.config import DEFAULT_CPU_KV_CACHE_BYTES

_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(
        cls,
        cache_dtype: str,
        model_dtype: str,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
    ) -> KVCacheSpec:
        name = model_dtype if cache_dtype == "auto" else cache_dtype
        if name not in _CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not supported")
        return cls(num_layers, block_size, num_kv_heads, head_size, _CACHE_DTYPES[name])

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size
        return per_layer * self.dtype.itemsize * self.num_layers


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    # Zeroed: attention reads (and masks out) the unwritten tail of a request's last block, and
    # uninitialised memory could hold NaN bit patterns that a mask does not remove.
    shape = (2, num_blocks, *spec.block_shape)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cpu_kv_cache_bytes() -> int:
    """Default CPU budget: min(2 GiB, 25% of the RAM available now)."""
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available_memory_bytes() // 4)
