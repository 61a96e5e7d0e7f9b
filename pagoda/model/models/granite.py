"""IBM Granite 3.x dense decoders (`GraniteForCausalLM`): the Llama blocks (`llama.py`) with four
scalars from config.json, applied where transformers' modeling_granite applies them:
- `embedding_multiplier`: the token embeddings are multiplied by it (in the model dtype);
- `residual_multiplier`: each sublayer's output (attention after o_proj, the MLP) is
  multiplied by it before the residual add;
- `attention_multiplier`: the attention scale, in place of head_dim ** -0.5;
- `logits_scaling`: the logits are divided by it.
Each is 1.0 where the config lacks it, as in transformers' GraniteConfig. The small models tie
the LM head to the embeddings (`tie_word_embeddings`), read as for Llama.

The multiplier sits in the embedding module itself (`ScaledEmbedding`), so every caller of
`embed_tokens` (the layer-wise calibration of the AWQ / GPTQ quantizers included) gets the
scaled embeddings. The C decoder stack of CPU steps (`llama_cpu_decoder.py`) takes only plain
`LlamaDecoderLayer`s, so Granite's steps run layer by layer there; llama.cpp's numerics
(`llama_ggml.py`) compute plain Llama and are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.model.layers.linear import LinearMethodBase
from pagoda.model.layers.vocab_embedding import VocabParallelEmbedding
from pagoda.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def config_scalar(cfg: dict[str, Any], key: str, default: float = 1.0) -> float:
    """A float field of config.json, `default` where it is absent or null."""
    value = cfg.get(key)
    return default if value is None else float(value)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings multiplied by a constant (rounded to the model dtype by the product)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__(cfg, layer_idx, flags, linear_method, attn_backend)
        self.residual_multiplier = config_scalar(cfg, "residual_multiplier")
        self.self_attn.attn.scale = config_scalar(cfg, "attention_multiplier")

    def sublayer_output(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    def __init__(
        self,
        hf_config: dict[str, Any],
        linear_method: LinearMethodBase | None = None,
        attn_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__(hf_config, linear_method, attn_backend)
        # The Llama model's plain embedding (allocated, never filled) gives way to the scaled
        # one, which the LM head then shares where the two are tied.
        self.model.embed_tokens = ScaledEmbedding(
            self.vocab_size,
            int(hf_config["hidden_size"]),
            config_scalar(hf_config, "embedding_multiplier"),
        )
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_scaling = config_scalar(hf_config, "logits_scaling")

    def enable_ggml_numerics(self, variant: str) -> None:
        raise ValueError(
            "ggml numerics run plain Llama models, not GraniteForCausalLM (its multipliers)"
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size], divided by `logits_scaling`."""
        return super().compute_logits(hidden_states) / self.logits_scaling
