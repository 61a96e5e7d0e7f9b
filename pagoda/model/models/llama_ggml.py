"""Llama steps with llama.cpp's CPU arithmetic (`$PAGODA_CPU_NUMERICS=ggml`): the same logits,
bit for bit, as llama.cpp on the same GGUF file, so the same greedy tokens.

Pagoda's own kernels compute a GGUF model as llama.cpp does in structure (int8 activations per
32 values, integer dot products, fp32 block scales) but not in the order of every fp32 sum, and
greedy decoding of a small quantized model is chaotic in the last bit: one float32 ulp on the
embeddings changes 8 of 10 prompts' 32 greedy tokens (`benchmarks/greedy_noise_floor.py`). A
user who needs llama.cpp's tokens (a regression suite recorded with llama.cpp, an A/B of two
servers) gets them from this mode, at about a third of Pagoda's own decode speed (above
llama.cpp's own on a 2-core Zen 4, benchmarks/README.md): every op runs the C of
`pagoda.kernels.cpu.ggml_numerics`, lane by lane as ggml's vector code sums.

The mode reproduces llama.cpp as llama-cpp-python 0.3.36 vendors it, built natively
(`ggml_numerics.default_variant()`; `ggml-avx2` / `ggml-avx512` pick the other build), with its
defaults: f16 KV cache, flash attention off. Every request is computed as llama.cpp computes it
alone: linear layers work row by row, and attention takes ggml's prompt-batch order (tinyBLAS)
for a request with several rows in the step and its decode order for one row, so batching with
other requests changes nothing, and a prompt split into chunks gives llama.cpp's result for
ubatches of those sizes. It takes plain Llama models (no biases, no q/k norms, no sliding
window, RoPE without scaling) whose linear layers are Q4_1 or Q8_0 blocks kept quantized, on the
CPU, without speculative decoding; anything else fails at load with the reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels.cpu import ggml_numerics as gn
from pagoda.kernels.cpu.quant import QuantWeight, unpack_x8

if TYPE_CHECKING:
    from pagoda.model.models.llama import LlamaForCausalLM

MODES = ("pagoda", "ggml", "ggml-avx2", "ggml-avx512")


def variant_of(mode: str) -> str | None:
    """The ggml build a `$PAGODA_CPU_NUMERICS` value names; None for Pagoda's own numerics.
    Raises ValueError for an unknown value, or "ggml" on a CPU without AVX2."""
    if mode not in MODES:
        raise ValueError(f"PAGODA_CPU_NUMERICS must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "pagoda":
        return None
    if mode != "ggml":
        return mode.removeprefix("ggml-")
    variant = gn.default_variant()
    if variant is None:
        raise ValueError(
            "PAGODA_CPU_NUMERICS=ggml: this CPU has no AVX2/FMA, where llama.cpp runs its scalar "
            "code, which the ggml numerics do not reproduce; pick ggml-avx2 or ggml-avx512"
        )
    return variant


def _as_rows(qw: QuantWeight) -> QuantWeight:
    """The GGUF rows layout of a weight: ggml streams each output row's blocks in turn."""
    if not qw.x8:
        return qw
    return QuantWeight(unpack_x8(qw.data, qw.ggml_type, qw.n, qw.k), qw.ggml_type, qw.n, qw.k)


def _layer_weights(layer: torch.nn.Module, name: str) -> list[tuple[QuantWeight, int]]:
    """The (QuantWeight, first output column) parts of a linear layer, checked, and put in the
    rows layout (in the layer too, which every CPU kernel also reads: no second copy)."""
    if getattr(layer, "tp_size", 1) != 1:
        raise ValueError(f"{name}: ggml numerics run unsharded layers only")
    if getattr(layer, "bias", None) is not None:
        raise ValueError(f"{name}: ggml numerics run layers without bias")
    if getattr(layer, "gguf_perm", None) is not None:
        raise ValueError(f"{name}: ggml numerics run layers without an input permutation")
    single = getattr(layer, "gguf_weight", None)
    segments = [single] if single is not None else getattr(layer, "gguf_segments", None)
    if not segments:
        raise ValueError(
            f"{name}: ggml numerics need the GGUF blocks kept quantized "
            "(a GGUF model on the CPU with quantization='gguf')"
        )
    parts, col = [], 0
    for seg in segments:
        if seg.ggml_type not in gn.SUPPORTED_TYPES:
            raise ValueError(
                f"{name}: ggml numerics multiply Q4_1 and Q8_0 blocks; this layer is "
                f"{seg.type_name}"
            )
        parts.append((_as_rows(seg), col))
        col += seg.n
    if single is not None:
        layer.gguf_weight = parts[0][0]
    else:
        layer.gguf_segments = [qw for qw, _ in parts]
    return parts


class GgmlNumerics:
    """The forward pass and logits of a `LlamaForCausalLM` in llama.cpp's arithmetic."""

    def __init__(self, model: LlamaForCausalLM, variant: str) -> None:
        cfg = model.config
        if type(model).flags(cfg) != {"qkv_bias": False, "o_bias": False, "qk_norm": False}:
            raise ValueError(f"ggml numerics run plain Llama models, not {type(model).__name__}")
        if cfg.get("rope_scaling") or cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("ggml numerics run RoPE without scaling")
        if cfg.get("sliding_window") or cfg.get("layer_sliding_windows"):
            raise ValueError("ggml numerics run full attention (no sliding window)")
        if variant not in gn.VARIANTS:
            raise ValueError(f"unknown ggml variant {variant!r}")
        self.variant = variant
        self.rope_base = float(cfg.get("rope_theta", 10000.0))
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        inner = model.model
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp).__name__ != "LlamaMLP":
                raise ValueError(f"layer {i}: ggml numerics run dense MLPs only")
            parts = {
                name: _layer_weights(module, f"layer {i} {name}")
                for name, module in (
                    ("qkv_proj", attn.qkv_proj),
                    ("o_proj", attn.o_proj),
                    ("gate_up_proj", mlp.gate_up_proj),
                    ("down_proj", mlp.down_proj),
                )
            }
            self.layers.append((layer, parts))
        head = model.lm_head
        quant = getattr(head.weight, "quant", None)
        if quant is None or quant.ggml_type not in gn.SUPPORTED_TYPES or head.tp_size != 1:
            raise ValueError("ggml numerics need the output weight as Q4_1 or Q8_0 blocks")
        self.lm_head = _as_rows(quant)
        head.weight.quant, head.weight.data = self.lm_head, self.lm_head.data  # tied: the table
        gn.load_library()  # build now, not inside the first step

    @staticmethod
    def _linear(x: torch.Tensor, parts: list[tuple[QuantWeight, int]], n: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for qw, col in parts:
            gn.linear(x, qw.data, qw.ggml_type, qw.n, qw.x8, out=out[:, col : col + qw.n])
        return out

    def forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (after the last norm) of a `LlamaModel` step."""
        md = attn_metadata
        if not kv_caches:
            raise ValueError("ggml numerics attend over a KV cache")
        t = md.num_actual_tokens
        if input_ids.shape[0] != t:
            raise ValueError("ggml numerics take steps without padding rows")
        ids, pos = input_ids[:t], positions[:t]
        x = model.embed_tokens(ids).float().contiguous()
        slots = md.slot_mapping[:t]
        for (layer, parts), kv in zip(self.layers, kv_caches):
            attn = layer.self_attn
            nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
            h = gn.rms_norm(x, layer.input_layernorm.weight, self.eps)
            qkv = self._linear(h, parts["qkv_proj"], (nh + 2 * nkv) * hd)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            gn.rope_(q, pos, nh, hd, self.rope_base)
            gn.rope_(k, pos, nkv, hd, self.rope_base)
            if kv.dtype is not torch.float16:
                raise ValueError(
                    f"ggml numerics read an f16 KV cache (--kv-cache-dtype float16), got {kv.dtype}"
                )
            flat = kv.view(2, -1, nkv, hd)
            keep = slots >= 0
            flat[0, slots[keep]] = k[keep].reshape(-1, nkv, hd).half()
            flat[1, slots[keep]] = v[keep].reshape(-1, nkv, hd).half()
            a = gn.attention(
                q, kv, nh, hd, 1.0 / math.sqrt(hd), md.query_start_loc, md.seq_lens,
                md.block_tables, self.variant,
            )  # fmt: skip
            o = self._linear(a, parts["o_proj"], attn.o_proj.output_size_per_partition)
            ffn_inp = o + x
            h = gn.rms_norm(ffn_inp, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            gu = self._linear(h, parts["gate_up_proj"], mlp.gate_up_proj.output_size_per_partition)
            act = gn.swiglu(gu, self.variant)
            d = self._linear(act, parts["down_proj"], mlp.down_proj.output_size_per_partition)
            x = d + ffn_inp
        return gn.rms_norm(x, model.norm.weight, self.eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qw = self.lm_head
        return gn.linear(hidden_states.float(), qw.data, qw.ggml_type, qw.n, qw.x8)
