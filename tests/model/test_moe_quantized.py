"""AWQ / GPTQ checkpoints of mixtures of experts (Mixtral, Qwen3-MoE), with the expert tensors
under vLLM's names (`block_sparse_moe.experts.{e}.w1.qweight`, `mlp.experts.{e}.gate_proj.
qweight`, the router dense): each tensor-parallel rank loads its shards of every expert's
packed tensors and holds, once they are dequantized, exactly the dense checkpoint's expert
slices; the logits match transformers on the weights the checkpoint encodes; expert shards
that would split a group are refused by name, as are the formats that do not cover experts.

Ranks are loaded in-process (set_tensor_parallel without a process group); the engine with
two worker processes is the slow tests' at the end."""

from __future__ import annotations

import json

import pytest
import torch
from model_testing import PagedRunner, make_tiny_checkpoint
from moe_testing import generate_tp
from quant_testing import quantized_moe_checkpoint

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.parallel import set_tensor_parallel

CASES = {  # (method, bits, act order, symmetric)
    "awq": ("awq", 4, False, False),
    "gptq4": ("gptq", 4, False, False),
    "gptq4-act-order": ("gptq", 4, True, False),
    "gptq8-sym": ("gptq", 8, False, True),
}
# Groups of 16: the tiny models' row-parallel inputs per rank at tp=2 (o_proj 32 or 64, the
# experts' down_proj 16 or 48, Qwen3-MoE's dense down_proj 48) are whole groups.
GROUP = 16


def _load(path, quantization: str | None, rank: int = 0, tp: int = 1, **kwargs):
    cfg = get_model_config_dict(str(path))
    set_tensor_parallel(rank, tp)
    try:
        mc = ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=64,
                         quantization=quantization, **kwargs)  # fmt: skip
        return load_model(mc)
    finally:
        set_tensor_parallel(0, 1)


def _experts(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("case", list(CASES))
def test_rank_experts_are_the_dense_checkpoints_slices(tmp_path, monkeypatch, family, case):
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the other layers exact too
    method, bits, act_order, sym = CASES[case]
    dense, quantized = quantized_moe_checkpoint(
        tmp_path, family, method, bits, act_order, sym, group=GROUP
    )
    for rank, tp in [(0, 1), (0, 2), (1, 2)]:
        want = _load(dense, None, rank, tp)
        got = _load(quantized, method, rank, tp)
        pairs = list(zip(_experts(got), _experts(want), strict=True))
        assert pairs
        for g, w in pairs:
            assert list(dict(g.named_children())) == []  # the per-expert layers dropped
            assert torch.equal(g.w13_weight, w.w13_weight), (rank, tp)
            assert torch.equal(g.w2_weight, w.w2_weight), (rank, tp)
        # The router stays dense; the attention layers are the dense ones too.
        for g, w in zip(got.model.layers, want.model.layers):
            if hasattr(w.mlp, "gate") and not hasattr(w.mlp, "gate_up_proj"):
                assert torch.equal(g.mlp.gate.weight, w.mlp.gate.weight)
            assert torch.equal(g.self_attn.o_proj.weight, w.self_attn.o_proj.weight)


@pytest.mark.parametrize(
    "family,case",
    [("mixtral", "awq"), ("qwen3_moe", "gptq4-act-order"), ("qwen2_moe", "awq"),
     ("qwen2_moe", "gptq4-act-order")],
)  # fmt: skip
def test_logits_match_transformers_on_the_dequantized_weights(tmp_path, family, case):
    """The default CPU path (layers whose groups are whole 32-input blocks kept as GGUF blocks;
    here groups of 16: dequantized, the experts layer by layer), against transformers'
    forward. Qwen2-MoE: experts, shared expert, dense MLP and attention packed; the router and
    the shared expert's gate dense."""
    import transformers

    method, bits, act_order, sym = CASES[case]
    dense, quantized = quantized_moe_checkpoint(
        tmp_path, family, method, bits, act_order, sym, group=GROUP
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32)
    model = _load(quantized, method)
    runner = PagedRunner(model, dict(model.config), num_blocks=32)
    prompt = [(5 * j + 3) % 128 for j in range(17)]
    got = torch.cat([runner.step(prompt, 0), runner.step([7], len(prompt))])
    with torch.no_grad():
        want = hf(torch.tensor([[*prompt, 7]])).logits[0].float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def _only_expert_groups_split(tmp_path, method: str):
    """Qwen3-MoE, groups of 32: at tp=2 o_proj's 64 inputs a rank are two groups, the experts'
    down_proj's 16 half of one (every layer sparse)."""
    _, path = quantized_moe_checkpoint(tmp_path, "qwen3_moe", method, group=32, mlp_only_layers=[])
    return path


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_expert_groups_split_between_ranks_are_refused_by_name(tmp_path, method):
    path = _only_expert_groups_split(tmp_path, method)
    with pytest.raises(ValueError) as e:
        _load(path, method, 1, 2)
    msg = str(e.value)
    fmt = "AWQ" if method == "awq" else "GPTQ 4-bit"
    assert msg.startswith("model.layers.0.mlp.experts.0.down_proj (and 15 more layers): "), msg
    assert f"16 of its 32 inputs per rank (tensor_parallel_size=2, {fmt} group_size=32)" in msg
    assert "a group would be split between two ranks" in msg
    _load(path, method)  # one rank holds whole groups


def test_mixtral_awq_router_left_out_by_autoawq_loads(tmp_path, monkeypatch):
    """AutoAWQ writes modules_to_not_convert ["gate"] for Mixtral: its router, dense anyway.
    Qwen3-MoE's "gate" would also leave out every gate_proj (AutoAWQ matches substrings)."""
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the experts stacked, to compare
    dense, path = quantized_moe_checkpoint(tmp_path, "mixtral", "awq", group=GROUP)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["gate"]
    (path / "config.json").write_text(json.dumps(cfg))
    got, want = _experts(_load(path, "awq"))[0], _experts(_load(dense, None))[0]
    assert torch.equal(got.w13_weight, want.w13_weight)

    _, qwen = quantized_moe_checkpoint(tmp_path / "qwen", "qwen3_moe", "awq", group=GROUP)
    cfg = json.loads((qwen / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["gate"]
    (qwen / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"entry 'gate' leaves out mlp.gate_proj"):
        _load(qwen, "awq")


def test_formats_without_expert_support_are_refused_by_layer(tmp_path):
    make_tiny_checkpoint(tmp_path, "mixtral")
    with pytest.raises(ValueError) as e:
        _load(tmp_path, "fp8")
    assert str(e.value).startswith(
        "model.layers.0.mlp.experts: OnlineW8A8Method does not cover mixture-of-experts experts"
    )


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_weights_of_a_quantized_moe_run(tmp_path, monkeypatch, method):
    """--load-format dummy --quantization X: random packed experts, processed as a real
    checkpoint's: kept as GGUF blocks on a CPU, dequantized with PAGODA_CPU_QUANTIZED=0."""
    make_tiny_checkpoint(tmp_path, "qwen3_moe", mlp_only_layers=[])
    for blocks in (True, False):
        monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "1" if blocks else "0")
        model = _load(tmp_path / "config.json", method, load_format="dummy")
        (experts, *_) = _experts(model)
        if blocks:
            down = experts.get_submodule("7").down_proj
            assert (down.gguf_weight.n, down.gguf_weight.k) == (64, 32)
        else:
            assert experts.w13_weight.shape == (8, 64, 64)
            assert experts.w2_weight.shape == (8, 64, 32)
        runner = PagedRunner(model, dict(model.config), num_blocks=16)
        assert torch.isfinite(runner.step(list(range(3, 12)), 0)).all()


def test_plan_counts_quantized_experts_dequantized() -> None:
    """Qwen3-30B-A3B's shape, GPTQ 4-bit on CUDA, bf16: the attention layers packed, the
    experts at 2 bytes a weight where the plan counted half a byte."""
    from pagoda.plan_weights import estimate_weights
    from pagoda.worker.memory_estimate import weight_bytes

    cfg = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
               num_experts=128, num_hidden_layers=48, num_attention_heads=32,
               num_key_value_heads=4, head_dim=128, vocab_size=151936)  # fmt: skip
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    cfg["quantization_config"] = qc
    experts = 48 * 128 * 3 * 2048 * 768
    for tp in (1, 2):
        nbytes, why = estimate_weights("m", cfg, "bfloat16", 2, "cuda", "gptq", tp)
        assert nbytes == int(weight_bytes(cfg, 2, tp, qc) + experts // tp * 1.5), tp
        assert why == "gptq 4-bit layers kept packed, MoE experts dequantized"


# ---- the engine: two worker processes -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,case", [("mixtral", "awq"), ("qwen3_moe", "gptq4"), ("qwen3_moe", "gptq4-act-order")]
)
def test_tp2_greedy_tokens_equal_one_rank_and_the_dense_model(tmp_path, family, case):
    method, bits, act_order, sym = CASES[case]
    dense, quantized = quantized_moe_checkpoint(
        tmp_path, family, method, bits, act_order, sym, group=GROUP
    )
    want = generate_tp(dense, 1)
    assert generate_tp(quantized, 1) == want
    assert generate_tp(quantized, 2) == want


@pytest.mark.slow
def test_tp2_engine_refuses_expert_groups_split_between_ranks(tmp_path):
    from pagoda import LLM

    path = _only_expert_groups_split(tmp_path, "awq")
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.down_proj .*not a whole number"):
        LLM(str(path), tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True,
            max_model_len=128)  # fmt: skip
