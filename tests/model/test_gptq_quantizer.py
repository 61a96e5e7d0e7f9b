"""GPTQ quantization by Pagoda: on correlated inputs it halves round-to-nearest's output error
(with and without act-order), its packed values reproduce its dequantized weight exactly, and
`quantize_model` writes a GPTQ checkpoint that Pagoda detects, loads and runs close to the dense
model; the CLI end to end on the embedded model is a slow test."""

from __future__ import annotations

import json

import pytest
import torch
from model_testing import TINY_CONFIG, PagedRunner, make_tiny_checkpoint

from pagoda.config import ModelConfig
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization.gptq import (
    calibration_sequences,
    gptq_quantize,
    output_error,
    quantize_model,
    rtn,
)


def _problem(k: int = 256, n: int = 64):
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    x = torch.randn(4096, k, generator=g) @ mix  # correlated features, as activations are
    return torch.randn(n, k, generator=g), 2 * x.t() @ x / x.shape[0]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_and_packs_exactly(act_order: bool) -> None:
    w, h = _problem()
    res = gptq_quantize(w, h, bits=4, group_size=64, act_order=act_order)
    assert output_error(w, res.dequantized, h) < 0.6 * output_error(w, rtn(w, 4, 64), h)
    assert res.values.min() >= 0 and res.values.max() <= 15
    g = res.g_idx.long()
    assert torch.bincount(g).tolist() == [64] * 4  # every group has group_size inputs
    rebuilt = ((res.values.float() - res.zeros[g]) * res.scales[g]).t()
    assert torch.equal(rebuilt, res.dequantized)
    if act_order:
        assert not torch.equal(g, torch.arange(256) // 64)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_gptq_has_every_zero_at_half_the_range(bits: int) -> None:
    w, h = _problem()
    res = gptq_quantize(w, h, bits=bits, group_size=64, sym=True)
    assert torch.equal(res.zeros, torch.full_like(res.zeros, 1 << (bits - 1)))
    assert output_error(w, res.dequantized, h) < 0.6 * output_error(w, rtn(w, bits, 64, True), h)
    g = res.g_idx.long()
    rebuilt = ((res.values.float() - res.zeros[g]) * res.scales[g]).t()
    assert torch.equal(rebuilt, res.dequantized)


def test_zero_points_fit_the_stored_zero_minus_one() -> None:
    # A group of nonnegative weights has zero point 0, which GPTQ's format (zero - 1 in 4
    # bits) cannot hold: it would read back as 16. Zeros are kept >= 1.
    w = torch.rand(8, 64, generator=torch.Generator().manual_seed(2))
    res = gptq_quantize(w, torch.eye(64), bits=4, group_size=32)
    assert int(res.zeros.min()) >= 1
    assert (res.dequantized - w).abs().max() < 0.1


def test_calibration_windows() -> None:
    assert calibration_sequences(list(range(10)), 4, 20) == [list(range(10))]
    windows = calibration_sequences(list(range(100)), 4, 30)
    assert len(windows) == 4 and all(len(s) == 30 for s in windows)
    assert windows[0][0] == 0 and windows[-1][-1] <= 99


@pytest.mark.parametrize(
    "kind,group_size,bits,sym",
    [
        ("llama_gqa_tied_llama3_rope", 32, 4, False),
        ("llama_gqa_tied_llama3_rope", 40, 4, False),  # 40: shorter last groups (64, 96 inputs)
        ("llama_mqa_attention_bias", 32, 4, False),  # linears' biases are written unquantized
        ("llama_gqa_tied_llama3_rope", 32, 8, True),  # on a CPU: Q8_0 blocks
    ],
)
def test_quantize_model_writes_a_checkpoint_that_runs(
    tmp_path, kind: str, group_size: int, bits: int, sym: bool
) -> None:
    make_tiny_checkpoint(tmp_path / "dense", kind)
    g = torch.Generator().manual_seed(3)
    seqs = [
        torch.randint(0, TINY_CONFIG["vocab_size"], (48,), generator=g).tolist() for _ in range(6)
    ]
    errors = quantize_model(
        str(tmp_path / "dense"), str(tmp_path / "q"), seqs, bits=bits, group_size=group_size,
        sym=sym,
    )  # fmt: skip
    assert len(errors) == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    mean_gptq = sum(e[0] for e in errors.values()) / len(errors)
    mean_rtn = sum(e[1] for e in errors.values()) / len(errors)
    assert mean_gptq < mean_rtn
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert config["quantization_config"]["sym"] is sym
    assert (
        EngineArgs(model=str(tmp_path / "q")).create_engine_config().model_config.quantization
        == "gptq"
    )

    models = []

    def logits(path, quantization=None):
        hf_config = get_model_config_dict(str(path))
        mc = ModelConfig(
            model=str(path),
            hf_config=hf_config,
            dtype="float32",
            max_model_len=128,
            quantization=quantization,
        )
        models.append(load_model(mc, "cpu"))
        runner = PagedRunner(models[-1], {**TINY_CONFIG, **hf_config})
        return runner.step(seqs[0][:20], 0)

    dense, quant = logits(tmp_path / "dense"), logits(tmp_path / "q", "gptq")
    rel = (quant - dense).norm() / dense.norm()
    assert rel < 0.1, rel
    # On a CPU: GGUF blocks (groups of whole 32-input blocks), Q8_0 for symmetric 8 bits.
    qkv = models[-1].model.layers[0].self_attn.qkv_proj
    blocks = getattr(qkv, "gguf_weight", None)
    if group_size % 32:
        assert blocks is None
    else:
        assert blocks.type_name == {(4, False): "Q4_1", (8, True): "Q8_0"}[bits, sym]


@pytest.mark.slow
def test_cli_quantizes_the_embedded_model(tmp_path, capsys) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.cli import main
    from pagoda.config import embedded_model_path

    assert main(["quantize", "--output", str(tmp_path), "--group-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "120 linear layers" in out and "round-to-nearest" in out
    llm = LLM(str(tmp_path), tokenizer=embedded_model_path(), max_model_len=256)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in text[0].outputs[0].text
