"""GGUF weights kept quantized on the CPU, as llama.cpp runs them (`quantization="gguf"`).

A GGUF file's config carries `quantization_config: {"quant_method": "gguf"}` when it holds
tensors the quantized CPU GEMM reads (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), so the engine
selects `quantization="gguf"` for it as it does AWQ / GPTQ from their config. Whether the
blocks stay quantized is decided once, at load (`gguf_weights_stay_quantized`): on a CPU, in
float32 (the kernels' activations: the CPU default for a GGUF file, or `--dtype float32`),
with the kernel built. Otherwise (`--dtype bfloat16` / `float16`, a GPU, or
`PAGODA_GGUF_QUANTIZED=0`, which gives the float32 reference) every tensor is dequantized to the
model dtype at load, as before. One log line says which.

Kept quantized, each linear layer holds its GGUF blocks (`GGUFLinearMethod`): the loader yields
`QuantWeight`s (rows un-permuted for Q/K like the dense path), fused layers (qkv, gate_up)
concatenate their shards' rows, Q4_0 / Q4_1 / Q8_0 are repacked into the kernel's x8 layout
(the same bytes), and `pagoda.kernels.cpu.quant.quant_linear` runs the product. A mixture of
experts' stacked experts become such layers too, a gate_up and a down layer per expert
(`pagoda.model.layers.fused_moe`), each running its tokens' rows. The token
embedding keeps its blocks too (`VocabParallelEmbedding`): a lookup dequantizes only the rows
it reads, and the tied LM head multiplies the same blocks. With a layer's `fused_ops` off (the
reference path) the weight is dequantized and F.linear runs. Tensor parallelism shards the
blocks as the dense path shards the weights: column layers and the vocabulary by rows, row
layers by whole blocks of their inputs (a rank's input range not a whole number of blocks
dequantizes that layer).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs
from pagoda.kernels.cpu import quant
from pagoda.kernels.cpu.quant import QuantWeight
from pagoda.model.layers.linear import (
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

logger = logging.getLogger(__name__)


def gguf_weights_stay_quantized(
    model: str, device: torch.device, dtype: torch.dtype
) -> tuple[bool, str]:
    """(keep the GGUF blocks, why) for a `quantization="gguf"` model on `device` in `dtype`."""
    if not (os.path.isfile(model) and model.endswith(".gguf")):
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got {model!r}")
    if not envs.PAGODA_GGUF_QUANTIZED:
        return False, f"dequantized to {dtype} (PAGODA_GGUF_QUANTIZED=0)"
    if device.type != "cpu":
        return False, f"dequantized to {dtype} on {device.type} (quantized kernels are CPU only)"
    if dtype is not torch.float32:
        return False, (
            f"dequantized to {dtype} (the quantized CPU kernels take float32 activations: "
            "--dtype float32 keeps the blocks)"
        )
    if not quant.quant_kernel_available():
        return False, f"dequantized to {dtype} (the quantized CPU kernel did not build)"
    return True, f"kept quantized (int8-activation {quant.kernel_isa()} kernels)"


def log_weight_types(model: nn.Module, why: str) -> None:
    """The one line saying which path runs, with the layers' types."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        qw = getattr(module, "gguf_weight", None)
        if qw is not None:
            counts[qw.type_name] += 1
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(
            module, "linear_method"
        ):
            counts[str(module.weight.dtype).replace("torch.", "")] += 1
    embed = getattr(getattr(model, "lm_head", None), "weight", None)
    if getattr(embed, "quant", None) is not None:
        counts[embed.quant.type_name + " (embedding)"] += 1
    layers = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
    logger.info("GGUF weights %s; linear layers: %s", why, layers)


def to_kernel_layout(qw: QuantWeight) -> QuantWeight:
    """The x8 layout for the types that have one (quant_x8.h), else the weight as it is."""
    if qw.x8 or qw.ggml_type not in quant.X8_TYPES:
        return qw
    return QuantWeight(quant.pack_x8(qw.data, qw.ggml_type, qw.k), qw.ggml_type, qw.n, qw.k, True)


@functools.cache
def _all_rows(n: int) -> torch.Tensor:
    return torch.arange(n)


def dequantize_weight(qw: QuantWeight) -> torch.Tensor:
    """The dense [n, k] float32 weight (the reference path's)."""
    return quant.dequantize_rows(qw, _all_rows(qw.n))


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer over GGUF blocks. The checkpoint's shards (one, or q/k/v, or gate/up)
    arrive as `QuantWeight`s (float tensors for a GGUF's F32/F16 tensors); once loaded, shards
    of one type are concatenated into `layer.gguf_weight`, shards of different types kept as
    `layer.gguf_segments` (each writes its columns of the output), and a layer with a float
    shard is dequantized into a dense one (`UnquantizedLinearMethod`)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.gguf_shards = {}

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            n = layer.output_partition_sizes[_shard_index(layer, shard_id)]
            if shard_id is None:
                n = layer.output_size_per_partition
            loaded = _this_rank(layer, loaded, shard_id)
            shape = (loaded.n, loaded.k) if isinstance(loaded, QuantWeight) else loaded.shape
            if tuple(shape) != (n, input_size_per_partition):
                raise ValueError(
                    f"shape mismatch: the model expects {(n, input_size_per_partition)}, "
                    f"got {tuple(shape)}"
                )
            layer.gguf_shards[shard_id] = loaded

        # A GGUF's F32/F16/BF16 tensors arrive as float tensors: this layer goes dense.
        set_weight_attrs(
            weight,
            {"output_dim": 0, "input_dim": 1, "weight_loader": load, "takes_float": True},
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = [layer.gguf_shards[key] for key in sorted(layer.gguf_shards, key=_shard_order)]
        del layer.gguf_shards
        if not all(isinstance(s, QuantWeight) for s in shards):
            dense = [dequantize_weight(s) if isinstance(s, QuantWeight) else s for s in shards]
            layer.weight = nn.Parameter(
                torch.cat(dense).to(layer.params_dtype), requires_grad=False
            )
            layer.linear_method = UnquantizedLinearMethod()
            layer.linear_method.process_weights_after_loading(layer)
            return
        if len({s.ggml_type for s in shards}) == 1:
            first = shards[0]
            data = torch.cat([s.data for s in shards]) if len(shards) > 1 else first.data
            n = sum(s.n for s in shards)
            qw = to_kernel_layout(QuantWeight(data, first.ggml_type, n, first.k))
            layer.weight = nn.Parameter(qw.data, requires_grad=False)
            layer.gguf_weight, layer.gguf_segments = qw, None
            return
        layer.gguf_segments = [to_kernel_layout(s) for s in shards]
        layer.gguf_weight = None
        layer.weight = None  # the segments' tensors hold the weights

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        qw, segments = layer.gguf_weight, layer.gguf_segments
        if not getattr(layer, "fused_ops", True) or x.dtype not in (torch.float32, torch.bfloat16):
            parts = [qw] if qw is not None else segments
            weight = torch.cat([dequantize_weight(p) for p in parts]).to(x.dtype)
            return F.linear(x, weight, bias)
        if qw is not None:
            return quant.quant_linear(x, qw, bias)
        out = torch.empty((*x.shape[:-1], layer.output_size_per_partition), dtype=x.dtype)
        out2, start = out.view(-1, out.shape[-1]), 0
        for seg in segments:
            quant.quant_linear(x, seg, out=out2[:, start : start + seg.n])
            start += seg.n
        return out if bias is None else out.add_(bias.to(out.dtype))


_QKV_ORDER = {"q": 0, "k": 1, "v": 2}


def narrow_rows(qw: QuantWeight, start: int, n: int) -> QuantWeight:
    """Rows [start, start + n) of a weight in the GGUF layout."""
    return QuantWeight(qw.data[start : start + n].contiguous(), qw.ggml_type, n, qw.k)


def _this_rank(layer: nn.Module, loaded: Any, shard_id: Any) -> Any:
    """This tensor-parallel rank's part of a checkpoint tensor (QuantWeight or dense), split
    as ColumnParallelLinear / QKVParallelLinear / RowParallelLinear split dense weights."""
    tp_size, rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if tp_size == 1:
        return loaded
    quantized = isinstance(loaded, QuantWeight)
    if isinstance(layer, RowParallelLinear):  # inputs split: whole blocks, else dense
        k = layer.input_size_per_partition
        elems, nbytes = quant.QUANT_TYPES[loaded.ggml_type] if quantized else (1, 0)
        if quantized and k % elems:
            loaded = dequantize_weight(loaded)
        if not isinstance(loaded, QuantWeight):
            return loaded[:, rank * k : (rank + 1) * k]
        width = k // elems * nbytes
        part = loaded.data[:, rank * width : (rank + 1) * width].contiguous()
        return QuantWeight(part, loaded.ggml_type, loaded.n, k)
    parts = tp_size
    if isinstance(layer, QKVParallelLinear) and shard_id in ("k", "v"):
        parts, rank = tp_size // layer.num_kv_head_replicas, rank // layer.num_kv_head_replicas
    n = (loaded.n if quantized else loaded.shape[0]) // parts
    return narrow_rows(loaded, rank * n, n) if quantized else loaded[rank * n : (rank + 1) * n]


def _shard_order(shard_id: Any) -> int:
    return 0 if shard_id is None else _QKV_ORDER.get(shard_id, shard_id)


def _shard_index(layer: nn.Module, shard_id: Any) -> int:
    return 0 if shard_id is None else _QKV_ORDER.get(shard_id, shard_id)


__all__ = [
    "GGUFLinearMethod",
    "dequantize_weight",
    "gguf_weights_stay_quantized",
    "log_weight_types",
    "narrow_rows",
    "to_kernel_layout",
]
