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
the `config_groups` say which. Static activation scales (`input_scale`) are read and not used:
every layer quantizes its activations per token, which is at least as accurate.

A checkpoint whose tensors do not match its quantization_config (a float weight where it
promises int8, a scale of the wrong shape) fails at load naming the tensor; so does an FP8
model on a GPU without FP8 tensor cores (compute capability below 8.9).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda import envs
from pagoda.kernels.scaled_mm import FP8_DTYPE, QuantizedRows, quantize_weight, scaled_mm
from pagoda.model.layers.linear import LinearMethodBase, set_weight_attrs
from pagoda.model.quantization import cpu_blocks

logger = logging.getLogger(__name__)

_CT_FORMATS = {"int-quantized": "int", "float-quantized": "float", "naive-quantized": None}


@dataclass(frozen=True)
class W8A8Scheme:
    """What Pagoda reads of a compressed-tensors config: 8-bit symmetric weights per channel or
    per tensor, of `weight_type` "int" (int8) or "float" (fp8 e4m3)."""

    weight_type: str  # "int" | "float"
    weight_strategy: str  # "channel" | "tensor"
    static_input_scale: bool  # the checkpoint has input_scale tensors (read, not used)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.weight_type == "int" else FP8_DTYPE


def _check_args(args: Any, what: str) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise ValueError(f"compressed-tensors {what} must be an object, got {args!r:.80}")
    if int(args.get("num_bits", 0)) != 8:
        raise ValueError(
            f"compressed-tensors {what}.num_bits={args.get('num_bits')}: Pagoda reads 8"
        )
    if args.get("type") not in ("int", "float"):
        raise ValueError(f"compressed-tensors {what}.type={args.get('type')!r}: int or float")
    if not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors {what}: asymmetric (zero points) is not supported")
    return args


def parse_compressed_tensors(qc: dict[str, Any]) -> W8A8Scheme:
    """The W8A8 scheme of a compressed-tensors quantization_config, or a ValueError naming the
    field Pagoda cannot serve."""
    fmt = qc.get("format", "naive-quantized")
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported; Pagoda reads "
            + ", ".join(_CT_FORMATS)
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        targets = group.get("targets", [])
        if targets not in (["Linear"], ["re:.*"], []):
            raise ValueError(
                f"compressed-tensors config_groups.{name}.targets={targets}: Pagoda quantizes "
                "every Linear alike (targets ['Linear'])"
            )
        w = _check_args(group.get("weights"), f"config_groups.{name}.weights")
        if w.get("strategy") not in ("channel", "tensor") or w.get("group_size"):
            raise ValueError(
                f"compressed-tensors config_groups.{name}.weights.strategy="
                f"{w.get('strategy')!r}: Pagoda reads 'channel' and 'tensor'"
            )
        a = group.get("input_activations")
        if a is None:
            raise ValueError(
                f"compressed-tensors config_groups.{name} quantizes weights only (no "
                "input_activations): Pagoda reads W8A8 (int8 or fp8 activations too)"
            )
        a = _check_args(a, f"config_groups.{name}.input_activations")
        if a["type"] != w["type"]:
            raise ValueError(
                f"compressed-tensors config_groups.{name}: weights and activations differ in type"
            )
        dynamic = bool(a.get("dynamic", False))
        if (
            dynamic
            and a.get("strategy") != "token"
            or not dynamic
            and a.get("strategy") != "tensor"
        ):
            raise ValueError(
                f"compressed-tensors config_groups.{name}.input_activations: strategy "
                f"{a.get('strategy')!r} with dynamic={dynamic}; Pagoda reads dynamic 'token' "
                "or static 'tensor' activation scales"
            )
        schemes.add(W8A8Scheme(w["type"], w["strategy"], not dynamic))
    if len(schemes) != 1:
        raise ValueError(
            "compressed-tensors config_groups with different schemes are not supported"
        )
    scheme = schemes.pop()
    if _CT_FORMATS[fmt] not in (None, scheme.weight_type):
        raise ValueError(f"compressed-tensors format {fmt!r} with {scheme.weight_type} weights")
    ignore = [i for i in qc.get("ignore", []) if i not in ("lm_head", "re:.*lm_head")]
    if ignore:
        raise ValueError(
            f"compressed-tensors ignore={ignore}: Pagoda quantizes every decoder linear "
            "(only lm_head may be left out)"
        )
    return scheme


def parse_fp8_config(qc: dict[str, Any]) -> W8A8Scheme:
    """vLLM's own FP8 checkpoints (`quant_method: fp8`, as AutoFP8 writes them): e4m3 weights
    with one scale per tensor, activations dynamic or with static per-tensor input_scale."""
    if qc.get("weight_block_size"):
        raise ValueError(
            f"fp8 weight_block_size={qc['weight_block_size']}: block-wise FP8 is not supported "
            "yet (per-tensor and per-channel are)"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme={scheme!r}: dynamic or static")
    return W8A8Scheme("float", "tensor", static_input_scale=scheme == "static")


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
        weight = nn.Parameter(torch.empty(n, k, dtype=scheme.dtype), requires_grad=False)
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
        expected = scheme.dtype

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
