"""AWQ quantization by Pagoda: folding the scales leaves the full-precision model's outputs
unchanged (with and without GQA, with biases); the scale search never does worse than
round-to-nearest on its calibration inputs and beats it where a few input channels carry large
activations; the checkpoint's packed tensors decode to exactly the quantized weights the model
ended up with; `quantize_model_awq` writes an AutoAWQ GEMM checkpoint that Pagoda detects,
loads and runs close to the dense model; the CLI rejects what AWQ checkpoints cannot hold."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from calibration_testing import capture_layer_inputs
from model_testing import TINY_CONFIG, PagedRunner, make_tiny_checkpoint
from safetensors.torch import load_file

from pagoda.config import ModelConfig
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization.awq import (
    GROUPS,
    _weight_mean,
    awq_quantize,
    fake_quantize,
    fold_scales,
    mlp_output,
    quantize_model_awq,
    quantize_rtn,
    search_clip,
    search_scale,
)
from pagoda.model.quantization.formats import dequantize_awq, pack_awq
from pagoda.quantize import add_quantize_args

CASES = {  # name -> (tiny case, overrides)
    "gqa_tied": ("llama_gqa_tied_llama3_rope", {}),
    "mha": ("llama_untied_linear_rope", {"num_key_value_heads": 4}),  # o_proj folds into v
    "mqa_bias": ("llama_mqa_attention_bias", {}),  # q/k/v/o and MLP biases
}


def _sequences(n: int = 6, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    vocab = TINY_CONFIG["vocab_size"]
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _load(path, quantization: str | None = None):
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path),
        hf_config=hf_config,
        dtype="float32",
        max_model_len=128,
        quantization=quantization,
    )
    return load_model(mc, "cpu"), {**TINY_CONFIG, **hf_config}


def _logits(model, cfg, seqs) -> torch.Tensor:
    return torch.cat([PagedRunner(model, cfg).step(s, 0) for s in seqs])


@pytest.mark.parametrize("case", list(CASES))
def test_folded_scales_leave_the_full_precision_outputs_unchanged(tmp_path, case) -> None:
    tiny, overrides = CASES[case]
    make_tiny_checkpoint(tmp_path, tiny, **overrides)
    model, cfg = _load(tmp_path)
    seqs = _sequences(3, 24)
    before = _logits(model, cfg, seqs)
    g = torch.Generator().manual_seed(1)
    for i, layer in enumerate(model.model.layers):
        inputs = capture_layer_inputs(model, cfg, seqs, i)
        scales = {}
        for name in GROUPS:
            if name == "self_attn.o_proj" and case != "mha":
                with pytest.raises(ValueError, match="GQA"):
                    fold_scales(layer, {name: torch.ones(inputs[name].shape[1])})
                continue
            # Far from 1 (0.25x..4x), so a missed or wrong fold shows.
            scales[name] = torch.exp(torch.randn(inputs[name].shape[1], generator=g))
        norm = layer.input_layernorm.weight.clone()
        fold_scales(layer, scales)
        assert not torch.allclose(norm, layer.input_layernorm.weight)
        # The folded layer's linears now read their inputs divided by the scales.
        folded = capture_layer_inputs(model, cfg, seqs, i)
        for name, s in scales.items():
            torch.testing.assert_close(folded[name] * s, inputs[name], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_logits(model, cfg, seqs), before, atol=1e-4, rtol=1e-4)


def test_scale_search_never_loses_to_round_to_nearest() -> None:
    g = torch.Generator().manual_seed(0)
    k, n = 256, 64
    x = torch.randn(2048, k, generator=g)
    x[:, :8] *= 30.0  # salient channels, as in LLM activations
    w = torch.randn(n, k, generator=g)
    res = search_scale(x, w, bits=4, group_size=64)
    assert res.alpha > 0 and res.error < 0.7 * res.rtn_error
    # alpha = 0 is round-to-nearest: the search error is measured the same way.
    rtn = ((x @ fake_quantize(w, 4, 64).t() - x @ w.t()) ** 2).mean()
    assert res.rtn_error == pytest.approx(float(rtn), rel=1e-5)
    approx = fake_quantize(w * res.scales, 4, 64) / res.scales
    assert float(((x @ approx.t() - x @ w.t()) ** 2).mean()) == pytest.approx(res.error, rel=1e-5)
    # Uniform activations: nothing to protect, and still never worse.
    flat = search_scale(torch.randn(512, k, generator=g), w, bits=4, group_size=64)
    assert flat.error <= flat.rtn_error


def test_duo_scaling_widens_the_search_and_never_loses() -> None:
    g = torch.Generator().manual_seed(0)
    k, n = 256, 64
    x = torch.randn(2048, k, generator=g)
    x[:, :8] *= 30.0
    w = torch.randn(n, k, generator=g)
    w[:, 64:96] *= 0.05  # input channels whose weights are small within their groups
    plain = search_scale(x, w, bits=4, group_size=64, duo_scaling=False)
    duo = search_scale(x, w, bits=4, group_size=64)
    assert not plain.duo and duo.duo and duo.error < plain.error
    assert duo.rtn_error == plain.rtn_error
    approx = fake_quantize(w * duo.scales, 4, 64) / duo.scales
    assert float(((x @ approx.t() - x @ w.t()) ** 2).mean()) == pytest.approx(duo.error, rel=1e-5)
    # AutoAWQ's w_mean: |w| over its group's max, averaged over the output rows.
    groups = w.abs().reshape(n, 4, 64)
    expected = (groups / groups.amax(-1, keepdim=True)).reshape(n, k).mean(0)
    torch.testing.assert_close(_weight_mean(w, 64), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["gqa_tied", "mqa_bias"])
def test_mlp_output_maps_gate_up_outputs_to_the_mlp_output(tmp_path, case) -> None:
    # gate/up's scales are scored on the MLP's output, as AutoAWQ does.
    tiny, overrides = CASES[case]
    make_tiny_checkpoint(tmp_path, tiny, **overrides)
    model, _ = _load(tmp_path)
    layer = model.model.layers[0]
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    x = torch.randn(10, gate_up.weight.shape[1], generator=torch.Generator().manual_seed(2))
    got = mlp_output(layer)(x @ gate_up.weight.detach().t())
    if down.bias is not None:
        got = got + down.bias.detach()
    with torch.no_grad():
        torch.testing.assert_close(got, layer.mlp(x), atol=1e-5, rtol=1e-5)


def test_block_scored_search_measures_the_block_output() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(512, 128, generator=g), torch.randn(32, 128, generator=g)
    x[:, :4] *= 20.0
    proj = torch.randn(32, 8, generator=g)
    res = search_scale(x, w, bits=4, group_size=64, block=lambda h: torch.tanh(h) @ proj)
    approx = fake_quantize(w * res.scales, 4, 64) / res.scales
    err = (torch.tanh(x @ approx.t()) @ proj - torch.tanh(x @ w.t()) @ proj).pow(2).mean()
    assert float(err) == pytest.approx(res.error, rel=1e-5) and res.error <= res.rtn_error


def test_clip_search_never_raises_a_groups_error() -> None:
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(512, 128, generator=g), torch.randn(16, 128, generator=g)
    w[0, 5] = 12.0  # an outlier weight: clipping it can pay
    m = search_clip(x, w, bits=4, group_size=64)
    assert m.shape == (16, 2) and (m <= w.abs().reshape(16, 2, 64).amax(-1) + 1e-6).all()
    for gi in range(2):
        cols = slice(64 * gi, 64 * gi + 64)
        wg = w[:, cols]
        clipped = torch.maximum(torch.minimum(wg, m[:, gi : gi + 1]), -m[:, gi : gi + 1])
        err = ((x[:, cols] @ (fake_quantize(clipped, 4, 64) - wg).t()) ** 2).mean(0)
        plain = ((x[:, cols] @ (fake_quantize(wg, 4, 64) - wg).t()) ** 2).mean(0)
        assert (err <= plain + 1e-6).all()


@pytest.mark.parametrize("k,group", [(256, 64), (96, 40), (64, 128)])  # short/only last groups
def test_rtn_values_pack_and_decode_exactly(k: int, group: int) -> None:
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(5))
    res = quantize_rtn(w, 4, group)
    assert res.values.min() >= 0 and res.values.max() <= 15
    assert res.zeros.min() >= 0 and res.zeros.max() <= 15
    decoded = dequantize_awq(pack_awq(res.values), pack_awq(res.zeros), res.scales, group)
    assert torch.equal(decoded, res.dequantized)
    assert torch.equal(fake_quantize(w, 4, group), res.dequantized)
    # Half a step inside the range; up to a step at its ends (the zero point is rounded).
    step = res.scales.float().repeat_interleave(group, dim=0)[:k].t()
    assert ((res.dequantized - w).abs() <= step * 1.001).all()
    assert (res.dequantized - w).abs().mean() < 0.3 * step.mean()


def test_checkpoint_tensors_decode_to_the_quantized_model(tmp_path) -> None:
    make_tiny_checkpoint(tmp_path, "llama_mqa_attention_bias")
    model, cfg = _load(tmp_path)
    tensors, errors = awq_quantize(model, _sequences(), group_size=32)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        shards = {
            "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "self_attn.o_proj": ["self_attn.o_proj"],
            "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
            "mlp.down_proj": ["mlp.down_proj"],
        }
        for fused, parts in shards.items():
            decoded = torch.cat(
                [
                    dequantize_awq(
                        tensors[p + s + ".qweight"],
                        tensors[p + s + ".qzeros"],
                        tensors[p + s + ".scales"],
                        32,
                    )
                    for s in parts
                ]
            )
            assert torch.equal(decoded, layer.get_submodule(fused).weight)
            bias = layer.get_submodule(fused).bias
            assert torch.equal(torch.cat([tensors[p + s + ".bias"] for s in parts]), bias.half())
            assert p + fused + ".weight" not in tensors
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(
                tensors[p + norm + ".weight"], layer.get_submodule(norm).weight.half()
            )
    assert len(errors) == 2 * len(GROUPS)


@pytest.mark.parametrize("group_size", [32, 40, 128])  # 40: shorter last groups; 128 > K
def test_quantize_model_writes_an_awq_checkpoint_that_runs(tmp_path, group_size: int) -> None:
    make_tiny_checkpoint(tmp_path / "dense", "llama_gqa_tied_llama3_rope")
    seqs = _sequences()
    errors = quantize_model_awq(
        str(tmp_path / "dense"), str(tmp_path / "q"), seqs, bits=4, group_size=group_size
    )
    assert len(errors) == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    mean_awq = sum(e[0] for e in errors.values()) / len(errors)
    mean_rtn = sum(e[1] for e in errors.values()) / len(errors)
    assert mean_awq < mean_rtn
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert "lm_head.weight" not in stored  # tied: the embedding once
    assert stored["model.layers.0.self_attn.k_proj.qweight"].shape == (64, 32 // 8)
    assert (
        EngineArgs(model=str(tmp_path / "q")).create_engine_config().model_config.quantization
        == "awq"
    )
    dense_model, cfg = _load(tmp_path / "dense")
    quant_model, _ = _load(tmp_path / "q", "awq")
    dense, quant = _logits(dense_model, cfg, seqs[:2]), _logits(quant_model, cfg, seqs[:2])
    rel = (quant - dense).norm() / dense.norm()
    assert rel < 0.1, rel


def test_the_engine_loads_the_awq_checkpoint(tmp_path) -> None:
    from pagoda import LLM, SamplingParams

    make_tiny_checkpoint(tmp_path / "dense", "llama_gqa_tied_llama3_rope")
    seqs = _sequences()
    quantize_model_awq(str(tmp_path / "dense"), str(tmp_path / "q"), seqs, group_size=32)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def prompt_logprobs(path) -> torch.Tensor:
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128)
        out = llm.generate([{"prompt_token_ids": seqs[0]}], params, use_tqdm=False)[0]
        return torch.tensor([e[t].logprob for t, e in zip(seqs[0][1:], out.prompt_logprobs[1:])])

    dense, quant = prompt_logprobs(tmp_path / "dense"), prompt_logprobs(tmp_path / "q")
    assert (quant - dense).abs().mean() < 0.05 * dense.abs().mean()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_quantize_args(parser.add_subparsers())
    return parser.parse_args(["quantize", *argv])


def test_cli_rejects_bits_awq_cannot_hold(tmp_path, capsys) -> None:
    args = _parse(["--method", "awq", "--bits", "8", "--output", str(tmp_path / "q")])
    assert args.func(args) == 2
    assert "4-bit" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    args = _parse(["--method", "awq", "--act-order", "--output", str(tmp_path / "q")])
    assert args.func(args) == 2
    for method in ("awq", "w8a8"):  # --sym is GPTQ's: AWQ has zero points, W8A8 none
        args = _parse(["--method", method, "--sym", "--output", str(tmp_path / "q")])
        assert args.func(args) == 2
        assert "--sym" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    assert _parse(["--output", "x"]).method == "gptq"  # the default is unchanged
    assert not _parse(["--output", "x"]).sym
    with pytest.raises(ValueError, match="4-bit"):
        quantize_model_awq("unused", str(tmp_path / "q"), [[1, 2]], bits=3)


def test_cli_quantizes_a_tiny_model_with_awq(tmp_path, capsys, monkeypatch) -> None:
    import pagoda.tokenizer

    class Tok:
        def encode(self, text: str) -> list[int]:
            return [b % TINY_CONFIG["vocab_size"] for b in text.encode()]

    monkeypatch.setattr(pagoda.tokenizer, "get_tokenizer", lambda *a, **k: Tok())
    make_tiny_checkpoint(tmp_path / "dense", "llama_gqa_tied_llama3_rope")
    argv = [str(tmp_path / "dense"), "--method", "awq", "--group-size", "32"]
    args = _parse([*argv, "--num-samples", "4", "--seq-len", "64", "--output", str(tmp_path / "q")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "AWQ 4-bit, group 32: 8 linear layers, 256 calibration tokens" in out
    assert "round-to-nearest" in out
    assert (
        json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"][
            "quant_method"
        ]
        == "awq"
    )


@pytest.mark.slow
def test_cli_awq_quantizes_the_embedded_model(tmp_path, capsys) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.cli import main
    from pagoda.config import embedded_model_path

    assert main(["quantize", "--method", "awq", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "AWQ 4-bit, group 128: 120 linear layers" in out and "round-to-nearest" in out
    llm = LLM(str(tmp_path), tokenizer=embedded_model_path(), max_model_len=256)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in text[0].outputs[0].text
