"""A checkpoint's `quantization_config`, read without torch: which `--quantization` a checkpoint
takes, the config a typical AWQ / GPTQ checkpoint carries, and the 8-bit schemes of
compressed-tensors and vLLM FP8 checkpoints.

The loader (`pagoda.model.quantization`, which re-exports these) and `pagoda plan` (torch-free)
read configs through this one module, so that both accept and refuse the same ones with the
same message. It lives outside `pagoda.model.quantization` because importing a module of that
package runs its `__init__`, which imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CT = "compressed-tensors"

# `--load-format dummy --quantization X` (and `pagoda plan` of a shape without weights): the
# quantization_config a checkpoint of that format would carry.
DUMMY_QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"},
}  # fmt: skip

# compressed-tensors `format` -> the weight type it implies (None: either).
_CT_FORMATS = {"int-quantized": "int", "float-quantized": "float", "naive-quantized": None}


@dataclass(frozen=True)
class W8A8Scheme:
    """What Pagoda reads of a compressed-tensors config: 8-bit symmetric weights per channel or
    per tensor, of `weight_type` "int" (int8) or "float" (fp8 e4m3)."""

    weight_type: str  # "int" | "float"
    weight_strategy: str  # "channel" | "tensor"
    static_input_scale: bool  # the checkpoint has input_scale tensors (read, not used)


def checkpoint_accepts(quantization: str, ckpt_method: str, hf_config: dict[str, Any]) -> bool:
    """Whether `quantization` names the checkpoint's method: itself, or for a compressed-tensors
    checkpoint w8a8 (int weights) / fp8 (float weights); fp8 also takes a GGUF file (its
    weights dequantized, then cast to fp8 at load, as a bf16 checkpoint's). A compressed-tensors
    config Pagoda cannot serve raises `parse_compressed_tensors`' ValueError."""
    if quantization == ckpt_method:
        return True
    if quantization == "fp8" and ckpt_method == "gguf":
        return True  # the GGUF file's weights, dequantized, cast to fp8 at load
    if ckpt_method != CT or quantization not in ("w8a8", "fp8"):
        return False
    scheme = parse_compressed_tensors(hf_config["quantization_config"])
    return scheme.weight_type == ("int" if quantization == "w8a8" else "float")


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


__all__ = [
    "CT",
    "DUMMY_QUANTIZATION_CONFIGS",
    "W8A8Scheme",
    "checkpoint_accepts",
    "parse_compressed_tensors",
    "parse_fp8_config",
]
