"""Mixture-of-experts GGUF files (llama.cpp's layout: `qwen3moe`, and `llama` with experts for
Mixtral; the router `ffn_gate_inp`, each projection's experts stacked in one `ffn_*_exps`
tensor) written from a tiny transformers model with the gguf package: the config read from the
metadata and Pagoda's logits from the file against transformers' own."""

from __future__ import annotations

import pytest
import torch
from model_testing import PagedRunner, make_tiny_checkpoint
from moe_testing import write_moe_gguf

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model

pytest.importorskip("gguf")


@pytest.mark.parametrize("case,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_moe_gguf_logits_match_transformers(tmp_path, case, arch):
    # llama.cpp's qwen3moe has experts on every layer and renormalizes the top-k weights.
    hf = make_tiny_checkpoint(
        tmp_path, case, **({"mlp_only_layers": []} if arch != "llama" else {})
    )
    path = str(tmp_path / "model.gguf")
    write_moe_gguf(hf, path, arch)
    cfg = get_model_config_dict(path)
    assert cfg["architectures"] == [type(hf).__name__]
    assert cfg["num_experts_per_tok"] == hf.config.num_experts_per_tok
    model = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=64))
    tokens = list(range(5, 30))
    logits = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (logits - want).abs().max().item() < 1e-4
