"""INT8 W8A8 by SmoothQuant (Xiao et al. 2022, arXiv:2211.10438), written as a compressed-tensors
checkpoint ("int-quantized", the layout llm-compressor writes and vLLM reads).

Activations have a few input channels with values 10-100x the rest, which per-token int8
quantization cannot hold alongside the small ones; weights do not. Smoothing moves that range
into the weights: per input channel j of each group of linears that read one input,
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (alpha = 0.5 by default, max|W_j| over the stacked
rows of the group), the input divided by s and the weight columns multiplied by s. The division
is folded into the op before: the norm before q/k/v and gate/up (the decoder layer's
`norm_before`; a model without one there is refused, `check_scales_fold`); v_proj's output
rows for o_proj (exact only without GQA, where o_proj reads v's outputs directly; skipped
otherwise); up_proj's output rows for down_proj (act(gate) * up is linear in up). The
full-precision model computes the same function. Then every linear is quantized per output channel, symmetric int8
(round to nearest); at run time activations are quantized per token, symmetric, dynamically
(`pagoda.kernels.scaled_mm`). Decoder layers are calibrated in order, each on the activations
of the model whose earlier layers are smoothed and quantized (`LayerwiseCalibration`).

    pagoda quantize MODEL --method w8a8 --output DIR [--smoothing-alpha 0.5]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.kernels.scaled_mm import quantize_rows_ref, quantize_weight
from pagoda.model.quantization.awq import (
    GROUPS,
    _calibration_inputs,
    _o_proj_foldable,
    _subsample,
    check_config_scales_fold,
    check_model_scales_fold,
    fold_scales,
)
from pagoda.model.quantization.calibration import LayerwiseCalibration
from pagoda.model.quantization.checkpoint import (
    layer_progress,
    load_calibration_model,
    shard_columns,
    unquantized_tensors,
    write_checkpoint,
)

ERROR_TOKENS = 1024  # calibration tokens on which the reported output errors are measured


def _int8_args(strategy: str, dynamic: bool) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "strategy": strategy,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


def w8a8_quantization_config() -> dict[str, Any]:
    """compressed-tensors' quantization_config of an INT8 W8A8 checkpoint: int8 weights per
    output channel, int8 activations per token, dynamic, both symmetric; lm_head left dense."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _int8_args("channel", dynamic=False),
                "input_activations": _int8_args("token", dynamic=True),
                "output_activations": None,
                "format": "int-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def smoothing_scales(
    x_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j: x_absmax [K] over the
    calibration tokens, weight [N, K] the stacked weights reading that input."""
    w_absmax = weight.abs().amax(dim=0).float().clamp_min(1e-5)
    s = x_absmax.float().clamp_min(1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return s.clamp_min(1e-5)


def w8a8_error(
    x: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> float:
    """||Q(x) Q(W)^T - x W^T||^2 / ||x W^T||^2: the relative squared output error of the int8
    layer (activations quantized per token as at run time) on the inputs x [n, K]."""
    x_q, x_scale = quantize_rows_ref(x, torch.int8)
    y = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()
    ref = x.float() @ weight.float().t()
    return float((y - ref).pow(2).sum() / ref.pow(2).sum())


def smoothquant_layer(
    layer: nn.Module, inputs: dict[str, torch.Tensor], alpha: float = 0.5
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, float]]:
    """SmoothQuant of one decoder layer in place: smoothing scales from `inputs` (the layer's
    linears' inputs, `GROUPS` names) folded, then int8 per-channel weights; the linears' weights
    become their dequantized values. Returns per GROUPS entry (int8 weight [N, K], scale [N, 1],
    relative output error of W8A8 with smoothing, of W8A8 without)."""
    originals = {name: layer.get_submodule(name).weight.detach().float().clone() for name in GROUPS}
    scales = {}
    for name in GROUPS:
        if name == "self_attn.o_proj" and not _o_proj_foldable(layer):
            continue  # o_proj reads attention's output, which no weight before it can divide
        scales[name] = smoothing_scales(inputs[name].abs().amax(dim=0), originals[name], alpha)
    fold_scales(layer, scales)
    out = {}
    for name in GROUPS:
        module = layer.get_submodule(name)
        w = module.weight.detach().float()
        w_q, w_scale = quantize_weight(w, torch.int8)
        x = _subsample(inputs[name], ERROR_TOKENS)
        s = scales.get(name)
        smoothed = w8a8_error(x if s is None else x / s, w, w_q, w_scale)
        plain_q, plain_scale = quantize_weight(originals[name], torch.int8)
        plain = w8a8_error(x, originals[name], plain_q, plain_scale)
        with torch.no_grad():
            module.weight.copy_(w_q.float() * w_scale)
        out[name] = (w_q, w_scale, smoothed, plain)
    return out


def quantize_model_w8a8(
    model_path: str, output_dir: str, sequences: list[list[int]], alpha: float = 0.5
) -> dict[str, tuple[float, float]]:
    """SmoothQuant W8A8 of the decoder model `model_path` (HF dir or .gguf) on the calibration
    token `sequences`, written to `output_dir` as a compressed-tensors int-quantized checkpoint
    (config.json, model.safetensors, the source's tokenizer). Returns per linear module the
    relative output error of W8A8 with and without smoothing on the calibration inputs."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--smoothing-alpha must be in [0, 1], got {alpha}")
    from pagoda.model.loader import get_model_config_dict

    check_config_scales_fold(get_model_config_dict(model_path), "w8a8")  # before the load
    model, hf_config = load_calibration_model(model_path, sequences, "w8a8")
    layers = check_model_scales_fold(model, "w8a8")
    calib = LayerwiseCalibration(model, sequences)
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, tuple[float, float]] = {}
    for i, layer in enumerate(layer_progress(layers, "W8A8")):
        inputs = _calibration_inputs(calib)
        results = smoothquant_layer(layer, inputs, alpha)
        del inputs
        calib.advance()
        for name, (w_q, w_scale, err, plain) in results.items():
            full = f"model.layers.{i}.{name}"
            errors[full] = (err, plain)
            module = layer.get_submodule(name)
            for prefix, cols in shard_columns(model, full, module):
                tensors[prefix + ".weight"] = w_q[cols].contiguous()
                tensors[prefix + ".weight_scale"] = w_scale[cols].contiguous()
                if module.bias is not None:
                    tensors[prefix + ".bias"] = module.bias.data[cols].half().contiguous()
    linear_prefixes = {f"model.layers.{i}.{name}" for i in range(len(layers)) for name in GROUPS}
    tensors.update(unquantized_tensors(model, linear_prefixes))
    write_checkpoint(output_dir, hf_config, w8a8_quantization_config(), tensors, source=model_path)
    return errors
