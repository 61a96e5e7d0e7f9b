"""`pagoda plan` on a CPU for AWQ, GPTQ, W8A8 and FP8 checkpoints against what the loader makes
of them (`quantization/cpu_blocks.py`): the GGUF block type the plan names is the loaded linear
layers' (or none where they are dequantized / 8-bit), and the plan's weights are the loaded
model's to the byte, the rotary cache aside (the plan leaves it out) and dense layers at their
logical size (the packed GEMM pads their rows)."""

from __future__ import annotations

import pytest
from model_testing import make_tiny_checkpoint
from quant_testing import fp8_checkpoint, quantized_checkpoint, quantized_moe_checkpoint

from pagoda.cli import build_parser
from pagoda.config import ModelConfig
from pagoda.kernels.cpu import quant
from pagoda.model.layers.linear import UnquantizedLinearMethod
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization.smoothquant import quantize_model_w8a8

pytestmark = pytest.mark.skipif(
    not quant.quant_kernel_available(), reason="the quantized CPU kernel does not build here"
)


def _w8a8(tmp_path):
    make_tiny_checkpoint(tmp_path / "dense", "llama_untied_linear_rope", num_key_value_heads=4)
    calibration = [[(7 * i + j) % 128 for j in range(32)] for i in range(2)]
    quantize_model_w8a8(str(tmp_path / "dense"), str(tmp_path / "q"), calibration)
    return tmp_path / "q"


def _dense(tmp_path):
    make_tiny_checkpoint(tmp_path, "llama_untied_linear_rope")
    return tmp_path


# name -> (writes the checkpoint under a directory and returns its path, --quantization, the
# block type its linear layers become; None: they stay dense or 8-bit)
CASES = {
    "awq": (lambda p: quantized_checkpoint(p, "awq")[1], None, "Q4_1"),
    "gptq4": (lambda p: quantized_checkpoint(p, "gptq")[1], None, "Q4_1"),
    "gptq4-sym": (lambda p: quantized_checkpoint(p, "gptq", sym=True)[1], None, "Q4_0"),
    "gptq4-act-order": (lambda p: quantized_checkpoint(p, "gptq", act_order=True)[1], None, "Q4_1"),
    "gptq8-sym": (lambda p: quantized_checkpoint(p, "gptq", bits=8, sym=True)[1], None, "Q8_0"),
    "gptq8-asym": (lambda p: quantized_checkpoint(p, "gptq", bits=8)[1], None, None),
    "mixtral-awq": (lambda p: quantized_moe_checkpoint(p, "mixtral", "awq")[1], None, "Q4_1"),
    "qwen3-moe-gptq8": (
        lambda p: quantized_moe_checkpoint(p, "qwen3_moe", "gptq", bits=8, sym=True)[1],
        None,
        "Q8_0",
    ),
    "qwen3-moe-gptq4-act-order": (
        lambda p: quantized_moe_checkpoint(p, "qwen3_moe", "gptq", act_order=True)[1],
        None,
        "Q4_1",
    ),
    # the shared expert's blocks, its gate and the router dense, the q/k/v biases
    "qwen2-moe-awq": (lambda p: quantized_moe_checkpoint(p, "qwen2_moe", "awq")[1], None, "Q4_1"),
    "w8a8": (_w8a8, None, "Q8_0"),
    "fp8-compressed-tensors": (
        lambda p: fp8_checkpoint(p, "channel", static_input=False) or p,
        None,
        "Q8_0",
    ),
    "fp8-at-load": (_dense, "fp8", "Q8_0"),
}


def _plan(path, quantization: str | None):
    from pagoda.plan import make_plan

    argv = ["plan", str(path), "--device", "cpu"]
    argv += ["--quantization", quantization] if quantization else []
    return make_plan(build_parser(only="plan").parse_args(argv))


def _loaded(path, plan):
    """The model as the engine loads it for `plan`: (its weights' bytes as the plan counts
    them, the GGUF block types of its linear layers)."""
    hf_config = get_model_config_dict(str(path), "auto")
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype=plan.dtype, max_model_len=128,
        quantization=plan.quantization,
    )  # fmt: skip
    model = load_model(mc, "cpu")
    total, types, seen = 0, set(), set()
    for name, module in model.named_modules():
        if "rotary_emb" in name:
            continue
        if isinstance(getattr(module, "linear_method", None), UnquantizedLinearMethod):
            n, k = module.output_size_per_partition, module.input_size_per_partition
            total += n * k * module.weight.element_size()
            bias = module.bias
            total += 0 if bias is None else bias.numel() * bias.element_size()
            continue
        if getattr(module, "gguf_weight", None) is not None:
            types.add(module.gguf_weight.type_name)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.data_ptr() not in seen:  # a tied LM head is the embedding
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total, types


@pytest.mark.parametrize("case", CASES)
def test_plan_on_a_cpu_names_the_blocks_and_bytes_the_loader_makes(tmp_path, case) -> None:
    write, quantization, block = CASES[case]
    path = write(tmp_path)
    plan = _plan(path, quantization)
    nbytes, types = _loaded(path, plan)
    assert types == ({block} if block else set())
    if block:
        assert f"as {block} GGUF blocks" in plan.weights_note
    else:
        assert "dequantized" in plan.weights_note
    assert plan.weights_bytes == nbytes


@pytest.mark.parametrize("case", ["awq", "gptq4-act-order", "qwen2-moe-awq", "w8a8", "fp8-at-load"])
def test_plan_follows_pagoda_cpu_quantized_0(tmp_path, monkeypatch, case) -> None:
    """PAGODA_CPU_QUANTIZED=0: AWQ / GPTQ dequantized at load, W8A8 / FP8 8-bit layers."""
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    write, quantization, _ = CASES[case]
    path = write(tmp_path)
    plan = _plan(path, quantization)
    nbytes, types = _loaded(path, plan)
    assert not types and "GGUF" not in plan.weights_note
    assert plan.weights_bytes == nbytes


def test_plan_refuses_a_quantization_the_checkpoint_is_not(tmp_path) -> None:
    path = CASES["fp8-compressed-tensors"][0](tmp_path)
    assert _plan(path, "fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="is a 'compressed-tensors' checkpoint"):
        _plan(path, "w8a8")
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        _plan(_dense(tmp_path / "dense"), "w8a8")
