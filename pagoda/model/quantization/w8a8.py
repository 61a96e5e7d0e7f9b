"""8-bit weights and activations: INT8 W8A8 (SmoothQuant checkpoints) and FP8 (e4m3), read from
compressed-tensors checkpoints (`quant_method: compressed-tensors`, the layout vLLM and
llm-compressor read and write), or FP8 made at load from a bf16/fp16 checkpoint
(`quantization="fp8"`), and vLLM's own FP8 checkpoints (`quant_method: fp8`, per-tensor scales).

A layer holds weight [N, K] int8 or float8_e4m3fn and weight_scale [N] float32 (one scale per
output channel; a checkpoint's per-tensor scales are spread over their shard's rows), and runs
`pagoda.kernels.scaled_mm`: activations quantized per token at run time, the 8-bit GEMM, the
scales after it. On a CPU an int8 layer becomes Q8_0 blocks of the quantized CPU GEMM instead
(`cpu_blocks.int8_blocks`, exact), an FP8 one too (`cpu_blocks.fp8_blocks`, requantized), a
GGUF layer like a GGUF file's. compressed-tensors stores, per linear layer, `<prefix>.weight`
(int8 / fp8) and `<prefix>.weight_scale` ([N, 1] for strategy "channel", [1] for "tensor");
the `config_groups` say which (parsed by `pagoda.quant_config`, torch-free, as `pagoda
plan` reads them too). Static activation scales (`input_scale`) are read and not used:
every layer quantizes its activations per token, which is at least as accurate.

A checkpoint whose tensors do not match its quantization_config (a float weight where it
promises int8, a scale of the wrong shape) fails at load naming the tensor; so does an FP8
model on a GPU without FP8 tensor cores (compute capability below 8.9).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagoda import envs
from pagoda.kernels.scaled_mm import FP8_DTYPE, QuantizedRows, quantize_weight, scaled_mm
from pagoda.model.layers.linear import LinearMethodBase, set_weight_attrs
from pagoda.model.quantization import cpu_blocks
from pagoda.quant_config import W8A8Scheme, parse_compressed_tensors, parse_fp8_config

logger = logging.getLogger(__name__)


def _weight_dtype(scheme: W8A8Scheme) -> torch.dtype:
    """The torch dtype of `scheme`'s weights: int8, or FP8 e4m3."""
    return torch.int8 if scheme.weight_type == "int" else FP8_DTYPE


def fp8_unsupported_message(capability: tuple[int, int], name: str) -> str | None:
    """Why a GPU of compute `capability` cannot run FP8 weights, or None where it can."""
    if capability >= (8, 9):
        return None
    major, minor = capability
    return (
        f"FP8 weights need a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, "
        f"Blackwell); {name} is sm_{major}{minor}: use --quantization w8a8 (int8) or the "
        "bf16 checkpoint"
    )


def check_fp8_device() -> None:
    """Raise where the current default device is a GPU without FP8 tensor cores."""
    device = torch.empty(0).device
    if device.type == "cuda":
        message = fp8_unsupported_message(
            torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
        )
        if message is not None:
            raise ValueError(message)


class W8A8LinearMethod(LinearMethodBase):
    """A loaded 8-bit layer: weight [N, K] int8 / fp8, weight_scale [N] float32."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise TypeError("W8A8LinearMethod runs layers that a checkpoint method loaded")

    def apply(
        self, layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return scaled_mm(x, layer.weight, layer.weight_scale, bias)

    def input_quantization(self, layer: nn.Module) -> torch.dtype | None:
        """The weight's dtype on CUDA (the kernel before quantizes for the product), unless
        PAGODA_W8A8_FUSED_QUANT is off or the layer runs its reference path."""
        w = layer.weight
        if not envs.PAGODA_W8A8_FUSED_QUANT or not getattr(layer, "fused_ops", True):
            return None
        return w.dtype if w.is_cuda else None


_RUN = W8A8LinearMethod()


def _finish(layer: nn.Module, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Install a loaded layer's 8-bit weight and per-channel scales: `W8A8LinearMethod`, or on
    a CPU (float32 / bf16) the Q8_0 blocks of the quantized CPU GEMM (a GGUF layer from then
    on) where they exist: an int8 weight's codes as they are (`cpu_blocks.int8_blocks`), an
    FP8 one requantized (`cpu_blocks.fp8_blocks`; the e4m3 product has no CPU kernel)."""
    if "input_scale" in layer._parameters:
        del layer._parameters["input_scale"]
    w_scale = w_scale.float().reshape(-1).contiguous()
    dtype = getattr(layer, "params_dtype", torch.float32)
    if cpu_blocks.cpu_blocks_enabled(w_q.device, dtype):
        to_blocks = cpu_blocks.int8_blocks if w_q.dtype == torch.int8 else cpu_blocks.fp8_blocks
        blocks = to_blocks(w_q, w_scale)
        if blocks is not None:
            if "weight_scale" in layer._parameters:
                del layer._parameters["weight_scale"]
            cpu_blocks.install(layer, blocks, None)
            return
    layer.weight = nn.Parameter(w_q.contiguous(), requires_grad=False)
    layer.weight_scale = nn.Parameter(w_scale, requires_grad=False)
    layer.linear_method = _RUN  # from now on the 8-bit GEMM, no check per call


class CompressedTensorsW8A8Method(LinearMethodBase):
    """Loads a compressed-tensors W8A8 checkpoint (int8 or fp8), or a vLLM-format FP8 one
    (`quant_method: fp8`), into `W8A8LinearMethod`."""

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("quant_method") == "fp8":
            self.scheme = parse_fp8_config(qc)
        else:
            self.scheme = parse_compressed_tensors(qc)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        scheme = self.scheme
        if scheme.weight_type == "float":
            check_fp8_device()
        n, k = sum(output_partition_sizes), input_size_per_partition
        weight = nn.Parameter(torch.empty(n, k, dtype=_weight_dtype(scheme)), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)
        shard_index = {"q": 0, "k": 1, "v": 2}

        def shard_scalars(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            # Per-tensor scales: one per checkpoint shard (q, k, v; gate, up), spread over the
            # shard's rows after loading.
            if loaded.numel() != 1:
                raise ValueError(
                    f"a per-tensor scale of shape {tuple(loaded.shape)} (the config says "
                    f"strategy 'tensor': one value)"
                )
            index = 0 if shard_id is None else shard_index.get(shard_id, shard_id)
            param.data[index] = loaded.reshape(()).float()

        shards = len(output_partition_sizes)
        if scheme.weight_strategy == "channel":
            scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"output_dim": 0})
        else:
            scale = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"weight_loader": shard_scalars})
        layer.register_parameter("weight_scale", scale)
        if scheme.static_input_scale:
            input_scale = nn.Parameter(
                torch.empty(shards, dtype=torch.float32), requires_grad=False
            )
            set_weight_attrs(input_scale, {"weight_loader": shard_scalars, "optional": True})
            layer.register_parameter("input_scale", input_scale)
        expected = _weight_dtype(scheme)

        def load_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if loaded.dtype != expected:
                raise ValueError(
                    f"weight of dtype {loaded.dtype} where quantization_config promises "
                    f"{expected} ({'int' if expected == torch.int8 else 'float'}-quantized)"
                )
            if shard_id is None:
                layer.weight_loader(param, loaded)
            else:
                layer.weight_loader(param, loaded, shard_id)

        weight.weight_loader = load_weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise RuntimeError("a quantized layer runs only after its checkpoint is loaded")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data
        if self.scheme.weight_strategy == "tensor":
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)
        _finish(layer, layer.weight.data, scale)


class OnlineW8A8Method(LinearMethodBase):
    """A bf16/fp16 checkpoint (or dummy weights) loaded dense, then quantized per output
    channel to `dtype` (fp8 e4m3 for `quantization="fp8"`; int8 for the dummy `w8a8` preset)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        if self.dtype == FP8_DTYPE:
            check_fp8_device()
        n, k = sum(output_partition_sizes), input_size_per_partition
        weight = nn.Parameter(torch.empty(n, k, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise RuntimeError("a quantized layer runs only after its checkpoint is loaded")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w_q, scale = quantize_weight(layer.weight.data, self.dtype)
        _finish(layer, w_q, scale)


__all__ = [
    "CompressedTensorsW8A8Method",
    "OnlineW8A8Method",
    "W8A8LinearMethod",
    "W8A8Scheme",
    "check_fp8_device",
    "fp8_unsupported_message",
    "parse_compressed_tensors",
    "parse_fp8_config",
]
