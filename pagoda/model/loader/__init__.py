"""Weight loaders: a Hugging Face directory (config.json + *.safetensors / *.bin, sharded or not),
a GGUF file (config and weights from the file, dequantized, or kept in their blocks on a CPU:
`pagoda.model.quantization.gguf`), or `dummy` (random weights of the shape a config.json
describes, for benchmarks). Nothing is ever downloaded.

`get_model_config_dict` returns the config.json-equivalent dict an `EngineConfig` is built from;
`load_model` builds the model directly on the target device and dtype (parameters are allocated
uninitialised, never randomly initialised, so a 135M model loads in well under a second from
safetensors) and fills it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagoda.config import ModelConfig
from pagoda.model.loader.hf_config import validate_hf_config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pagoda.attention.backend import AttentionBackend
    from pagoda.model.layers.linear import LinearMethodBase

# torch is imported where weights are loaded, not here: reading and checking a model's config
# (`get_model_config_dict`) stays cheap for the server's front end, which never loads weights.
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_TORCH_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def _is_gguf(model: str, load_format: str) -> bool:
    return load_format == "gguf" or (os.path.isfile(model) and model.endswith(".gguf"))


def _gguf_files(directory: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.endswith(".gguf")]
    except OSError:
        return []


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable JSON config ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def get_model_config_dict(model: str, load_format: str = "auto") -> dict[str, Any]:
    """The checkpoint's config.json (a dict), from a HF directory, a .gguf file, or for
    load_format="dummy" a config.json path (or a directory holding one). The fields Pagoda
    reads are checked (`validate_hf_config`): a bad one is a ValueError naming file and field."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} not found: pass a local Hugging Face directory, a .gguf file, or "
            "a config.json with load_format='dummy' (Pagoda never downloads models)"
        )
    if _is_gguf(model, load_format):
        from pagoda.model.loader.gguf import GGUFReader, gguf_config_keys, gguf_to_hf_config

        reader = GGUFReader(model)
        try:
            config = gguf_to_hf_config(reader)
        except ValueError as e:  # its messages name the GGUF key, not the file
            raise ValueError(f"{model}: {e}") from None
        validate_hf_config(config, model, gguf_config_keys(reader.metadata))
        return config
    if os.path.isfile(model):
        if load_format != "dummy" and not model.endswith(".json"):
            raise ValueError(
                f"model {model!r} is a file but not a .gguf: pass the checkpoint's directory"
            )
        path = model
    else:
        path = os.path.join(model, "config.json")
        ggufs = [] if os.path.isfile(path) else sorted(_gguf_files(model))
        if ggufs:
            raise ValueError(
                f"{model} is a directory without a config.json; it holds {', '.join(ggufs)}: "
                "pass the path of the .gguf file to load"
            )
        if not os.path.isfile(path):
            raise ValueError(
                f"no config.json in {model}: a Hugging Face model directory needs one "
                "(or pass a .gguf file)"
            )
    config = _read_json(path)
    validate_hf_config(config, path)
    return config


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype!r}")
    return getattr(torch, _TORCH_DTYPES[dtype])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    attn_backend: AttentionBackend | None = None,
    linear_method: LinearMethodBase | None = None,
) -> nn.Module:
    """Build `model_config.architecture` on `device` in `dtype` (default: model_config.dtype)
    and fill it from the checkpoint (or with dummy weights). Returns the model in eval mode.

    `attn_backend` defaults to the registry's pick for the device; `linear_method` is how every
    linear layer stores and multiplies its weight (None: the checkpoint's AWQ/GPTQ method per
    `model_config.quantization`, else unquantized)."""
    import torch

    from pagoda.attention.backend import get_attn_backend
    from pagoda.model.loader.weights import (
        WeightLoadingState,
        find_weight_files,
        init_dummy_weights,
        iter_weight_file,
    )
    from pagoda.model.registry import get_model_class

    dtype = torch_dtype(dtype or model_config.dtype)
    device = torch.device(device)
    model_cls = get_model_class(model_config.architecture)
    if attn_backend is None:
        attn_backend = get_attn_backend(device)
    source, load_format = model_config.model, model_config.load_format
    gguf_why, gguf_blocks = None, False  # quantization="gguf": blocks kept or not, and why
    if linear_method is None:
        from pagoda.model.quantization import get_linear_method

        try:
            linear_method = get_linear_method(
                model_config.quantization, model_config.hf_config, dummy=load_format == "dummy"
            )
        except ValueError as e:  # its messages name the quantization_config field, not the model
            raise ValueError(f"{source}: {e}") from None
        if model_config.quantization == "gguf" and load_format != "dummy":
            from pagoda.model.quantization.gguf import GGUFLinearMethod, gguf_weights_stay_quantized

            gguf_blocks, gguf_why = gguf_weights_stay_quantized(source, device, dtype)
            linear_method = GGUFLinearMethod() if gguf_blocks else None
    if load_format != "dummy" and not os.path.exists(source):
        raise ValueError(f"model {source!r} not found: pass a local directory or .gguf file")
    files: list[str] = []
    if load_format != "dummy" and not _is_gguf(source, load_format):
        files = find_weight_files(source)  # fail on missing weights before building anything
    with torch.device(device), _default_dtype(dtype), torch.no_grad():
        model = model_cls(model_config.hf_config, linear_method, attn_backend)
        if model_config.quantization in ("awq", "gptq"):
            from pagoda.model.quantization.tp_shards import raise_shard_problems

            raise_shard_problems(model)  # a rank's shards that do not split, before reading
        if load_format == "dummy":
            init_dummy_weights(model, model_config.seed)
        else:
            state = WeightLoadingState(model)
            if _is_gguf(source, load_format):
                from pagoda.model.loader.gguf import QUANT_KERNEL_TYPES, iter_gguf_weights

                keep = QUANT_KERNEL_TYPES if gguf_blocks else ()
                state.load(iter_gguf_weights(source, keep), source)
            else:
                for path in files:
                    state.load(iter_weight_file(path), path)
            state.finish(source)
    if gguf_why is not None:
        from pagoda.model.quantization.gguf import log_weight_types

        log_weight_types(model, gguf_why)
    return model.eval()
