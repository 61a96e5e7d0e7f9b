"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) against `transformers`: q/k/v biases, routed experts
with norm_topk_prob false (the released configs) and true, the shared expert and its sigmoid
gate, dense layers (mlp_only_layers, decoder_sparse_step) and per-layer sliding windows from
layer_types.

End to end through `LLM` with batching, chunked prefill and prefix caching on, as
test_model_families.py checks the other families (its prompts and reference): greedy tokens
equal transformers' and each token's log-probability within 1e-3. Also: both expert layouts
load, two gloo ranks against one, GPTQ / AWQ checkpoints (shared expert quantized, its gate and
the router dense), and a config whose sliding layers are ambiguous is refused.
"""

from __future__ import annotations

import pytest
import torch
from model_testing import assert_two_ranks_match_one, make_tiny_checkpoint
from quant_testing import quantized_moe_checkpoint
from test_model_families import _prompts, assert_matches_transformers, engine
from test_moe import _save_fused

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.loader.hf_config import layer_sliding_windows

CONFIGS = {
    "released": {},
    "norm_topk_prob": dict(norm_topk_prob=True),
    # layer 0 dense by the step; a window of 16 on layer 0 only (transformers 5's rule: even
    # layers below max_window_layers), written out as layer_types; no q/k/v biases.
    "sparse_step_sliding_no_bias": dict(
        mlp_only_layers=[],
        decoder_sparse_step=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        qkv_bias=False,
    ),
}


def _load(path, quantization: str | None = None) -> torch.nn.Module:
    cfg = get_model_config_dict(str(path))
    mc = ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=64,
                     quantization=quantization)  # fmt: skip
    return load_model(mc)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_matches_transformers(tmp_path, config):

    hf = make_tiny_checkpoint(tmp_path, "qwen2_moe", **CONFIGS[config])
    prompts = _prompts(hf.config.vocab_size)
    llm = engine(tmp_path)
    windows = layer_sliding_windows(get_model_config_dict(str(tmp_path)))
    assert windows == ([16, None] if "sliding" in config else [None, None])
    layers = llm.llm_engine.executor.model_runner.model.model.layers
    sparse = [hasattr(layer.mlp, "shared_expert") for layer in layers]
    assert sparse == ([False, True] if "sparse_step" in config else [True, False])
    assert_matches_transformers(llm, hf, prompts)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_experts_and_shared_expert_load_from_both_layouts(tmp_path, layout):
    hf = make_tiny_checkpoint(tmp_path, "qwen2_moe")
    if layout == "fused":
        _save_fused(hf, tmp_path)
    block, want = _load(tmp_path).model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(block.experts.w13_weight, want.experts.gate_up_proj)
    assert torch.equal(block.experts.w2_weight, want.experts.down_proj)
    assert torch.equal(block.gate.weight, want.gate.weight)
    shared = want.shared_expert
    gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
    assert torch.equal(block.shared_expert.gate_up_proj.weight, gate_up)
    assert torch.equal(block.shared_expert.down_proj.weight, shared.down_proj.weight)
    assert torch.equal(block.shared_expert_gate.weight, want.shared_expert_gate.weight)


def test_two_rank_forward_matches_one_rank(tmp_path):
    """Each rank a slice of every expert and of the shared expert, its gate whole."""
    make_tiny_checkpoint(tmp_path, "qwen2_moe")
    assert_two_ranks_match_one(tmp_path)


def test_sparse_block_all_reduces_once_at_two_ranks(tmp_path, monkeypatch):
    """The routed experts' and the shared expert's partial sums are added on each rank and
    all-reduced once (the shared expert's down_proj reducing on its own made two). Each rank's
    block in-process, the all-reduce counted and left the identity: the ranks' outputs sum to
    the one-rank block's."""
    import torch.distributed as dist

    from pagoda.model.parallel import set_tensor_parallel

    make_tiny_checkpoint(tmp_path, "qwen2_moe")
    block = _load(tmp_path).model.layers[0].mlp
    x = torch.randn(5, block.gate.weight.shape[1])
    with torch.no_grad():
        want = block(x)
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *args, **kwargs: calls.append(t.shape))
    got = torch.zeros_like(want)
    for rank in range(2):
        set_tensor_parallel(rank, 2)
        try:
            block = _load(tmp_path).model.layers[0].mlp
            calls.clear()
            with torch.no_grad():
                got += block(x)
        finally:
            set_tensor_parallel(0, 1)
        assert calls == [want.shape], rank
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_quantized_shared_expert_rank_shards(tmp_path, monkeypatch):
    """GPTQ with act order at tp=2, loaded in-process per rank and dequantized at load: each
    rank's shared expert (and experts) exactly the dense checkpoint's slices, its gate whole."""
    from safetensors import safe_open

    from pagoda.model.parallel import set_tensor_parallel

    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")
    dense, path = quantized_moe_checkpoint(tmp_path, "qwen2_moe", "gptq", 4, True, group=16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.shared_expert.down_proj.qweight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    for rank in range(2):
        set_tensor_parallel(rank, 2)
        try:
            got, want = _load(path, "gptq").model.layers[0].mlp, _load(dense).model.layers[0].mlp
        finally:
            set_tensor_parallel(0, 1)
        assert got.shared_expert.down_proj.weight.shape == (64, 32)
        for name in ("gate_up_proj", "down_proj"):
            g, w = getattr(got.shared_expert, name), getattr(want.shared_expert, name)
            assert torch.equal(g.weight, w.weight), (rank, name)
        assert torch.equal(got.shared_expert_gate.weight, want.shared_expert_gate.weight)
        assert torch.equal(got.experts.w2_weight, want.experts.w2_weight)


def test_sliding_window_without_layer_types_is_refused(tmp_path):
    import json

    make_tiny_checkpoint(tmp_path, "qwen2_moe", use_sliding_window=True, sliding_window=16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_sliding_window but no layer_types"):
        _load(tmp_path)
