"""`reshape_and_cache` (slots, skips, FP8/INT8 quantization) and `TritonAttentionBackend`
against the torch reference backend on whole steps (write + attend), under the Triton
interpreter in float32 without a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_testing import (
    enable_interpreter_without_cuda,
    kernel_device,
    make_paged_batch,
    ref_reshape_and_cache,
)

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from pagoda.attention.triton.backend import TritonAttentionBackend  # noqa: E402
from pagoda.attention.triton.reshape_and_cache import reshape_and_cache  # noqa: E402

DEV = kernel_device()
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _new_kv(num_tokens: int, num_kv_heads: int, head_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEV)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEV)
    return k, v


def test_writes_each_token_to_its_slot_and_skips_padding() -> None:
    batch = make_paged_batch([1, 4, 3], [9, 16, 0], 4, 2, 32, 16, device=DEV)
    k, v = _new_kv(8, 2, 32)
    slots = batch.slot_mapping.clone()
    slots[2] = -1  # a padding token: must leave the cache alone
    cache, expected = batch.kv_cache.clone(), batch.kv_cache.clone()
    reshape_and_cache(k, v, cache, slots)
    ref_reshape_and_cache(k, v, expected, slots)
    assert torch.equal(cache, expected)
    assert not torch.equal(cache, batch.kv_cache)
    blk, off = divmod(int(batch.slot_mapping[2]), 16)
    assert torch.equal(cache[:, blk, off], batch.kv_cache[:, blk, off])


def test_writes_from_strided_qkv_views() -> None:
    batch = make_paged_batch([5], [3], 4, 2, 64, 16, device=DEV)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, device=DEV)
    k = qkv[:, 256:384].view(5, 2, 64)
    v = qkv[:, 384:].view(5, 2, 64)
    cache, expected = batch.kv_cache.clone(), batch.kv_cache.clone()
    reshape_and_cache(k, v, cache, batch.slot_mapping)
    ref_reshape_and_cache(k.contiguous(), v.contiguous(), expected, batch.slot_mapping)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("cache_dtype", [*FP8, torch.int8])
def test_quantized_write_matches_reference(cache_dtype: torch.dtype) -> None:
    batch = make_paged_batch([2, 6], [3, 12], 4, 2, 32, 16, device=DEV, seed=1)
    k, v = _new_kv(8, 2, 32, seed=1)
    k_scale, v_scale = (0.125, 0.25) if cache_dtype in FP8 else (0.03, 0.02)
    if cache_dtype in FP8:
        # Values on the FP8 grid: the interpreter's float->fp8 rounding is not IEEE
        # round-to-nearest-even, so only exact conversions are compared here (the GPU test
        # covers rounding).
        k = (k / k_scale).to(cache_dtype).float() * k_scale
        v = (v / v_scale).to(cache_dtype).float() * v_scale
    cache = torch.zeros(batch.kv_cache.shape, dtype=cache_dtype, device=DEV)
    expected = cache.clone()
    reshape_and_cache(k, v, cache, batch.slot_mapping, k_scale, v_scale)
    ref_reshape_and_cache(k, v, expected, batch.slot_mapping, k_scale, v_scale)
    assert torch.equal(_bits(cache), _bits(expected))


def test_int8_write_rounds_half_to_even_and_saturates() -> None:
    x = torch.tensor([2.5, 3.5, -2.5, -0.5, 1.49, 300.0, -300.0, 127.5], device=DEV)
    k = x.view(8, 1, 1).expand(8, 1, 16).contiguous()
    cache = torch.zeros(2, 1, 8, 1, 16, dtype=torch.int8, device=DEV)
    reshape_and_cache(k, k, cache, torch.arange(8, device=DEV), 1.0, 1.0)
    assert cache[0, 0, :, 0, 0].tolist() == [2, 4, -2, 0, 1, 127, -128, 127]


def test_fp8_write_saturates_instead_of_overflowing() -> None:
    k = torch.tensor([1000.0, -1000.0, 448.0, 1.0], device=DEV).view(4, 1, 1).expand(4, 1, 16)
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=torch.float8_e4m3fn, device=DEV)
    reshape_and_cache(k.contiguous(), k.contiguous(), cache, torch.arange(4, device=DEV), 1.0, 1.0)
    assert cache[0, 0, :, 0, 0].float().tolist() == [448.0, -448.0, 448.0, 1.0]


def test_quantized_write_without_scales_is_rejected() -> None:
    cache = torch.zeros(2, 1, 16, 1, 16, dtype=torch.int8, device=DEV)
    k = torch.zeros(1, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(k, k, cache, torch.zeros(1, dtype=torch.int64, device=DEV))


def test_mismatched_cache_shape_is_rejected() -> None:
    cache = torch.zeros(2, 1, 16, 2, 16, device=DEV)
    k = torch.zeros(1, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="num_kv_heads"):
        reshape_and_cache(k, k, cache, torch.zeros(1, dtype=torch.int64, device=DEV))


def _layer(num_heads: int, num_kv_heads: int, head_size: int, k_scale=1.0, v_scale=1.0):
    return types.SimpleNamespace(
        layer_idx=0,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _step(cache_dtype: torch.dtype):
    # A whole step: decodes, a chunk with a cached prefix, a fresh prompt, two padding rows.
    batch = make_paged_batch([1, 1, 6, 9], [20, 33, 16, 0], 8, 2, 32, 16, device=DEV, seed=2)
    num_actual = sum(batch.query_lens)
    k, v = _new_kv(num_actual + 2, 2, 32, seed=3)
    q = torch.cat([batch.q, torch.randn(2, 8, 32, device=DEV)])
    md = batch.metadata(num_actual_tokens=num_actual)
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((2,), -1, device=DEV)])
    if cache_dtype == torch.int8:
        batch.kv_cache = (batch.kv_cache * 40).round().clamp(-128, 127).to(torch.int8)
    return batch, q, k, v, md


def test_backend_step_matches_torch_reference() -> None:
    batch, q, k, v, md = _step(torch.float32)
    layer = _layer(8, 2, 32)
    cache_tri, cache_ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    out = TritonAttentionBackend().forward(layer, q, k, v, cache_tri, md, 0.2)
    ref = TorchAttentionBackend().forward(layer, q, k, v, cache_ref, md, 0.2)
    assert torch.equal(cache_tri, cache_ref)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert torch.all(out[md.num_actual_tokens :] == 0)


def test_backend_step_with_int8_cache_reads_every_key_from_the_cache() -> None:
    # Unlike the torch reference (whose fresh prompts attend to their unquantized k/v), the
    # kernel reads all keys, this step's included, back from the quantized cache, as vLLM's
    # backends do: compare with the oracle over the written cache; the cache bytes must match
    # the torch reference's exactly.
    batch, q, k, v, md = _step(torch.int8)
    layer = _layer(8, 2, 32, k_scale=0.03, v_scale=0.025)
    cache_ref = batch.kv_cache.clone()
    TorchAttentionBackend().forward(layer, q, k, v, cache_ref, md, 0.2)
    out = TritonAttentionBackend().forward(layer, q, k, v, batch.kv_cache, md, 0.2)
    assert torch.equal(batch.kv_cache, cache_ref)
    batch.q = q[: md.num_actual_tokens]
    oracle = batch.reference(0.2, k_scale=0.03, v_scale=0.025)
    torch.testing.assert_close(out[: md.num_actual_tokens], oracle, atol=2e-5, rtol=1e-5)
    assert torch.all(out[md.num_actual_tokens :] == 0)


def test_backend_without_cache_attends_within_each_request() -> None:
    # Memory-profiling runs pass no cache: fresh prompts attend causally to their own rows.
    batch = make_paged_batch([3, 7, 1], [0, 0, 0], 4, 2, 32, 16, device=DEV, seed=4)
    k, v = _new_kv(11, 2, 32, seed=4)
    md = batch.metadata()
    layer = _layer(4, 2, 32)
    out = TritonAttentionBackend().forward(layer, batch.q, k, v, None, md, 0.3)
    ref = TorchAttentionBackend().forward(layer, batch.q, k, v, None, md, 0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
