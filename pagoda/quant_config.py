"""A checkpoint's `quantization_config`, read without torch: its method and which
`--quantization` it takes, the config a typical AWQ / GPTQ checkpoint carries, the AWQ / GPTQ
configs Pagoda reads, and the 8-bit schemes of compressed-tensors and vLLM FP8 checkpoints.

The loader (`pagoda.model.quantization`, which re-exports these) and `pagoda plan` (torch-free)
read configs through this one module, so that both accept and refuse the same ones with the
same message. It lives outside `pagoda.model.quantization` because importing a module of that
package runs its `__init__`, which imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.model.loader.hf_config import num_experts, shared_expert_size, sparse_layers

CT = "compressed-tensors"
# The quant_methods Pagoda reads. gguf: `quantization/gguf.py`, decided at load;
# compressed-tensors (and its aliases w8a8 for int8, fp8 for float8 checkpoints, fp8 also for a
# bf16/fp16 checkpoint quantized at load): `quantization/w8a8.py`.
QUANT_METHODS = ("awq", "gptq", "gguf", CT, "w8a8", "fp8")

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


def checkpoint_quant_method(hf_config: dict[str, Any]) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None."""
    qc = hf_config.get("quantization_config")
    return None if not isinstance(qc, dict) else qc.get("quant_method")


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


def linear_method_refusal(
    quantization: str | None, hf_config: dict[str, Any], dummy: bool = False
) -> str | None:
    """Why the loader (`get_linear_method`) refuses `quantization` for this config, or None
    where it loads it. A compressed-tensors or vLLM FP8 config loads as itself (fp8 or w8a8
    over it, as the engine's `checkpoint_accepts` has let through: a compressed-tensors one
    only of that 8-bit type); fp8 also quantizes a dense checkpoint at load, and with `dummy`
    (random weights, `pagoda plan` of a shape) w8a8 too. awq / gptq need the config of that
    method, or with `dummy` none (a typical checkpoint's). A compressed-tensors config Pagoda
    cannot serve raises `parse_compressed_tensors`' ValueError."""
    ckpt = checkpoint_quant_method(hf_config)
    if quantization is None and ckpt in (CT, "fp8"):
        quantization = ckpt  # nothing else can hold its int8 / fp8 tensors
    if quantization in (CT, "w8a8", "fp8"):
        if ckpt == CT and not checkpoint_accepts(quantization, CT, hf_config):
            return (f"quantization={quantization!r} but the checkpoint's compressed-tensors "
                    "weights are of the other 8-bit type")  # fmt: skip
        if ckpt in (CT, "fp8") or quantization == "fp8" or dummy:
            return None
        return (f"quantization={quantization!r} but the checkpoint's config.json has no "
                "compressed-tensors quantization_config: make one with `pagoda quantize "
                "--method w8a8`, or use --quantization fp8 to quantize a bf16/fp16 checkpoint "
                "at load")  # fmt: skip
    if quantization in ("awq", "gptq") and ckpt != quantization and not (dummy and ckpt is None):
        return (f"quantization={quantization!r} but the checkpoint's config.json has no "
                f"quantization_config with quant_method {quantization!r}")  # fmt: skip
    return None


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


@dataclass(frozen=True)
class PackedScheme:
    """What Pagoda reads of an AWQ / GPTQ config: `bits`-bit weights with a scale and a zero
    point per `group_size` inputs (-1 or 0: one group a row)."""

    bits: int
    group_size: int
    sym: bool = False  # GPTQ: every zero point 2**(bits - 1)
    desc_act: bool = False  # GPTQ act order: g_idx gives each input's group


def parse_awq_config(qc: dict[str, Any]) -> PackedScheme:
    """An AutoAWQ config (4-bit, GEMM version, zero points), or a ValueError naming what Pagoda
    cannot serve. modules_to_not_convert is refused: `drop_router_exclusions` first clears the
    entries that name only layers Pagoda keeps dense."""
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise ValueError(
            f"AWQ bits={bits}, version={version!r}, zero_point={qc.get('zero_point')}: "
            "Pagoda reads 4-bit GEMM-version AWQ checkpoints with zero points"
        )
    if qc.get("modules_to_not_convert"):
        raise ValueError("AWQ modules_to_not_convert is not supported yet")
    return PackedScheme(bits, int(qc.get("group_size", qc.get("q_group_size", 128))))


def parse_gptq_config(qc: dict[str, Any]) -> PackedScheme:
    """An AutoGPTQ config (4 or 8 bits, the 'gptq' checkpoint format), or a ValueError naming
    what Pagoda cannot serve."""
    bits = int(qc.get("bits", 4))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if bits not in (4, 8) or fmt != "gptq":
        raise ValueError(
            f"GPTQ bits={bits}, checkpoint_format={fmt!r}: Pagoda reads 4- and 8-bit "
            "checkpoints in the 'gptq' format"
        )
    return PackedScheme(bits, int(qc.get("group_size", 128)), sym=bool(qc.get("sym", False)),
                        desc_act=bool(qc.get("desc_act", False)))  # fmt: skip


# AWQ's `modules_to_not_convert`: the layers an AutoAWQ checkpoint left unquantized, each entry a
# substring of their names within a decoder layer (AutoAWQ's rule; vLLM matches it against the
# full names). AutoAWQ writes ["gate"] for mixtures of experts: for Mixtral that names only the
# router, which Pagoda keeps dense in every checkpoint; for Qwen2-MoE and Qwen3-MoE it also
# names every expert's (and dense MLP's) gate_proj, which AutoAWQ then leaves unquantized too.
# Qwen2-MoE's shared_expert_gate is dense in every checkpoint as well; its shared expert's
# projections are quantized like the experts'. A config whose entries name only dense layers is
# read as one without them; one that names a layer Pagoda loads quantized is refused, naming the
# entry and the layer (its tensors would be dense where the model expects packed ones).
_ATTENTION = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_names(hf_config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the quantized linear layers of the decoder layers, the layers that are dense in every
    checkpoint), by their checkpoint names within a layer (lm_head outside any)."""
    experts = num_experts(hf_config)
    arch = (hf_config.get("architectures") or [""])[0]
    quantized = list(_ATTENTION)
    if arch == "MixtralForCausalLM":
        quantized += [f"block_sparse_moe.experts.{e}.{w}" for e in range(experts)
                      for w in ("w1", "w2", "w3")]  # fmt: skip
        return quantized, ["block_sparse_moe.gate", "lm_head"]
    if not experts:
        return quantized + [f"mlp.{p}" for p in _MLP], ["lm_head"]
    if not all(sparse_layers(hf_config)):  # a dense MLP on some layers
        quantized += [f"mlp.{p}" for p in _MLP]
    quantized += [f"mlp.experts.{e}.{p}" for e in range(experts) for p in _MLP]
    dense = ["mlp.gate", "lm_head"]
    if shared_expert_size(hf_config):
        quantized += [f"mlp.shared_expert.{p}" for p in _MLP]
        dense.append("mlp.shared_expert_gate")
    return quantized, dense


def drop_router_exclusions(qc: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """`qc` without its modules_to_not_convert where every entry names only layers Pagoda keeps
    dense (a MoE router, Qwen2-MoE's shared_expert_gate, lm_head); ValueError naming the entry
    otherwise."""
    entries = qc.get("modules_to_not_convert")
    if not entries:
        return qc
    quantized, dense = _layer_names(hf_config)
    for entry in entries:
        hit = next((name for name in quantized if entry in name), None)
        if hit is not None or not any(entry in name for name in dense):
            what = (
                f"leaves out {hit} (a substring of its name)"
                if hit
                else "names no layer Pagoda keeps unquantized"
            )
            raise ValueError(
                f"AWQ modules_to_not_convert entry {entry!r} {what}: Pagoda reads AWQ "
                "checkpoints whose every attention and MLP (or expert) projection is quantized; "
                "only the MoE router (gate), shared_expert_gate and lm_head may be left out"
            )
    return {**qc, "modules_to_not_convert": None}


__all__ = [
    "CT",
    "DUMMY_QUANTIZATION_CONFIGS",
    "QUANT_METHODS",
    "PackedScheme",
    "W8A8Scheme",
    "checkpoint_accepts",
    "checkpoint_quant_method",
    "drop_router_exclusions",
    "linear_method_refusal",
    "parse_awq_config",
    "parse_compressed_tensors",
    "parse_fp8_config",
    "parse_gptq_config",
]
