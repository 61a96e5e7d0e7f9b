"""AWQ / GPTQ checkpoints split across tensor-parallel ranks: each rank's packed shards, once
dequantized, are the dense weight's shards (column layers by outputs, q/k/v with the one KV
head replicated on every rank, gate/up, row layers by inputs), whichever layout the layer
takes after loading; and shards that would split a packed word or a group are refused by name.

Ranks are loaded in-process (set_tensor_parallel without a process group); the end-to-end runs
through worker processes are test_quantized_tp_engine.py's."""

from __future__ import annotations

import pytest
import torch
from quant_testing import quantized_checkpoint

import pagoda.model.quantization as quantization
from pagoda.config import ModelConfig
from pagoda.model.layers.linear import QKVParallelLinear
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.parallel import set_tensor_parallel
from pagoda.model.quantization import AWQLinearMethod
from pagoda.model.quantization.tp_shards import shard_problem

TP = 3
# 6 heads of 32, one KV head (replicated on all 3 ranks), 192 inputs and intermediate: 64 per
# rank, two groups of 32.
SHAPE = dict(
    hidden_size=192,
    num_attention_heads=6,
    num_key_value_heads=1,
    intermediate_size=192,
    vocab_size=96,
)
CASES = {  # (method, bits, act order, symmetric)
    "awq": ("awq", 4, False, False),
    "gptq4": ("gptq", 4, False, False),
    "gptq4-act-order": ("gptq", 4, True, False),
    "gptq8-sym": ("gptq", 8, False, True),
}


def _load(path, method: str, rank: int):
    cfg = get_model_config_dict(str(path))
    set_tensor_parallel(rank, TP)
    try:
        mc = ModelConfig(
            model=str(path), hf_config=cfg, dtype="float32", max_model_len=64, quantization=method
        )
        return load_model(mc)
    finally:
        set_tensor_parallel(0, 1)


def _rows(w: torch.Tensor, rank: int) -> torch.Tensor:
    n = w.shape[0] // TP
    return w[rank * n : (rank + 1) * n]


def _dense_shards(ref: dict[str, torch.Tensor], layer: int, rank: int) -> dict[str, torch.Tensor]:
    """The dense weights' shards of `rank`, as the dense path splits them."""
    w = {n: ref[f"model.layers.{layer}.{n}.weight"] for n in _NAMES}
    cols = slice(rank * 64, (rank + 1) * 64)
    return {
        "self_attn.qkv_proj": torch.cat(
            [_rows(w["self_attn.q_proj"], rank), w["self_attn.k_proj"], w["self_attn.v_proj"]]
        ),
        "self_attn.o_proj": w["self_attn.o_proj"][:, cols],
        "mlp.gate_up_proj": torch.cat(
            [_rows(w["mlp.gate_proj"], rank), _rows(w["mlp.up_proj"], rank)]
        ),
        "mlp.down_proj": w["mlp.down_proj"][:, cols],
    }


_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _weight(module) -> torch.Tensor:
    """The layer's [N, K] weight as its method computes with it (dequantized per call)."""
    module.fused_ops = False
    eye = torch.eye(module.input_size_per_partition)
    return module.linear_method.apply(module, eye).t()


@pytest.mark.parametrize("layout", ["dequantized", "cpu_blocks", "gpu_layout"])
@pytest.mark.parametrize("case", list(CASES))
def test_rank_shards_dequantize_to_the_dense_shards(tmp_path, monkeypatch, case, layout) -> None:
    method, bits, act_order, sym = CASES[case]
    hf, path = quantized_checkpoint(tmp_path, method, bits, act_order, sym, **SHAPE)
    ref = hf.state_dict()  # the weights the checkpoint encodes
    if layout == "dequantized":  # the exact reference: each rank's shards dequantized at load
        monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    elif layout == "gpu_layout":  # the W4A16 / W8A16 kernels' repack, on the rank's tensors
        monkeypatch.setattr(quantization, "w4a16_enabled", lambda device: True)
        monkeypatch.setattr(quantization, "w8a16_enabled", lambda device: True)
    kept = {
        "dequantized": "UnquantizedLinearMethod",
        "cpu_blocks": "ActOrderGGUFLinearMethod" if act_order else "GGUFLinearMethod",
        "gpu_layout": "W4A16LinearMethod" if bits == 4 else "W8A16LinearMethod",
    }[layout]
    for rank in range(TP):
        model = _load(path, method, rank)
        for i, decoder in enumerate(model.model.layers):
            for name, want in _dense_shards(ref, i, rank).items():
                module = decoder.get_submodule(name)
                row = name.endswith(("o_proj", "down_proj"))
                # An act-order row-parallel shard holds parts of many groups: dequantized.
                dense = act_order and row and layout != "dequantized"
                expected = "UnquantizedLinearMethod" if dense else kept
                if layout == "cpu_blocks" and row and not dense:
                    expected = "GGUFLinearMethod"  # row shards' g_idx is plain
                assert type(module.linear_method).__name__ == expected, (rank, name)
                got = _weight(module)
                assert got.shape == want.shape, (rank, name)
                if layout == "cpu_blocks" and not dense:  # Q4_1's m rounded to fp16
                    err = (got - want).abs().max() / want.abs().max()
                    assert err < 0.01, (rank, name, float(err))
                else:
                    assert torch.equal(got, want), (rank, name)


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_groups_split_between_ranks(tmp_path, monkeypatch, method, act_order) -> None:
    """Groups of 128 inputs: a rank's 64 inputs of o_proj / down_proj are half a group. Refused
    by name, as vLLM does, except act order, where every rank keeps all the groups (dequantized
    there, as the row shards of any act-order layer)."""
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # every layer exact
    hf, path = quantized_checkpoint(tmp_path, method, 4, act_order, group=128, **SHAPE)
    if not act_order:
        with pytest.raises(ValueError) as e:
            _load(path, method, 1)
        msg = str(e.value)
        assert msg.startswith("model.layers.0.self_attn.o_proj (and 3 more layers): "), msg
        assert "64 of its 192 inputs per rank" in msg and "tensor_parallel_size=3" in msg
        assert "group_size=128" in msg and "a group would be split between two ranks" in msg
        return
    ref = hf.state_dict()
    for rank in range(TP):
        decoder = _load(path, method, rank).model.layers[1]
        for name, want in _dense_shards(ref, 1, rank).items():
            assert torch.equal(_weight(decoder.get_submodule(name)), want), (rank, name)


def test_packed_outputs_split_mid_word_are_refused() -> None:
    """One KV head of 4 outputs per rank: AWQ's words hold 8."""
    set_tensor_parallel(0, TP)
    try:
        qkv = QKVParallelLinear(48, 4, 6, 3, linear_method=AWQLinearMethod({"group_size": 16}))
    finally:
        set_tensor_parallel(0, 1)
    assert qkv.quant_shard_problem == (
        "4 of its 12 outputs per rank (tensor_parallel_size=3, AWQ group_size=16) is not a "
        "multiple of 8, the outputs packed in one int32 word of its tensors"
    )
    assert shard_problem(qkv, "AWQ", 16, 8, False, False) == qkv.quant_shard_problem


def test_plan_counts_act_order_row_shards_dequantized() -> None:
    from pagoda.plan_weights import estimate_weights

    cfg = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    plain, _ = estimate_weights(
        "m", {**cfg, "quantization_config": qc}, "bfloat16", 2, "cuda", "gptq", 2
    )
    qc["desc_act"] = True
    act, why = estimate_weights(
        "m", {**cfg, "quantization_config": qc}, "bfloat16", 2, "cuda", "gptq", 2
    )
    rows = 32 * 4096 * (4096 + 14336) // 2  # o_proj and down_proj weights a rank holds
    assert act - plain == int(rows * 1.5) and "act-order o_proj / down_proj dequantized" in why
