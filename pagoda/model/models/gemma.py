"""Gemma 2 (Gemma Team 2024, arXiv:2408.00118) and Gemma 3 text (arXiv:2503.19786) decoders.

What sets them apart from the Llama blocks (`llama.py`), all read from config.json as Hugging
Face reads it:
- RMSNorm scales by (1 + weight), in float32; each block has four norms: before and after
  attention, before and after the MLP (the post norms apply to the sublayer's output before the
  residual add);
- GeGLU MLP: gelu(gate, tanh approximation) * up;
- embeddings multiplied by sqrt(hidden_size) (rounded to the model dtype), tied LM head;
- attention scale query_pre_attn_scalar ** -0.5; local (sliding-window) and global layers
  alternate (`layer_types`; Gemma 2: every other, Gemma 3: `sliding_window_pattern`);
- Gemma 2: attention logits soft-capped (`attn_logit_softcapping`, in the attention backend) and
  final logits soft-capped (`final_logit_softcapping`);
- Gemma 3: per-head RMSNorm of q and k before RoPE, and RoPE with base `rope_local_base_freq`
  (10k) on local layers, `rope_theta` (1M, maybe scaled) on global ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.backend import AttentionBackend, get_attn_backend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.layers.rotary_embedding import get_rope
from pagoda.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.loader.hf_config import layer_sliding_windows
from pagoda.model.models.llama import LlamaForCausalLM, ResidualStream


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32 and rounded once (Hugging Face's Gemma norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def divide_output_(self, scales: torch.Tensor) -> None:
        """Divide the norm's output by `scales` [hidden] per channel from now on, in place: the
        factor (1 + weight) becomes (1 + weight) / scales."""
        with torch.no_grad():
            self.weight.copy_((1.0 + self.weight.float()) / scales - 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], linear_method: LinearMethodBase | None) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, linear_method)
        self.down_proj = RowParallelLinear(inter, hidden, False, linear_method)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up of gate_up_proj's outputs [.., 2 * d] (GeGLU, tanh approximation)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def _layer_rope_config(cfg: dict[str, Any], local: bool, gemma3: bool) -> dict[str, Any]:
    """The config a layer's RoPE is built from: Gemma 3's local layers take their own base."""
    if not gemma3:
        return cfg
    params = cfg.get("rope_parameters") or {}
    layer_type = "sliding_attention" if local else "full_attention"
    if isinstance(params.get(layer_type), dict):  # transformers 5: one entry per layer type
        return {
            **cfg,
            "rope_theta": None,
            "rope_scaling": None,
            "rope_parameters": params[layer_type],
        }
    if local:  # transformers 4: rope_local_base_freq, unscaled
        base = float(cfg.get("rope_local_base_freq") or 10000.0)
        return {**cfg, "rope_theta": base, "rope_scaling": None, "rope_parameters": None}
    return cfg


class GemmaAttention(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        gemma3: bool,
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        total_heads = int(cfg["num_attention_heads"])
        total_kv_heads = int(cfg.get("num_key_value_heads") or total_heads)
        head_dim = int(cfg.get("head_dim") or hidden // total_heads)
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, total_heads, total_kv_heads, bias, linear_method
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, bias, linear_method)
        window = layer_sliding_windows(cfg)[layer_idx]
        self.rotary_emb = get_rope(_layer_rope_config(cfg, window is not None, gemma3), head_dim)
        self.qk_norm = gemma3
        if gemma3:
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            self.q_norm = GemmaRMSNorm(head_dim, eps)
            self.k_norm = GemmaRMSNorm(head_dim, eps)
        scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
        self.attn = Attention(
            self.num_heads,
            head_dim,
            scale,
            self.num_kv_heads,
            layer_idx,
            attn_backend,
            sliding_window=window,
            logits_soft_cap=cfg.get("attn_logit_softcapping"),
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class GemmaDecoderLayer(nn.Module):
    # As `LlamaDecoderLayer.norm_before`: the MLP reads pre_feedforward_layernorm's output.
    norm_before: dict[str, str] = {
        "self_attn.qkv_proj": "input_layernorm",
        "mlp.gate_up_proj": "pre_feedforward_layernorm",
    }

    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        gemma3: bool,
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = GemmaAttention(cfg, layer_idx, gemma3, linear_method, attn_backend)
        self.mlp = GemmaMLP(cfg, linear_method)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(h)


class GemmaModel(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        gemma3: bool,
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.embed_tokens = VocabParallelEmbedding(int(cfg["vocab_size"]), hidden)
        self.embed_scale = math.sqrt(hidden)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, gemma3, linear_method, attn_backend)
            for i in range(int(cfg["num_hidden_layers"]))
        )
        self.norm = GemmaRMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)))

    def embed(self, input_ids: torch.Tensor) -> ResidualStream:
        """The residual stream entering the first decoder layer: (scaled embeddings,)."""
        h = self.embed_tokens(input_ids)
        # The normalizer is rounded to the model dtype first, as Hugging Face does.
        return (h * torch.tensor(self.embed_scale, dtype=h.dtype),)

    def run_layer(
        self,
        layer: nn.Module,
        positions: torch.Tensor,
        stream: ResidualStream,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> ResidualStream:
        """One decoder layer on the residual stream (hidden_states,): the call `forward` makes
        of each layer, and the one the quantizers' layer-wise calibration makes."""
        return (layer(positions, stream[0], kv_cache, attn_metadata),)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        stream = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            stream = self.run_layer(layer, positions, stream, kv_cache, attn_metadata)
        return self.norm(stream[0])


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; `compute_logits`, backends and fused-op switches come from the Llama class."""

    gemma3 = False
    decoder_layer_cls = GemmaDecoderLayer  # built by GemmaModel

    def __init__(
        self,
        hf_config: dict[str, Any],
        linear_method: LinearMethodBase | None = None,
        attn_backend: AttentionBackend | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        attn_backend = attn_backend or get_attn_backend("cpu", "torch")
        self.model = GemmaModel(hf_config, self.gemma3, linear_method, attn_backend)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", True))
        self.vocab_size = int(hf_config["vocab_size"])
        self.lm_head = ParallelLMHead(self.vocab_size, int(hf_config["hidden_size"]))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = hf_config.get("final_logit_softcapping") or None
        self.fused_ops = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size], soft-capped where configured."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gemma3 = True
