"""RoPE and the KV-cache write in one kernel (`rotary_embedding_and_cache`) against the two
separate kernels it replaces (`rotary_embedding_triton`, then `reshape_and_cache`): the same q,
k and cache bytes, for float32/FP8/INT8 caches, partial rotary, strided qkv views and padding
rows; then the Triton backend's `forward_with_rope` and the attention layer that picks it.
Under the Triton interpreter in float32 without a GPU; bf16 at Llama-3-8B shapes, and a
CUDA-graph replay, on the GPU."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device, make_paged_batch

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from pagoda.attention.triton import backend as triton_backend  # noqa: E402
from pagoda.attention.triton.backend import TritonAttentionBackend  # noqa: E402
from pagoda.attention.triton.reshape_and_cache import (  # noqa: E402
    reshape_and_cache,
    rotary_embedding_and_cache,
)
from pagoda.kernels.rotary import rotary_embedding_triton  # noqa: E402
from pagoda.model.layers.attention import Attention  # noqa: E402
from pagoda.model.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEV = kernel_device()
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = {torch.int8: (0.03, 0.025), FP8[0]: (0.125, 0.25), FP8[1]: (0.5, 0.25)}


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _cos_sin_cache(max_pos: int, rot: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEV)


def _step(heads: int, kv_heads: int, head_size: int, cache_dtype: torch.dtype, seed: int = 0):
    """A mixed step (decodes, a chunk with a cached prefix, a fresh prompt) plus two padding
    rows; q, k, v are column slices of one qkv tensor, as the model produces them."""
    batch = make_paged_batch(
        [1, 1, 5, 7], [20, 33, 16, 0], heads, kv_heads, head_size, 16, device=DEV, seed=seed
    )
    n = sum(batch.query_lens)
    rows = n + 2
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_size, generator=gen).to(DEV)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    q = q.view(rows, heads, head_size)
    k, v = k.view(rows, kv_heads, head_size), v.view(rows, kv_heads, head_size)
    # Each row's position: its request's context length plus its index in the request.
    positions = torch.tensor([20, 33, *range(16, 21), *range(7), 0, 0], device=DEV)
    md = batch.metadata(num_actual_tokens=n)
    slots = md.slot_mapping.clone()
    slots[3] = -1  # a skipped slot among the real rows
    # The padding rows carry real slots: only num_actual_tokens may keep them out of the cache.
    md.slot_mapping = torch.cat([slots, slots[:2]])
    if cache_dtype == torch.int8:
        batch.kv_cache = (batch.kv_cache * 40).round().clamp(-128, 127).to(torch.int8)
    elif cache_dtype in FP8:
        batch.kv_cache = batch.kv_cache.to(cache_dtype)
    return batch.kv_cache, qkv, q, k, v, positions, md


def _separate(positions, q, k, v, cos_sin, cache, md, head_size, k_scale=None, v_scale=None):
    n = md.num_actual_tokens
    rotary_embedding_triton(positions, q, k, cos_sin, head_size)
    reshape_and_cache(k[:n], v[:n], cache, md.slot_mapping[:n], k_scale, v_scale)


@pytest.mark.parametrize("cache_dtype", [torch.float32, *FP8, torch.int8], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_size,rot",
    [(8, 2, 32, 32), (6, 3, 80, 80), (4, 1, 64, 32), (4, 2, 80, 48)],
    ids=["gqa", "odd-heads-80", "partial-half", "partial-80-48"],
)
def test_fused_equals_rope_then_cache_write(
    cache_dtype: torch.dtype, heads: int, kv_heads: int, head_size: int, rot: int
) -> None:
    cache, qkv, q, k, v, positions, md = _step(heads, kv_heads, head_size, cache_dtype)
    cos_sin = _cos_sin_cache(64, rot)
    k_scale, v_scale = SCALES.get(cache_dtype, (None, None))
    ref_cache, ref_qkv = cache.clone(), qkv.clone()
    ref_q, ref_k, ref_v = (
        x.view(q.shape[0], -1, head_size)
        for x in ref_qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], -1)
    )
    _separate(positions, ref_q, ref_k, ref_v, cos_sin, ref_cache, md, head_size, k_scale, v_scale)
    n = md.num_actual_tokens
    rotary_embedding_and_cache(
        positions, q, k, v, cos_sin, cache, md.slot_mapping, n, k_scale, v_scale
    )
    assert torch.equal(qkv, ref_qkv)  # q and k rotated in place (padding rows too), v untouched
    assert torch.equal(_bits(cache), _bits(ref_cache))
    assert not torch.equal(ref_q, q.new_zeros(q.shape))


def test_padding_rows_and_skipped_slots_leave_the_cache_alone() -> None:
    cache, _, q, k, v, positions, md = _step(4, 2, 32, torch.float32)
    before = cache.clone()
    n = md.num_actual_tokens
    rotary_embedding_and_cache(
        positions, q, k, v, _cos_sin_cache(64, 32), cache, md.slot_mapping, n
    )
    changed = (cache != before).flatten(3).any(-1).any(0).flatten()  # per slot
    written = md.slot_mapping[:n][md.slot_mapping[:n] >= 0]
    assert sorted(changed.nonzero().flatten().tolist()) == sorted(written.tolist())
    # Nothing written at all when no row is real.
    cache2 = before.clone()
    rotary_embedding_and_cache(
        positions, q, k, v, _cos_sin_cache(64, 32), cache2, md.slot_mapping, 0
    )
    assert torch.equal(cache2, before)


def test_bad_arguments_are_rejected() -> None:
    cache, _, q, k, v, positions, md = _step(4, 2, 32, torch.int8)
    cs = _cos_sin_cache(64, 32)
    with pytest.raises(ValueError, match="k_scale"):
        rotary_embedding_and_cache(positions, q, k, v, cs, cache, md.slot_mapping, 3)
    with pytest.raises(ValueError, match="num_actual_tokens"):
        rotary_embedding_and_cache(positions, q, k, v, cs, cache, md.slot_mapping, q.shape[0] + 1)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding_and_cache(
            positions, q, k, v, _cos_sin_cache(8, 34), cache, md.slot_mapping, 3
        )


def _layer(heads: int, kv_heads: int, head_size: int, k_scale=1.0, v_scale=1.0):
    return types.SimpleNamespace(
        layer_idx=0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=str)
def test_backend_forward_with_rope_equals_rotate_then_forward(cache_dtype: torch.dtype) -> None:
    cache, _, q, k, v, positions, md = _step(8, 2, 32, cache_dtype, seed=3)
    k_scale, v_scale = SCALES.get(cache_dtype, (1.0, 1.0))
    layer = _layer(8, 2, 32, torch.tensor([k_scale], device=DEV), v_scale)
    cs = _cos_sin_cache(64, 32)
    backend = TritonAttentionBackend()
    ref_cache, ref_q, ref_k = cache.clone(), q.clone(), k.clone()
    rotary_embedding_triton(positions, ref_q, ref_k, cs, 32)
    ref = backend.forward(layer, ref_q, ref_k, v, ref_cache, md, 0.2)
    out = backend.forward_with_rope(layer, positions, cs, q, k, v, cache, md, 0.2)
    assert torch.equal(_bits(cache), _bits(ref_cache))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(out, ref)
    assert torch.all(out[md.num_actual_tokens :] == 0)


def test_backend_forward_with_rope_without_a_cache_declines() -> None:
    _, _, q, k, v, positions, md = _step(4, 2, 32, torch.float32)
    q0, layer, cs = q.clone(), _layer(4, 2, 32), _cos_sin_cache(64, 32)
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        assert backend.forward_with_rope(layer, positions, cs, q, k, v, None, md, 0.2) is None
    assert torch.equal(q, q0)  # declined before touching anything


def _layer_fused_and_reference(backend, seed: int = 5):
    """The attention layer given the rotary embedding (the model's fused path), and the
    reference: torch RoPE, then the layer without it. Returns (out, cache, ref, ref_cache)."""
    cache, _, q, k, v, positions, md = _step(8, 2, 32, torch.float32, seed=seed)
    rope = RotaryEmbedding(32, 64, 10000.0).to(DEV)
    ref_cache = cache.clone()
    rq, rk = rope(positions, q.clone(), k.clone())
    ref = Attention(8, 32, 0.2, 2, 0, backend)(rq, rk, v, ref_cache, md)
    out = Attention(8, 32, 0.2, 2, 0, backend)(q, k, v, cache, md, rope, positions)
    return out, cache, ref, ref_cache


def _spy(monkeypatch, module, names: tuple[str, ...]) -> list[str]:
    """Record the calls of module.<name> for each name (still calling through)."""
    calls: list[str] = []
    for name in names:

        def spy(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def test_attention_layer_rope_and_cache_write_in_one_kernel(monkeypatch) -> None:
    calls = _spy(monkeypatch, triton_backend, ("reshape_and_cache", "rotary_embedding_and_cache"))
    out, cache, ref, ref_cache = _layer_fused_and_reference(TritonAttentionBackend())
    # The reference ran the separate write; the fused path ran the one kernel only.
    assert calls == ["reshape_and_cache", "rotary_embedding_and_cache"]
    assert out.shape == (ref.shape[0], 8 * 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)


def test_attention_layer_with_a_backend_without_fusion_rotates_first() -> None:
    # The torch backend has no forward_with_rope: the layer rotates (as RoPE fused=True) and
    # calls forward, the same results as before the fusion existed.
    out, cache, ref, ref_cache = _layer_fused_and_reference(TorchAttentionBackend())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)


def test_kv_scale_calibration_sees_the_rotated_keys() -> None:
    # The calibrating step takes scales from the rotated k before the write: no fusion there.
    cache, _, q, k, v, positions, md = _step(8, 2, 32, torch.int8, seed=7)
    md.calibrate_kv_scales = True
    rope = RotaryEmbedding(32, 64, 10000.0).to(DEV)
    attn, ref_attn = (Attention(8, 32, 0.2, 2, 0, TritonAttentionBackend()) for _ in range(2))
    for a in (attn, ref_attn):
        a.use_device_kv_scales(DEV)
    ref_cache = cache.clone()
    rotate = _TritonRope(rope)
    ref_attn(*rotate(positions, q.clone(), k.clone(), fused=True), v, ref_cache, md)
    attn(q, k, v, cache, md, rotate, positions)
    assert float(attn.k_scale) != 1.0
    torch.testing.assert_close(attn.k_scale, ref_attn.k_scale, atol=0, rtol=0)
    torch.testing.assert_close(attn.v_scale, ref_attn.v_scale, atol=0, rtol=0)
    assert torch.equal(cache, ref_cache)


class _TritonRope:
    """A RotaryEmbedding whose fused=True rotation is the Triton kernel on any device (on a CPU
    the module would take the C op; the interpreter stands in for the GPU here)."""

    def __init__(self, rope: RotaryEmbedding) -> None:
        self.cos_sin_cache = rope.cos_sin_cache
        self.head_size = rope.head_size

    def __call__(self, positions, q, k, fused: bool = False):
        assert fused
        return rotary_embedding_triton(positions, q, k, self.cos_sin_cache, self.head_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
def test_gpu_fused_equals_separate_kernels_at_llama8b_shapes(cache_dtype: torch.dtype) -> None:
    h, kvh, d, t = 32, 8, 128, 300
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 64, 16, kvh, d, device="cuda").to(cache_dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:t]
    slots[::7] = -1
    positions = torch.randint(0, 8192, (t,), device="cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    k_scale, v_scale = (None, None) if cache_dtype == torch.bfloat16 else (0.05, 0.04)
    md = types.SimpleNamespace(num_actual_tokens=t - 5, slot_mapping=slots)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()

    def views(x):
        q, k, v = x.split([h * d, kvh * d, kvh * d], -1)
        return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)

    _separate(positions, *views(ref_qkv), cs, ref_cache, md, d, k_scale, v_scale)
    q, k, v = views(qkv)
    rotary_embedding_and_cache(positions, q, k, v, cs, cache, slots, t - 5, k_scale, v_scale)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(_bits(cache), _bits(ref_cache))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_forward_with_rope_replays_in_a_cuda_graph() -> None:
    h, kvh, d = 32, 8, 128
    batch = make_paged_batch(
        [1] * 8, [300 + 50 * i for i in range(8)], h, kvh, d, dtype=torch.bfloat16, device="cuda"
    )
    md = batch.metadata()
    positions = batch.seq_lens.long() - 1
    cs = RotaryEmbedding(d, 4096, 500000.0).to("cuda").cos_sin_cache
    q_in = batch.q.clone()
    k_in = torch.randn(8, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k_in)
    q, k = q_in.clone(), k_in.clone()
    backend, layer = TritonAttentionBackend(), _layer(h, kvh, d)
    backend.forward_with_rope(layer, positions, cs, q, k, v, batch.kv_cache, md, d**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_with_rope(layer, positions, cs, q, k, v, batch.kv_cache, md, d**-0.5)
    # Replay on fresh inputs and zeroed slots: the rotation and the write must happen again.
    blk, off = md.slot_mapping // 16, md.slot_mapping % 16
    batch.kv_cache[:, blk, off] = 0
    ref_cache = batch.kv_cache.clone()
    q.copy_(q_in)
    k.copy_(k_in)
    graph.replay()
    rq, rk = q_in.clone(), k_in.clone()
    rotary_embedding_triton(positions, rq, rk, cs, d)
    ref = backend.forward(layer, rq, rk, v, ref_cache, md, d**-0.5)
    torch.cuda.synchronize()
    assert torch.equal(batch.kv_cache, ref_cache) and batch.kv_cache[:, blk, off].any()
    assert torch.equal(q, rq) and torch.equal(k, rk)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["llama_gqa_tied_llama3_rope", "qwen3"])
def test_tiny_model_on_the_triton_backend_matches_the_torch_backend(tmp_path, case) -> None:
    # The model's own call (positions, q/k views of qkv, qk-norm): a prefill then decodes, with
    # RoPE + cache write fused on the Triton backend vs the whole reference path.
    pytest.importorskip("transformers")
    from model_testing import TINY_CASES, TINY_CONFIG, PagedRunner, make_tiny_checkpoint

    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    make_tiny_checkpoint(tmp_path, case)
    hf_config = get_model_config_dict(str(tmp_path))
    mc = ModelConfig(model=str(tmp_path), hf_config=hf_config, dtype="float32", max_model_len=64)
    cfg = {**TINY_CONFIG, **TINY_CASES[case][2], **hf_config}
    logits = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        model = load_model(mc, DEV, attn_backend=backend).to(DEV)
        if isinstance(backend, TorchAttentionBackend):
            model.set_fused_ops(False)
        runner = PagedRunner(model, cfg)
        runner.kv_caches = [c.to(DEV) for c in runner.kv_caches]
        tokens = list(range(3, 12))
        out = [runner.step(tokens, 0)]
        for _ in range(3):
            tokens.append(int(out[-1][-1].argmax()))
            out.append(runner.step(tokens[-1:], len(tokens) - 1))
        logits.append(torch.cat(out))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
