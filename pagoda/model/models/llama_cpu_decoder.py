"""Steps of a Llama-family model on CPU in one C call (`pagoda.kernels.cpu.decoder`).

At decode on a small model, dispatching ~10 kernels a layer from Python costs as much as the
kernels. `CpuDecoder` describes the model's layers to the C stack once and, for a step that
qualifies, runs every decoder layer and the final norm there; `LlamaModel.forward` keeps its
layer-by-layer code for everything else and as the reference (`PAGODA_CPU_DECODER=0`, or
`set_fused_ops(False)`). Both call the same kernels in the same order, so a step gives the
same bits either way (tests/model/test_cpu_decoder.py).

A model qualifies when every layer is a plain `LlamaDecoderLayer` (no mixture of experts),
unsharded, on the CPU attention backend without logit soft-capping, with C-supported linear
layers (GGUF blocks kept quantized, AWQ / GPTQ layers as such blocks, packed bf16, or plain
weights in the model dtype) and
norms in the model dtype. A step (decodes, prompt chunks or both) qualifies when it has no
padding rows, every row has a cache slot (so the attention kernel reads every key from the
cache, as the backend then does too), the cache holds the model dtype (or 16 bits or fp8 e5m2
under a float32 model), and, with plain
weights, the rows are few enough for the skinny GEMM (more go to torch's GEMM, which only
the layer path calls).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagoda import envs
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels.cpu import decoder as cdec

if TYPE_CHECKING:
    from pagoda.model.models.llama import LlamaModel

logger = logging.getLogger(__name__)


class _Unsupported(Exception):
    pass


def _linear_spec(layer: torch.nn.Module, dtype: torch.dtype) -> cdec.LinearSpec:
    from pagoda.kernels.cpu import gemm as cpu_gemm
    from pagoda.model.layers.linear import UnquantizedLinearMethod
    from pagoda.model.quantization.cpu_blocks import ActOrderGGUFLinearMethod
    from pagoda.model.quantization.gguf import GGUFLinearMethod

    if getattr(layer, "tp_size", 1) != 1:
        raise _Unsupported("tensor parallelism")
    n, k = layer.output_size_per_partition, layer.input_size_per_partition
    bias = layer.bias
    method = layer.linear_method
    if type(method) in (GGUFLinearMethod, ActOrderGGUFLinearMethod):
        segments = [layer.gguf_weight] if layer.gguf_weight is not None else layer.gguf_segments
        fbias = None if bias is None else bias.detach().float().contiguous()
        parts, col = [], 0
        for seg in segments:
            parts.append(
                cdec.PartSpec(
                    cdec.PART_QUANT,
                    seg.data,
                    col,
                    seg.n,
                    None if fbias is None else fbias[col : col + seg.n],
                    seg.ggml_type,
                    seg.x8,
                    seg.data.stride(0),
                )
            )
            col += seg.n
        return cdec.LinearSpec(n, k, tuple(parts), getattr(layer, "gguf_perm", None))
    if type(method) is not UnquantizedLinearMethod:
        raise _Unsupported(f"{type(method).__name__} layers")
    weight = layer.weight
    if bias is not None:
        bias = bias.detach().to(dtype).contiguous()
    if cpu_gemm.is_packed(weight):
        if dtype is not torch.bfloat16:
            raise _Unsupported("packed weights in a float32 model")
        return cdec.LinearSpec(n, k, (cdec.PartSpec(cdec.PART_PACKED, weight, 0, n, bias),))
    if weight.dtype is not dtype or not weight.is_contiguous():
        raise _Unsupported(f"{weight.dtype} weights in a {dtype} model")
    return cdec.LinearSpec(n, k, (cdec.PartSpec(cdec.PART_GEMV, weight, 0, n, bias),))


def _spec(model: LlamaModel) -> cdec.DecoderSpec:
    from pagoda.attention.cpu.backend import CpuAttentionBackend
    from pagoda.kernels import cpu as cpu_ops
    from pagoda.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if not cpu_ops.cpu_ops_available():
        raise _Unsupported("the C ops are off")
    first = model.layers[0].self_attn
    dtype = first.qkv_proj.params_dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise _Unsupported(f"dtype {dtype}")
    layers = []
    for layer in model.layers:
        if (
            type(layer) is not LlamaDecoderLayer
            or type(layer.mlp) is not LlamaMLP
            or type(layer.self_attn) is not LlamaAttention
        ):
            raise _Unsupported(f"{type(layer).__name__} layers")
        attn = layer.self_attn
        if not isinstance(attn.attn.backend, CpuAttentionBackend):
            raise _Unsupported(f"the {attn.attn.backend.name} attention backend")
        if attn.attn.logits_soft_cap or attn.head_dim > 256:
            raise _Unsupported("attention the C kernel does not take")
        if attn.rotary_emb is not first.rotary_emb:
            raise _Unsupported("per-layer rotary tables")
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if any(nm.weight.dtype is not dtype or not nm.weight.is_contiguous() for nm in norms):
            raise _Unsupported("norm weights in another dtype than the model's")
        layers.append(
            cdec.LayerSpec(
                qkv=_linear_spec(attn.qkv_proj, dtype),
                o=_linear_spec(attn.o_proj, dtype),
                gate_up=_linear_spec(layer.mlp.gate_up_proj, dtype),
                down=_linear_spec(layer.mlp.down_proj, dtype),
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                q_norm=attn.q_norm.weight if attn.qk_norm else None,
                k_norm=attn.k_norm.weight if attn.qk_norm else None,
                sliding_window=attn.attn.sliding_window or 0,
                k_scale=float(attn.attn.k_scale),
                v_scale=float(attn.attn.v_scale),
            )
        )
    eps = {nm.variance_epsilon for layer in model.layers for nm in _norms(layer)}
    if len(eps | {model.norm.variance_epsilon}) != 1 or model.norm.weight.dtype is not dtype:
        raise _Unsupported("norms that differ in epsilon or dtype")
    cos_sin = first.rotary_emb.cos_sin_cache
    if cos_sin.dtype is not torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] % 2:
        raise _Unsupported("the rotary table")
    return cdec.DecoderSpec(
        layers=tuple(layers),
        final_norm=model.norm.weight,
        cos_sin=cos_sin,
        hidden=model.norm.weight.shape[0],
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_dim,
        inter=model.layers[0].mlp.down_proj.input_size_per_partition,
        dtype=dtype,
        eps=eps.pop(),
        scale=first.attn.scale,
    )


def _norms(layer: torch.nn.Module) -> list[torch.nn.Module]:
    attn = layer.self_attn
    extra = [attn.q_norm, attn.k_norm] if attn.qk_norm else []
    return [layer.input_layernorm, layer.post_attention_layernorm, *extra]


class CpuDecoder:
    """A model's C decoder stack, built at its first step with a KV cache; `forward` returns
    None for a step the layer path must run."""

    def __init__(self) -> None:
        self._stack: cdec.CpuDecoderStack | None = None
        self._unsupported = True  # until `enable`
        self._max_rows: int | None = None

    def enable(self) -> None:
        """Let steps take the stack (unless `PAGODA_CPU_DECODER=0`). The stack points at the
        weights as they are at its first step and runs no module hooks, so only an owner that
        keeps both fixed from then on (the model runner, after loading) enables it; code that
        hooks or edits layers (calibration) drives them one by one instead."""
        self._unsupported = not envs.PAGODA_CPU_DECODER

    def _build(self, model: LlamaModel, block_size: int) -> None:
        from pagoda.kernels.cpu.ops import MAX_GEMV_ROWS
        from pagoda.utils.cpu_build import CpuKernelUnavailable

        try:
            spec = _spec(model)
            self._stack = cdec.CpuDecoderStack(spec, block_size)
        except (_Unsupported, CpuKernelUnavailable) as e:
            logger.info("CPU steps run layer by layer (%s)", e)
            self._unsupported = True
            return
        gemv = any(
            p.kind == cdec.PART_GEMV for layer in spec.layers for p in cdec.layer_parts(layer)
        )
        self._max_rows = MAX_GEMV_ROWS[spec.dtype] if gemv else None
        logger.info("CPU steps run the %d decoder layers in one C call", len(spec.layers))

    def forward(
        self,
        model: LlamaModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        md: AttentionMetadata,
    ) -> torch.Tensor | None:
        rows = input_ids.shape[0]
        if (
            self._unsupported
            or input_ids.is_cuda
            or not kv_caches
            or rows != md.num_actual_tokens
            or (self._max_rows is not None and rows > self._max_rows)
        ):
            return None
        cache = kv_caches[0]
        if self._stack is None:
            self._build(model, int(cache.shape[2]))
            if self._stack is None:
                return None
            if self._max_rows is not None and rows > self._max_rows:
                return None
        spec = self._stack.spec
        if (
            not cdec.cache_dtype_supported(spec.dtype, cache.dtype)
            or not cache.is_contiguous()
            or cache.numel() == 0
        ):
            return None
        from pagoda.attention.cpu.backend import step_plan

        # The attention backend's plan of this step (its work items, int32 tables, slots).
        plan = step_plan(md, cache, spec.num_heads // spec.num_kv_heads)
        if plan.write_rows is not None:  # some row has no cache slot
            return None
        self._stack.bind_kv_caches(kv_caches)
        x = model.embed_tokens(input_ids)
        if not x.is_contiguous() or x.dtype is not spec.dtype:
            x = x.to(spec.dtype).contiguous()
        return self._stack.run(
            x,
            positions if positions.dtype is torch.int64 else positions.long(),
            plan.write_slots.contiguous(),
            plan.block_tables,
            plan.seq_lens,
            plan.query_start_loc,
            plan.items,
            torch.get_num_threads(),
            plan.num_threads,
        )
