"""Mixture-of-experts GGUF files (llama.cpp's layout: `qwen3moe`, `qwen2moe`, and `llama` with
experts for Mixtral; the router `ffn_gate_inp`, each projection's experts stacked in one
`ffn_*_exps` tensor, Qwen2-MoE's shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp`) written from a tiny transformers model with the gguf package: the config
read from the metadata (and `pagoda plan`'s weight estimate from it) and Pagoda's logits from
the file against transformers' own. The Qwen2-MoE file is also read back by transformers' own
GGUF loader, which proves the writer's tensor names and layout llama.cpp's, and its sizes
default as llama.cpp's where the metadata lacks them."""

from __future__ import annotations

import pytest
import torch
from model_testing import PagedRunner, make_tiny_checkpoint
from moe_testing import write_moe_gguf

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.loader.gguf import gguf_to_hf_config
from pagoda.model.loader.hf_config import weight_params

pytest.importorskip("gguf")

# The config fields a MoE file's metadata gives back, where the family has them.
_MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob")  # fmt: skip


def _sparse_everywhere(case: str) -> dict:
    """llama.cpp's qwen2moe / qwen3moe have experts on every layer (no mlp_only_layers)."""
    return {} if case == "mixtral" else {"mlp_only_layers": []}


@pytest.mark.parametrize(
    "case,arch,shared_gate_1d",
    [
        ("qwen3_moe", "qwen3moe", False),
        ("mixtral", "llama", False),
        ("qwen2_moe", "qwen2moe", False),
        pytest.param("qwen2_moe", "qwen2moe", True, id="qwen2_moe-shared_gate_1d"),
    ],
)
def test_moe_gguf_logits_match_transformers(tmp_path, case, arch, shared_gate_1d):
    # llama.cpp renormalizes qwen3moe's top-k weights, not qwen2moe's: the cases' own settings.
    hf = make_tiny_checkpoint(tmp_path, case, **_sparse_everywhere(case))
    path = str(tmp_path / "model.gguf")
    write_moe_gguf(hf, path, arch, shared_gate_1d=shared_gate_1d)
    cfg = get_model_config_dict(path)
    assert cfg["architectures"] == [type(hf).__name__]
    for field in _MOE_FIELDS:
        if hasattr(hf.config, field):
            assert cfg[field] == getattr(hf.config, field), field
    assert weight_params(cfg).total == sum(p.numel() for p in hf.parameters())
    model = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=64))
    tokens = list(range(5, 30))
    logits = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (logits - want).abs().max().item() < 1e-4


def test_qwen2_moe_gguf_reads_back_in_transformers_gguf_loader(tmp_path):
    """transformers' GGUF loader maps llama.cpp's names through the gguf package: it gives back
    every tensor of the checkpoint from the file, and the config fields it reads from the
    metadata equal Pagoda's. It reads neither expert_feed_forward_length nor
    expert_shared_feed_forward_length (the checkpoint's config is passed in) and takes the
    shared expert gate 1-D (older converters' [hidden]; it adds the leading 1 itself)."""
    import transformers

    try:
        from transformers.modeling_gguf_pytorch_utils import (
            GGUF_SUPPORTED_ARCHITECTURES,
            load_gguf_checkpoint,
        )
    except ImportError:
        pytest.skip("this transformers has no GGUF loader")
    if "qwen2_moe" not in GGUF_SUPPORTED_ARCHITECTURES:
        pytest.skip("this transformers does not read qwen2moe GGUF files")
    hf = make_tiny_checkpoint(tmp_path, "qwen2_moe", mlp_only_layers=[])
    write_moe_gguf(hf, str(tmp_path / "model.gguf"), "qwen2moe", shared_gate_1d=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", config=hf.config, dtype=torch.float32
    )
    got, want = theirs.state_dict(), hf.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    their_cfg = load_gguf_checkpoint(str(tmp_path / "model.gguf"), return_tensors=False)["config"]
    ours = get_model_config_dict(str(tmp_path / "model.gguf"))
    assert {"num_experts", "num_experts_per_tok"} <= their_cfg.keys()
    for field, value in their_cfg.items():
        assert ours[field] == pytest.approx(value), field


def test_qwen2_moe_sizes_default_as_llama_cpp_reads_them():
    """Without expert_feed_forward_length / expert_shared_feed_forward_length llama.cpp sizes
    the experts feed_forward_length / expert_used_count and the shared expert
    feed_forward_length; a qwen2moe file without expert_count is refused, as llama.cpp does."""
    meta = {"general.architecture": "qwen2moe", "qwen2moe.embedding_length": 64,
            "qwen2moe.block_count": 2, "qwen2moe.attention.head_count": 4,
            "qwen2moe.feed_forward_length": 128, "qwen2moe.expert_count": 8,
            "qwen2moe.expert_used_count": 4, "qwen2moe.vocab_size": 128}  # fmt: skip
    cfg = gguf_to_hf_config(meta)
    assert (cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == (32, 128)
    assert cfg["qkv_bias"] and not cfg["norm_topk_prob"]
    del meta["qwen2moe.expert_count"]
    with pytest.raises(ValueError, match="lacks qwen2moe.expert_count"):
        gguf_to_hf_config(meta)
