"""The Triton one-row GEMV against F.linear (under the Triton interpreter in float32 when there
is no GPU; bf16 at Llama-3-8B decode shapes and the model's dispatch on the GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels.gemv import gemv_supported, gemv_triton  # noqa: E402

DEV = kernel_device()


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


@pytest.mark.parametrize(
    "n,k", [(1, 16), (7, 33), (40, 300), (96, 1024), (200, 8200)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(n: int, k: int, with_bias: bool) -> None:
    x, w = _randn(1, k, seed=n), _randn(n, k, seed=k)
    bias = _randn(n, seed=3) if with_bias else None
    out = gemv_triton(x, w, bias)
    assert out.shape == (1, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)


def test_gemv_takes_a_strided_weight_and_a_3d_row() -> None:
    w = _randn(48, 128, seed=1)[:, :64]  # rows of stride 128: a slice of a wider weight
    x = _randn(1, 1, 64, seed=2)
    out = gemv_triton(x, w)
    assert out.shape == (1, 1, 48)
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_gemv_supported_is_one_row_on_cuda_only() -> None:
    from pagoda.kernels import one_row_linear

    w = torch.zeros(8, 16)
    assert not gemv_supported(torch.zeros(1, 16), w)  # CPU tensors: the CPU kernels' job
    assert one_row_linear(torch.zeros(1, 16), w) is None
    if torch.cuda.is_available():
        wc = w.cuda()
        assert gemv_supported(torch.zeros(1, 16, device="cuda"), wc)
        assert not gemv_supported(torch.zeros(2, 16, device="cuda"), wc)
        assert not gemv_supported(torch.zeros(1, 16, device="cuda", dtype=torch.bfloat16), wc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gemv_bf16_at_llama8b_shapes(n: int, k: int) -> None:
    x = _randn(1, k, seed=1, dtype=torch.bfloat16)
    w = _randn(n, k, seed=2, dtype=torch.bfloat16) * 0.02
    ref = torch.nn.functional.linear(x.float(), w.float())
    out = gemv_triton(x, w)
    # fp32 accumulation in another order, one bf16 rounding: within 2 ulps of the fp32 result.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("n,k", [(5, 40), (64, 1536)])
def test_gemv_with_silu_and_mul_is_the_mlp_down_projection(n: int, k: int) -> None:
    gate_up, w = _randn(1, 2 * k, seed=4), _randn(n, k, seed=5)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    out = gemv_triton(gate_up, w, silu_and_mul=True)
    torch.testing.assert_close(out, act @ w.T, atol=1e-4, rtol=1e-4)
    if torch.cuda.is_available():  # the tensors are on the GPU then
        assert gemv_supported(gate_up, w, silu_and_mul=True) and not gemv_supported(gate_up, w)


def test_gemv_float32_output_for_logits() -> None:
    x, w = _randn(1, 96, seed=6), _randn(300, 96, seed=7)
    out = gemv_triton(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_bf16_silu_and_mul_matches_the_separate_kernels() -> None:
    from pagoda.kernels import silu_and_mul

    gate_up = _randn(1, 2 * 14336, seed=8, dtype=torch.bfloat16)
    w = _randn(4096, 14336, seed=9, dtype=torch.bfloat16) * 0.02
    ref = torch.nn.functional.linear(silu_and_mul(gate_up).float(), w.float())
    out = gemv_triton(gate_up, w, silu_and_mul=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)
