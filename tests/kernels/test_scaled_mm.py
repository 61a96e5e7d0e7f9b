"""The W8A8 GEMMs (int8 and fp8, per-token activations, per-channel weights) against their
dequantize-then-matmul reference: the plain path (CPU), the Triton row-quantization and int8
epilogue kernels (under the Triton interpreter without a GPU), and on a GPU the whole
tensor-core path (`torch._int_mm` / `torch._scaled_mm`, gpu-marked) at Llama-like shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()

from pagoda.kernels.scaled_mm import (  # noqa: E402
    FP8_DTYPE,
    fp8_supported,
    quantize_rows_ref,
    quantize_weight,
    scaled_mm,
    scaled_mm_ref,
)

DTYPES = [torch.int8, FP8_DTYPE]


def _randn(*shape: int, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _problem(m: int, k: int, n: int, dtype: torch.dtype, device="cpu", x_dtype=torch.float32):
    x = _randn(m, k, seed=1, device=device)
    x[:, 3] *= 20.0  # an outlier channel, as LLM activations have
    w_q, w_scale = quantize_weight(_randn(n, k, seed=2, device=device) * 0.05, dtype)
    bias = _randn(n, seed=3, device=device)
    return x.to(x_dtype), w_q, w_scale.reshape(-1), bias.to(x_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_rows_dequantize_within_half_a_step(dtype) -> None:
    x = _randn(5, 300) * 3
    x[2] = 0.0  # an all-zero row stays zero (no division by zero)
    q, scale = quantize_rows_ref(x, dtype)
    assert q.dtype == dtype and scale.shape == (5, 1)
    err = (q.float() * scale - x).abs()
    if dtype == torch.int8:
        assert (err <= scale / 2 + 1e-6).all() and q.abs().max() == 127
    else:  # e4m3: 3 mantissa bits, a relative step of 1/16 at most
        assert (err <= x.abs() / 16 + scale * 2**-9).all()
    assert (q[2].float() == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_plain_path_matches_dequantize_then_matmul(dtype, m) -> None:
    x, w_q, w_scale, bias = _problem(m, 96, 40, dtype)
    y = scaled_mm(x, w_q, w_scale, bias)  # CPU tensors: the plain path
    torch.testing.assert_close(y, scaled_mm_ref(x, w_q, w_scale, bias), atol=1e-4, rtol=1e-4)
    # and W8A8 stays close to the unquantized product
    dense = x @ (w_q.float() * w_scale[:, None]).t() + bias
    assert float((y - dense).norm() / dense.norm()) < (0.03 if dtype == torch.int8 else 0.05)


def test_batched_inputs_keep_their_leading_dims() -> None:
    x, w_q, w_scale, _ = _problem(6, 64, 24, torch.int8)
    y = scaled_mm(x.reshape(2, 3, 64), w_q, w_scale)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.reshape(6, 24), scaled_mm(x, w_q, w_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 300, 5000])
def test_triton_row_quantization_matches_reference(dtype, k) -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import quantize_rows_triton

    dev = kernel_device()
    x = _randn(4, k, seed=k, device=dev) * 2
    x[1] = 0.0
    q, scale = quantize_rows_triton(x, dtype)
    q_ref, scale_ref = quantize_rows_ref(x, dtype)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    diff = (q.float() - q_ref.float()).abs()
    if dtype == torch.int8:
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # a tie rounded otherwise
    elif dev.type == "cuda":  # within one e4m3 step (a cast through fp16 may round twice)
        assert (diff <= torch.clamp(q_ref.float().abs() / 8, min=2.0**-9)).all()
        assert (diff > 0).float().mean() < 0.01
    else:
        # The interpreter's fp32 -> e4m3 cast drops the carry when rounding up crosses a power
        # of two (125.5 -> 64, not 128): a mismatch is allowed only there.
        bad = diff > 0
        assert (q_ref.float()[bad].abs().log2() % 1 == 0).all() and bad.float().mean() < 0.05


@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_int8_epilogue_matches_reference(with_bias) -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import int8_epilogue

    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**20), 2**20, (40, 200), generator=g, dtype=torch.int32).to(dev)
    xs = torch.rand(40, 1, generator=g).to(dev) / 100
    ws = torch.rand(200, generator=g).to(dev) / 100
    bias = torch.randn(200, generator=g).to(dev) if with_bias else None
    out = int8_epilogue(acc, xs, ws, bias, torch.float32, rows=33)  # the rows past 33 are padding
    ref = acc[:33].float() * xs[:33] * ws
    if bias is not None:
        ref = ref + bias
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 16, 20])
def test_int8_tensor_core_path_matches_reference(m) -> None:
    # The CUDA int8 path end to end (row quantization, padding to 32 rows, torch._int_mm, the
    # epilogue); without a GPU, the kernels under the interpreter and torch._int_mm on the CPU.
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import scaled_mm_cuda

    x, w_q, w_scale, bias = _problem(m, 64, 48, torch.int8, device=kernel_device())
    y = scaled_mm_cuda(x, w_q, w_scale, bias)
    assert y.shape == (m, 48)
    torch.testing.assert_close(y, scaled_mm_ref(x, w_q, w_scale, bias), atol=1e-4, rtol=1e-4)


# ---- GPU: the tensor-core paths --------------------------------------------------------------

LLAMA3_8B_GEMMS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 17, 64, 300])
@pytest.mark.parametrize("k_n", [(4096, 6144), (14336, 4096), (576, 960)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scaled_mm_matches_dequantize_then_matmul(dtype, k_n, m) -> None:
    if dtype == FP8_DTYPE and not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    k, n = k_n
    x, w_q, w_scale, bias = _problem(m, k, n, dtype, device="cuda", x_dtype=torch.bfloat16)
    y = scaled_mm(x, w_q, w_scale, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = scaled_mm_ref(x, w_q, w_scale, bias).float()
    # The same quantized operands up to a tie rounded otherwise; bf16 output.
    err = float((y.float() - ref).norm() / ref.norm())
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scaled_mm_without_bias_and_in_float16(dtype) -> None:
    if dtype == FP8_DTYPE and not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    x, w_q, w_scale, _ = _problem(64, 1024, 512, dtype, device="cuda", x_dtype=torch.float16)
    y = scaled_mm(x, w_q, w_scale)
    assert y.dtype == torch.float16
    ref = scaled_mm_ref(x, w_q, w_scale).float()
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
