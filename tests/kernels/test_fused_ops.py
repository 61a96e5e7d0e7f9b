"""The fused RMSNorm(+residual), SiLU-and-mul and RoPE Triton kernels against their torch
references (under the Triton interpreter in float32 when there is no GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from pagoda.kernels.norm_act import rms_norm_triton, silu_and_mul_triton  # noqa: E402
from pagoda.kernels.reference import (  # noqa: E402
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from pagoda.kernels.rotary import rotary_embedding_triton  # noqa: E402
from pagoda.kernels.scaled_mm import QuantizedRows, quantize_rows_ref  # noqa: E402
from pagoda.kernels.scaled_mm_triton import quantize_rows_triton  # noqa: E402

DEV = kernel_device()
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32  # the interpreter: float32


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_rms_norm_matches_reference(hidden: int) -> None:
    x, w = _randn(7, hidden), _randn(hidden, seed=1)
    out, res = rms_norm_triton(x, w, 1e-6)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert res is x  # no residual: the input itself is the next residual


def test_fused_add_rms_norm_returns_sum_as_new_residual() -> None:
    x, r, w = _randn(5, 3, 128), _randn(5, 3, 128, seed=1), _randn(128, seed=2)
    out, new_res = rms_norm_triton(x, w, 1e-5, residual=r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert out.shape == x.shape and new_res.shape == x.shape
    torch.testing.assert_close(new_res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_res, x + r, rtol=0, atol=0)


def test_rms_norm_reads_strided_rows() -> None:
    base = _randn(6, 256)
    x = base[:, :128]  # rows 256 apart, like a slice of a fused projection
    w = _randn(128, seed=3)
    out, _ = rms_norm_triton(x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x.contiguous(), w, 1e-6)[0], rtol=1e-5, atol=1e-5)


def test_rms_norm_rejects_wrong_weight_shape() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(_randn(2, 64), _randn(32), 1e-6)


@pytest.mark.parametrize("d", [64, 1500])
def test_silu_and_mul_matches_reference(d: int) -> None:
    x = _randn(4, 2 * d) * 3
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_keeps_leading_dims() -> None:
    x = _randn(2, 3, 128)
    out = silu_and_mul_triton(x)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-5, atol=1e-5)


QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _assert_same_quantized(got, q_ref, scale_ref, lead, dtype: torch.dtype = DTYPE) -> None:
    # Bit for bit what the row quantization makes of the unfused kernel's output.
    assert isinstance(got, QuantizedRows) and got.dtype == dtype
    assert got.q.shape == (*lead, q_ref.shape[-1]) and got.scale.shape == (*lead, 1)
    assert torch.equal(got.q.reshape(q_ref.shape).view(torch.int8), q_ref.view(torch.int8))
    assert torch.equal(got.scale.reshape(scale_ref.shape), scale_ref)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantized_output_is_the_quantized_norm(quant_dtype, with_residual) -> None:
    x, w = _randn(3, 5, 320).to(DTYPE), _randn(320, seed=1).to(DTYPE)
    x[0, 2] = 0.0  # an all-zero row: the smallest scale, zeros
    r = _randn(3, 5, 320, seed=2).to(DTYPE) if with_residual else None
    if r is not None:
        r[0, 2] = 0.0
    got, h = rms_norm_triton(x, w, 1e-6, r, quant_dtype)
    out, h_ref = rms_norm_triton(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _assert_same_quantized(got, *quantize_rows_triton(out.reshape(15, 320), quant_dtype), (3, 5))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("d", [64, 2500, 16500])  # from registers; two passes of blocks
def test_silu_and_mul_quantized_output_is_the_quantized_product(quant_dtype, d) -> None:
    x = (_randn(2, 3, 2 * d) * 3).to(DTYPE)
    got = silu_and_mul_triton(x, quant_dtype)
    out = silu_and_mul_triton(x).reshape(6, d)
    _assert_same_quantized(got, *quantize_rows_triton(out, quant_dtype), (2, 3))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_quantized_outputs_on_the_torch_path(quant_dtype) -> None:
    # CPU tensors take the references, then the reference row quantization.
    x, r, w = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    got, h = rms_norm(x, w, 1e-6, r, quant_dtype)
    out, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _assert_same_quantized(got, *quantize_rows_ref(out, quant_dtype), (4,), x.dtype)
    got = silu_and_mul(x, quant_dtype)
    ref = quantize_rows_ref(silu_and_mul_ref(x), quant_dtype)
    _assert_same_quantized(got, *ref, (4,), x.dtype)
    with pytest.raises(ValueError, match="quant_dtype"):
        rms_norm_triton(x.to(DEV), w.to(DEV), 1e-6, None, torch.float16)


def _cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEV)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 2, 64), (9, 3, 64), (3, 1, 80)])
def test_rotary_embedding_matches_reference_in_place(
    num_heads: int, num_kv_heads: int, head_size: int
) -> None:
    t = 6
    positions = torch.tensor([0, 1, 5, 17, 3, 99], device=DEV)
    cache = _cos_sin_cache(128, head_size)
    q, k = _randn(t, num_heads * head_size), _randn(t, num_kv_heads, head_size, seed=1)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache, head_size)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(q_ref, q_ref.new_zeros(q_ref.shape))


def test_rotary_embedding_is_hf_rotate_half() -> None:
    # Position p rotates pair (x[i], x[i + d/2]) by p * inv_freq[i]: check one pair by hand.
    head_size = 8
    cache = _cos_sin_cache(16, head_size)
    q = torch.zeros(1, 1, head_size, device=DEV)
    q[0, 0, 1] = 1.0  # x1 component of pair 1
    rotary_embedding_triton(torch.tensor([3], device=DEV), q, None, cache, head_size)
    angle = 3 * (1.0 / 10000 ** (2 / head_size))
    expected = torch.zeros(head_size)
    expected[1], expected[1 + head_size // 2] = torch.tensor(angle).cos(), torch.tensor(angle).sin()
    torch.testing.assert_close(q[0, 0].cpu(), expected, rtol=1e-5, atol=1e-6)


def test_rotary_embedding_partial_rotary_leaves_tail() -> None:
    head_size, rot = 64, 32
    cache = _cos_sin_cache(32, rot)
    positions = torch.arange(4, device=DEV)
    q = _randn(4, 2, head_size)
    q_ref = q.clone()
    rotary_embedding_ref(positions, q_ref, None, cache, head_size)
    before_tail = q[..., rot:].clone()
    rotary_embedding_triton(positions, q, None, cache, head_size)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(q[..., rot:], before_tail)


def test_rotary_embedding_on_strided_qkv_slices() -> None:
    # q and k as column slices of one fused qkv output, as the attention layer produces them.
    head_size, nh, nkv = 32, 4, 2
    qkv = _randn(5, (nh + 2 * nkv) * head_size)
    q, k = qkv[:, : nh * head_size], qkv[:, nh * head_size : (nh + nkv) * head_size]
    v_before = qkv[:, (nh + nkv) * head_size :].clone()
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.tensor([4, 0, 9, 2, 7], device=DEV)
    cache = _cos_sin_cache(16, head_size)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    rotary_embedding_triton(positions, q, k, cache, head_size)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (nh + nkv) * head_size :], v_before)


def test_dispatchers_fall_back_to_reference_on_cpu() -> None:
    x, w = torch.randn(3, 64), torch.randn(64)
    out, res = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6)[0])
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))
    q = torch.randn(3, 2, 64)
    q_ref = q.clone()
    rotary_embedding(torch.arange(3), q, None, _cos_sin_cache(8, 64).cpu(), 64)
    rotary_embedding_ref(torch.arange(3), q_ref, None, _cos_sin_cache(8, 64).cpu(), 64)
    torch.testing.assert_close(q, q_ref)
