"""Tiny Llama checkpoints quantized into AWQ's and GPTQ's formats, with the transformers model
on exactly the weights they encode (the reference)."""

from __future__ import annotations

import json

import torch
from model_testing import make_tiny_checkpoint
from safetensors.torch import save_file

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
