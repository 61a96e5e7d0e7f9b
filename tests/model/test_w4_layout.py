"""AWQ and GPTQ layers repacked into the W4A16 kernel's layout (torch only, no kernel): the
nibble order bit by bit, repacked weights that dequantize to exactly what the checkpoint's own
dequantization gives (ragged last group, GPTQ act-order sorted by group), the act-order cases
that cannot be one permutation, and which path a loaded layer takes (packed on CUDA with
triton, dense on a CPU with PAGODA_CPU_QUANTIZED=0 or with PAGODA_W4A16=0; 8-bit GPTQ kept
8-bit for the W8A16 kernel, whose layout tests/kernels/test_w8a16.py checks)."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from pagoda.model.quantization import (
    AWQLinearMethod,
    GPTQLinearMethod,
    W4A16LinearMethod,
    w4a16_enabled,
)
from pagoda.model.quantization.formats import (
    AWQ_ORDER,
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq_weight,
)
from pagoda.model.quantization.w4_layout import (
    act_order_perm,
    awq_to_w4,
    dequantize_w4,
    gptq_to_w4,
    pack_w4,
    unpack_w4,
)

N, K, G = 48, 200, 64  # groups of 64, 64, 64 and 8


def _random(k: int, n: int, groups: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 1e-3).half()
    return values, zeros, scales, gen


def _gptq_zeros(zeros: torch.Tensor) -> torch.Tensor:
    return pack_gptq_weight(zeros.t().contiguous(), 4).t().contiguous()


def test_words_hold_consecutive_inputs_in_awq_nibble_order() -> None:
    values = torch.randint(0, 16, (3, 21), generator=torch.Generator().manual_seed(0))
    packed = pack_w4(values)
    assert packed.shape == (3, 3) and packed.dtype == torch.int32  # K padded to 24
    for j in range(3):
        for s in range(8):
            k = 8 * j + AWQ_ORDER[s]
            expect = values[:, k] if k < 21 else torch.zeros(3, dtype=values.dtype)
            assert torch.equal((packed[:, j] >> (4 * s)) & 0xF, expect)
    assert torch.equal(unpack_w4(packed, 21).long(), values)


def test_awq_repacked_dequantizes_exactly() -> None:
    values, zeros, scales, _ = _random(K, N, 4, seed=1)
    qweight, qzeros = pack_awq(values), pack_awq(zeros)
    w4 = awq_to_w4(qweight, qzeros, scales, G)
    assert w4.qweight.shape == (N, 25) and w4.zeros.dtype == torch.uint8 and w4.perm is None
    assert torch.equal(dequantize_w4(w4, K), dequantize_awq(qweight, qzeros, scales, G))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repacked_dequantizes_exactly(act_order: bool) -> None:
    values, zeros, scales, gen = _random(K, N, 4, seed=2)
    g_idx = torch.arange(K, dtype=torch.int32) // G
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    qweight, qzeros = pack_gptq_weight(values, 4), _gptq_zeros(zeros)
    w4 = gptq_to_w4(qweight, qzeros, scales, g_idx[None], G)
    assert (w4.perm is not None) == act_order
    assert int(w4.zeros.max()) <= 16  # stored zero - 1, plus 1
    if act_order:  # inputs sorted by group: groups of G consecutive inputs again
        assert torch.equal(g_idx[w4.perm.long()], torch.arange(K, dtype=torch.int32) // G)
    ref = dequantize_gptq(qweight, qzeros, scales, g_idx, 4)
    assert torch.equal(dequantize_w4(w4, K), ref)


def test_act_order_must_be_one_permutation_of_whole_groups() -> None:
    gen = torch.Generator().manual_seed(3)
    plain = torch.arange(K, dtype=torch.int32) // G
    a, b = plain[torch.randperm(K, generator=gen)], plain[torch.randperm(K, generator=gen)]
    assert act_order_perm(torch.stack([plain, plain]), G) is None
    assert act_order_perm(torch.stack([a, a]), G) is not None
    with pytest.raises(ValueError, match="different g_idx"):
        act_order_perm(torch.stack([a, b]), G)  # q and k ordered differently share x
    uneven = plain.clone()
    uneven[60:70] = 0  # group 0 holds 70 inputs
    with pytest.raises(ValueError, match="groups of group_size"):
        act_order_perm(uneven[None], G)
    values, zeros, scales, _ = _random(K, N, 4, seed=4)
    args = (pack_gptq_weight(values, 4), _gptq_zeros(zeros), scales)
    assert gptq_to_w4(*args, torch.stack([a, b]), G) is None  # the layer stays dense


def _gptq_layer(bits: int, n: int = 64, k: int = 128, seed: int = 5):
    """A loaded (random) GPTQ MergedColumnParallelLinear on the CPU."""
    qc = {"quant_method": "gptq", "bits": bits, "group_size": 32}
    method = GPTQLinearMethod(qc)
    layer = MergedColumnParallelLinear(k, [n // 2, n // 2], False, method)
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        if name in ("qweight", "qzeros"):
            p.data.copy_(torch.randint(-(2**31), 2**31 - 1, p.shape, generator=gen))
        elif name == "scales":
            p.data.copy_(torch.rand(p.shape, generator=gen) * 0.05)
    return layer, method


def test_a_cpu_layer_is_dequantized_to_a_dense_weight(monkeypatch) -> None:
    # With PAGODA_CPU_QUANTIZED on (the default) it becomes GGUF blocks instead:
    # tests/model/test_cpu_blocks.py.
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    assert not w4a16_enabled(torch.device("cpu"))
    layer, method = _gptq_layer(bits=4)
    ref = dequantize_gptq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx[0], 4)
    method.process_weights_after_loading(layer)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod)
    assert not any(name.startswith(("w4_", "q")) for name, _ in layer.named_parameters())
    layer.fused_ops = False  # F.linear on the dense weight
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ ref.T, atol=1e-5, rtol=1e-5)


def test_w4a16_needs_cuda_and_can_be_turned_off(monkeypatch) -> None:
    cuda = torch.device("cuda")
    from pagoda.kernels import triton_available

    assert w4a16_enabled(cuda) == triton_available()
    monkeypatch.setenv("PAGODA_W4A16", "0")
    assert not w4a16_enabled(cuda)


def test_8bit_gptq_is_not_repacked() -> None:
    layer, method = _gptq_layer(bits=8)
    assert not method.repack_to_w4a16(layer)  # 8-bit layers take the W8A16 layout instead
    assert isinstance(layer.linear_method, GPTQLinearMethod) and hasattr(layer, "qweight")


def test_w8a16_needs_cuda_and_can_be_turned_off(monkeypatch) -> None:
    from pagoda.kernels import triton_available
    from pagoda.model.quantization import w8a16_enabled

    assert not w8a16_enabled(torch.device("cpu"))
    assert w8a16_enabled(torch.device("cuda")) == triton_available()
    monkeypatch.setenv("PAGODA_W8A16", "0")
    assert not w8a16_enabled(torch.device("cuda"))


def test_8bit_layer_kept_8bit_holds_a_byte_per_weight() -> None:
    """What a CUDA layer keeps (repacked here on the CPU, where it does not run): K*N bytes of
    codes, a scale and an int16 zero per group and output, the checkpoint's tensors gone."""
    from pagoda.model.quantization import W8A16LinearMethod

    layer, method = _gptq_layer(bits=8)
    assert method.repack_to_w8a16(layer)
    assert isinstance(layer.linear_method, W8A16LinearMethod) and layer.weight is None
    k, n = layer.input_size_per_partition, sum(layer.output_partition_sizes)
    groups = k // method.group_size
    held = {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}
    assert held == {"w8_qweight": k * n, "w8_scales": groups * n * 2, "w8_zeros": groups * n * 2}


def test_repacked_layer_holds_half_a_byte_per_weight() -> None:
    """What a CUDA layer keeps (repacked here on the CPU, where it does not run): K*N/2 bytes
    of weights and 3 bytes per group and output, the checkpoint's tensors gone."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    method = AWQLinearMethod(qc)
    layer = RowParallelLinear(256, 64, bias=False, linear_method=method)
    for p in layer.parameters():
        p.data.copy_(torch.randint_like(p, 0, 1 << 30) if p.dtype == torch.int32 else 0.01)
    assert method.repack_to_w4a16(layer)
    assert isinstance(layer.linear_method, W4A16LinearMethod) and layer.weight is None
    held = {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}
    assert held == {"w4_qweight": 256 * 64 // 2, "w4_scales": 8 * 64 * 2, "w4_zeros": 8 * 64}


def test_llama_mlp_takes_the_activation_from_a_method_that_fuses_it(monkeypatch) -> None:
    import torch.nn.functional as F

    from pagoda.model.models.llama import LlamaMLP

    mlp = LlamaMLP({"hidden_size": 8, "intermediate_size": 6}, None)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(3, 8)
    ref = mlp(x)
    method, calls = mlp.gate_up_proj.linear_method, []

    def fused(layer, x, bias=None):  # what W4A16LinearMethod's kernel gives on a GPU
        calls.append(tuple(x.shape))
        y = method.apply(layer, x, bias)
        return F.silu(y[..., :6]) * y[..., 6:]

    monkeypatch.setattr(method, "apply_silu_and_mul", fused)
    monkeypatch.setattr(mlp.act_fn, "forward", lambda *a: pytest.fail("activation run twice"))
    torch.testing.assert_close(mlp(x), ref)
    assert calls == [(3, 8)]
    mlp.act_fn.fused_ops = False  # the reference path never asks for it
    monkeypatch.undo()
    monkeypatch.setattr(method, "apply_silu_and_mul", lambda *a: pytest.fail("fused asked"))
    torch.testing.assert_close(mlp(x), ref)
