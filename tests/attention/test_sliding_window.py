"""Sliding-window attention and logit soft-capping in the torch and C (`"cpu"`) backends,
against a naive oracle that scores one query row at a time.

A query at position p sees keys (p - window, p] (Hugging Face's `sliding_window`); a soft cap
turns each score s into cap * tanh(s / cap) before the softmax (Gemma 2). Batches mix decodes,
fresh prompts longer than the window and chunks with a cached prefix, over shuffled blocks; the
block tables hold the null block (0) where a request's blocks left the window, as the KV cache
manager leaves them, so a backend that read them would see zeros, not the keys.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.attention.cpu.library import load_library
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_ref import TorchAttentionBackend, first_window_block
from pagoda.utils.cpu_build import CpuKernelUnavailable


class Layer:
    def __init__(self, num_heads, num_kv_heads, head_size, window=None, soft_cap=None) -> None:
        self.layer_idx, self.num_heads, self.num_kv_heads = 0, num_heads, num_kv_heads
        self.head_size, self.k_scale, self.v_scale = head_size, 1.0, 1.0
        self.sliding_window, self.logits_soft_cap = window, soft_cap


def make_case(seed, block_size, num_heads, num_kv_heads, head_size, specs, window, dtype):
    """specs: (context_len, query_len) per request. Blocks before a request's window are the
    null block in its table. Returns (q, k, v, cache, md, history)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(blocks_needed) + 4
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    max_blocks = max(blocks_needed)
    tables, qs, ks, vs, slots, history = [], [], [], [], [], []
    for (context, n), nb in zip(specs, blocks_needed):
        table = [free.pop() for _ in range(nb)]
        keys = torch.randn(context + n, num_kv_heads, head_size, generator=g).to(dtype)
        vals = torch.randn(context + n, num_kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(context + n)
        flat_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[0, flat_slots[:context]] = keys[:context]
        flat[1, flat_slots[:context]] = vals[:context]
        slots += flat_slots[context:].tolist()
        # Blocks no query of this step can see are freed by the KV cache manager.
        for i in range(first_window_block(context, window, block_size)):
            table[i] = 0
        tables.append(table + [0] * (max_blocks - nb))
        ks.append(keys[context:])
        vs.append(vals[context:])
        qs.append(torch.randn(n, num_heads, head_size, generator=g).to(dtype))
        history.append((keys.float(), vals.float()))
    md = AttentionMetadata.from_lists(specs, slots, tables)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, md, history


def naive_attention(q, md, history, num_heads, num_kv_heads, scale, window, soft_cap):
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl = md.query_start_loc_cpu
    for b, (keys, vals) in enumerate(history):
        query_len = qsl[b + 1] - qsl[b]
        for i in range(query_len):
            pos = keys.shape[0] - query_len + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(num_heads):
                kv = h // group
                scores = keys[lo : pos + 1, kv] @ q[qsl[b] + i, h].float() * scale
                if soft_cap:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                out[qsl[b] + i, h] = torch.softmax(scores, 0) @ vals[lo : pos + 1, kv]
    return out


# Decodes (inside, at and past the window), a fresh prompt longer than the window, chunks whose
# prefix reaches past the window, a one-row chunk after a long prefix.
MIXED = [(37, 1), (3, 1), (0, 1), (200, 1), (16, 1), (0, 45), (21, 6), (50, 33), (90, 2)]


def _backends():
    params = [pytest.param("torch")]
    try:
        load_library()
        params.append(pytest.param("cpu"))
    except CpuKernelUnavailable:
        params.append(pytest.param("cpu", marks=pytest.mark.skip(reason="no CPU kernel")))
    return params


def _backend(name):
    if name == "torch":
        return TorchAttentionBackend()
    from pagoda.attention.cpu.backend import CpuAttentionBackend

    return CpuAttentionBackend()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", [1, 5, 16, 40, None])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("block_size,heads,head_size", [(16, (8, 2), 64), (4, (6, 2), 40)])
def test_window_and_soft_cap_match_oracle(backend, window, soft_cap, block_size, heads, head_size):
    q, k, v, cache, md, history = make_case(
        window or 0, block_size, *heads, head_size, MIXED, window, torch.float32
    )
    layer = Layer(*heads, head_size, window, soft_cap)
    # Scores of magnitude ~10: the cap of 2 changes them a lot.
    scale = 10 * head_size**-0.5 if soft_cap else head_size**-0.5
    out = _backend(backend).forward(layer, q, k, v, cache, md, scale)
    ref = naive_attention(q, md, history, *heads, scale, window, soft_cap)
    assert (out - ref).abs().max().item() < 5e-5


@pytest.mark.parametrize("window", [5, 40])
def test_cpu_kernel_window_and_soft_cap_at_each_isa(window, cpu_isa):
    try:
        load_library()
    except CpuKernelUnavailable as e:
        pytest.skip(f"CPU kernel unavailable: {e}")
    for dtype, tol in ((torch.float32, 5e-5), (torch.bfloat16, 3e-2)):
        for head_size in (64, 128, 40):
            q, k, v, cache, md, history = make_case(
                head_size, 16, 8, 2, head_size, MIXED, window, dtype
            )
            layer = Layer(8, 2, head_size, window, 3.0)
            out = _backend("cpu").forward(layer, q, k, v, cache, md, 4 * head_size**-0.5)
            ref = naive_attention(q, md, history, 8, 2, 4 * head_size**-0.5, window, 3.0)
            assert (out.float() - ref).abs().max().item() < tol, (dtype, head_size)
