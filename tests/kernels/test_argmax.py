"""The two-stage Triton row argmax against torch.argmax (the first maximal index), under the
Triton interpreter in float32 without a GPU; at Llama-3 vocabulary sizes in bf16/fp32, inside
the sampler and in a CUDA graph on the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels.argmax import argmax_supported, argmax_triton  # noqa: E402

DEV = kernel_device()
VOCABS = [128256, 49152, 1000]


def _logits(rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    if ties:  # the maximum at several places of each row, across chunks too: the first wins
        for r in range(rows):
            x[r, torch.randint(0, vocab, (4,), generator=g)] = x[r].max() + 1
    return x.to(DEV)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_argmax_is_torch_argmax(vocab: int, rows: int, ties: bool) -> None:
    x = _logits(rows, vocab, seed=vocab + rows, ties=ties)
    out = argmax_triton(x)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert out.tolist() == x.argmax(dim=-1).tolist()


def test_ties_inside_one_chunk_and_at_the_row_ends() -> None:
    x = torch.zeros(4, 3000, device=DEV)
    x[0, [7, 5, 900]] = 2.0  # same chunk: 5 beats 7
    x[1, [2999, 1024, 1025]] = 2.0  # the first index of the second chunk
    x[2, [2999]] = 2.0  # the very last column, in a partial chunk
    # row 3: all equal, the answer is 0
    assert argmax_triton(x).tolist() == [5, 1024, 2999, 0] == x.argmax(dim=-1).tolist()


def test_masked_rows_nan_and_infinities_follow_torch() -> None:
    x = torch.full((5, 2500), float("-inf"), device=DEV)  # row 0: all -inf -> 0
    x[1, [1500, 2100]] = -3.0  # masked logits (allowed_token_ids) with two survivors
    x[2, [40, 2200]] = float("inf")
    x[3, :] = 1.0
    x[3, [1800, 2300]] = float("nan")  # torch: the first NaN is the maximum
    x[4, :] = 1.0
    x[4, 3] = float("nan")
    assert argmax_triton(x).tolist() == x.argmax(dim=-1).tolist() == [0, 1500, 40, 1800, 3]


def test_strided_rows_and_a_huge_vocabulary() -> None:
    wide = _logits(2, 2 * 1000, seed=5, ties=True)
    x = wide[:, :1000]  # rows of stride 2000
    assert argmax_triton(x).tolist() == x.argmax(dim=-1).tolist()
    big = _logits(1, 1024 * 1024 + 17, seed=6, ties=True)  # chunks grow past MAX_CHUNKS
    assert argmax_triton(big).tolist() == big.argmax(dim=-1).tolist()


def test_unsupported_layouts_are_rejected() -> None:
    assert not argmax_supported(torch.zeros(4, 8, device=DEV).t())
    assert not argmax_supported(torch.zeros(8, device=DEV))
    assert not argmax_supported(torch.zeros(2, 8, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        argmax_triton(torch.zeros(4, 8, device=DEV).t())
    assert argmax_triton(torch.zeros(0, 8, device=DEV)).shape == (0,)


def test_greedy_argmax_dispatch() -> None:
    from pagoda.sample.sampler import greedy_argmax

    x = _logits(3, 1000, seed=7, ties=True)
    assert greedy_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert greedy_argmax(x.cpu()).tolist() == x.argmax(dim=-1).tolist()  # torch on a CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_argmax_is_torch_argmax(vocab: int, rows: int, dtype: torch.dtype) -> None:
    for ties in (False, True):
        x = _logits(rows, vocab, seed=rows * vocab, ties=ties).to(dtype)  # bf16 adds ties
        assert torch.equal(argmax_triton(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_plain_greedy_sampler_replays_in_a_cuda_graph() -> None:
    from pagoda.sample.sampler import Sampler, SamplingMetadata
    from pagoda.sampling_params import SamplingParams

    vocab = 128256
    logits = torch.randn(1, vocab, device="cuda")
    md = SamplingMetadata.from_requests(
        [SamplingParams(temperature=0.0)], [[1, 2]], [[]], [None], vocab, logits.device
    )
    assert md.is_plain_greedy
    sampler = Sampler()
    sampler.sample_on_device(logits, md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync or a host read of a device value fails here
        sampled = sampler.sample_on_device(logits, md).sampled_token_ids
    for seed in range(3):
        logits.copy_(_logits(1, vocab, seed=seed, ties=seed == 1))
        graph.replay()
        assert torch.equal(sampled, logits.argmax(dim=-1))
