"""The torch paged-attention backend against a naive per-sequence, per-token oracle.

The oracle keeps each request's keys/values as plain lists of vectors (no cache, no blocks) and
computes softmax(q k^T * scale) v one query row at a time, so it shares nothing with the backend
but the maths. Batches mix decodes, fresh prefills and chunks with a cached prefix, under GQA,
MQA and MHA, block sizes 16 and 4, and shuffled (non-contiguous) block tables.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagoda.attention.backend import get_attn_backend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_ref import TorchAttentionBackend


class Layer:
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        self.layer_idx, self.num_heads, self.num_kv_heads = 0, num_heads, num_kv_heads
        self.head_size, self.k_scale, self.v_scale = head_size, 1.0, 1.0


def naive_attention(q_rows, keys, values, num_heads, num_kv_heads, scale):
    """q_rows: list of [H, D] for positions len(keys)-len(q_rows) ..; keys/values: lists of
    [KVH, D] for positions 0..len-1. Returns list of [H, D]."""
    group = num_heads // num_kv_heads
    context = len(keys) - len(q_rows)
    out = []
    for i, q in enumerate(q_rows):
        row = torch.empty_like(q)
        for h in range(num_heads):
            kvh = h // group
            visible = range(context + i + 1)
            scores = [float(q[h] @ keys[j][kvh]) * scale for j in visible]
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = sum(weights)
            acc = torch.zeros_like(q[h])
            for w, j in zip(weights, visible):
                acc += (w / total) * values[j][kvh]
            row[h] = acc
        out.append(row)
    return out


def run_case(seed, block_size, num_heads, num_kv_heads, specs, dtype=torch.float32, layout="nhd"):
    """specs: list of (context_len, query_len) per request, in batch order. layout "hnd": the
    cache is a [2, blocks, block_size, kv_heads, head] view of head-major blocks (CUDA's)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    head_size, num_blocks = 8, 96
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    if layout == "hnd":
        cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_size, dtype=dtype)
        cache = cache.transpose(2, 3)
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered blocks; block 0 is the null block used as padding
    max_blocks = max(-(-(c + n) // block_size) for c, n in specs)
    tables, q_rows, k_rows, v_rows, slots, history = [], [], [], [], [], []
    for context, n in specs:
        nb = -(-(context + n) // block_size)
        table = [free.pop() for _ in range(nb)]
        tables.append(table + [0] * (max_blocks - nb))
        keys = [torch.randn(num_kv_heads, head_size, generator=g) for _ in range(context + n)]
        vals = [torch.randn(num_kv_heads, head_size, generator=g) for _ in range(context + n)]
        for pos in range(context):  # the cached prefix, written as earlier steps would have
            cache[0, table[pos // block_size], pos % block_size] = keys[pos].to(dtype)
            cache[1, table[pos // block_size], pos % block_size] = vals[pos].to(dtype)
        for pos in range(context, context + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            k_rows.append(keys[pos])
            v_rows.append(vals[pos])
            q_rows.append(torch.randn(num_heads, head_size, generator=g))
        history.append((keys, vals))
    md = AttentionMetadata.from_lists(specs, slots, tables)
    scale = head_size**-0.5
    out = TorchAttentionBackend().forward(
        Layer(num_heads, num_kv_heads, head_size),
        torch.stack(q_rows).to(dtype),
        torch.stack(k_rows).to(dtype),
        torch.stack(v_rows).to(dtype),
        cache,
        md,
        scale,
    )
    expected = []
    for b, (keys, vals) in enumerate(history):
        qsl = md.query_start_loc_cpu
        rows = [q.to(dtype).float() for q in q_rows[qsl[b] : qsl[b + 1]]]
        keys = [k.to(dtype).float() for k in keys]
        vals = [v.to(dtype).float() for v in vals]
        expected += naive_attention(rows, keys, vals, num_heads, num_kv_heads, scale)
    # The new k/v landed in the cache at their slots.
    flat = cache.reshape(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[0, torch.tensor(slots)], torch.stack(k_rows).to(dtype))
    assert torch.equal(flat[1, torch.tensor(slots)], torch.stack(v_rows).to(dtype))
    return out.float(), torch.stack(expected)


MIXED = [(37, 1), (5, 1), (0, 1), (0, 19), (21, 6), (16, 16), (3, 1), (0, 2)]


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_mixed_batch_matches_naive_oracle(block_size, heads):
    out, expected = run_case(block_size, block_size, *heads, MIXED)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_batches_match_naive_oracle(seed):
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 40), rng.choice([1, 1, 1, rng.randrange(1, 12)])) for _ in range(7)]
    specs.sort(key=lambda s: s[1] != 1)  # the runner puts decodes first
    rng.shuffle(specs) if seed % 2 else None  # ... but any order must work
    out, expected = run_case(100 + seed, rng.choice([4, 16]), 8, 2, specs)
    assert (out - expected).abs().max().item() < 1e-5


def test_head_major_cache_layout_matches_naive_oracle():
    # The layout CUDA caches take (`pagoda.worker.kv_cache.kv_cache_layout`): same results.
    out, expected = run_case(11, 16, 6, 2, MIXED, layout="hnd")
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cache_writes_land_alike_in_both_layouts(dtype):
    from pagoda.attention.torch_ref import write_kv_cache

    nhd = torch.zeros(2, 6, 4, 3, 8, dtype=dtype)
    hnd = torch.zeros(2, 6, 3, 4, 8, dtype=dtype).transpose(2, 3)
    k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    slots = torch.tensor([0, 5, 23, 9, 14])
    for cache in (nhd, hnd):
        write_kv_cache(cache, k, v, slots, 0.5, 0.25)
    assert torch.equal(nhd.view(torch.uint8), hnd.contiguous().view(torch.uint8))
    assert nhd.float().abs().sum() > 0


def test_bfloat16_cache_stays_close():
    out, expected = run_case(7, 16, 6, 2, MIXED, dtype=torch.bfloat16)
    assert (out - expected).abs().max().item() < 3e-2


def test_padding_rows_and_skipped_slots():
    """Rows past num_actual_tokens come back zero; slot -1 writes nothing."""
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 4, 1, 8)
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    md = AttentionMetadata(
        num_actual_tokens=3,
        slot_mapping=torch.tensor([4, -1, 6, 7]),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        max_query_len=3,
        max_seq_len=3,
    )
    out = TorchAttentionBackend().forward(Layer(2, 1, 8), q, k, v, cache, md, 0.5)
    assert torch.equal(out[3], torch.zeros(2, 8))
    flat = cache.view(2, 16, 1, 8)
    assert torch.equal(flat[0, 4], k[0]) and torch.equal(flat[0, 6], k[2])
    assert torch.equal(flat[0, 5], torch.zeros(1, 8)) and torch.equal(flat[0, 7], torch.zeros(1, 8))


def test_no_cache_attends_within_each_request():
    specs_q = [3, 5]
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    md = AttentionMetadata(
        num_actual_tokens=8,
        slot_mapping=torch.full((8,), -1),
        query_start_loc=torch.tensor([0, 3, 8], dtype=torch.int32),
        seq_lens=torch.tensor(specs_q, dtype=torch.int32),
        block_tables=torch.zeros(2, 1, dtype=torch.int32),
        max_query_len=5,
        max_seq_len=5,
    )
    out = TorchAttentionBackend().forward(Layer(4, 2, 8), q, k, v, None, md, 0.35)
    for lo, hi in ((0, 3), (3, 8)):
        ref = naive_attention(list(q[lo:hi]), list(k[lo:hi]), list(v[lo:hi]), 4, 2, 0.35)
        assert (out[lo:hi] - torch.stack(ref)).abs().max() < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_round_trips_through_scales(cache_dtype):
    torch.manual_seed(0)
    layer = Layer(2, 1, 8)
    layer.k_scale = layer.v_scale = 0.05
    cache = torch.zeros(2, 3, 4, 1, 8, dtype=cache_dtype)
    q, k, v = torch.randn(1, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    md = AttentionMetadata(
        num_actual_tokens=5,
        slot_mapping=torch.tensor([8, 9, 10, 11, 4]),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[2, 1]], dtype=torch.int32),
        max_query_len=5,
        max_seq_len=5,
    )
    TorchAttentionBackend().forward(layer, torch.randn(5, 2, 8), k, v, cache, md, 0.35)
    # A decode row reads the quantized prefix back (stored * scale) ...
    md = AttentionMetadata(
        num_actual_tokens=1,
        slot_mapping=torch.tensor([5]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        block_tables=torch.tensor([[2, 1]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=6,
    )
    k6, v6 = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    out = TorchAttentionBackend().forward(layer, q, k6, v6, cache, md, 0.35)
    keys, vals = list(torch.cat([k, k6])), list(torch.cat([v, v6]))
    ref = torch.stack(naive_attention([q[0]], keys, vals, 2, 1, 0.35))
    # ... so it matches full precision up to the quantization step.
    assert (out - ref).abs().max() < 0.1


def test_registry_picks_torch_on_cpu_and_rejects_unknown_names():
    assert get_attn_backend("cpu").name in ("cpu", "torch")  # torch when the C kernel can't build
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend("cpu", "flash")
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend("cpu", "triton")


def test_decodes_split_into_cache_sized_groups_match_oracle(monkeypatch):
    import pagoda.attention.torch_ref as torch_ref

    # 4 KB per group = 32 tokens of K+V (2 KV heads x 8 dims, float32): groups of 1 to 4 rows.
    monkeypatch.setattr(torch_ref, "_DECODE_GROUP_BYTES", 4096)
    specs = [(c, 1) for c in (3, 40, 7, 7, 1, 25, 12, 0)] + [(9, 5)]
    out, expected = run_case(11, 4, 8, 2, specs)
    assert (out - expected).abs().max().item() < 1e-5
