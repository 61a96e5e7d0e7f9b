"""Mixture-of-experts GGUF files (llama.cpp's layout: `qwen3moe`, and `llama` with experts for
Mixtral; the router `ffn_gate_inp`, each projection's experts stacked in one `ffn_*_exps`
tensor) written from a tiny transformers model with the gguf package: the config read from the
metadata and Pagoda's logits from the file against transformers' own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import PagedRunner, make_tiny_checkpoint

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model

gguf = pytest.importorskip("gguf")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for the llama architecture (LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(hf, path: str, arch: str) -> None:
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    for key, value in {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": head_dim,
        "expert_count": experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": getattr(c, "moe_intermediate_size", c.intermediate_size),
        "vocab_size": c.vocab_size,
    }.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp"}  # fmt: skip
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            module = rest.rsplit(".", 1)[0]
            if rest.endswith("experts.gate_up_proj"):
                gate, up = np.split(t, 2, axis=1)
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            if rest.endswith("experts.down_proj"):
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", t)
                continue
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
                t = _permute(t, heads)
            w.add_tensor(f"blk.{layer}.{names[module]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_moe_gguf_logits_match_transformers(tmp_path, case, arch):
    # llama.cpp's qwen3moe has experts on every layer and renormalizes the top-k weights.
    hf = make_tiny_checkpoint(
        tmp_path, case, **({"mlp_only_layers": []} if arch != "llama" else {})
    )
    path = str(tmp_path / "model.gguf")
    _write_gguf(hf, path, arch)
    cfg = get_model_config_dict(path)
    assert cfg["architectures"] == [type(hf).__name__]
    assert cfg["num_experts_per_tok"] == hf.config.num_experts_per_tok
    model = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=64))
    tokens = list(range(5, 30))
    logits = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (logits - want).abs().max().item() < 1e-4
