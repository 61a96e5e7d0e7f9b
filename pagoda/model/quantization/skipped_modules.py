"""AWQ's `modules_to_not_convert`: the layers an AutoAWQ checkpoint left unquantized, each entry
a substring of their names within a decoder layer (AutoAWQ's rule; vLLM matches it against the
full names). AutoAWQ writes `["gate"]` for mixtures of experts (Mixtral, Qwen2-MoE): the
router, which Pagoda keeps dense in every checkpoint. A config whose entries name only such
layers is read as one without them; one that names a layer Pagoda loads quantized is refused
at load, naming the entry and the layer (its tensors would be dense where the model expects
packed ones).
"""

from __future__ import annotations

from typing import Any

_ATTENTION = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_names(hf_config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the quantized linear layers of a decoder layer, its layers that are dense in every
    checkpoint), by their checkpoint names within the layer (lm_head outside any)."""
    from pagoda.model.models.moe import moe_num_experts

    experts = moe_num_experts(hf_config)
    arch = (hf_config.get("architectures") or [""])[0]
    quantized = list(_ATTENTION)
    if arch == "MixtralForCausalLM":
        quantized += [f"block_sparse_moe.experts.{e}.{w}" for e in range(experts)
                      for w in ("w1", "w2", "w3")]  # fmt: skip
        return quantized, ["block_sparse_moe.gate", "lm_head"]
    quantized += [f"mlp.{p}" for p in _MLP]
    if experts:
        quantized += [f"mlp.experts.{e}.{p}" for e in range(experts) for p in _MLP]
        return quantized, ["mlp.gate", "lm_head"]
    return quantized, ["lm_head"]


def drop_router_exclusions(qc: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """`qc` without its modules_to_not_convert where every entry names only layers Pagoda keeps
    dense (a MoE router, lm_head); ValueError naming the entry otherwise."""
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
                "only the MoE router (gate) and lm_head may be left out"
            )
    return {**qc, "modules_to_not_convert": None}
