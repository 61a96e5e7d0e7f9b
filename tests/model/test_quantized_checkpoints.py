"""AWQ and GPTQ checkpoints: the packing layouts bit by bit (AutoAWQ's interleaved nibbles,
GPTQ's input-packed words and zero-minus-one), and tiny Llama checkpoints quantized into each
format that Pagoda loads and runs with the logits of `transformers` on the dequantized weights
(act-order g_idx included); config detection and clear errors. On a GPU (marked `gpu`): 4-bit
layers stay packed (the W4A16 kernel), 8-bit GPTQ ones 8-bit (the W8A16 kernel, whose own tests
are tests/kernels/test_w8a16.py), and compute what the CPU's dense layers do, and the
engine's greedy tokens are the same with CUDA graphs, eagerly and on the torch reference path."""

from __future__ import annotations

import json

import pytest
import torch
from model_testing import TINY_CONFIG, PagedRunner
from quant_testing import quantized_checkpoint

from pagoda.config import ModelConfig
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.layers.linear import LinearBase
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization.formats import (
    AWQ_ORDER,
    pack_awq,
    pack_gptq_weight,
    unpack_awq,
    unpack_gptq_weight,
)


def test_awq_nibbles_are_interleaved() -> None:
    v = torch.randint(0, 16, (5, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = pack_awq(v)
    for j in range(2):
        for s in range(8):
            assert torch.equal((packed[:, j] >> (4 * s)) & 0xF, v[:, 8 * j + AWQ_ORDER[s]])
    assert torch.equal(unpack_awq(packed), v)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_words_pack_inputs(bits: int) -> None:
    per = 32 // bits
    v = torch.randint(0, 1 << bits, (4 * per, 6), dtype=torch.int32)
    packed = pack_gptq_weight(v, bits)
    assert packed.shape == (4, 6)
    for i in range(4):
        for s in range(per):
            assert torch.equal((packed[i] >> (bits * s)) & ((1 << bits) - 1), v[per * i + s])
    assert torch.equal(unpack_gptq_weight(packed, bits), v)


@pytest.mark.parametrize(
    "method,bits,act_order,sym",
    [
        ("awq", 4, False, False),
        ("gptq", 4, False, False),
        ("gptq", 4, False, True),
        ("gptq", 8, False, False),
        ("gptq", 8, False, True),
        ("gptq", 4, True, False),
    ],
)
@pytest.mark.parametrize("blocks", [False, True], ids=["dense", "blocks"])
def test_quantized_checkpoint_runs_like_its_dequantized_reference(
    tmp_path, monkeypatch, method, bits, act_order, sym, blocks
):
    """Dequantized at load (`PAGODA_CPU_QUANTIZED=0`): the reference's logits to float
    rounding. Kept as GGUF blocks (the CPU default): within the int8 rounding of the
    activations, in the block type the format maps to (asymmetric 8 bits have none: dense)."""
    from pagoda.model.quantization.gguf import GGUFLinearMethod

    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "1" if blocks else "0")
    hf, path = quantized_checkpoint(tmp_path, method, bits, act_order, sym)
    hf_config = get_model_config_dict(str(path))
    quant = EngineArgs(model=str(path)).create_engine_config().model_config.quantization
    assert quant == method  # detected from config.json
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype="float32", max_model_len=256, quantization=quant
    )
    model = load_model(mc, "cpu")
    runner = PagedRunner(model, {**TINY_CONFIG, **hf_config})
    tokens = torch.randint(
        0, TINY_CONFIG["vocab_size"], (9,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    ours = runner.step(tokens, 0)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float()
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "qweight")
    kept = blocks and (bits == 4 or sym)
    assert isinstance(qkv.linear_method, GGUFLinearMethod) == kept
    if kept:
        want = {(4, False): "Q4_1", (4, True): "Q4_0", (8, True): "Q8_0"}[bits, sym]
        assert qkv.gguf_weight.type_name == want
        assert hasattr(qkv, "gguf_perm") == act_order
        err = (ours - ref).abs().max().item() / ref.abs().max().item()
        assert err < 0.01, err
    else:
        assert (ours - ref).abs().max().item() < 1e-4


def test_configuration_errors(tmp_path) -> None:
    _, path = quantized_checkpoint(tmp_path, "awq")
    with pytest.raises(ValueError, match="'awq' checkpoint"):
        EngineArgs(model=str(path), quantization="gptq").create_engine_config()
    with pytest.raises(ValueError, match="not supported yet"):
        EngineArgs(model=str(path), quantization="squeezellm").create_engine_config()
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (path / "config.json").write_text(json.dumps(cfg))
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype="float32", max_model_len=64, quantization="awq"
    )
    with pytest.raises(ValueError, match="GEMM-version"):
        load_model(mc, "cpu")
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported yet"):
        EngineArgs(model=str(path)).create_engine_config()


@pytest.mark.parametrize(
    "method,bits,act_order", [("awq", 4, False), ("gptq", 4, True), ("gptq", 8, False)]
)
def test_which_layers_stay_packed_where_the_kernel_runs(
    tmp_path, monkeypatch, method, bits, act_order
) -> None:
    # As on CUDA (the repacking needs no GPU): 4-bit layers stay packed, act-order ones too
    # when the shards of one input share their permutation; 8-bit layers go dense where the
    # W8A16 path is off (here: w8a16_enabled is False on a CPU).
    import pagoda.model.quantization as quant

    monkeypatch.setattr(quant, "w4a16_enabled", lambda device: True)
    _, path = quantized_checkpoint(tmp_path, method, bits, act_order)
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype="float32", max_model_len=256,
        quantization=method,
    )  # fmt: skip
    model = load_model(mc, "cpu", dtype="float32")
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * TINY_CONFIG["num_hidden_layers"]
    for name, layer in linears:
        assert isinstance(layer.linear_method, quant.W4A16LinearMethod) == (bits == 4), name
        assert (layer.weight is None) == (bits == 4), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "method,bits,act_order", [("awq", 4, False), ("gptq", 4, True), ("gptq", 8, False)]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_keeps_4bit_layers_packed(tmp_path, monkeypatch, method, bits, act_order, dtype):
    from pagoda.model.quantization import W4A16LinearMethod, W8A16LinearMethod

    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the CPU reference: dequantized layers

    _, path = quantized_checkpoint(tmp_path, method, bits, act_order)
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype=dtype, max_model_len=256, quantization=method
    )
    cpu, gpu = load_model(mc, "cpu", dtype="float32"), load_model(mc, "cuda")
    linears = [(n, m) for n, m in gpu.named_modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * TINY_CONFIG["num_hidden_layers"]
    for name, layer in linears:
        kept = W4A16LinearMethod if bits == 4 else W8A16LinearMethod  # 8-bit stays 8-bit
        assert isinstance(layer.linear_method, kept) and layer.weight is None, name
        dense = cpu.get_submodule(name)
        x = torch.randn(5, dense.input_size_per_partition)
        ref = dense(x)
        out = layer(x.to("cuda", getattr(torch, dtype))).float().cpu()
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(out, ref, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_engine_on_a_gpu_keeps_greedy_tokens_with_packed_layers(tmp_path, method, act_order):
    import gc

    from pagoda import LLM, SamplingParams

    _, path = quantized_checkpoint(tmp_path, method, 4, act_order)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, TINY_CONFIG["vocab_size"], (5 + 7 * i,), generator=gen).tolist()
        for i in range(6)
    ]

    def generate(**kwargs) -> list[list[int]]:
        llm = LLM(
            str(path),
            skip_tokenizer_init=True,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=64 << 20,
            **kwargs,
        )
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return [o.outputs[0].token_ids for o in outs]

    graphs = generate()
    assert graphs == generate(enforce_eager=True)
    # The torch backend turns fused ops off: each packed layer dequantizes and runs F.linear.
    assert graphs == generate(enforce_eager=True, attention_backend="torch")
