"""Checkpoint files -> model parameters: find the weight files of a Hugging Face directory, read
them (safetensors, or PyTorch .bin with `weights_only=True`), and copy each tensor into its
parameter through the parameter's own `weight_loader` (fused shards via the model's
`packed_modules_mapping`). Every problem a user can cause (missing, truncated, unexpected or
mis-shaped tensors) raises a ValueError naming the file and tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.model.layers.linear import LinearBase, default_weight_loader

# Buffers some checkpoints carry that the model recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# A quantized layer's tensors, whose shapes follow quantization_config (bits, group size).
_QUANTIZATION_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale")


def find_weight_files(model_dir: str) -> list[str]:
    """The checkpoint files of a directory: its sharded index if any, else every *.safetensors,
    else every *.bin."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = os.path.join(model_dir, index_name)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(f"{index_path} is not a valid shard index ({e})") from None
            files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise ValueError(
                    f"{index_path} lists shard(s) that are missing: "
                    f"{', '.join(os.path.basename(m) for m in missing)}; download them again"
                )
            return files
    names = sorted(os.listdir(model_dir))
    for ext in (".safetensors", ".bin"):
        files = [os.path.join(model_dir, n) for n in names if n.endswith(ext)]
        if files:
            return files
    raise ValueError(
        f"no weights in {model_dir}: expected *.safetensors or pytorch_model*.bin files "
        "(or pass load_format='dummy' for random weights)"
    )


def iter_weight_file(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one checkpoint file, read lazily (safetensors) or memory-mapped."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            f = safe_open(path, framework="pt", device="cpu")
            keys = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(
                f"{path} is not a readable safetensors file ({e}); it may be truncated or "
                "corrupt: download it again"
            ) from None
        for key in keys:
            try:
                tensor = f.get_tensor(key)
            except Exception as e:
                raise ValueError(f"{path}: cannot read tensor {key!r} ({e})") from None
            yield key, tensor
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint ({e}); it may be truncated or corrupt"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict")
    yield from state.items()


def _check_dtype(source: str, name: str, tensor: object, param: torch.Tensor) -> None:
    """A ValueError unless `tensor` is of `param`'s kind: floating-point values for a
    floating-point parameter, integers for an integer one (packed words, codes, g_idx). The
    copy casts within a kind; across kinds it would turn integer codes into weights (or
    weights into truncated integers): a model that loads and answers garbage."""
    if not isinstance(tensor, torch.Tensor):  # GGUF blocks kept quantized: their own type
        return
    if tensor.is_floating_point() and getattr(param, "takes_float", False):
        return  # a GGUF blocks parameter given a float tensor: its layer is kept dense
    want_float = param.is_floating_point()
    is_int = (
        not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
    )
    if tensor.is_floating_point() if want_float else is_int:
        return
    expected = "floating-point weights" if want_float else "integers"
    raise ValueError(
        f"{source}: tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')} where "
        f"the model expects {expected} ({str(param.dtype).removeprefix('torch.')}); the "
        "checkpoint does not match its config.json (quantization_config, or none)"
    )


class WeightLoadingState:
    """Tracks which parameters (and which shards of fused ones) a checkpoint has filled."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
        # A model's own (parameter, shard) for names the mapping cannot express (MoE experts).
        self.remap = getattr(model, "map_checkpoint_name", None)
        self.tied = bool(getattr(model, "tie_word_embeddings", False))
        self.expected: set[tuple[str, object]] = set()
        for name, param in self.params.items():
            if getattr(param, "optional", False):  # has a default when the checkpoint lacks it
                continue
            shards = getattr(param, "shard_ids", None) or [
                sid for (fused, sid) in self.mapping.values() if f".{fused}." in name
            ]
            self.expected.update((name, sid) for sid in (shards or [None]))
        self.loaded: set[tuple[str, object]] = set()

    def _checkpoint_name(self, name: str, shard_id: object) -> str:
        if isinstance(shard_id, tuple):  # (expert, shard) of a MoE layer's stacked experts
            return f"{name} (expert {shard_id[0]}, {shard_id[1]})"
        for ckpt, (fused, sid) in self.mapping.items():
            if sid == shard_id and f".{fused}." in name:
                return name.replace(f".{fused}.", f".{ckpt}.")
        return name

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
                continue
            param_name, shard_id = name, None
            mapped = self.remap(name) if self.remap is not None else None
            if mapped is not None:
                param_name, shard_id = mapped
            else:
                for ckpt, (fused, sid) in self.mapping.items():
                    if f".{ckpt}." in name:
                        param_name, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                        break
            param = self.params.get(param_name)
            if param is None:
                raise ValueError(
                    f"{source}: tensor {name!r} has no place in {type(self.model).__name__}; "
                    "the checkpoint does not match its config.json (architectures / layer counts)"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ValueError as e:
                fields = (
                    "quantization_config: bits / group_size"
                    if name.endswith(_QUANTIZATION_SUFFIXES)
                    else "hidden_size / heads / intermediate_size / vocab_size"
                )
                raise ValueError(
                    f"{source}: tensor {name!r}: {e}; the checkpoint does not match its "
                    f"config.json ({fields})"
                ) from None
            # After the loader, whose own check (a format's) says more where it has one.
            _check_dtype(source, name, tensor, param)
            if shard_id is None:
                self.loaded.update(k for k in self.expected if k[0] == param_name)
            else:
                self.loaded.add((param_name, shard_id))

    def finish(self, source: str) -> None:
        missing = sorted(self._checkpoint_name(n, s) for n, s in self.expected - self.loaded)
        if missing:
            shown = ", ".join(missing[:6]) + (
                f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            )
            raise ValueError(f"{source}: the checkpoint lacks tensors the model needs: {shown}")
        process_weights_after_loading(self.model)


def process_weights_after_loading(model: nn.Module) -> None:
    """Once every tensor is in: first the modules that rework their own weights (a MoE layer's
    quantized experts, where they do not stay per-expert layers dequantized into its stacked
    weights and those layers dropped: `FusedMoE`), then every remaining linear layer's method
    (repack, dequantize, GGUF blocks)."""
    for module in list(model.modules()):
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None and not isinstance(module, LinearBase):
            hook()
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.linear_method.process_weights_after_loading(module)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights for benchmarks of real shapes: normal(0, std) matrices, unit norm weights,
    deterministic for a given seed (generated on the parameter's device, so fast on a GPU).
    A quantized layer's packed integer tensors get random bits (every 4-bit value of an AWQ /
    GPTQ word), its scales |normal(0, std)| / 8, about the step of 4-bit weights of that size."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("scales"):
            param.normal_(0.0, std / 8, generator=gen).abs_()
        elif param.is_floating_point():
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("g_idx"):
            continue  # its default (in-order groups) is the only valid one for random weights
        elif param.dtype in (torch.int32, torch.int8, torch.uint8):
            info = torch.iinfo(param.dtype)
            param.random_(info.min, info.max, generator=gen)
        else:
            param.zero_()
    for module in model.modules():
        if isinstance(module, LinearBase):
            # A format may constrain its random tensors (GPTQ: symmetric zeros, 8-bit steps).
            init = getattr(module.linear_method, "init_dummy_weights", None)
            if init is not None:
                init(module)
    process_weights_after_loading(model)
