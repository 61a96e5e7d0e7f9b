"""The CUDA decode kernel (`pagoda.attention.cuda.paged_decode`) against the Triton kernel and
the float32 oracle: GQA groups 1-8, block sizes 16 and 32, ragged contexts (1 key, chunk edges,
thousands of keys), e4m3 and e5m2 caches with layer scales and bf16/fp16 caches, bf16 and fp16
queries, split and unsplit, stale NaN slots past each request's end, an empty request, the
head-major cache layout, and a CUDA graph replayed over new lengths. Marked `gpu`; on a CPU
only the dispatch rules are checked."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, make_paged_batch

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.attention.cuda import paged_decode  # noqa: E402
from pagoda.attention.triton.unified_attention import unified_attention  # noqa: E402
from pagoda.kernels import cuda_launch  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONTEXTS = [0, 14, 15, 16, 31, 299, 1023, 2050]  # decode rows see context + 1 keys
ATOL = RTOL = 2e-2


def _batch(group, kv_heads, block_size, cache_dtype, dtype, contexts=CONTEXTS, seed=0, hnd=False):
    batch = make_paged_batch(
        [1] * len(contexts), contexts, group * kv_heads, kv_heads, 128, block_size,
        device="cuda", seed=seed,
    )  # fmt: skip
    batch.q = batch.q.to(dtype)
    cache = batch.kv_cache * 8
    # Slots past each request's end hold NaN: a kernel that lets them into the sums fails.
    for b, sl in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_tables[b, (sl - 1) // block_size])
        cache[:, last, (sl - 1) % block_size + 1 :] = float("nan")
    batch.kv_cache = cache.to(cache_dtype)
    if hnd:  # the CUDA engine's layout: each (block, KV head) contiguous, same logical shape
        batch.kv_cache = batch.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    return batch


def _run(batch, cuda: bool, split: bool | None = None, scales=(0.05, 0.02)) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    k, v = (torch.tensor([s], device="cuda") for s in scales)
    md = batch.metadata()
    unified_attention(
        batch.q, batch.kv_cache, out, md, 128**-0.5, k, v, split_kv=split, cuda_decode_kernel=cuda
    )
    return out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group,kv_heads", [(4, 8), (3, 3), (7, 4), (8, 1), (1, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_matches_triton_and_oracle(group, kv_heads, block_size, split, cache_dtype) -> None:
    batch = _batch(group, kv_heads, block_size, cache_dtype, torch.bfloat16, hnd=block_size == 32)
    cuda = _run(batch, True, split)
    triton = _run(batch, False, split)
    # A 16-bit cache is not scaled (the kernels ignore the scales passed).
    scales = (0.05, 0.02) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    ref = batch.reference(128**-0.5, *scales)
    assert not cuda.isnan().any()
    torch.testing.assert_close(cuda.float(), triton.float(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cuda.float(), ref, atol=ATOL, rtol=RTOL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, "q"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_formats_and_query_dtypes(cache_dtype, dtype) -> None:
    cache_dtype = dtype if cache_dtype == "q" else cache_dtype  # a cache of q's own dtype
    batch = _batch(4, 2, 16, cache_dtype, dtype, seed=3)
    scales = (0.5, 0.25) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    for split in (False, True):
        out = _run(batch, True, split, scales=(0.5, 0.25))
        ref = batch.reference(128**-0.5, *scales)
        torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@gpu
@pytest.mark.gpu
def test_empty_request_is_skipped() -> None:
    batch = _batch(4, 2, 16, torch.float8_e4m3fn, torch.bfloat16, contexts=[40, 7])
    # Request 1 gets no query row this step: the kernel must skip it.
    batch.query_lens = [1, 0]
    batch.query_start_loc = torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda")
    batch.q = batch.q[:1].contiguous()
    out = _run(batch, True)
    ref = batch.reference(128**-0.5, 0.05, 0.02)
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_cuda_graph_replays_new_lengths(cache_dtype) -> None:
    batch = _batch(4, 8, 16, cache_dtype, torch.bfloat16, contexts=[500] * 8)
    md = batch.metadata()
    scales = (torch.tensor([0.05], device="cuda"), torch.tensor([0.02], device="cuda"))
    out = torch.empty_like(batch.q)

    def step():
        unified_attention(batch.q, batch.kv_cache, out, md, 128**-0.5, *scales)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    batch.seq_lens.copy_(torch.tensor([1, 17, 100, 200, 300, 400, 499, 501], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ref = batch.reference(128**-0.5, *((0.05, 0.02) if cache_dtype.itemsize == 1 else (1, 1)))
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


def test_unsupported_steps_keep_the_triton_kernel() -> None:
    batch = make_paged_batch([1, 1], [5, 9], 8, 2, 128, 16)
    md = batch.metadata()
    reason = paged_decode.unsupported_reason(batch.q, batch.kv_cache, batch.q, md)
    assert reason is not None  # a CPU tensor
    assert paged_decode.cache_kind(torch.float8_e5m2) == "e5m2"
    assert paged_decode.cache_kind(torch.bfloat16) == "16bit"
    assert paged_decode.smem_bytes(4, 2, "16bit") == paged_decode.smem_bytes(4, 4, "e4m3")
    with pytest.raises(ValueError, match="CUDA decode kernel cannot"):
        unified_attention(
            batch.q, batch.kv_cache, torch.empty_like(batch.q), md, 0.1, cuda_decode_kernel=True
        )


def test_launch_passes_the_grid_cta_shape_and_byte_strides(monkeypatch) -> None:
    # The launch without a GPU: what reaches cuLaunchKernel for a stand-in compiled kernel.
    calls = []

    class Driver:
        def cuLaunchKernel(self, *args):  # noqa: N802 (the driver's name)
            calls.append(args)
            return 0

    monkeypatch.setattr(cuda_launch, "libcuda", lambda: Driver())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: SimpleNamespace(cuda_stream=0))
    batch = make_paged_batch([1, 1, 1], [5, 9, 40], 8, 2, 128, 16)
    kernel = paged_decode.DecodeKernel(SimpleNamespace(func="handle"), threads=128, smem=49152)
    one = torch.ones(1)
    paged_decode.paged_decode(
        kernel, batch.q, batch.kv_cache, batch.q, batch.metadata(), 0.1, one, one, 4, None
    )
    (args,) = calls
    assert args[:8] == ("handle", 2, 3, 4, 128, 1, 1, 49152)  # grid (KV heads, requests, segs)
    params = args[9]
    strides = [ctypes.c_int.from_address(params[i]).value for i in range(18, 21)]
    assert strides == [s * 4 for s in batch.kv_cache.stride()[1:4]]  # bytes of float32
    assert ctypes.c_double.from_address(params[12]).value == 0.1
