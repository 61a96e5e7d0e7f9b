"""AWQ / GPTQ layers on a CPU kept quantized as GGUF blocks (`pagoda.model.quantization.
cpu_blocks`): the blocks dequantize to the checkpoint's own weights (Q4_0 and Q8_0 exactly,
Q4_1 to within the fp16 rounding of its min term), layers without an exact block form stay
dense, a loaded layer runs the quantized GEMM (act order through its input permutation) within
the int8 rounding of the activations of the dense reference, and what it holds."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.cpu import quant
from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from pagoda.model.quantization import AWQLinearMethod, GPTQLinearMethod
from pagoda.model.quantization.cpu_blocks import (
    ActOrderGGUFLinearMethod,
    cpu_blocks_enabled,
    w4_blocks,
    w8_blocks,
)
from pagoda.model.quantization.formats import (
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq_weight,
)
from pagoda.model.quantization.gguf import GGUFLinearMethod, dequantize_weight
from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4, pack_w4
from pagoda.model.quantization.w8_layout import W8Weight, dequantize_w8

pytestmark = pytest.mark.skipif(
    not quant.quant_kernel_available(), reason="the quantized CPU kernel does not build here"
)

N, K = 40, 256


def _w4(group: int, zeros_value: int | None = None, seed: int = 0, k: int = K) -> W4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    values = torch.randint(0, 16, (N, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (groups, N), generator=gen, dtype=torch.uint8)
    if zeros_value is not None:
        zeros.fill_(zeros_value)
    scales = (torch.rand(groups, N, generator=gen) * 0.05 + 1e-3).half()
    return W4Weight(pack_w4(values), scales, zeros, group, None)


@pytest.mark.parametrize("group", [32, 64, 128, K])
def test_4bit_blocks_dequantize_to_the_checkpoint_weights(group: int) -> None:
    w = _w4(group)
    blocks = w4_blocks(w, K)
    assert blocks is not None and blocks.type_name == "Q4_1" and not blocks.x8
    ref = dequantize_w4(w, K)
    got = dequantize_weight(blocks)
    # d = s exactly; m = -s * z rounded to fp16: at most half its ulp.
    g = torch.arange(K) // group
    sz = (w.scales.float() * w.zeros.float())[g].t()
    assert ((got - ref).abs() <= sz * 2.0**-11 + 1e-12).all()
    assert (got - ref).abs().max() > 0  # m did round somewhere: the bound is the one that binds


def test_symmetric_4bit_is_q4_0_exactly() -> None:
    w = _w4(64, zeros_value=8)
    blocks = w4_blocks(w, K)
    assert blocks is not None and blocks.type_name == "Q4_0"
    assert torch.equal(dequantize_weight(blocks), dequantize_w4(w, K))


def _w8(zeros: torch.Tensor | None, seed: int = 1, lo: int = 0, hi: int = 256) -> W8Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = K // 64
    codes = torch.randint(lo, hi, (N, K), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(groups, N, generator=gen) * 0.01 + 1e-4).half()
    return W8Weight(codes, scales, zeros, 64, None)


def test_8bit_blocks_are_q8_0_exactly_where_the_codes_fit() -> None:
    sym = _w8(None)
    blocks = w8_blocks(sym, K)
    assert blocks is not None and blocks.type_name == "Q8_0"
    assert torch.equal(dequantize_weight(blocks), dequantize_w8(sym, K))
    # Asymmetric: codes within 127 of every zero point fit int8 ...
    zeros = torch.full((K // 64, N), 10, dtype=torch.int16)  # z = 138
    fits = _w8(zeros, lo=20, hi=256)
    blocks = w8_blocks(fits, K)
    assert blocks is not None
    assert torch.equal(dequantize_weight(blocks), dequantize_w8(fits, K))
    # ... a code of 0 under z = 138 does not: no exact Q8_0 form.
    assert w8_blocks(_w8(zeros, lo=0, hi=256), K) is None


def test_layers_without_an_exact_block_form_are_refused() -> None:
    assert w4_blocks(_w4(16), K) is None  # groups of half a block
    assert w4_blocks(_w4(64, k=200), 200) is None  # K not whole blocks
    w = _w4(64)
    tiny = W4Weight(w.qweight, w.scales.float() * 1e-7, w.zeros, 64, None)
    assert w4_blocks(tiny, K) is None  # scales fp16 cannot hold
    huge = W4Weight(w.qweight, w.scales.float() * 1e6, w.zeros, 64, None)
    assert w4_blocks(huge, K) is None


def _awq_layer(group: int = 32, dtype: torch.dtype = torch.float32):
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    method = AWQLinearMethod(qc)
    layer = RowParallelLinear(K, 64, bias=False, linear_method=method, params_dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    groups = K // group
    layer.qweight.data.copy_(pack_awq(torch.randint(0, 16, (K, 64), generator=gen)))
    layer.qzeros.data.copy_(pack_awq(torch.randint(0, 16, (groups, 64), generator=gen)))
    layer.scales.data.copy_((torch.rand(groups, 64, generator=gen) * 0.05 + 1e-3).half())
    ref = dequantize_awq(layer.qweight, layer.qzeros, layer.scales, group)
    return layer, method, ref


def _close_to(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < rel, err


def test_a_loaded_awq_layer_runs_its_blocks_and_holds_20_bytes_per_32_weights() -> None:
    layer, method, ref = _awq_layer()
    method.process_weights_after_loading(layer)
    assert type(layer.linear_method) is GGUFLinearMethod
    held = {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}
    assert held == {"weight": K * 64 // 32 * 20}
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    _close_to(layer(x), x @ ref.T, 1.5e-2)  # int8 activations per 32 inputs
    layer.fused_ops = False  # the reference path: the blocks dequantized, F.linear
    torch.testing.assert_close(layer(x), x @ dequantize_weight(layer.gguf_weight).T)
    _close_to(layer(x), x @ ref.T, 1e-3)


def test_a_bf16_model_runs_its_blocks_in_bf16() -> None:
    layer, method, ref = _awq_layer(dtype=torch.bfloat16)
    method.process_weights_after_loading(layer)
    assert type(layer.linear_method) is GGUFLinearMethod
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    y = layer(x.bfloat16())
    assert y.dtype is torch.bfloat16
    _close_to(y, x @ ref.T, 3e-2)


def test_act_order_layer_gathers_its_inputs() -> None:
    group, n = 32, 64
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True}
    method = GPTQLinearMethod(qc)
    layer = MergedColumnParallelLinear(K, [n // 2, n // 2], False, method)
    gen = torch.Generator().manual_seed(6)
    g_idx = (torch.arange(K) // group)[torch.randperm(K, generator=gen)].to(torch.int32)
    layer.qweight.data.copy_(pack_gptq_weight(torch.randint(0, 16, (K, n), generator=gen), 4))
    zeros = torch.randint(0, 16, (n, K // group), generator=gen)
    layer.qzeros.data.copy_(pack_gptq_weight(zeros, 4).t())
    layer.scales.data.copy_((torch.rand(K // group, n, generator=gen) * 0.05 + 1e-3).half())
    layer.g_idx.data.copy_(g_idx.expand(2, K))
    ref = dequantize_gptq(layer.qweight, layer.qzeros, layer.scales, g_idx, 4)
    method.process_weights_after_loading(layer)
    assert type(layer.linear_method) is ActOrderGGUFLinearMethod
    x = torch.randn(4, K, generator=gen)
    _close_to(layer(x), x @ ref.T, 1.5e-2)
    layer.fused_ops = False
    _close_to(layer(x), x @ ref.T, 1e-3)


def test_dense_where_blocks_are_off(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert cpu_blocks_enabled(cpu, torch.float32) and cpu_blocks_enabled(cpu, torch.bfloat16)
    assert not cpu_blocks_enabled(cpu, torch.float16)  # the kernel takes f32 / bf16 activations
    assert not cpu_blocks_enabled(torch.device("cuda"), torch.float32)
    layer, method, ref = _awq_layer(group=16)  # no exact block form
    method.process_weights_after_loading(layer)
    assert type(layer.linear_method) is UnquantizedLinearMethod
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    assert not cpu_blocks_enabled(cpu, torch.float32)
    layer, method, ref = _awq_layer()
    method.process_weights_after_loading(layer)
    assert type(layer.linear_method) is UnquantizedLinearMethod
    torch.testing.assert_close(layer.weight.data, ref)
