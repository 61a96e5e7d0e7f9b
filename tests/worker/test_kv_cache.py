"""The KV cache's layout choice: token-major on a CPU, head-major blocks on CUDA (a view of the
same logical [2, blocks, block_size, kv_heads, head_size] shape)."""

from __future__ import annotations

import torch

from pagoda.worker.kv_cache import KVCacheSpec, allocate_kv_caches, kv_cache_layout


def test_layout_by_device() -> None:
    assert kv_cache_layout(torch.device("cpu")) == "nhd"
    assert kv_cache_layout(torch.device("cuda")) == "hnd"


def test_head_major_allocation_keeps_the_logical_shape() -> None:
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=4, head_size=8, dtype=torch.int8)
    hnd = allocate_kv_caches(spec, 5, torch.device("cpu"), layout="hnd")
    nhd = allocate_kv_caches(spec, 5, torch.device("cpu"))
    assert len(hnd) == 2 and hnd[0].shape == nhd[0].shape == (2, 5, 16, 4, 8)
    # Each (block, KV head) is one contiguous 16 x 8 piece; tokens of a head are 8 apart.
    assert hnd[0].stride() == (5 * 4 * 16 * 8, 4 * 16 * 8, 8, 16 * 8, 1)
    assert nhd[0].is_contiguous() and not hnd[0].is_contiguous()
    assert hnd[0].untyped_storage().nbytes() == spec.bytes_per_block * 5 // 2
