"""The C paged-attention kernel (`"cpu"` backend) against the torch backend and a naive loop.

Batches mix decodes of various context lengths, fresh prompts and chunks with a cached prefix,
over shuffled (non-contiguous) block tables, block sizes 16 and 32 (and odd ones), GQA 3:1 and
4:1, MHA and MQA, head sizes 64 and 128 (and odd ones that take the kernel's generic path).
float32 must match tightly; bfloat16 and float16 within their rounding.
"""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from pagoda.attention.backend import get_attn_backend
from pagoda.attention.cpu.library import CACHE_DTYPE_CODES, load_library
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_ref import TorchAttentionBackend
from pagoda.utils.cpu_build import CpuKernelUnavailable

try:
    load_library()
except CpuKernelUnavailable as e:  # no compiler on this machine: nothing here can run
    pytest.skip(f"CPU kernel unavailable: {e}", allow_module_level=True)

from pagoda.attention.cpu.backend import CpuAttentionBackend, build_items  # noqa: E402


class Layer:
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        self.layer_idx, self.num_heads, self.num_kv_heads = 0, num_heads, num_kv_heads
        self.head_size, self.k_scale, self.v_scale = head_size, 1.0, 1.0


def make_case(seed, block_size, num_heads, num_kv_heads, head_size, specs, dtype, cache_dtype=None):
    """specs: (context_len, query_len) per request. Returns (q, k, v, cache, md, history) where
    history[b] = (keys, values) of request b for positions 0 .. seq_len - 1 (float32, as the
    cache holds them: rounded to `cache_dtype`, default `dtype`)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(blocks_needed) + 8
    cache_dtype = cache_dtype or dtype
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered blocks; block 0 is the null block used as padding
    max_blocks = max(blocks_needed)
    tables, qs, ks, vs, slots, history = [], [], [], [], [], []
    for (context, n), nb in zip(specs, blocks_needed):
        table = [free.pop() for _ in range(nb)]
        tables.append(table + [0] * (max_blocks - nb))
        keys = torch.randn(context + n, num_kv_heads, head_size, generator=g).to(dtype)
        vals = torch.randn(context + n, num_kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(context + n)
        flat_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[0, flat_slots[:context]] = keys[:context].to(cache_dtype)  # earlier steps' prefix
        flat[1, flat_slots[:context]] = vals[:context].to(cache_dtype)
        slots += flat_slots[context:].tolist()
        ks.append(keys[context:])
        vs.append(vals[context:])
        qs.append(torch.randn(n, num_heads, head_size, generator=g).to(dtype))
        history.append((keys.to(cache_dtype).float(), vals.to(cache_dtype).float()))
    md = AttentionMetadata.from_lists(specs, slots, tables)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, md, history


def naive_attention(q, md, history, num_heads, num_kv_heads, scale):
    """One query row and head at a time: softmax(q . K[:pos + 1] * scale) V[:pos + 1]."""
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl = md.query_start_loc_cpu
    for b, (keys, vals) in enumerate(history):
        query_len = qsl[b + 1] - qsl[b]
        for i in range(query_len):
            pos = keys.shape[0] - query_len + i
            for h in range(num_heads):
                kv = h // group
                scores = keys[: pos + 1, kv] @ q[qsl[b] + i, h].float() * scale
                out[qsl[b] + i, h] = torch.softmax(scores, 0) @ vals[: pos + 1, kv]
    return out


def run_both(seed, block_size, heads, head_size, specs, dtype=torch.float32, cache_dtype=None):
    num_heads, num_kv_heads = heads
    q, k, v, cache, md, history = make_case(
        seed, block_size, num_heads, num_kv_heads, head_size, specs, dtype, cache_dtype
    )
    layer, scale = Layer(num_heads, num_kv_heads, head_size), head_size**-0.5
    ref_cache = cache.clone()
    out = CpuAttentionBackend().forward(layer, q, k, v, cache, md, scale)
    md.extra = None
    ref = TorchAttentionBackend().forward(layer, q, k, v, ref_cache, md, scale)
    assert torch.equal(cache, ref_cache)  # the new rows landed at the same slots
    assert out.dtype == dtype and out.shape == q.shape
    return out.float(), ref.float(), naive_attention(q, md, history, *heads, scale)


MIXED = [(37, 1), (5, 1), (0, 1), (300, 1), (16, 1), (0, 19), (21, 6), (16, 16), (40, 33)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "heads", [(9, 3), (8, 2), (4, 4), (4, 1)], ids=["gqa3", "gqa4", "mha", "mqa"]
)
@pytest.mark.parametrize("head_size", [64, 128])
def test_float32_mixed_batch_matches_oracles(block_size, heads, head_size, cpu_isa):
    out, ref, naive = run_both(block_size + head_size, block_size, heads, head_size, MIXED)
    assert (out - naive).abs().max().item() < 2e-5
    assert (out - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("seed", range(6))
def test_random_decode_batches_match_torch_backend(seed, cpu_isa):
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 400), 1) for _ in range(rng.randrange(1, 40))]
    specs += [(rng.randrange(0, 50), rng.randrange(1, 20)) for _ in range(seed % 3)]
    heads = rng.choice([(9, 3), (8, 2), (6, 6), (5, 1)])
    head_size = rng.choice([64, 128])
    out, ref, _ = run_both(seed, rng.choice([16, 32]), heads, head_size, specs)
    assert (out - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)], ids=["gqa3", "gqa4"])
@pytest.mark.parametrize("head_size", [64, 96, 128, 40])  # 96: generic bf16dp; 40: generic
def test_half_precision_stays_close(dtype, heads, head_size, cpu_isa):
    out, ref, naive = run_both(3, 16, heads, head_size, MIXED, dtype)
    # One rounding of the output (2^-8 relative for bf16) on values of magnitude <~ 1.
    assert (out - naive).abs().max().item() < 2e-2
    assert (out - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1)], ids=["gqa3", "mqa"])
@pytest.mark.parametrize("head_size", [64, 128, 40])  # 40: the generic tile
def test_float32_over_a_16_bit_cache_widens_exactly(cache_dtype, heads, head_size, cpu_isa):
    """A float32 model over a 16-bit cache: the new rows are rounded as torch rounds them, and
    the kernel widens the cached keys and values exactly, so against the naive loop fed the
    same rounded history only float32 arithmetic differs. (The torch backend attends a fresh
    prompt over its unrounded rows: it differs by the cache's rounding there.)"""
    out, ref, naive = run_both(
        head_size, 16, heads, head_size, MIXED, torch.float32, cache_dtype=cache_dtype
    )
    assert out.dtype == torch.float32
    assert (out - naive).abs().max().item() < 2e-5
    assert (out - ref).abs().max().item() < 3e-2


def _fp8_case(q_dtype, k_scale, v_scale, head_size=64, heads=(9, 3)):
    """MIXED over an fp8 e5m2 cache holding k / k_scale, v / v_scale (written as the torch
    backend writes: saturated, rounded to nearest even); history as the cache holds it."""
    from pagoda.attention.torch_ref import write_kv_cache

    num_heads, num_kv_heads = heads
    q, k, v, cache32, md, history = make_case(
        5, 16, num_heads, num_kv_heads, head_size, MIXED, q_dtype, torch.float32
    )
    cache = torch.zeros(cache32.shape, dtype=torch.float8_e5m2)
    flat32 = cache32.view(2, -1, num_kv_heads, head_size)
    written = (flat32[0].abs().sum((1, 2)) > 0).nonzero().squeeze(1)  # the prefix's slots
    write_kv_cache(cache, flat32[0, written], flat32[1, written], written, k_scale, v_scale)
    layer = Layer(num_heads, num_kv_heads, head_size)
    layer.k_scale, layer.v_scale = k_scale, v_scale

    def as_cached(x, s):
        return (x / s).clamp(-57344, 57344).to(torch.float8_e5m2).float() * s

    history = [(as_cached(kk, k_scale), as_cached(vv, v_scale)) for kk, vv in history]
    return q, k, v, cache, md, history, layer


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 3.0)])
def test_fp8_e5m2_cache_is_read_exactly(q_dtype, scales, cpu_isa):
    """An fp8 e5m2 cache (`--kv-cache-dtype fp8_e5m2`): the kernel widens each byte exactly and
    applies the scales (k_scale folded into q, v_scale into the output), so against the naive
    loop over the same stored values only float32 arithmetic (and the output's rounding)
    differs, and so against the torch backend reading the same cache."""
    q, k, v, cache, md, history, layer = _fp8_case(q_dtype, *scales)
    ref_cache = cache.clone()
    scale = 64**-0.5
    out = CpuAttentionBackend().forward(layer, q, k, v, cache, md, scale).float()
    md.extra = None
    ref = TorchAttentionBackend().forward(layer, q, k, v, ref_cache, md, scale).float()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    naive = naive_attention(q, md, history, 9, 3, scale)
    tol = 2e-5 if q_dtype == torch.float32 else 2e-2
    assert (out - naive).abs().max().item() < tol * max(1.0, scales[1])
    # The torch backend attends a fresh prompt over its unrounded rows: compare the others.
    cached = torch.cat([torch.full((n,), ctx > 0) for ctx, n in MIXED])
    assert (out - ref)[cached].abs().max().item() < tol * max(1.0, scales[1])


def test_a_16_bit_q_over_a_float32_cache_goes_to_torch():
    q, k, v, cache, md, _ = make_case(0, 16, 4, 2, 64, [(5, 1)], torch.bfloat16, torch.float32)
    out = CpuAttentionBackend().forward(Layer(4, 2, 64), q, k, v, cache, md, 0.125)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [192, 40])  # 40: a tail no vector covers
def test_write_kv_rounds_as_torch_does(cache_dtype, width, cpu_isa):
    """pagoda_write_kv (the decoder stack's cache write) against torch's conversion, bit for
    bit, on values that round both ways, ties, tiny and huge ones and infinities."""
    lib = load_library()
    g = torch.Generator().manual_seed(width)
    rows = 7
    src = torch.randn(rows, 3 * width, generator=g) * torch.logspace(-9, 6, 3 * width)
    src[0, :5] = torch.tensor([float("inf"), -float("inf"), 1 + 2**-8, 1 + 3 * 2**-8, 65520.0])
    src[1, :4] = torch.tensor([2**-24, 2**-25, 3 * 2**-26, -0.0])
    k, v = src[:, width : 2 * width], src[:, 2 * width :]  # rows 3 * width apart, like qkv
    cache = torch.full((2, 16, width), 7.0, dtype=cache_dtype)
    slots = torch.tensor([3, -1, 0, 15, 8, -1, 9], dtype=torch.int64)
    rc = lib.pagoda_write_kv(
        k.data_ptr(), v.data_ptr(), 3 * width, 0, cache[0].data_ptr(), cache[1].data_ptr(),
        CACHE_DTYPE_CODES[cache_dtype],
        slots.data_ptr(), rows, width, 1.0, 1.0,
    )  # fmt: skip
    assert rc == 0
    expected = torch.full_like(cache, 7.0)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot], expected[1, slot] = k[t].to(cache_dtype), v[t].to(cache_dtype)
    assert torch.equal(
        cache.view(torch.int16 if cache_dtype.itemsize == 2 else torch.int32),
        expected.view(torch.int16 if cache_dtype.itemsize == 2 else torch.int32),
    )


def test_write_kv_rejects_a_narrower_source_than_the_cache():
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 8)
    slots = torch.zeros(1, dtype=torch.int64)
    args = (x.data_ptr(), x.data_ptr(), 8, 1, cache[0].data_ptr(), cache[1].data_ptr(), 0)
    assert load_library().pagoda_write_kv(*args, slots.data_ptr(), 1, 8, 1.0, 1.0) == -1


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 5.0)])
def test_write_kv_to_fp8_e5m2_rounds_and_saturates_as_torch_does(scales, cpu_isa):
    """The e5m2 cache write (decoder stack) against the torch backend's write, bit for bit:
    x / scale saturated to +-57344, round to nearest even, subnormals and ties included."""
    from pagoda.attention.torch_ref import write_kv_cache

    lib = load_library()
    width, rows = 200, 6
    g = torch.Generator().manual_seed(1)
    src = torch.randn(rows, 2 * width, generator=g) * torch.logspace(-9, 6, 2 * width)
    src[0, :6] = torch.tensor([1e9, -1e9, float("inf"), 2**-16, 3 * 2**-17, 1.125])
    src[1, :4] = torch.tensor([1.375, 1.625, -0.0, 2**-20])  # ties to even, tiny
    k, v = src[:, :width], src[:, width:]
    slots = torch.tensor([3, -1, 0, 9, 4, 7], dtype=torch.int64)
    cache = torch.zeros(2, 16, 1, 1, width, dtype=torch.float8_e5m2)
    rc = lib.pagoda_write_kv(
        k.data_ptr(), v.data_ptr(), 2 * width, 0, cache[0].data_ptr(), cache[1].data_ptr(), 3,
        slots.data_ptr(), rows, width, *scales,
    )  # fmt: skip
    assert rc == 0
    ref = torch.zeros_like(cache)
    keep = slots >= 0
    write_kv_cache(
        ref, k[keep].view(-1, 1, width), v[keep].view(-1, 1, width), slots[keep], *scales
    )
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("head_size", [8, 40, 80])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_generic_head_and_block_sizes(head_size, block_size, cpu_isa):
    out, _, naive = run_both(head_size, block_size, (6, 2), head_size, MIXED[:6])
    assert (out - naive).abs().max().item() < 2e-5


def test_padding_rows_are_zero_and_skipped_slots_unwritten():
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 4, 1, 64)
    q, k, v = torch.randn(4, 2, 64), torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    cache[0, 1, :2], cache[1, 1, :2] = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    md = AttentionMetadata(
        num_actual_tokens=2,
        slot_mapping=torch.tensor([6, -1, 9, 9]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([3, 1], dtype=torch.int32),
        block_tables=torch.tensor([[1], [2]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=3,
    )
    expected_cache = cache.clone()
    expected_cache[0, 1, 2], expected_cache[1, 1, 2] = k[0], v[0]
    out = CpuAttentionBackend().forward(Layer(2, 1, 64), q, k, v, cache, md, 0.125)
    assert torch.equal(out[2:], torch.zeros(2, 2, 64))
    assert torch.equal(cache, expected_cache)  # slot -1 (row 1) wrote nothing
    keys, vals = cache[0, 1, :3, 0], cache[1, 1, :3, 0]
    for h in range(2):
        expected = torch.softmax(keys @ q[0, h] * 0.125, 0) @ vals
        assert (out[0, h] - expected).abs().max() < 1e-5


def test_fresh_prompt_with_unwritten_rows_attends_to_its_own_rows():
    """A slot of -1 means "not cached": a fresh prompt then reads its k/v from this step."""
    q, k, v, cache, md, history = make_case(9, 16, 8, 2, 64, [(20, 1), (0, 7)], torch.float32)
    md.slot_mapping[3] = -1  # a row of the fresh prompt that is not written
    out = CpuAttentionBackend().forward(Layer(8, 2, 64), q, k, v, cache, md, 0.125)
    assert md.extra["cpu_plan"].fresh == [(1, 8)]
    assert (out - naive_attention(q, md, history, 8, 2, 0.125)).abs().max().item() < 2e-5
    slot = int(md.block_tables[1, 0]) * 16 + 2
    assert torch.equal(cache.view(2, -1, 2, 64)[:, slot], torch.zeros(2, 2, 64))


def test_strided_query_view_is_read_in_place(cpu_isa):
    """q as the model makes it: a column slice of the fused qkv projection."""
    q, k, v, cache, md, history = make_case(5, 16, 9, 3, 64, MIXED, torch.float32)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view = qkv[:, : 9 * 64].view(-1, 9, 64)
    assert not q_view.is_contiguous()
    out = CpuAttentionBackend().forward(Layer(9, 3, 64), q_view, k, v, cache, md, 0.125)
    assert (out - naive_attention(q, md, history, 9, 3, 0.125)).abs().max().item() < 2e-5


def test_no_cache_and_quantized_cache_fall_back_to_torch():
    q, k, v = torch.randn(5, 4, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    md = AttentionMetadata(
        num_actual_tokens=5,
        slot_mapping=torch.full((5,), -1),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=5,
        max_seq_len=5,
    )
    out = CpuAttentionBackend().forward(Layer(4, 2, 64), q, k, v, None, md, 0.125)
    md.extra = None
    ref = TorchAttentionBackend().forward(Layer(4, 2, 64), q, k, v, None, md, 0.125)
    assert torch.allclose(out, ref, atol=1e-6)


def test_items_split_heads_only_when_requests_are_few():
    # 9 decodes of 50 tokens, a 4-row chunk over a 16-token prefix, a fresh 3-token prompt.
    qsl, seq_lens = list(range(10)) + [13, 16], [50] * 9 + [20, 3]
    items, fresh = build_items(qsl, seq_lens, num_kv_heads=3, group=3, threads=2)
    assert fresh == []  # fresh prompts go to the kernel too ...
    assert sorted(it for it in items if it[0] == 10) == [(10, h, h + 1, 13, 16) for h in range(3)]
    decodes = [it for it in items if it[4] - it[3] == 1]
    assert sorted(decodes) == [(b, 0, 3, b, b + 1) for b in range(9)]  # 9 >= 4 x 2 threads
    assert sorted(it for it in items if it[0] == 9) == [(9, h, h + 1, 9, 13) for h in range(3)]
    assert items[0][:3] == (0, 0, 3)  # the costliest (whole decodes) go first
    items, _ = build_items(qsl, seq_lens, num_kv_heads=3, group=3, threads=4)
    assert sum(1 for it in items if it[4] - it[3] == 1) == 27  # too few for 4 threads: split
    _, fresh = build_items(qsl, seq_lens, num_kv_heads=3, group=3, threads=2, fresh_to_sdpa=True)
    assert fresh == [(13, 16)]  # ... unless some rows were not written to the cache


def test_registry_picks_cpu_kernel_by_default_on_cpu():
    assert get_attn_backend("cpu").name == "cpu"
    assert get_attn_backend("cpu", "torch").name == "torch"


def test_registry_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch, caplog):
    import pagoda.attention.cpu.backend as cpu_backend
    from pagoda.utils import cpu_build as build

    def no_compiler():
        raise CpuKernelUnavailable("no C compiler found (set $CC or install gcc)")

    monkeypatch.setattr(cpu_backend, "load_library", no_compiler)
    monkeypatch.setattr(build, "_said", set())  # nothing logged yet in this process
    # The "pagoda" logger stops propagation once set up; let caplog (on the root) see it.
    monkeypatch.setattr(logging.getLogger("pagoda"), "propagate", True)
    with caplog.at_level("WARNING"):
        assert get_attn_backend("cpu").name == "torch"
    assert "CPU kernels unavailable (no C compiler found" in caplog.text
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CpuKernelUnavailable, match="no C compiler"):
        build._find_compiler()


def test_cpu_backend_needs_a_cpu_device():
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        get_attn_backend("cuda", "cpu")


@pytest.mark.slow
def test_concurrent_first_builds_leave_one_library(tmp_path):
    """Two processes building into an empty cache at once: both load, each library (the
    attention kernel and the thread pool it links) is built once, and no temp file is left
    (only the `flock` files beside the libraries, which stay: removing one races a waiter)."""
    import subprocess
    import sys

    code = "from pagoda.attention.cpu.library import load_library; load_library()"
    env = {**os.environ, "PAGODA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    names = sorted(p.name for p in tmp_path.iterdir())
    libraries = [n for n in names if n.endswith(".so")]
    assert sorted(n.split("_")[0] for n in libraries) == ["paged", "pool"], names
    assert names == sorted([*libraries, *(n + ".lock" for n in libraries)]), names


@pytest.mark.slow
def test_embedded_model_greedy_tokens_match_torch_backend():
    """The embedded SmolLM2 (float32) generates the same greedy tokens with either backend."""
    from pagoda.attention.torch_ref import TorchAttentionBackend as Torch
    from pagoda.entrypoints.llm import LLM
    from pagoda.model.layers.attention import Attention
    from pagoda.sampling_params import SamplingParams

    llm = LLM(None, dtype="float32", attention_backend="cpu")
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model = llm.llm_engine.executor.model_runner.model
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.backend = Torch()
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert cpu == ref
