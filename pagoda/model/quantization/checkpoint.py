"""What the quantizers (`gptq.py`, `awq.py`) share around their algorithms: the float32 model
they calibrate, the checkpoint shards of a fused linear layer, the tensors written unquantized,
and the checkpoint directory (config.json with its quantization_config, model.safetensors, and
the source model's tokenizer and generation config)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from pagoda import envs

T = TypeVar("T")


def check_not_moe(hf_config: dict[str, Any], method: str) -> None:
    """ValueError for a mixture of experts: the quantizers calibrate and write the linear
    layers only, not the experts (nor would they leave the router dense)."""
    from pagoda.model.loader.hf_config import num_experts

    if num_experts(hf_config):
        arch = (hf_config.get("architectures") or ["this model"])[0]
        raise ValueError(
            f"pagoda quantize --method {method} does not quantize mixture-of-experts models "
            f"({arch}, {num_experts(hf_config)} experts a layer) yet: quantize it with "
            "AutoAWQ or GPTQModel (Pagoda serves their AWQ / GPTQ checkpoints), or serve it "
            "unquantized"
        )


def load_calibration_model(
    model_path: str, sequences: list[list[int]], method: str
) -> tuple[nn.Module, dict[str, Any]]:
    """(`model_path` loaded in float32 on the CPU, its HF config), long enough for `sequences`;
    a mixture of experts refused first (`check_not_moe`, naming `method`)."""
    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    hf_config = get_model_config_dict(model_path)
    check_not_moe(hf_config, method)
    mc = ModelConfig(
        model=model_path,
        hf_config=hf_config,
        dtype="float32",
        max_model_len=max(len(s) for s in sequences),
    )
    return load_model(mc, "cpu"), hf_config


@contextmanager
def calibration_threads() -> Iterator[int]:
    """torch's intra-op threads for a calibration run, restored after: one fewer per core's
    worth of load already on the machine (1-minute load average), at least one. Calibration is
    thousands of short parallel regions, each as slow as its slowest thread; on a busy CPU a
    descheduled thread stalls every one of them (the embedded model's AWQ layer took 140-180 s
    with 2 threads on 2 cores at a load average of 8, 27 s with 1). PAGODA_CALIBRATION_THREADS
    sets the count."""
    import torch

    before = torch.get_num_threads()
    threads = envs.PAGODA_CALIBRATION_THREADS
    if threads is None:
        from pagoda.utils.cpu_build import usable_cores

        free = usable_cores() - os.getloadavg()[0] if hasattr(os, "getloadavg") else before
        threads = max(1, min(before, int(round(free))))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def layer_progress(layers: Sequence[T], desc: str) -> Iterator[T]:
    """`layers`, one at a time, while `calibration_threads` holds, with a progress bar on
    stderr (decoder layers done, rate, ETA): calibration takes minutes on a CPU. The bar is off
    where stderr is not a terminal and PAGODA_PROGRESS is unset, so logs and tests stay clean;
    PAGODA_PROGRESS=0 turns it off, =1 on."""
    import sys

    from tqdm import tqdm

    show = envs.PAGODA_PROGRESS
    if show is None:
        show = sys.stderr.isatty()
    with (
        calibration_threads(),
        tqdm(total=len(layers), desc=desc, unit="layer", file=sys.stderr, disable=not show) as bar,
    ):
        for layer in layers:
            yield layer
            bar.update()


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


# The files of a Hugging Face directory that are not weights nor config.json: a quantized
# checkpoint of that directory carries them over as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def write_source_files(source: str, output_dir: str, hf_config: dict[str, Any]) -> None:
    """Make `output_dir` self-contained: the tokenizer and generation config of the source model
    (a HF directory's files copied; a GGUF file's tokenizer written as tokenizer.json +
    tokenizer_config.json with its chat template, and generation_config.json from its bos / eos
    / padding token ids)."""
    import shutil

    os.makedirs(output_dir, exist_ok=True)
    if os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(output_dir, name))
        return
    if not source.endswith(".gguf"):
        return
    from pagoda.model.loader.gguf import GGUFReader
    from pagoda.tokenizer import Tokenizer

    reader = GGUFReader(source)
    Tokenizer.from_gguf(reader).save_pretrained(
        output_dir, model_max_length=hf_config.get("max_position_embeddings")
    )
    md = reader.metadata
    generation = {
        f"{role}_token_id": int(md[f"tokenizer.ggml.{key}_token_id"])
        for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
        if md.get(f"tokenizer.ggml.{key}_token_id") is not None
    }
    with open(os.path.join(output_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)


def write_checkpoint(
    output_dir: str,
    hf_config: dict[str, Any],
    quantization_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: str | None = None,
    torch_dtype: str = "float16",
) -> None:
    """config.json (`hf_config` in `torch_dtype` with `quantization_config`) and
    model.safetensors; with `source` (the model quantized), its tokenizer and generation config
    too (`write_source_files`), so that the directory loads on its own."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config = dict(hf_config)
    config["torch_dtype"] = torch_dtype
    config["quantization_config"] = quantization_config
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"))
    if source is not None:
        write_source_files(source, output_dir, hf_config)
