"""INT8 W8A8 (SmoothQuant) and FP8: `pagoda quantize --method w8a8` writes a compressed-tensors
checkpoint that compressed-tensors itself decompresses to the weights Pagoda serves, and that
Pagoda loads and runs close to the dense model; `quantization="fp8"` quantizes a dense checkpoint
at load; compressed-tensors FP8 checkpoints load; a checkpoint whose tensors contradict its
quantization_config fails naming the tensor; the dummy presets build every format."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from model_testing import TINY_CONFIG, PagedRunner, make_tiny_checkpoint
from quant_testing import fp8_checkpoint
from safetensors.torch import load_file, save_file

from pagoda.config import ModelConfig
from pagoda.kernels.scaled_mm import FP8_DTYPE, quantize_weight, scaled_mm
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization.smoothquant import (
    quantize_model_w8a8,
    smoothing_scales,
    w8a8_quantization_config,
)
from pagoda.model.quantization.w8a8 import fp8_unsupported_message, parse_compressed_tensors


def _sequences(n: int = 4, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, TINY_CONFIG["vocab_size"], (length,), generator=g).tolist()
        for _ in range(n)
    ]


def _load(path, quantization=None, load_format="auto"):
    hf_config = get_model_config_dict(str(path), load_format)
    mc = ModelConfig(
        model=str(path),
        hf_config=hf_config,
        dtype="float32",
        max_model_len=128,
        quantization=quantization,
        load_format=load_format,
    )
    return load_model(mc, "cpu"), {**TINY_CONFIG, **hf_config}


def _logits(model, cfg, seqs) -> torch.Tensor:
    return torch.cat([PagedRunner(model, cfg).step(s, 0) for s in seqs])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    make_tiny_checkpoint(root / "dense", "llama_untied_linear_rope", num_key_value_heads=4)
    errors = quantize_model_w8a8(str(root / "dense"), str(root / "q"), _sequences())
    return root, errors


def test_smoothing_scales_balance_activation_and_weight_ranges() -> None:
    x_max = torch.tensor([100.0, 1.0, 4.0])
    w = torch.tensor([[1.0, 4.0, 1.0], [-1.0, 1.0, 0.25]])
    s = smoothing_scales(x_max, w, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([10.0, 0.5, 2.0]))
    # After smoothing the input's and the weight's column ranges are equal (alpha = 0.5).
    torch.testing.assert_close(x_max / s, w.abs().amax(0) * s)


def test_w8a8_checkpoint_layout_is_compressed_tensors(w8a8_checkpoint) -> None:
    root, errors = w8a8_checkpoint
    config = json.loads((root / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc == w8a8_quantization_config()
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["type"] == "int"
    assert group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True
    tensors = load_file(str(root / "q" / "model.safetensors"))
    n = TINY_CONFIG["hidden_size"]
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (n, 1)
    assert tensors["model.layers.1.mlp.up_proj.weight"].dtype == torch.int8
    assert "lm_head.weight" in tensors and tensors["lm_head.weight"].dtype == torch.float16
    # Smoothing lowers the W8A8 output error on the calibration inputs on average.
    assert sum(e[0] for e in errors.values()) < sum(e[1] for e in errors.values())


@pytest.mark.parametrize("blocks", [True, False], ids=["q8_0-blocks", "int8-reference"])
def test_w8a8_checkpoint_runs_close_to_the_dense_model(w8a8_checkpoint, monkeypatch, blocks):
    # On a CPU int8 layers are Q8_0 blocks of the quantized GEMM; PAGODA_CPU_QUANTIZED=0 keeps
    # the int8 weight and per-channel scales for the float32 reference product.
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "1" if blocks else "0")
    root, _ = w8a8_checkpoint
    seqs = _sequences(2, 32)
    dense, cfg = _load(root / "dense")
    quant, _ = _load(root / "q")
    layer = quant.model.layers[0].self_attn.qkv_proj
    if blocks:
        assert layer.gguf_weight.type_name == "Q8_0" and layer.weight.dtype == torch.uint8
        assert not hasattr(layer, "weight_scale")
    else:
        assert layer.weight.dtype == torch.int8
        assert layer.weight_scale.shape == (layer.weight.shape[0],)
    assert _rel(_logits(quant, cfg, seqs), _logits(dense, cfg, seqs)) < 0.05


def test_compressed_tensors_decompresses_pagoda_w8a8_to_the_same_weights(
    w8a8_checkpoint, monkeypatch
) -> None:
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the int8 weights as loaded
    ct = pytest.importorskip(
        "compressed_tensors",
        reason="compressed-tensors not installed (pip install --no-deps "
        "compressed-tensors loguru): vLLM's format reader",
    )
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    root, _ = w8a8_checkpoint
    qc = json.loads((root / "q" / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)  # its own parser accepts the config
    assert config.format == "int-quantized"
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    tensors = load_file(str(root / "q" / "model.safetensors"))
    quant, _ = _load(root / "q")
    prefix = "model.layers.1.mlp.down_proj"
    dense = compressor.decompress(
        {"weight": tensors[prefix + ".weight"], "weight_scale": tensors[prefix + ".weight_scale"]},
        scheme,
    )["weight"]
    module = quant.model.layers[1].mlp.down_proj
    ours = module.weight.float() * module.weight_scale[:, None]
    assert torch.equal(dense.float(), ours), ct.__version__
    # The fused q/k/v rows too, shard by shard.
    qkv = quant.model.layers[0].self_attn.qkv_proj
    rows = 0
    for shard in ("q_proj", "k_proj", "v_proj"):
        p = f"model.layers.0.self_attn.{shard}"
        d = compressor.decompress(
            {"weight": tensors[p + ".weight"], "weight_scale": tensors[p + ".weight_scale"]},
            scheme,
        )["weight"]
        ours = (
            qkv.weight[rows : rows + d.shape[0]].float()
            * qkv.weight_scale[rows : rows + d.shape[0], None]
        )
        assert torch.equal(d.float(), ours)
        rows += d.shape[0]


@pytest.mark.parametrize("blocks", [True, False], ids=["q8_0-blocks", "fp8-reference"])
def test_fp8_at_load_runs_close_to_the_dense_model(tmp_path, monkeypatch, blocks) -> None:
    # On a CPU FP8 layers are requantized as Q8_0 blocks of the quantized GEMM;
    # PAGODA_CPU_QUANTIZED=0 keeps the e4m3 weight for the float32 reference product.
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "1" if blocks else "0")
    make_tiny_checkpoint(tmp_path, "llama_mqa_attention_bias")
    seqs = _sequences(2, 32)
    dense, cfg = _load(tmp_path)
    fp8, _ = _load(tmp_path, "fp8")
    layer = fp8.model.layers[1].mlp.gate_up_proj
    if blocks:
        assert layer.gguf_weight.type_name == "Q8_0" and not hasattr(layer, "weight_scale")
    else:
        assert layer.weight.dtype == torch.float8_e4m3fn
    assert _rel(_logits(fp8, cfg, seqs), _logits(dense, cfg, seqs)) < 0.1


def test_norms_and_activation_quantize_for_the_8bit_layers(tmp_path, monkeypatch) -> None:
    # RMSNorm and SiLU-and-mul hand the 8-bit qkv, gate_up and down projections their input
    # quantized (`QuantizedRows`), as they do on CUDA (asked for here on a CPU, where they run
    # the torch references and the reference row quantization); o_proj quantizes its own.
    from pagoda.model.quantization import w8a8

    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the 8-bit layers, not Q8_0 blocks
    make_tiny_checkpoint(tmp_path, "llama_mqa_attention_bias")
    seqs = _sequences(2, 32)
    fp8, cfg = _load(tmp_path, "fp8")
    assert fp8.model.layers[0].self_attn.qkv_proj.input_quantization() is None  # CPU weights
    plain = _logits(fp8, cfg, seqs)
    seen: list[str] = []

    def spy(x, *args):
        seen.append(type(x).__name__)
        return scaled_mm(x, *args)

    monkeypatch.setattr(w8a8, "scaled_mm", spy)
    monkeypatch.setattr(w8a8.W8A8LinearMethod, "input_quantization", lambda m, layer: FP8_DTYPE)
    fused = _logits(fp8, cfg, seqs)
    assert seen.count("QuantizedRows") == 3 * seen.count("Tensor") > 0
    # the same 8-bit rows up to the CPU's own RMSNorm / SiLU ops in the unfused run
    assert _rel(fused, plain) < 1e-3


def test_8bit_layers_ask_for_quantized_input_on_cuda_unless_turned_off(monkeypatch) -> None:
    from types import SimpleNamespace

    from pagoda.model.quantization.w8a8 import W8A8LinearMethod

    method = W8A8LinearMethod()
    layer = SimpleNamespace(weight=SimpleNamespace(is_cuda=True, dtype=torch.int8))
    assert method.input_quantization(layer) == torch.int8
    layer.fused_ops = False  # the reference path: each layer quantizes its own input
    assert method.input_quantization(layer) is None
    layer.fused_ops = True
    monkeypatch.setenv("PAGODA_W8A8_FUSED_QUANT", "0")
    assert method.input_quantization(layer) is None
    monkeypatch.setenv("PAGODA_W8A8_FUSED_QUANT", "1")
    layer.weight.is_cuda = False
    assert method.input_quantization(layer) is None


@pytest.mark.parametrize(
    ("strategy", "static_input", "vllm_format"),
    [("channel", False, False), ("tensor", True, False), ("tensor", True, True)],
)
def test_compressed_tensors_fp8_checkpoints_load(
    tmp_path, monkeypatch, strategy, static_input, vllm_format
):
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the e4m3 weights and scales as loaded
    fp8_checkpoint(tmp_path / "c", strategy, static_input, vllm_format)
    make_tiny_checkpoint(tmp_path / "d", "llama_gqa_tied_llama3_rope")
    seqs = _sequences(2, 32)
    dense, cfg = _load(tmp_path / "d")
    fp8, _ = _load(tmp_path / "c")
    qkv = fp8.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dim() == 1
    if strategy == "tensor":  # q, k and v each keep their own scale
        sizes = qkv.output_partition_sizes
        assert qkv.weight_scale[0] != qkv.weight_scale[sizes[0]]
    assert _rel(_logits(fp8, cfg, seqs), _logits(dense, cfg, seqs)) < 0.1


def test_a_checkpoint_contradicting_its_config_fails_naming_the_tensor(
    w8a8_checkpoint, tmp_path
) -> None:
    root, _ = w8a8_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((root / "q" / "config.json").read_text())
    tensors = load_file(str(root / "q" / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].half()  # a dense weight where int8 is promised
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj\.weight.*float16.*torch\.int8"):
        _load(bad)
    tensors = load_file(str(root / "q" / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(1)  # per-tensor, not channel
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale.*shape"):
        _load(bad)


def test_unsupported_compressed_tensors_configs_name_the_field() -> None:
    qc = w8a8_quantization_config()
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match="num_bits"):
        parse_compressed_tensors(qc)
    qc = w8a8_quantization_config()
    qc["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(ValueError, match="weights only"):
        parse_compressed_tensors(qc)
    qc = w8a8_quantization_config()
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ValueError, match="asymmetric"):
        parse_compressed_tensors(qc)


def test_fp8_on_a_gpu_without_fp8_names_the_problem() -> None:
    message = fp8_unsupported_message((8, 0), "NVIDIA A100-SXM4-80GB")
    assert "FP8" in message and "sm_80" in message and "A100" in message and "8.9" in message
    assert fp8_unsupported_message((8, 9), "NVIDIA L4") is None
    assert fp8_unsupported_message((9, 0), "NVIDIA H200") is None


@pytest.mark.parametrize("quantization", ["awq", "gptq", "w8a8", "fp8"])
def test_dummy_presets_build_quantized_layers(tmp_path, quantization) -> None:
    from pagoda.model.quantization.gguf import dequantize_weight

    make_tiny_checkpoint(tmp_path, "llama_gqa_tied_llama3_rope")
    model, cfg = _load(tmp_path / "config.json", quantization, load_format="dummy")
    layer = model.model.layers[0].mlp.down_proj
    if quantization in ("w8a8", "fp8"):  # a CPU runs int8 and FP8 layers as Q8_0 blocks
        assert layer.gguf_weight.type_name == "Q8_0"
    else:  # a CPU runs 4-bit layers as GGUF blocks: random nibbles, non-zero weights
        assert layer.gguf_weight.type_name in ("Q4_0", "Q4_1")
        assert dequantize_weight(layer.gguf_weight).abs().sum() > 0
    logits = _logits(model, cfg, _sequences(1, 16))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_the_engine_takes_a_w8a8_checkpoint_by_its_names(w8a8_checkpoint) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.engine.arg_utils import EngineArgs

    root, _ = w8a8_checkpoint
    path = str(root / "q")
    assert EngineArgs(model=path).create_engine_config().model_config.quantization == (
        "compressed-tensors"
    )
    for name in ("w8a8", "compressed-tensors"):
        assert EngineArgs(model=path, quantization=name).create_engine_config()
    with pytest.raises(ValueError, match="'compressed-tensors' checkpoint"):
        EngineArgs(model=path, quantization="fp8").create_engine_config()
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["w8a8", "fp8"])
def test_gpu_engine_runs_8bit_dummy_weights_in_cuda_graphs(
    tmp_path, quantization, monkeypatch
) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.kernels.scaled_mm import fp8_supported

    if quantization == "fp8" and not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY_CONFIG,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    # CUDA graphs replay the same kernels: the same greedy tokens; so do the layers quantizing
    # their own inputs (the same 8-bit rows as RMSNorm / SiLU-and-mul write for them).
    runs = (("eager", True, "1"), ("graphs", False, "1"), ("unfused", False, "0"))
    for name, eager, fused_quant in runs:
        monkeypatch.setenv("PAGODA_W8A8_FUSED_QUANT", fused_quant)
        llm = LLM(
            str(tmp_path / "config.json"),
            load_format="dummy",
            quantization=quantization,
            skip_tokenizer_init=True,
            enforce_eager=eager,
            max_model_len=128,
            kv_cache_memory_bytes=64 << 20,
        )
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        gc.collect()  # the engine's reference cycles: its KV cache freed before the next one
        torch.cuda.empty_cache()
    assert outs["eager"] == outs["graphs"] == outs["unfused"]
    assert all(len(t) == 8 for t in outs["eager"])


def _cpu_8bit_layer(dtype: torch.dtype, x_dtype: torch.dtype):
    """A 96 x 256 layer quantized per channel to `dtype` and installed as on a CPU (`_finish`),
    with its input (an outlier channel, as LLM activations have), float weight and bias;
    skips where the quantized CPU GEMM does not build."""
    from pagoda.kernels.cpu import quant
    from pagoda.model.quantization.w8a8 import _finish

    if not quant.quant_kernel_available():
        pytest.skip("the quantized CPU GEMM does not build here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g)
    x[:, 7] *= 20.0
    w = torch.randn(96, 256, generator=g) * 0.05
    w[3, 32:64] = 0.0  # an all-zero block
    bias = torch.randn(96, generator=g)
    w_q, w_scale = quantize_weight(w, dtype)
    layer = torch.nn.Module()
    layer.params_dtype = x_dtype
    _finish(layer, w_q, w_scale)
    return x, w, bias, w_q, w_scale, layer


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_layers_run_the_quantized_cpu_gemm(x_dtype) -> None:
    """On a CPU an FP8 layer is requantized as Q8_0 blocks (each block's max / 127 its scale):
    every weight within half a Q8_0 step of its e4m3 value, and the product no further from
    the float one than the FP8 reference's (e4m3 activations per token)."""
    from pagoda.kernels.scaled_mm import scaled_mm_ref
    from pagoda.model.quantization.cpu_blocks import fp8_blocks
    from pagoda.model.quantization.gguf import GGUFLinearMethod, dequantize_weight
    from pagoda.model.quantization.w8a8 import _finish

    x, w, bias, w_q, w_scale, layer = _cpu_8bit_layer(FP8_DTYPE, x_dtype)
    assert type(layer.linear_method) is GGUFLinearMethod
    assert layer.gguf_weight.type_name == "Q8_0" and not hasattr(layer, "weight_scale")
    ref_w = (w_q.float() * w_scale.reshape(-1, 1)).view(96, 8, 32)
    half_step = ref_w.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10)  # d rounded to fp16
    got = dequantize_weight(layer.gguf_weight).view(96, 8, 32)
    assert ((got - ref_w).abs() <= half_step).all() and (got[3, 1] == 0).all()
    y = layer.linear_method.apply(layer, x.to(x_dtype), bias.to(x_dtype)).double()
    assert y.shape == (5, 96)
    exact = x.double() @ w.double().T + bias.double()
    ref = scaled_mm_ref(x, w_q, w_scale.reshape(-1), bias).double()
    slack = 0.01 if x_dtype == torch.bfloat16 else 0.0
    assert _rel(y, exact) <= _rel(ref, exact) + slack
    # K not a multiple of 32, or a block's scale below fp16's normal range: the plain path
    assert fp8_blocks(w_q[:, :250].contiguous(), w_scale) is None
    assert fp8_blocks(w_q, torch.full((96,), 1e-9)) is None
    plain = torch.nn.Module()
    _finish(plain, w_q[:, :250].contiguous(), w_scale)
    assert plain.weight.dtype == FP8_DTYPE and plain.weight_scale.shape == (96,)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_layers_run_the_quantized_cpu_gemm(x_dtype) -> None:
    """On a CPU an int8 layer becomes Q8_0 blocks of the quantized GEMM (its codes as they
    are, the per-channel scale in fp16, activations quantized per 32 values): no further from
    the float product than the per-token reference."""
    from pagoda.kernels.scaled_mm import scaled_mm_ref
    from pagoda.model.quantization.cpu_blocks import int8_blocks
    from pagoda.model.quantization.gguf import GGUFLinearMethod, dequantize_weight
    from pagoda.model.quantization.w8a8 import _finish

    x, w, bias, w_q, w_scale, layer = _cpu_8bit_layer(torch.int8, x_dtype)
    assert type(layer.linear_method) is GGUFLinearMethod
    assert layer.gguf_weight.type_name == "Q8_0" and not hasattr(layer, "weight_scale")
    # The blocks hold the codes and the scales rounded to fp16: at most 2**-11 of a weight.
    ref_w = w_q.float() * w_scale.reshape(-1, 1)
    assert ((dequantize_weight(layer.gguf_weight) - ref_w).abs() <= ref_w.abs() * 2**-11).all()
    y = layer.linear_method.apply(layer, x.to(x_dtype), bias.to(x_dtype))
    assert y.dtype == x_dtype and y.shape == (5, 96)
    exact = x.double() @ w.double().T + bias.double()
    ref = scaled_mm_ref(x, w_q, w_scale.reshape(-1), bias).double()
    # per-32 activation scales: no worse than per-token ones (better beside an outlier)
    tol = (ref - exact).abs().max() + (0.05 if x_dtype == torch.bfloat16 else 0.0)
    assert (y.double() - exact).abs().max() <= tol
    # K not a multiple of 32, or a scale below fp16's normal range: the plain path instead
    assert int8_blocks(w_q[:, :250].contiguous(), w_scale) is None
    assert int8_blocks(w_q, torch.full((96,), 1e-6)) is None
    plain = torch.nn.Module()
    _finish(plain, w_q[:, :250].contiguous(), w_scale)
    assert plain.weight.dtype == torch.int8 and plain.weight_scale.shape == (96,)
