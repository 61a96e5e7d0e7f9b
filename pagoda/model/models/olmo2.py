"""OLMo 2 decoders (`Olmo2ForCausalLM`, OLMo et al. 2024, arXiv:2501.00656): the Llama blocks
(`llama.py`) with the norms moved, as transformers' modeling_olmo2 has them:
- q_norm and k_norm: RMSNorm over the whole q projection (num_heads * head_dim) and the whole k
  projection (num_kv_heads * head_dim), not per head, before RoPE;
- no norm before a sublayer: each block's input goes to the attention and the MLP as it is, and
  `post_attention_layernorm` / `post_feedforward_layernorm` norm the sublayer's output before
  the residual add; the final `model.norm` as in Llama.

The residual stream keeps `LlamaModel`'s contract (a layer returns (output, residual), the sum
being the stream), so the next layer's first add and the final norm's fused add close it.
The norms are Pagoda's RMSNorm, which rounds the normed values to the model dtype before the
weight multiplies them, where transformers' Olmo2RMSNorm rounds the product: the same in
float32, one rounding apart in bf16 / fp16.

Under tensor parallelism each rank holds its heads' slice of q and k (a KV head replicated on
several ranks where there are fewer KV heads than ranks): the norms' sums of squares are summed
over ranks (one all-reduce of two numbers a token), divided by tp_size times the local width,
which counts a replicated head as often as its copies, and each rank scales its slice by its
slice of the weights. The C decoder stack of CPU steps (`llama_cpu_decoder.py`) takes only
plain `LlamaDecoderLayer`s, so OLMo 2's steps run layer by layer there; llama.cpp's numerics
(`llama_ggml.py`) compute plain Llama and are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels.l2_prefetch import WeightPrefetch
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import LinearMethodBase, copy_checked, set_weight_attrs
from pagoda.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pagoda.model.parallel import tensor_model_parallel_all_reduce


def _shard_loader(rank: int, parts: int) -> Callable[[nn.Parameter, torch.Tensor], None]:
    """Loads part `rank` of `parts` equal slices of a checkpoint vector into a norm's weight."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        if tuple(loaded_weight.shape) != (size * parts,):
            copy_checked(param.data, loaded_weight)  # raises with the shapes
        copy_checked(param.data, loaded_weight.narrow(0, rank * size, size))

    return load


class Olmo2Attention(LlamaAttention):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__(cfg, layer_idx, {**flags, "qk_norm": False}, linear_method, attn_backend)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)
        qkv = self.qkv_proj
        self.tp_size = qkv.tp_size
        if self.tp_size > 1:
            replicas = qkv.num_kv_head_replicas
            set_weight_attrs(
                self.q_norm.weight, {"weight_loader": _shard_loader(qkv.tp_rank, qkv.tp_size)}
            )
            loader = _shard_loader(qkv.tp_rank // replicas, qkv.tp_size // replicas)
            set_weight_attrs(self.k_norm.weight, {"weight_loader": loader})

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm(q), k_norm(k) over the whole projections, [T, q_size] / [T, kv_size]."""
        if self.tp_size == 1:
            return self.q_norm(q), self.k_norm(k)
        qf, kf = q.float(), k.float()
        sums = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)
        sums = tensor_model_parallel_all_reduce(sums)
        q = self._scaled(q, qf, sums[:, :1], self.q_norm)
        return q, self._scaled(k, kf, sums[:, 1:], self.k_norm)

    def _scaled(
        self, x: torch.Tensor, xf: torch.Tensor, sum_sq: torch.Tensor, norm: RMSNorm
    ) -> torch.Tensor:
        """A rank's slice x (xf: in float32) normed by the whole projection's sum of squares,
        at RMSNorm's rounding points."""
        h = xf * torch.rsqrt(sum_sq / (x.shape[-1] * self.tp_size) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [tokens, heads, head_dim] of qkv_proj's output, q and k normed over the
        whole projections."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_qk(q, k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    # No norm before qkv_proj nor gate_up_proj: both read the residual stream itself, which
    # every later layer reads too, so AWQ's and SmoothQuant's input scales fold nowhere.
    norm_before: dict[str, str] = {}

    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        nn.Module.__init__(self)  # Llama's parts but its input_layernorm
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        hidden = int(cfg["hidden_size"])
        self.self_attn = Olmo2Attention(cfg, layer_idx, flags, linear_method, attn_backend)
        self.mlp = self.make_mlp(cfg, layer_idx, linear_method)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.self_attn.l2_prefetch = WeightPrefetch(self.weights_after_qkv)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) as `LlamaDecoderLayer`'s: the stream is their sum."""
        x = hidden_states if residual is None else hidden_states + residual
        h = self.self_attn(positions, x, kv_cache, attn_metadata)
        x = x + self.post_attention_layernorm(h)
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer

    def enable_ggml_numerics(self, variant: str) -> None:
        raise ValueError("ggml numerics run plain Llama models, not Olmo2ForCausalLM (its norms)")
