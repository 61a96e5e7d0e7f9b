"""The KV cache's layout choice: token-major on a CPU, head-major blocks on CUDA (a view of the
same logical [2, blocks, block_size, kv_heads, head_size] shape)."""

from __future__ import annotations

import os

import pytest
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_cache_is_zero_and_resident_only_where_written(dtype) -> None:
    """A CPU cache of 256 MiB per layer costs no resident memory until blocks are written (a
    server's RSS grows with the blocks in use), and reads as zeros like torch.zeros."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_size=64, dtype=dtype)
    num_blocks = 2**28 // (2 * 16 * 8 * 64 * dtype.itemsize)
    before = _rss_bytes()
    caches = allocate_kv_caches(spec, num_blocks, torch.device("cpu"))
    assert _rss_bytes() - before < 2**25  # not the 512 MiB allocated
    for c in caches:
        assert c.shape == (2, num_blocks, 16, 8, 64) and c.dtype == dtype and c.is_contiguous()
    caches[0][0, 7] = 1.0  # one block written: resident, and only it
    assert (caches[0][0, 7].float() == 1.0).all()
    assert caches[0][:, :7].float().abs().sum() == 0 and caches[1][:, -3:].float().abs().sum() == 0
    assert _rss_bytes() - before < 2**25
