"""`unified_attention` with a sliding window and logit soft-capping (Mistral, Gemma 2/3) against
the naive oracle: mixed batches with prompts and contexts longer than the window, the split-KV
decode path, and block-table entries before each request's window pointed at a block of NaNs
(blocks the KV cache manager freed): a kernel that read them would return NaN. Float32 under
the Triton interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device, make_paged_batch

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.attention.triton.unified_attention import unified_attention  # noqa: E402

DEV = kernel_device()
ATOL = RTOL = 2e-5


def _poison_blocks_before_windows(batch, window: int) -> None:
    """Point every table entry wholly before a request's first query's window at a NaN block."""
    nan_block = batch.kv_cache.shape[1]  # a block appended to the cache, owned by nobody
    batch.kv_cache = torch.cat(
        (batch.kv_cache, torch.full_like(batch.kv_cache[:, :1], float("nan"))), dim=1
    )
    block_size = batch.kv_cache.shape[2]
    for b, ctx in enumerate(batch.context_lens):
        first = max(0, ctx - window + 1) // block_size
        batch.block_tables[b, :first] = nan_block


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
@pytest.mark.parametrize("split_kv", [False, True])
def test_window_and_soft_cap_match_oracle(window, soft_cap, split_kv) -> None:
    # Decodes inside and far past the window, chunks whose prefix reaches past it, a fresh
    # prompt longer than it.
    query_lens, context_lens = [1, 1, 1, 5, 19, 45], [100, 3, 47, 9, 60, 0]
    if split_kv:
        query_lens, context_lens = [1, 1, 1], [300, 20, 47]
    batch = make_paged_batch(query_lens, context_lens, 8, 2, 64, 16, device=DEV, seed=window)
    scale = 0.5 if soft_cap else 0.125
    ref = batch.reference(scale, sliding_window=window, soft_cap=soft_cap)
    _poison_blocks_before_windows(batch, window)
    out = torch.zeros_like(batch.q)
    unified_attention(
        batch.q, batch.kv_cache, out, batch.metadata(), scale,
        split_kv=split_kv, sliding_window=window, soft_cap=soft_cap,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_cuda_decode_kernel_refuses_a_window() -> None:
    batch = make_paged_batch([1], [10], 8, 2, 64, 16, device=DEV)
    out = torch.zeros_like(batch.q)
    with pytest.raises(ValueError, match="sliding window or soft cap"):
        unified_attention(
            batch.q, batch.kv_cache, out, batch.metadata(), 0.125,
            cuda_decode_kernel=True, sliding_window=4,
        )  # fmt: skip
