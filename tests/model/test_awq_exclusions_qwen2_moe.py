"""AWQ `modules_to_not_convert` on Qwen2-MoE configs (`quant_config.drop_router_exclusions`),
matched as AutoAWQ matches it (an entry leaves out every layer whose name within a decoder layer
contains it): entries naming only the layers every checkpoint keeps dense (the router
`mlp.gate`, `mlp.shared_expert_gate`, lm_head) are read as absent; one naming a quantized layer
(an expert's, a dense layer's or the shared expert's gate_proj / up_proj / down_proj) is
refused, naming the layer, as for Qwen3-MoE. Then the same through `pagoda plan` (torch-free)
and the loader on a tiny AWQ checkpoint.
"""

from __future__ import annotations

import json

import pytest
from quant_testing import quantized_moe_checkpoint

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.quant_config import DUMMY_QUANTIZATION_CONFIGS, drop_router_exclusions

_MOE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], **_MOE,
             "shared_expert_intermediate_size": 48}  # fmt: skip
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], **_MOE}

# entries -> the quantized layer the refusal names (None: read as absent), for Qwen2-MoE with
# every layer sparse (the released configs) and with layer 1 a dense MLP
ENTRIES = {
    ("shared_expert_gate",): (None, None),
    ("mlp.shared_expert_gate", "lm_head"): (None, None),
    ("mlp.gate", "shared_expert_gate"): (None, "mlp.gate_proj"),
    # AutoAWQ's usual entry: a substring of every gate_proj too
    ("gate",): ("mlp.experts.0.gate_proj", "mlp.gate_proj"),
    ("shared_expert",): ("mlp.shared_expert.gate_proj",) * 2,
    ("shared_expert_gate", "down_proj"): ("mlp.experts.0.down_proj", "mlp.down_proj"),
    ("shared_expert.up_proj",): ("mlp.shared_expert.up_proj",) * 2,
    ("experts",): ("mlp.experts.0.gate_proj",) * 2,
}


def _qc(entries) -> dict:
    return {**DUMMY_QUANTIZATION_CONFIGS["awq"], "modules_to_not_convert": list(entries)}


@pytest.mark.parametrize("entries", ENTRIES, ids="+".join)
@pytest.mark.parametrize("dense_layer", [False, True], ids=["all-sparse", "dense-layer-1"])
def test_qwen2_moe_entries(entries, dense_layer) -> None:
    cfg = {**QWEN2_MOE, "mlp_only_layers": [1] if dense_layer else []}
    hit = ENTRIES[entries][dense_layer]
    if hit is None:
        assert drop_router_exclusions(_qc(entries), cfg)["modules_to_not_convert"] is None
        return
    with pytest.raises(ValueError) as e:
        drop_router_exclusions(_qc(entries), cfg)
    entry = next(x for x in entries if x in hit)
    assert f"entry {entry!r} leaves out {hit} (a substring of its name)" in str(e.value)


def test_qwen3_moe_reads_gate_as_qwen2_moe_does_and_has_no_shared_expert_gate() -> None:
    cfg = {**QWEN3_MOE, "mlp_only_layers": []}
    assert drop_router_exclusions(_qc(["mlp.gate"]), cfg)["modules_to_not_convert"] is None
    for dense_layer, hit in [(False, "mlp.experts.0.gate_proj"), (True, "mlp.gate_proj")]:
        cfg = {**QWEN3_MOE, "mlp_only_layers": [1] if dense_layer else []}
        with pytest.raises(ValueError, match=f"entry 'gate' leaves out {hit} "):
            drop_router_exclusions(_qc(["gate"]), cfg)
        with pytest.raises(ValueError, match="'shared_expert_gate' names no layer Pagoda keeps"):
            drop_router_exclusions(_qc(["shared_expert_gate"]), cfg)


@pytest.fixture
def awq_checkpoint(tmp_path):
    """A tiny Qwen2-MoE AWQ checkpoint (layer 1 dense; the shared expert's projections packed,
    its gate and the router dense) and a writer of its entries."""
    _, path = quantized_moe_checkpoint(tmp_path, "qwen2_moe", "awq")

    def with_entries(entries: list[str]):
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["modules_to_not_convert"] = entries
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    return with_entries


def test_loader_and_plan_read_the_entries_alike(awq_checkpoint, capsys) -> None:
    from pagoda.cli import main

    def load(path):
        cfg = get_model_config_dict(str(path))
        mc = ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=64,
                         quantization="awq")  # fmt: skip
        return load_model(mc)

    path = awq_checkpoint(["mlp.shared_expert_gate", "lm_head"])
    model = load(path)
    block = model.model.layers[0].mlp
    assert block.shared_expert_gate.weight.shape == (1, 64)  # dense
    assert main(["plan", str(path), "--device", "cpu"]) == 0
    capsys.readouterr()

    path = awq_checkpoint(["gate"])
    with pytest.raises(ValueError) as loader:
        load(path)
    assert main(["plan", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # the loader's message, which the loader prefixes by the path
    assert err.startswith("error: AWQ modules_to_not_convert entry 'gate' leaves out mlp.gate_proj")
    assert str(loader.value).endswith(err.removeprefix("error: ").rstrip("\n"))
