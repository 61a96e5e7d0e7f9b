"""Helpers of the speculative-decoding tests: tiny Llama checkpoints whose next token depends
strongly on the current one."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_model(
    tmp_path: Path, vocab: int = 8, seed: int = 0, sharpness: float = 0.12, max_len: int = 64
) -> str:
    """A one-layer Llama (safetensors in `tmp_path`) whose next token depends strongly on the
    current one (t -> t + 1, p ~ 0.55 over 8 tokens at the default sharpness): sampling from a
    wrong context shows in the distributions. Another seed gives another model."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = 32, 64
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g)
    emb = 4 * emb / emb.norm(dim=1, keepdim=True)

    def small(*shape: int) -> torch.Tensor:
        return 0.02 * torch.randn(*shape, generator=g)

    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": sharpness * emb.roll(1, dims=0),  # row t' = e[t' - 1]: favours t -> t + 1
        "model.norm.weight": torch.ones(hidden),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        layer + "self_attn.q_proj.weight": small(hidden, hidden),
        layer + "self_attn.k_proj.weight": small(hidden // 2, hidden),
        layer + "self_attn.v_proj.weight": small(hidden // 2, hidden),
        layer + "self_attn.o_proj.weight": small(hidden, hidden),
        layer + "mlp.gate_proj.weight": small(inter, hidden),
        layer + "mlp.up_proj.weight": small(inter, hidden),
        layer + "mlp.down_proj.weight": small(hidden, inter),
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(tmp_path / "model.safetensors"))
    return str(tmp_path)
