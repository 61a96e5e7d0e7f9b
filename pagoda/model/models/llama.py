"""The Llama-family decoder (Touvron et al. 2023): Llama 2/3, Mistral, SmolLM, Qwen2/2.5, Qwen3,
Phi-3/Phi-4.

One set of blocks with flags read from the config: each layer's sliding window (Mistral; Qwen2
with `use_sliding_window`; `layer_sliding_windows`), bias on the q/k/v projections (Qwen2),
on o_proj (Llama's `attention_bias`), on the MLP (`mlp_bias`), per-head RMSNorm of q and k
before RoPE (Qwen3), tied input/output embeddings. GQA/MQA come from `num_key_value_heads`.
Projections are fused (qkv_proj, gate_up_proj); `packed_modules_mapping` tells the loader which
checkpoint tensor fills which shard. The residual stream follows Hugging Face's order so float32
logits match `transformers` to rounding.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.backend import AttentionBackend, get_attn_backend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels import l2_prefetch
from pagoda.kernels.l2_prefetch import WeightPrefetch
from pagoda.kernels.linear import lm_head_logits, silu_and_mul_linear
from pagoda.kernels.scaled_mm import QuantizedRows
from pagoda.model.layers.activation import SiluAndMul, swiglu
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.layers.rotary_embedding import get_rope
from pagoda.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.loader.hf_config import layer_sliding_windows
from pagoda.model.models.llama_cpu_decoder import CpuDecoder
from pagoda.model.models.llama_ggml import GgmlNumerics

logger = logging.getLogger(__name__)

# The residual stream between decoder layers as a model's `run_layer` passes it on: Llama's
# (hidden_states, residual), Gemma's (hidden_states,).
ResidualStream = tuple[torch.Tensor | None, ...]


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        linear_method: LinearMethodBase | None,
        reduce_results: bool = True,
    ) -> None:
        """`reduce_results=False`: down_proj's partial sum is returned unreduced under tensor
        parallelism, for a caller that all-reduces it (`RowParallelLinear`)."""
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        bias = bool(cfg.get("mlp_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, linear_method)
        self.down_proj = RowParallelLinear(
            inter, hidden, bias, linear_method, reduce_results=reduce_results
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x: the normed hidden states, quantized already where `input_quantization` asked."""
        if self.act_fn.fused_ops and not isinstance(x, QuantizedRows):
            # the activation inside the gate_up kernel (4-bit layers)
            gate_up_proj = self.gate_up_proj
            act = gate_up_proj.linear_method.apply_silu_and_mul(gate_up_proj, x, gate_up_proj.bias)
            if act is not None:
                return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        quant = down.input_quantization()
        if quant is not None:  # an 8-bit down_proj: the activation quantizes for it
            return down(self.act_fn(gate_up, quant))
        if self.act_fn.fused_ops and down.tp_size == 1:  # the activation inside the down GEMV
            y = silu_and_mul_linear(gate_up, down.weight, down.bias)
            if y is not None:
                return y
        return down(self.act_fn(gate_up))

    def input_quantization(self) -> torch.dtype | None:
        """The dtype gate_up_proj takes its input quantized to (`LinearBase`'s)."""
        return self.gate_up_proj.input_quantization()

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up_proj's outputs [.., 2 * d], the torch reference."""
        return swiglu(gate_up, fused=False)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        total_heads = int(cfg["num_attention_heads"])
        total_kv_heads = int(cfg.get("num_key_value_heads") or total_heads)
        head_dim = _head_dim(cfg)
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, total_heads, total_kv_heads, flags["qkv_bias"], linear_method
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            total_heads * head_dim, hidden, flags["o_bias"], linear_method
        )
        self.rotary_emb = get_rope(cfg, head_dim)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.qk_norm = flags["qk_norm"]
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.attn = Attention(
            self.num_heads,
            head_dim,
            head_dim**-0.5,
            self.num_kv_heads,
            layer_idx,
            attn_backend,
            sliding_window=layer_sliding_windows(cfg)[layer_idx],
        )
        # RoPE by the fused kernel on CUDA (with the cache write on the Triton backend) / the C
        # op on CPU (the rotary module is shared by all layers and models with the same table,
        # so the choice lives here).
        self.fused_ops = True
        # Set by the decoder layer: what to ask into L2 once qkv_proj has run (`l2_prefetch`).
        self.l2_prefetch: WeightPrefetch | None = None

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [tokens, heads, head_dim] of qkv_proj's output, q and k normed per head
        where the model has q/k norms."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # hidden_states may come quantized (QuantizedRows)
        if self.l2_prefetch is not None:  # the next weights into L2 while the attention runs
            self.l2_prefetch(qkv)
        q, k, v = self.split_qkv(qkv)
        if self.fused_ops:  # RoPE in place; on the Triton backend with the cache write
            out = self.attn(q, k, v, kv_cache, attn_metadata, self.rotary_emb, positions)
        else:  # the reference: torch RoPE, then the backend's separate cache write
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    # linear -> the norm whose output is its input: AWQ and SmoothQuant fold the scales they
    # divide that input by into the norm (`RMSNorm.divide_output_`).
    norm_before: dict[str, str] = {
        "self_attn.qkv_proj": "input_layernorm",
        "mlp.gate_up_proj": "post_attention_layernorm",
    }

    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        hidden = int(cfg["hidden_size"])
        self.self_attn = LlamaAttention(cfg, layer_idx, flags, linear_method, attn_backend)
        self.mlp = self.make_mlp(cfg, layer_idx, linear_method)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn.l2_prefetch = WeightPrefetch(self.weights_after_qkv)

    def weights_after_qkv(self) -> list[nn.Module]:
        """The layers whose weights are read next once qkv_proj has run, in order: o_proj, then
        (a dense MLP) gate_up_proj."""
        after: list[nn.Module] = [self.self_attn.o_proj]
        if isinstance(self.mlp, LlamaMLP):
            after.append(self.mlp.gate_up_proj)
        return after

    def make_mlp(
        self, cfg: dict[str, Any], layer_idx: int, linear_method: LinearMethodBase | None
    ) -> nn.Module:
        """The layer's feed-forward block (a mixture-of-experts model overrides this)."""
        return LlamaMLP(cfg, linear_method)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Before 8-bit projections the norms write their output quantized for them.
        quant = self.self_attn.qkv_proj.input_quantization()
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states, quant_dtype=quant)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual, quant)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.sublayer_output(hidden_states)
        quant = self.mlp.input_quantization() if isinstance(self.mlp, LlamaMLP) else None
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual, quant)
        return self.sublayer_output(self.mlp(hidden_states)), residual

    def sublayer_output(self, x: torch.Tensor) -> torch.Tensor:
        """The attention's or the MLP's output as it joins the residual stream (Granite
        scales it)."""
        return x


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        flags: dict[str, bool],
        linear_method: LinearMethodBase | None,
        attn_backend: AttentionBackend,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.embed_tokens = VocabParallelEmbedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, flags, linear_method, attn_backend)
            for i in range(int(cfg["num_hidden_layers"]))
        )
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)))
        # Decode steps on CPU: every layer in one C call (llama_cpu_decoder.py).
        self.cpu_decoder = CpuDecoder()
        self.fused_ops = True
        self.ggml_numerics: GgmlNumerics | None = None  # llama.cpp's arithmetic (llama_ggml.py)

    def embed(self, input_ids: torch.Tensor) -> ResidualStream:
        """The residual stream entering the first decoder layer: (embeddings, no residual)."""
        return self.embed_tokens(input_ids), None

    def run_layer(
        self,
        layer: nn.Module,
        positions: torch.Tensor,
        stream: ResidualStream,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> ResidualStream:
        """One decoder layer on the residual stream (hidden_states, residual), whose sum is the
        stream (the residual None before the first layer): the call `forward` makes of each
        layer, and the one the quantizers' layer-wise calibration makes."""
        return layer(positions, stream[0], stream[1], kv_cache, attn_metadata)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.ggml_numerics is not None:
            return self.ggml_numerics.forward(self, input_ids, positions, kv_caches, attn_metadata)
        if self.fused_ops and not input_ids.is_cuda:
            out = self.cpu_decoder.forward(self, input_ids, positions, kv_caches, attn_metadata)
            if out is not None:
                return out
        stream = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches else None
            stream = self.run_layer(layer, positions, stream, kv_cache, attn_metadata)
        hidden_states, residual = stream
        l2_prefetch.join(hidden_states)  # the layers' weight prefetches, issued on a side stream
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (fused module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    decoder_layer_cls = LlamaDecoderLayer

    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        bias = bool(cfg.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def __init__(
        self,
        hf_config: dict[str, Any],
        linear_method: LinearMethodBase | None = None,
        attn_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        attn_backend = attn_backend or get_attn_backend("cpu", "torch")
        self.model = LlamaModel(
            hf_config, self.flags(hf_config), linear_method, attn_backend, self.decoder_layer_cls
        )
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.vocab_size = int(hf_config["vocab_size"])
        self.lm_head = ParallelLMHead(self.vocab_size, int(hf_config["hidden_size"]))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused_ops = True  # logits by pagoda.kernels.linear (compute_logits)

    def set_attn_backend(self, backend: AttentionBackend) -> None:
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    def enable_cpu_decoder(self) -> None:
        """CPU steps run every decoder layer in one C call from now on where they qualify
        (`llama_cpu_decoder.py`); the weights must stay as they are."""
        decoder = getattr(self.model, "cpu_decoder", None)  # a LlamaModel's, not Gemma's
        if decoder is not None:
            decoder.enable()

    def enable_ggml_numerics(self, variant: str) -> None:
        """Compute every step and the logits in llama.cpp's CPU arithmetic (`llama_ggml.py`) as
        its `variant` build ("avx2" / "avx512") does; raises ValueError for a model it cannot
        run that way, naming the reason."""
        self.model.ggml_numerics = GgmlNumerics(self, variant)

    def set_fused_ops(self, enabled: bool) -> None:
        """Fused Triton RMSNorm / SiLU-and-mul / RoPE on CUDA and the C ops on CPU (skinny
        GEMM for linear layers and logits, RMSNorm, SiLU-and-mul, RoPE: `pagoda.kernels.cpu`)
        (True, the default), or the plain torch ops everywhere (the reference path)."""
        for module in self.modules():
            if hasattr(module, "fused_ops"):
                module.fused_ops = enabled

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size]."""
        ggml = getattr(self.model, "ggml_numerics", None)
        if ggml is not None:
            return ggml.compute_logits(hidden_states)
        if self.fused_ops:
            return lm_head_logits(hidden_states, self.lm_head)
        quant = getattr(self.lm_head.weight, "quant", None)
        if quant is not None and self.lm_head.tp_size == 1:  # GGUF blocks, dequantized
            from pagoda.model.quantization.gguf import dequantize_weight

            return F.linear(hidden_states.float(), dequantize_weight(quant))
        return self.lm_head.compute_logits(hidden_states).float()


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4 (-mini): Llama blocks whose checkpoints store qkv_proj and
    gate_up_proj already fused in Pagoda's order (q, k, v; gate, up), loaded as they are and
    split by output rows under tensor parallelism; RoPE may be partial and LongRoPE-scaled
    (`get_rope`); `sliding_window`, where set, applies to every layer."""

    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        bias = bool(cfg.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
