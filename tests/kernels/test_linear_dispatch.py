"""The dense-linear dispatch (`pagoda.kernels.linear`) on CPU tensors: for each representative
case, which kernel it picks (spied on where the dispatch looks it up), that its output is that
kernel's output bit for bit, and that it matches the torch reference (`fused_ops` off).

Cases: a packed bf16 layer (the packed GEMM at every row count); a float32 layer with at most
MAX_GEMV_ROWS rows (the C skinny GEMM) and with more (F.linear); the LM head in bf16 (a packed
copy), in float32, and kept as GGUF blocks (the quantized GEMM); the fused SiLU-and-mul GEMV,
which is CUDA's only. On a GPU (`-m gpu`), the CUDA rules: the GEMV for one row, the skinny
GEMM for a few, cuBLAS for many and for float32 logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu
from pagoda.kernels import linear as dispatch
from pagoda.kernels.cpu import gemm, quant
from pagoda.kernels.linear import dense_linear, lm_head_logits, silu_and_mul_linear
from pagoda.kernels.reference import silu_and_mul_ref
from pagoda.model.layers.linear import ReplicatedLinear
from pagoda.model.layers.vocab_embedding import ParallelLMHead

needs_cpu_ops = pytest.mark.skipif(
    not cpu.cpu_ops_available(), reason="C CPU ops unavailable (no C compiler?)"
)

BF16, F32 = torch.bfloat16, torch.float32
FP32_ROWS = cpu.MAX_GEMV_ROWS[F32]


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the kernels the dispatch runs, in order (none: it fell back to F.linear)."""
    calls: list[str] = []

    def spy(module, name: str, label: str) -> None:
        kernel = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(label)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(gemm, "packed_linear", "packed")
    spy(cpu, "linear", "skinny")  # `pagoda.kernels.linear` calls `cpu.linear`
    spy(quant, "quant_linear", "quant")
    return calls


def _layer(n: int, k: int, dtype: torch.dtype) -> ReplicatedLinear:
    layer = ReplicatedLinear(k, n, bias=True, params_dtype=dtype)
    layer.weight.data.copy_(_randn(n, k, seed=n, dtype=dtype))
    layer.bias.data.copy_(_randn(n, seed=k, dtype=dtype))
    layer.linear_method.process_weights_after_loading(layer)
    return layer


def _reference(layer: ReplicatedLinear, x: torch.Tensor) -> torch.Tensor:
    layer.fused_ops = False
    try:
        return layer(x)
    finally:
        layer.fused_ops = True


@needs_cpu_ops
@pytest.mark.parametrize("m", [1, 5, 40, 300])
def test_a_packed_bf16_layer_takes_the_packed_gemm_at_every_row_count(m, kernel_calls):
    layer = _layer(40, 48, BF16)
    assert gemm.is_packed(layer.weight)
    x = _randn(m, 48, seed=m, dtype=BF16)
    y = layer(x)
    assert kernel_calls == ["packed"]
    assert torch.equal(y, gemm.packed_linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(y, _reference(layer, x), rtol=2**-7, atol=1e-2)


@needs_cpu_ops
@pytest.mark.parametrize(
    "m,kernel", [(1, ["skinny"]), (FP32_ROWS, ["skinny"]), (FP32_ROWS + 1, []), (300, [])]
)
def test_a_float32_layer_takes_the_skinny_gemm_for_few_rows_else_f_linear(m, kernel, kernel_calls):
    layer = _layer(40, 48, F32)
    assert not gemm.is_packed(layer.weight)  # only bf16 weights are packed
    x = _randn(m, 48, seed=m)
    y = layer(x)
    assert kernel_calls == kernel
    ref = _reference(layer, x)
    if kernel:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(y, ref)
    assert torch.equal(dense_linear(x, layer.weight, layer.bias), y)


@needs_cpu_ops
def test_dense_linear_writes_float32_from_a_plain_bf16_weight(kernel_calls):
    w, x = _randn(24, 32, dtype=BF16), _randn(3, 32, seed=1, dtype=BF16)
    y = dense_linear(x, w, out_dtype=F32)
    assert kernel_calls == ["skinny"] and y.dtype is F32
    assert torch.equal(y, cpu.linear(x, w, out_dtype=F32))
    torch.testing.assert_close(y, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)


def _lm_head(vocab: int, hidden: int, dtype: torch.dtype) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    head.weight.data.copy_(_randn(vocab, hidden, seed=vocab, dtype=dtype))
    return head


@needs_cpu_ops
@pytest.mark.parametrize("m", [1, 100])
def test_a_bf16_lm_head_takes_its_packed_copy_to_float32(m, kernel_calls):
    head = _lm_head(70, 64, BF16)
    x = _randn(m, 64, seed=m, dtype=BF16)
    logits = lm_head_logits(x, head)
    assert kernel_calls == ["packed"] and logits.dtype is F32
    assert not gemm.is_packed(head.weight)  # the plain weight stays (tied embedding)
    assert torch.equal(logits, gemm.packed_linear(x, head.packed_weight, out_dtype=F32))
    torch.testing.assert_close(logits, F.linear(x.float(), head.weight.float()))


@needs_cpu_ops
@pytest.mark.parametrize("m,kernel", [(2, ["skinny"]), (FP32_ROWS + 1, [])])
def test_a_float32_lm_head_takes_the_skinny_gemm_for_few_rows_else_f_linear(
    m, kernel, kernel_calls
):
    head = _lm_head(70, 64, F32)
    x = _randn(m, 64, seed=m)
    logits = lm_head_logits(x, head)
    assert kernel_calls == kernel and logits.dtype is F32
    ref = head.compute_logits(x)  # the reference: F.linear
    if kernel:
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(logits, ref)


@needs_cpu_ops
@pytest.mark.skipif(not quant.quant_kernel_available(), reason="quantized CPU GEMM unavailable")
def test_a_gguf_lm_head_takes_the_quantized_gemm(kernel_calls):
    from pagoda.model.loader.gguf_quants import GGML_BLOCK_SIZES
    from pagoda.model.quantization.gguf import dequantize_weight

    vocab, hidden, q8_0 = 40, 64, 8
    elems, nbytes = GGML_BLOCK_SIZES[q8_0]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(vocab, hidden // elems, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((vocab, hidden // elems)) * 0.02).astype(np.float16)
    raw[:, :, :2] = scales.view(np.uint8).reshape(vocab, hidden // elems, 2)
    blocks = quant.QuantWeight(torch.from_numpy(raw.reshape(vocab, -1)), q8_0, vocab, hidden)
    head = ParallelLMHead(vocab, hidden)
    head.weight.weight_loader(head.weight, blocks)
    x = _randn(3, hidden)
    logits = lm_head_logits(x, head)
    assert kernel_calls == ["quant"] and logits.dtype is F32
    assert torch.equal(logits, quant.quant_linear(x, head.weight.quant, out_dtype=F32))
    # The reference (`LlamaForCausalLM.compute_logits` with fused ops off) dequantizes; the
    # kernel differs from it by the int8 rounding of the activations.
    ref = F.linear(x, dequantize_weight(head.weight.quant))
    torch.testing.assert_close(logits, ref, rtol=0.0, atol=0.05 * ref.abs().max().item())


def test_the_fused_silu_and_mul_gemv_is_cuda_only():
    gate_up, w = _randn(1, 64), _randn(16, 32)
    assert silu_and_mul_linear(gate_up, w) is None  # CPU: the activation, then down_proj
    assert silu_and_mul_linear(gate_up, None) is None  # no dense weight (4-bit kept packed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_rules(monkeypatch):
    picked: list[str] = []

    def spy(name: str, label: str) -> None:
        kernel = getattr(dispatch, name)

        def wrapped(*args, **kwargs):
            y = kernel(*args, **kwargs)
            if y is not None:
                picked.append(label)
            return y

        monkeypatch.setattr(dispatch, name, wrapped)

    spy("one_row_linear", "gemv")
    spy("few_rows_linear", "skinny")
    w = _randn(4096, 4096, seed=1, dtype=BF16).cuda()
    for m, expect in ((1, ["gemv"]), (8, ["skinny"]), (512, [])):
        picked.clear()
        x = _randn(m, 4096, seed=m, dtype=BF16).cuda()
        y = dense_linear(x, w)
        assert picked == expect, m
        if not expect:
            assert torch.equal(y, F.linear(x, w))  # cuBLAS
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=0.5)

    head = ParallelLMHead(4096, 4096, params_dtype=BF16).cuda()
    head.weight.data.copy_(w)
    for m, expect in ((1, ["gemv"]), (100, [])):
        picked.clear()
        x = _randn(m, 4096, seed=m, dtype=BF16).cuda()
        logits = lm_head_logits(x, head)
        assert picked == expect and logits.dtype is F32, m
        if not expect:  # cuBLAS writing float32 from its accumulators
            assert torch.equal(logits, torch.mm(x, w.t(), out_dtype=F32))
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(logits, ref, rtol=1e-2, atol=1e-2)

    gate_up = _randn(1, 2 * 4096, seed=5, dtype=BF16).cuda()
    y = silu_and_mul_linear(gate_up, w)
    assert y is not None
    ref = F.linear(silu_and_mul_ref(gate_up.float()), w.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=0.5)
