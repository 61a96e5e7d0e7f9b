"""Tiny Llama checkpoints quantized into AWQ's and GPTQ's formats, with the transformers model
on exactly the weights they encode (the reference), and into compressed-tensors' FP8."""

from __future__ import annotations

import json

import torch
from model_testing import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from pagoda.kernels.scaled_mm import quantize_weight
from pagoda.model.quantization.formats import (
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq_weight,
    quantize_groups,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32

SHARED_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "mlp",
    "up_proj": "mlp",
}


def quantized_checkpoint(
    tmp_path,
    method: str,
    bits: int = 4,
    act_order: bool = False,
    sym: bool = False,
    group: int = GROUP,
    **overrides,
):
    """A tiny Llama (its config's `overrides`) saved in `method`'s format, groups of `group`
    inputs (GPTQ with `sym`: every zero point 2**(bits-1)); returns the HF model with the
    dequantized weights (the reference) and the path."""
    assert not sym or method == "gptq"
    hf = make_tiny_checkpoint(tmp_path / "dense", "llama_gqa_tied_llama3_rope", **overrides)
    tensors = {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            proj = name.split(".")[-2]
            if proj not in LINEARS:
                tensors[name] = p.detach().clone().contiguous()
                continue
            prefix = name.removesuffix(".weight")
            n, k = p.shape
            values, zeros, scales = quantize_groups(
                p, bits, group, symmetric=sym, min_zero=method == "gptq"
            )
            scales = scales.half()
            if method == "awq":
                tensors[prefix + ".qweight"] = pack_awq(values)
                tensors[prefix + ".qzeros"] = pack_awq(zeros)
                tensors[prefix + ".scales"] = scales
                dense = dequantize_awq(
                    tensors[prefix + ".qweight"], tensors[prefix + ".qzeros"], scales, group
                )
            else:
                g_idx = torch.arange(k, dtype=torch.int32) // group
                if act_order:  # inputs regrouped: a permutation of the groups' members
                    # Projections of one input (q/k/v, gate/up) share it, as AutoGPTQ's do:
                    # their Hessians, which order the inputs, are the same.
                    shared = SHARED_INPUT.get(proj, proj)
                    key = (prefix.split(".")[2], shared)
                    if key not in perms:
                        perms[key] = torch.randperm(k, generator=g)
                    g_idx = g_idx[perms[key]]
                    values, zeros, scales = _quantize_by_g_idx(p, bits, g_idx, sym)
                    scales = scales.half()
                tensors[prefix + ".qweight"] = pack_gptq_weight(values, bits)
                tensors[prefix + ".qzeros"] = _pack_gptq_zeros(zeros - 1, bits)
                tensors[prefix + ".scales"] = scales
                tensors[prefix + ".g_idx"] = g_idx
                dense = dequantize_gptq(
                    tensors[prefix + ".qweight"], tensors[prefix + ".qzeros"], scales, g_idx, bits
                )
            p.copy_(dense)  # the reference runs on exactly what the checkpoint encodes
    path = tmp_path / method
    path.mkdir()
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        cfg["quantization_config"] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": act_order,
            "sym": sym,
        }
    (path / "config.json").write_text(json.dumps(cfg))
    tensors.pop("lm_head.weight", None)  # tied
    save_file(tensors, str(path / "model.safetensors"))
    return hf, path


def _pack_gptq_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """[groups, N] -> [groups, N/P], packed along outputs (GPTQ's qzeros)."""
    return pack_gptq_weight(zeros.t().contiguous(), bits).t().contiguous()


def _quantize_by_g_idx(weight, bits, g_idx, sym):
    n, k = weight.shape
    groups = int(g_idx.max()) + 1
    values = torch.empty(k, n, dtype=torch.int32)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    scales = torch.empty(groups, n)
    for gi in range(groups):
        cols = (g_idx == gi).nonzero().flatten()
        v, z, s = quantize_groups(weight[:, cols], bits, len(cols), symmetric=sym, min_zero=1)
        values[cols] = v
        zeros[gi], scales[gi] = z[0], s[0]
    return values, zeros, scales


# A MoE checkpoint's linear layers: attention and dense MLPs as above, and every expert's
# projections (Mixtral's w1 / w3 / w2; Qwen3-MoE's gate_proj / up_proj / down_proj). The
# router (`gate`) stays dense, as AutoAWQ and GPTQModel leave it.
MOE_LINEARS = (*LINEARS, "w1", "w2", "w3")
_MOE_SHARED_INPUT = {**SHARED_INPUT, "w1": "mlp", "w3": "mlp"}


def quantized_moe_checkpoint(
    tmp_path,
    case: str,
    method: str,
    bits: int = 4,
    act_order: bool = False,
    sym: bool = False,
    group: int = GROUP,
    **overrides,
):
    """A tiny MoE model (`model_testing.TINY_CASES[case]`: "mixtral" or "qwen3_moe") saved in
    `method`'s format under vLLM's names (`...experts.{e}.w1.qweight`, `...experts.{e}.
    gate_proj.qweight`), groups of `group` inputs, its config's `overrides` (initializer_range
    0.2 unless given); returns (the dense checkpoint of exactly the weights the quantized one
    encodes, the quantized checkpoint's path). transformers loads the dense one (the
    reference) from its per-expert tensors."""
    from safetensors.torch import load_file

    assert not sym or method == "gptq"
    dense_dir, path = tmp_path / "dense", tmp_path / method
    make_tiny_checkpoint(dense_dir, case, **{"initializer_range": 0.2, **overrides})
    (weights_file,) = dense_dir.glob("*.safetensors")
    state = load_file(str(weights_file))
    tensors, dense = {}, {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    g = torch.Generator().manual_seed(7)
    for name, w in sorted(state.items()):
        prefix, proj = name.removesuffix(".weight"), name.split(".")[-2]
        if proj not in MOE_LINEARS or not name.endswith(".weight"):
            tensors[name] = dense[name] = w
            continue
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group
        if act_order:  # projections of one input share its order (see quantized_checkpoint)
            key = (prefix.rsplit(".", 1)[0], _MOE_SHARED_INPUT.get(proj, proj))
            if key not in perms:
                perms[key] = torch.randperm(w.shape[1], generator=g)
            g_idx = g_idx[perms[key]]
        packed = _quantized_tensors(w, method, bits, group, g_idx if act_order else None, sym)
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
        dense[name] = _dequantized(packed, method, bits, group).contiguous()
    path.mkdir()
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(method, bits, group, act_order, sym)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    # The reference: what the quantized tensors encode.
    save_file(dense, str(weights_file), metadata={"format": "pt"})
    return dense_dir, path


def _quantized_tensors(weight, method, bits, group, act_order_g_idx, sym):
    """One [N, K] weight in `method`'s tensors (GPTQ with act order: groups `act_order_g_idx`)."""
    if act_order_g_idx is not None:
        values, zeros, scales = _quantize_by_g_idx(weight, bits, act_order_g_idx, sym)
        g_idx = act_order_g_idx
    else:
        values, zeros, scales = quantize_groups(
            weight, bits, group, symmetric=sym, min_zero=method == "gptq"
        )
        g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group
    if method == "awq":
        return {"qweight": pack_awq(values), "qzeros": pack_awq(zeros), "scales": scales.half()}
    return {
        "qweight": pack_gptq_weight(values, bits),
        "qzeros": _pack_gptq_zeros(zeros - 1, bits),
        "scales": scales.half(),
        "g_idx": g_idx,
    }


def _dequantized(packed, method, bits, group) -> torch.Tensor:
    if method == "awq":
        return dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"], group)
    return dequantize_gptq(
        packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits
    )


def _quantization_config(method, bits, group, act_order, sym) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
            "sym": sym}  # fmt: skip


def fp8_checkpoint(tmp_path, strategy: str, static_input: bool, vllm_format: bool = False) -> None:
    """A compressed-tensors float-quantized checkpoint (as llm-compressor's FP8 / FP8_DYNAMIC
    schemes write them) made from a tiny dense one."""
    make_tiny_checkpoint(tmp_path, "llama_gqa_tied_llama3_rope")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        if strategy == "channel":
            w_q, scale = quantize_weight(w, torch.float8_e4m3fn)
        else:
            scale = (w.abs().amax() / 448.0).reshape(1)
            w_q = (w / scale).to(torch.float8_e4m3fn)
        tensors[name] = w_q
        tensors[name + "_scale"] = scale.to(torch.bfloat16)
        if static_input:
            tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    args = {"num_bits": 8, "type": "float", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": strategy, "dynamic": False},
                "input_activations": {
                    **args,
                    "strategy": "tensor" if static_input else "token",
                    "dynamic": not static_input,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    if vllm_format:  # AutoFP8's layout: per-tensor scales, quant_method fp8
        scheme = "static" if static_input else "dynamic"
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme}
    (tmp_path / "config.json").write_text(json.dumps(config))
