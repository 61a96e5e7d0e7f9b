"""Layer-wise calibration (`LayerwiseCalibration`): every decoder layer's linears see bit for
bit the inputs of full-model passes (`FullModelCalibration`, the reference), also when the
earlier layers change between layers as quantization changes them; and the GPTQ and AWQ
checkpoints written on it are identical to those written on the full-model passes."""

from __future__ import annotations

import pytest
import torch
from calibration_testing import FullModelCalibration
from model_testing import TINY_CONFIG, make_tiny_checkpoint
from safetensors.torch import load_file

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.quantization import awq, calibration
from pagoda.model.quantization.awq import _calibration_inputs, quantize_model_awq
from pagoda.model.quantization.calibration import LayerwiseCalibration
from pagoda.model.quantization.gptq import quantize_model

CASES = {  # name -> (tiny case, overrides)
    "gqa_tied": ("llama_gqa_tied_llama3_rope", {}),
    "mqa_bias": ("llama_mqa_attention_bias", {"num_hidden_layers": 3}),
    "qwen3_qk_norm": ("qwen3", {}),
}


def _sequences(lengths=(40, 17, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    vocab = TINY_CONFIG["vocab_size"]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _load(path):
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(model=str(path), hf_config=hf_config, dtype="float32", max_model_len=128)
    return load_model(mc, "cpu"), {**TINY_CONFIG, **hf_config}


@pytest.mark.parametrize("fused_ops", [True, False])  # the fused CPU norms work in place
@pytest.mark.parametrize("case", list(CASES))
def test_layer_inputs_equal_full_model_passes(tmp_path, case, fused_ops) -> None:
    tiny, overrides = CASES[case]
    make_tiny_checkpoint(tmp_path, tiny, **overrides)
    model, cfg = _load(tmp_path)
    model.set_fused_ops(fused_ops)
    seqs = _sequences()
    fast, ref = LayerwiseCalibration(model, seqs), FullModelCalibration(model, cfg, seqs)
    g = torch.Generator().manual_seed(1)
    for i, layer in enumerate(model.model.layers):
        assert fast.index == ref.index == i
        got, want = _calibration_inputs(fast), _calibration_inputs(ref)
        for name in awq.GROUPS:
            assert got[name].shape[0] == sum(len(s) for s in seqs)
            assert torch.equal(got[name], want[name]), (i, name)
        assert torch.equal(_calibration_inputs(fast)["mlp.down_proj"], got["mlp.down_proj"])
        with torch.no_grad():  # as quantization does: the next layer must see the change
            for p in layer.parameters():
                p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g))
        fast.advance()
        ref.advance()


def _full_model_calibration(monkeypatch, cfg) -> list[FullModelCalibration]:
    made: list[FullModelCalibration] = []

    def reference(model, sequences):
        made.append(FullModelCalibration(model, cfg, sequences))
        return made[-1]

    monkeypatch.setattr(calibration, "LayerwiseCalibration", reference)  # gptq imports it late
    monkeypatch.setattr(awq, "LayerwiseCalibration", reference)
    return made


@pytest.mark.parametrize("method", ["gptq", "gptq_act_order", "awq"])
@pytest.mark.parametrize("case", ["gqa_tied", "mqa_bias"])
def test_checkpoints_equal_those_of_full_model_passes(tmp_path, monkeypatch, case, method) -> None:
    # One thread count for both runs (by default it follows the load average, and a GEMM's
    # float sums follow the thread count).
    monkeypatch.setenv("PAGODA_CALIBRATION_THREADS", "1")
    tiny, overrides = CASES[case]
    make_tiny_checkpoint(tmp_path / "dense", tiny, **overrides)
    cfg = {**TINY_CONFIG, **get_model_config_dict(str(tmp_path / "dense"))}
    seqs = _sequences((48, 48, 31, 48))

    def write(out: str) -> dict:
        if method == "awq":
            return quantize_model_awq(str(tmp_path / "dense"), out, seqs, group_size=32)
        act_order = method == "gptq_act_order"
        return quantize_model(str(tmp_path / "dense"), out, seqs, 4, 32, act_order)

    errors = write(str(tmp_path / "layerwise"))
    with monkeypatch.context() as m:
        made = _full_model_calibration(m, cfg)
        ref_errors = write(str(tmp_path / "full"))
    # The reference really ran: full-model passes up to every layer.
    assert len(made) == 1 and made[0].index == cfg["num_hidden_layers"]
    assert errors == ref_errors
    got = load_file(str(tmp_path / "layerwise" / "model.safetensors"))
    want = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
