"""What the quantizers (`gptq.py`, `awq.py`) share around their algorithms: the float32 model
they calibrate, the checkpoint shards of a fused linear layer, the tensors written unquantized,
and the checkpoint directory (config.json with its quantization_config, model.safetensors)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def load_calibration_model(
    model_path: str, sequences: list[list[int]]
) -> tuple[nn.Module, dict[str, Any]]:
    """(`model_path` loaded in float32 on the CPU, its HF config), long enough for `sequences`."""
    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    hf_config = get_model_config_dict(model_path)
    mc = ModelConfig(
        model=model_path,
        hf_config=hf_config,
        dtype="float32",
        max_model_len=max(len(s) for s in sequences),
    )
    return load_model(mc, "cpu"), hf_config


def shard_columns(model: nn.Module, name: str, module: nn.Module) -> list[tuple[str, slice]]:
    """(checkpoint prefix, output columns) of each checkpoint layer the linear `name` fuses
    (q/k/v in qkv_proj, gate/up in gate_up_proj), or of the layer itself."""
    fused = name.rsplit(".", 1)[-1]
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    parts = [ckpt for ckpt, (target, _) in mapping.items() if target == fused] or [fused]
    sizes = module.output_partition_sizes if len(parts) > 1 else [module.output_size_per_partition]
    out, start = [], 0
    for part, size in zip(parts, sizes):
        out.append((name.rsplit(".", 1)[0] + "." + part, slice(start, start + size)))
        start += size
    return out


def unquantized_tensors(
    model: nn.Module, linear_prefixes: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Every parameter outside the quantized linears, in float16; tied embeddings once."""
    skip = set(linear_prefixes)
    tensors = {}
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0] in skip:
            continue
        if getattr(model, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        tensors[name] = param.data.half().contiguous()
    return tensors


def write_checkpoint(
    output_dir: str,
    hf_config: dict[str, Any],
    quantization_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    """config.json (`hf_config` in float16 with `quantization_config`) and model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config = dict(hf_config)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"))
