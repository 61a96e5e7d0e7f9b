"""The weights `pagoda plan` counts: one rank's bytes, in the form the loader gives them.

The form depends on the checkpoint, the device and the build, as at load: a GGUF file keeps its
blocks on a CPU (float32, one rank, $PAGODA_GGUF_QUANTIZED) and is dequantized elsewhere;
AWQ / GPTQ / W8A8 / FP8 layers become GGUF blocks on a CPU (float32 or bfloat16,
$PAGODA_CPU_QUANTIZED, a C compiler: `cpu_blocks`); W8A8 / FP8 layers otherwise stay 8-bit;
AWQ / GPTQ layers on CUDA stay packed (4-bit) or 8-bit, their MoE experts and GPTQ's act-order
row-parallel shards (tp > 1) dequantized; anything else is dequantized to the model's dtype.
The byte counts are `memory_estimate`'s; this module picks among them without torch and says
which it picked. It reads the quantization_config as the loader does (`pagoda.quant_config`): one
the loader refuses raises the loader's ValueError here.
"""

from __future__ import annotations

from typing import Any

from pagoda import envs
from pagoda.model.loader.hf_config import (
    expert_intermediate_size,
    num_experts,
    shared_expert_size,
    sparse_layers,
)
from pagoda.quant_config import (
    CT,
    DUMMY_QUANTIZATION_CONFIGS,
    PackedScheme,
    drop_router_exclusions,
    parse_awq_config,
    parse_compressed_tensors,
    parse_fp8_config,
    parse_gptq_config,
)
from pagoda.worker import memory_estimate as est


def estimate_weights(
    model: str, hf_config: dict[str, Any], dtype: str, itemsize: int, device: str,
    quant: str | None, tp: int,
) -> tuple[int, str]:  # fmt: skip
    """One rank's weights as the loader holds `quant` on `device`: their bytes, and a note
    saying in what form ("GGUF blocks kept quantized", "awq 4-bit layers kept packed", ...)."""
    if quant == "gguf":
        keep = (device == "cpu" and dtype == "float32" and tp == 1
                and envs.PAGODA_GGUF_QUANTIZED)  # fmt: skip
        if keep:
            return est.gguf_weight_bytes(model, True), "GGUF blocks kept quantized"
        return est.weight_bytes(hf_config, itemsize, tp), f"GGUF dequantized to {dtype}"
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") not in (quant, CT):
        qc = DUMMY_QUANTIZATION_CONFIGS.get(quant, {})  # a preset: a typical checkpoint's
    eight_bit = _eight_bit_weights(quant, qc)
    packed = _packed_scheme(quant, qc, hf_config)
    if device == "cpu" and _cpu_blocks(dtype) and (eight_bit or packed):
        return _cpu_blocks_weights(hf_config, dtype, itemsize, quant, packed, eight_bit, tp)
    if eight_bit:
        where = " (the float32 reference product on a CPU)" if device == "cpu" else ""
        return est.int8_weight_bytes(hf_config, itemsize, tp), f"{eight_bit} layers 8-bit{where}"
    if packed and device == "cuda":
        bits = packed.bits
        kept = "4-bit layers kept packed" if bits == 4 else "8-bit layers kept 8-bit"
        nbytes = est.weight_bytes(hf_config, itemsize, tp,
                                  {"bits": bits, "group_size": packed.group_size})  # fmt: skip
        experts = _expert_params(hf_config)
        if experts:  # dequantized into the MoE kernel's dense weights (`layers/fused_moe.py`)
            nbytes += experts // tp * (itemsize - bits / 8)
            kept += ", MoE experts dequantized"
        if tp > 1 and packed.desc_act:
            # A rank's inputs of an act-order o_proj / down_proj hold parts of many groups:
            # dequantized there (`quantization/tp_shards.py`).
            nbytes += _row_parallel_params(hf_config) // tp * (itemsize - bits / 8)
            kept += ", act-order o_proj / down_proj dequantized"
        return int(nbytes), f"{quant} {kept}"
    if quant in ("awq", "gptq"):
        return est.weight_bytes(hf_config, itemsize, tp), f"{quant} dequantized to {dtype}"
    return est.weight_bytes(hf_config, itemsize, tp), dtype


def _cpu_blocks(dtype: str) -> bool:
    """Whether AWQ / GPTQ / W8A8 / FP8 layers on this CPU become GGUF blocks at load, as
    `cpu_blocks.cpu_blocks_enabled` decides (a C compiler standing in for the built kernel)."""
    from pagoda.utils import cpu_build as build  # stdlib only: no torch here

    return (dtype in ("float32", "bfloat16") and envs.PAGODA_CPU_QUANTIZED
            and build.compiler_available())  # fmt: skip


def _packed_scheme(
    quant: str | None, qc: dict[str, Any], hf_config: dict[str, Any]
) -> PackedScheme | None:
    """An AWQ / GPTQ config read as the loader reads it (`get_linear_method`): one it refuses
    raises its ValueError here. None for another format; a typical checkpoint's where `qc` is
    another method's (a shape planned with --quantization)."""
    if quant not in ("awq", "gptq"):
        return None
    if qc.get("quant_method") != quant:
        qc = DUMMY_QUANTIZATION_CONFIGS[quant]
    if quant == "awq":
        return parse_awq_config(drop_router_exclusions(qc, hf_config))
    return parse_gptq_config(qc)


def _eight_bit_weights(quant: str | None, qc: dict[str, Any]) -> str | None:
    """What 8-bit weights with per-channel scales the linear layers hold (`quantization/
    w8a8.py`): "int8 W8A8", "FP8", or None for another format. A compressed-tensors or FP8
    checkpoint's config is parsed as the loader parses it: one Pagoda cannot serve raises the
    loader's ValueError here."""
    if quant not in (CT, "w8a8", "fp8"):
        return None
    if qc.get("quant_method") == CT:
        scheme = parse_compressed_tensors(qc)
        if quant == CT:
            return "FP8" if scheme.weight_type == "float" else "int8 W8A8"
    elif qc.get("quant_method") == "fp8":
        parse_fp8_config(qc)
    # w8a8 / fp8 name the type: the checkpoint's (`checkpoint_accepts` refuses the other), or
    # for a shape without weights the one to plan.
    return "FP8" if quant == "fp8" else "int8 W8A8"


def _cpu_blocks_weights(
    hf_config: dict[str, Any], dtype: str, itemsize: int, quant: str | None,
    packed: PackedScheme | None, eight_bit: str | None, tp: int,
) -> tuple[int, str]:  # fmt: skip
    """The weights as `cpu_blocks` makes them: 4-bit AWQ / GPTQ layers Q4_1 (Q4_0 for GPTQ's
    symmetric ones), 8-bit symmetric GPTQ and int8 W8A8 Q8_0, FP8 requantized as Q8_0, MoE
    experts too; asymmetric 8-bit GPTQ dequantized (its codes minus the zero point span 9 bits:
    no Q8_0 form). `packed`: the AWQ / GPTQ config's scheme (None with `eight_bit`)."""
    experts = ", MoE experts too" if _expert_params(hf_config) else ""
    if eight_bit:
        how = "requantized as" if eight_bit == "FP8" else "as"
        nbytes, dense = est.cpu_blocks_weight_bytes(hf_config, itemsize, tp, "Q8_0", w8a8=True)
        note = f"{eight_bit} layers {how} Q8_0 GGUF blocks"
        return nbytes, note + (f", {'/'.join(dense)} 8-bit (no block form)" if dense else "")
    bits, group, sym, act_order = packed.bits, packed.group_size, packed.sym, packed.desc_act
    if bits == 8 and not sym:
        return (est.weight_bytes(hf_config, itemsize, tp),
                f"{quant} 8-bit asymmetric: dequantized to {dtype} (no Q8_0 form)")  # fmt: skip
    block = "Q8_0" if bits == 8 else "Q4_0" if sym else "Q4_1"
    nbytes, dense = est.cpu_blocks_weight_bytes(hf_config, itemsize, tp, block, group, act_order)
    note = f"{quant} {bits}-bit layers as {block} GGUF blocks{experts}"
    note += ", inputs permuted (act order)" if act_order else ""
    if dense:
        note += f", {'/'.join(dense)} dequantized to {dtype} (no block form)"
    return nbytes, note


def _row_parallel_params(hf_config: dict[str, Any]) -> int:
    """The weights of the row-parallel linear layers of all decoder layers: o_proj, the dense
    MLPs' down_proj and Qwen2-MoE's shared experts' (the routed experts' are counted by
    `_expert_params`)."""
    shape = est.ModelShape.from_hf_config(hf_config)
    sparse = sparse_layers(hf_config)
    inputs = shape.num_layers * shape.num_attention_heads * shape.head_dim
    inputs += (len(sparse) - sum(sparse)) * shape.intermediate_size
    inputs += sum(sparse) * shared_expert_size(hf_config)
    return shape.hidden_size * inputs


def _expert_params(hf_config: dict[str, Any]) -> int:
    """The weights of every routed MoE expert of the sparse layers (`sparse_layers`; 0 for a
    dense model)."""
    inter = expert_intermediate_size(hf_config)
    experts, hidden = num_experts(hf_config), int(hf_config["hidden_size"])
    return sum(sparse_layers(hf_config)) * experts * 3 * hidden * inter
