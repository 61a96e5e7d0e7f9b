"""The Triton kernels at real shapes in bf16/fp16 on a CUDA GPU (Llama-3-8B attention: 32
query heads, 8 KV heads, head 128, block 16): a 64-request decode batch with 1-2k contexts,
split-KV decode, a 2k prefill next to cached-prefix chunks, FP8/INT8 caches, the backend
against the torch reference, a CUDA-graph replay, and the fused ops. Marked `gpu`: run with
`pytest tests/kernels -m gpu` (or tests/kernels/run_on_gpu.sh)."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_testing import (
    enable_interpreter_without_cuda,
    make_paged_batch,
    ref_reshape_and_cache,
)

enable_interpreter_without_cuda()
pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagoda.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from pagoda.attention.triton.backend import TritonAttentionBackend  # noqa: E402
from pagoda.attention.triton.reshape_and_cache import reshape_and_cache  # noqa: E402
from pagoda.attention.triton.unified_attention import (  # noqa: E402
    unified_attention,
    use_split_kv,
)
from pagoda.kernels.norm_act import rms_norm_triton, silu_and_mul_triton  # noqa: E402
from pagoda.kernels.reference import (  # noqa: E402
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from pagoda.kernels.rotary import rotary_embedding_triton  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16  # Llama-3-8B attention
SCALE = D**-0.5
# bf16 rounds the probabilities and the output (2^-8 relative): decode outputs are averages
# over ~1k values (|out| ~ 0.1), early prefill rows average a few (|out| ~ 1).
TOL = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 5e-3)}
DTYPES = [torch.bfloat16, torch.float16]


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _attend(batch, scale: float = SCALE, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, out, batch.metadata(), scale, **kwargs)
    return out


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch64_with_1k_to_2k_contexts(dtype) -> None:
    ctx = _lens(64, 1024, 2047, seed=0)
    batch = make_paged_batch([1] * 64, ctx, H, KVH, D, BS, dtype=dtype, device="cuda")
    assert not use_split_kv(64, KVH, 1)
    _check(_attend(batch), batch.reference(SCALE), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_of_few_long_requests(dtype) -> None:
    batch = make_paged_batch(
        [1] * 4, [8000, 3000, 17, 4096], H, KVH, D, BS, dtype=dtype, device="cuda", seed=1
    )
    assert use_split_kv(4, KVH, 1)
    split = _attend(batch)
    _check(split, batch.reference(SCALE), dtype)
    _check(split, _attend(batch, split_kv=False).float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_2k_prefill_mixed_with_chunks_and_decodes(dtype) -> None:
    # Decodes, a 512-row chunk after a 1k cached prefix, a 100-row chunk, a fresh 2k prompt.
    batch = make_paged_batch(
        [1, 1, 1, 512, 100, 2048],
        [1500, 37, 900, 1024, 3000, 0],
        H,
        KVH,
        D,
        BS,
        dtype=dtype,
        device="cuda",
        seed=2,
    )
    _check(_attend(batch), batch.reference(SCALE), dtype)


def test_gqa_1to1_mqa_and_padded_head_sizes() -> None:
    for heads, kv_heads, head_size in [(16, 16, 64), (16, 1, 128), (12, 4, 96), (8, 2, 80)]:
        batch = make_paged_batch(
            [1, 1, 33, 300],
            [700, 64, 200, 0],
            heads,
            kv_heads,
            head_size,
            32,
            dtype=torch.bfloat16,
            device="cuda",
            seed=3,
        )
        scale = head_size**-0.5
        _check(_attend(batch, scale, split_kv=False), batch.reference(scale), torch.bfloat16)
        _check(_attend(batch, scale, split_kv=True), batch.reference(scale), torch.bfloat16)


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decodes"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_quantized_cache_write_and_attention(cache_dtype, decode_only) -> None:
    extra = ([], []) if decode_only else ([256], [300])  # decodes only: the decode tiles
    batch = make_paged_batch(
        [1] * 16 + extra[0],
        _lens(16, 500, 1500, 4) + extra[1],
        H,
        KVH,
        D,
        BS,
        dtype=torch.bfloat16,
        device="cuda",
        seed=4,
    )
    n = batch.q.shape[0]
    k = torch.randn(n, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, KVH, D, device="cuda", dtype=torch.bfloat16)
    k_scale, v_scale = (0.02, 0.03) if cache_dtype == torch.int8 else (0.01, 0.015)
    batch.kv_cache = (batch.kv_cache.float() / 0.05).clamp(-100, 100).to(cache_dtype)
    expected = batch.kv_cache.clone()
    reshape_and_cache(k, v, batch.kv_cache, batch.slot_mapping, k_scale, v_scale)
    ref_reshape_and_cache(k, v, expected, batch.slot_mapping, k_scale, v_scale)
    # torch on CUDA divides by a scalar as x * (1 / s): allow rare one-code differences.
    differ = batch.kv_cache.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean().item() < 1e-3
    torch.testing.assert_close(batch.kv_cache.float(), expected.float(), atol=1.0, rtol=0.26)
    ref = batch.reference(SCALE, k_scale, v_scale)
    for split in (False, True):
        _check(
            _attend(batch, k_scale=k_scale, v_scale=v_scale, split_kv=split), ref, torch.bfloat16
        )


def _layer(k_scale=1.0, v_scale=1.0):
    return types.SimpleNamespace(
        layer_idx=0, num_heads=H, num_kv_heads=KVH, head_size=D, k_scale=k_scale, v_scale=v_scale
    )


def test_backend_matches_torch_reference_on_a_mixed_step() -> None:
    batch = make_paged_batch(
        [1] * 8 + [128, 700],
        _lens(8, 100, 2000, 5) + [256, 0],
        H,
        KVH,
        D,
        BS,
        dtype=torch.bfloat16,
        device="cuda",
        seed=5,
    )
    n = batch.q.shape[0]
    k = torch.randn(n, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, KVH, D, device="cuda", dtype=torch.bfloat16)
    cache_ref = batch.kv_cache.clone()
    out = TritonAttentionBackend().forward(
        _layer(), batch.q, k, v, batch.kv_cache, batch.metadata(), SCALE
    )
    ref = TorchAttentionBackend().forward(
        _layer(), batch.q, k, v, cache_ref, batch.metadata(), SCALE
    )
    assert torch.equal(batch.kv_cache, cache_ref)
    _check(out, ref.float(), torch.bfloat16)


def test_decode_step_replays_in_a_cuda_graph() -> None:
    # No host syncs or host reads of device values: a captured decode step replays correctly
    # after the sequence lengths and slots (device tensors) change in place.
    ctx = _lens(8, 300, 1200, 6)
    batch = make_paged_batch(
        [1] * 8, ctx, H, KVH, D, BS, dtype=torch.bfloat16, device="cuda", seed=6, spare_blocks=0
    )
    md = batch.metadata()
    k = torch.randn(8, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    backend = TritonAttentionBackend()
    layer = _layer()
    backend.forward(layer, batch.q, k, v, batch.kv_cache, md, SCALE)  # warm up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(layer, batch.q, k, v, batch.kv_cache, md, SCALE)
    # Replay as the step before: 5 fewer keys per request, the new token 5 slots earlier.
    md.seq_lens.sub_(5)
    pos = md.seq_lens.long() - 1
    blocks = batch.block_tables.long().gather(1, (pos // BS)[:, None]).squeeze(1)
    md.slot_mapping.copy_(blocks * BS + pos % BS)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, batch.reference(SCALE), torch.bfloat16)


def test_fused_ops_bf16_at_llama8b_shapes() -> None:
    t, hidden, inter = 300, 4096, 14336
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)
    gate_up = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up), atol=2e-2, rtol=1e-2
    )
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    positions = torch.randint(0, 8192, (t,), device="cuda")
    q = torch.randn(t, H * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, KVH, D, device="cuda", dtype=torch.bfloat16)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache, D)
    rotary_embedding_triton(positions, q, k, cache, D)
    torch.testing.assert_close(q, q_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k, k_ref, atol=2e-2, rtol=1e-2)
