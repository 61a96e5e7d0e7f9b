"""`unified_attention` (and its split-KV decode path) against a naive per-request oracle on
random paged batches: decodes and prefill chunks with cached prefixes of varied lengths in one
batch, random non-contiguous block tables, GQA 4:1 / 3:1, MHA and MQA, block sizes 16 and 32.
Float32 under the Triton interpreter without a GPU (float32 on the GPU otherwise)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device, make_paged_batch

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.attention.triton.unified_attention import (  # noqa: E402
    unified_attention,
    use_split_kv,
)

DEV = kernel_device()
ATOL = RTOL = 2e-5

# (query_lens, context_lens): decodes first, then chunks with cached prefixes (one shorter
# than a block, one spanning blocks), then a fresh prompt.
MIXED = ([1, 1, 1, 5, 19, 12], [30, 1, 47, 9, 20, 0])
# Decodes only: the decode tile shapes (a longer one over a quantized cache), contexts past it.
DECODES = ([1, 1, 1, 1], [300, 1, 129, 64])


def _run(batch, scale, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, batch.metadata(), scale, **kwargs)
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [
        (8, 2, 64, 16),  # GQA 4:1
        (4, 4, 32, 16),  # MHA
        (4, 1, 64, 32),  # MQA, block 32
        (6, 2, 80, 16),  # GQA 3:1 (BLOCK_M not a multiple of G), head padded to 128
    ],
)
def test_mixed_batch_matches_oracle(num_heads, num_kv_heads, head_size, block_size) -> None:
    batch = make_paged_batch(*MIXED, num_heads, num_kv_heads, head_size, block_size, device=DEV)
    scale = head_size**-0.5
    torch.testing.assert_close(_run(batch, scale), batch.reference(scale), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_segments", [4, 16])
def test_split_kv_decode_matches_unsplit_and_oracle(num_segments: int) -> None:
    # Long decodes (many tiles per segment) next to a short one (more segments than tiles).
    batch = make_paged_batch([1, 1, 1], [300, 129, 6], 8, 2, 64, 16, device=DEV, seed=1)
    split = _run(batch, 0.125, split_kv=True, num_segments=num_segments)
    unsplit = _run(batch, 0.125, split_kv=False)
    torch.testing.assert_close(split, unsplit, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(split, batch.reference(0.125), atol=ATOL, rtol=RTOL)


def test_split_kv_is_exact_on_mixed_batches_too() -> None:
    # The split path is chosen for pure decode steps, but is correct for any batch (causal
    # rows whose keys end before a segment write an empty partial).
    batch = make_paged_batch(*MIXED, 4, 2, 32, 16, device=DEV, seed=2)
    out = _run(batch, 0.2, split_kv=True, num_segments=4)
    torch.testing.assert_close(out, batch.reference(0.2), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_m,tile_size", [(64, 16), (16, 64), (32, 32)])
def test_tile_shapes_do_not_change_results(block_m: int, tile_size: int) -> None:
    batch = make_paged_batch([1, 7, 33], [40, 17, 3], 8, 2, 32, 16, device=DEV, seed=3)
    out = _run(batch, 0.2, block_m=block_m, tile_size=tile_size)
    torch.testing.assert_close(out, batch.reference(0.2), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("split_kv", [False, True])
def test_grid_order_does_not_change_results(split_kv: bool) -> None:
    # KV heads fastest in the grid (the programs of one q block side by side) or q blocks
    # fastest: each program computes the same rows either way.
    batch = make_paged_batch(*MIXED, 8, 2, 32, 16, device=DEV, seed=5)
    heads = _run(batch, 0.2, heads_fastest=True, split_kv=split_kv, num_segments=4)
    reqs = _run(batch, 0.2, heads_fastest=False, split_kv=split_kv, num_segments=4)
    torch.testing.assert_close(heads, reqs, atol=0, rtol=0)
    torch.testing.assert_close(heads, batch.reference(0.2), atol=ATOL, rtol=RTOL)


def test_rows_past_num_actual_tokens_are_untouched() -> None:
    batch = make_paged_batch([1, 6], [10, 4], 4, 2, 32, 16, device=DEV, seed=4)
    pad = torch.zeros(3, 4, 32, device=DEV)
    batch.q = torch.cat([batch.q, pad])  # CUDA-graph style padding rows after the real ones
    out = torch.full_like(batch.q, 7.0)
    unified_attention(batch.q, batch.kv_cache, out, batch.metadata(num_actual_tokens=7), 0.2)
    assert torch.all(out[7:] == 7.0)
    batch.q = batch.q[:7]
    torch.testing.assert_close(out[:7], batch.reference(0.2), atol=ATOL, rtol=RTOL)


def test_empty_requests_in_batch_are_skipped() -> None:
    # Padded requests with no query rows (a captured graph's spare slots) produce nothing and
    # do not shift the other requests' rows.
    batch = make_paged_batch([1, 1, 4], [20, 9, 5], 4, 1, 32, 16, device=DEV, seed=5)
    ref = batch.reference(0.2)
    md = batch.metadata()
    md.query_start_loc = torch.tensor([0, 1, 1, 2, 6, 6], dtype=torch.int32, device=DEV)
    md.seq_lens = torch.tensor([21, 0, 10, 9, 0], dtype=torch.int32, device=DEV)
    bt = batch.block_tables
    zeros = torch.zeros_like(bt[:1])
    md.block_tables = torch.cat([bt[:1], zeros, bt[1:], zeros])
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, md, 0.2, split_kv=False)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    out.fill_(float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, md, 0.2, split_kv=True, num_segments=4)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "cache_dtype,k_scale,v_scale",
    [(torch.float8_e4m3fn, 0.05, 0.02), (torch.float8_e5m2, 0.5, 0.25), (torch.int8, 0.03, 0.02)],
)
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_quantized_cache_is_dequantized_with_layer_scales(
    cache_dtype, k_scale, v_scale, lens
) -> None:
    batch = make_paged_batch(*lens, 8, 2, 32, 16, device=DEV, seed=6)
    if cache_dtype == torch.int8:
        batch.kv_cache = (batch.kv_cache * 40).round().clamp(-128, 127).to(cache_dtype)
    else:
        batch.kv_cache = (batch.kv_cache * 8).to(cache_dtype)
    ref = batch.reference(0.2, k_scale, v_scale)
    for split in (False, True):
        out = _run(batch, 0.2, k_scale=k_scale, v_scale=v_scale, split_kv=split, num_segments=4)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_quantized_cache_without_scales_is_rejected() -> None:
    batch = make_paged_batch([1], [3], 4, 2, 32, 16, device=DEV)
    batch.kv_cache = batch.kv_cache.to(torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        _run(batch, 0.2)


def test_head_mismatch_is_rejected() -> None:
    batch = make_paged_batch([1], [3], 6, 4, 32, 16, device=DEV)
    with pytest.raises(ValueError, match="num_kv_heads"):
        _run(batch, 0.2)


def test_split_kv_is_picked_for_small_decode_batches_only() -> None:
    assert use_split_kv(num_reqs=4, num_kv_heads=8, max_query_len=1)
    assert not use_split_kv(num_reqs=64, num_kv_heads=8, max_query_len=1)
    assert not use_split_kv(num_reqs=4, num_kv_heads=8, max_query_len=16)
