"""Quantize a model ourselves with AWQ (Lin et al. 2023, arXiv:2306.00978, as AutoAWQ does it)
and write an AutoAWQ GEMM checkpoint (4-bit, zero points, `formats.py`'s layout) that Pagoda and
vLLM load.

Activation-aware scaling: the input channels that carry large activations matter most, so
before round-to-nearest each linear group (the projections that share one input: q/k/v,
o, gate/up, down) has its weight columns multiplied by s = mean|x|^alpha (normalized by
sqrt(max(s) min(s))) and its input divided by s, which the preceding op absorbs (the norm
before q/k/v or gate/up, named by the decoder layer's `norm_before`; v_proj's or up_proj's
output rows): the full-precision model computes the same function, and the salient channels
are quantized with finer steps. alpha comes from a grid of 20 values in [0, 1) by the group's
output error on the calibration inputs (alpha = 0 is plain round-to-nearest, so the search
never does worse than it there); the search also tries
AutoAWQ's duo scaling, s = mean|x|^alpha / mean(|w| / group max)^(1 - alpha), and scores
gate/up's scales on the MLP's output, as AutoAWQ does. Then, per output row and
group of inputs, a clipping search shrinks the range [-m, m] (m = max|w|, ratios 1 down to
0.55) where that lowers the output error (not on q/k, whose errors the softmax amplifies, as
AutoAWQ). Decoder layers are calibrated in order, each on the activations of the model whose
earlier layers are already scaled and quantized (`LayerwiseCalibration` keeps each layer's
inputs and runs only that layer, once quantized, to get the next one's).

    pagoda quantize MODEL --method awq --output DIR [--group-size 128]
        [--calibration-file FILE] [--num-samples 32] [--seq-len 512]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.model.quantization.calibration import Calibration, LayerwiseCalibration
from pagoda.model.quantization.checkpoint import (
    layer_progress,
    load_calibration_model,
    shard_columns,
    unquantized_tensors,
    write_checkpoint,
)
from pagoda.model.quantization.formats import pack_awq

GRID = 20  # alpha in {0, 1/20, ..., 19/20}; clip ratios 1 - i/20 for i < 10
BLOCK_SEARCH_TOKENS = 1024  # calibration tokens of gate/up's MLP-scored scale search
# The linears of a decoder layer (Pagoda's fused modules) and the op before each one.
GROUPS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# The linears whose input scales fold into the norm before them (the layer's `norm_before`).
NORM_FOLDED = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_METHOD_NAMES = {"awq": "AWQ", "w8a8": "SmoothQuant W8A8"}


def check_scales_fold(layer_cls: type, architecture: str, method: str) -> None:
    """ValueError, naming the method (`awq` or `w8a8`), the architecture and why, where the
    decoder layers of `layer_cls` have no norm before a linear of NORM_FOLDED: the scales that
    divide its input would have nowhere to go."""
    norms = getattr(layer_cls, "norm_before", {})
    missing = [name.rsplit(".", 1)[-1] for name in NORM_FOLDED if name not in norms]
    if missing:
        raise ValueError(
            f"pagoda quantize --method {method}: {_METHOD_NAMES.get(method, method)} cannot "
            f"quantize {architecture}: it divides the inputs of {' and '.join(missing)} by "
            "per-channel scales folded into the norm before them, and "
            f"{architecture}'s decoder layers have no norm before {' and '.join(missing)} "
            "(they read the residual stream itself, which every later layer reads too); "
            "quantize it with --method gptq"
        )


def check_config_scales_fold(hf_config: dict[str, Any], method: str) -> None:
    """`check_scales_fold` for the model of `hf_config` (config.json), before it is loaded."""
    from pagoda.model.registry import get_model_class

    architecture = (hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
    layer_cls = get_model_class(architecture).decoder_layer_cls
    check_scales_fold(layer_cls, architecture, method)


def check_model_scales_fold(model: nn.Module, method: str) -> nn.ModuleList:
    """The decoder layers of a loaded model, each of which passed `check_scales_fold`."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{method}: {type(model).__name__} has no decoder layers (model.layers)")
    config = getattr(model, "config", None) or {}
    architecture = (config.get("architectures") or [type(model).__name__])[0]
    for layer_cls in {type(layer) for layer in layers}:
        check_scales_fold(layer_cls, architecture, method)
    return layers


@dataclass
class RTNResult:
    values: torch.Tensor  # [K, N] int32 in [0, 2**bits)
    zeros: torch.Tensor  # [groups, N] int32 in [0, 2**bits)
    scales: torch.Tensor  # [groups, N] float16 (what the checkpoint stores)
    dequantized: torch.Tensor  # [N, K] float32, exactly (values - zeros) * scales


def _group_slices(k: int, group_size: int) -> list[slice]:
    g = k if group_size in (-1, 0) else group_size
    return [slice(i, min(i + g, k)) for i in range(0, k, g)]  # a shorter last group if need be


def _rtn_group(block: torch.Tensor, qmax: int) -> tuple[torch.Tensor, ...]:
    """AutoAWQ's round-to-nearest of one group [..., G]: (q, zero, scale), each row's scale
    (max - min) / qmax rounded to float16, zero = -round(min / scale); w ~= (q - zero) * scale."""
    lo, hi = block.amin(dim=-1, keepdim=True), block.amax(dim=-1, keepdim=True)
    scale = ((hi - lo).clamp_min(1e-5) / qmax).half().float().clamp_min(6e-8)
    zero = torch.clamp(-torch.round(lo / scale), 0, qmax)
    q = torch.clamp(torch.round(block / scale) + zero, 0, qmax)
    return q, zero, scale


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128) -> RTNResult:
    """AutoAWQ's round-to-nearest with zero points of a [N, K] weight in groups of inputs
    (`_rtn_group`); the scale is rounded to float16 first, so the checkpoint reproduces
    `dequantized` exactly."""
    w = weight.detach().float()
    n, k = w.shape
    qmax = (1 << bits) - 1
    slices = _group_slices(k, group_size)
    values = torch.empty(k, n, dtype=torch.int32)
    zeros = torch.empty(len(slices), n, dtype=torch.int32)
    scales = torch.empty(len(slices), n, dtype=torch.float16)
    deq = torch.empty(n, k)
    for g, cols in enumerate(slices):
        q, zero, scale = _rtn_group(w[:, cols], qmax)
        values[cols] = q.t().to(torch.int32)
        zeros[g], scales[g] = zero[:, 0].to(torch.int32), scale[:, 0].half()
        deq[:, cols] = (q - zero) * scale
    return RTNResult(values, zeros, scales, deq)


def fake_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128) -> torch.Tensor:
    """`quantize_rtn(...).dequantized` without the integer tensors (the search's inner step)."""
    w = weight.float()
    qmax = (1 << bits) - 1
    n, k = w.shape
    g = k if group_size in (-1, 0) else group_size
    if k % g == 0:  # every group at once: [N, K/G, G] (the elementwise ops are the same)
        q, zero, scale = _rtn_group(w.reshape(n, k // g, g), qmax)
        return ((q - zero) * scale).reshape(n, k)
    out = torch.empty_like(w)
    for cols in _group_slices(k, group_size):
        q, zero, scale = _rtn_group(w[:, cols], qmax)
        out[:, cols] = (q - zero) * scale
    return out


def relative_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||x (approx - weight)^T||^2 / ||x weight^T||^2: the relative squared output error."""
    return float((x @ (approx - weight).t()).pow(2).sum() / (x @ weight.t()).pow(2).sum())


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [K] float32, the best candidate's
    alpha: float
    duo: bool  # the candidate also divides by the weights' mean magnitude
    error: float  # mean squared output error of Q(W * s) / s on the inputs
    rtn_error: float  # the same for alpha = 0 (plain round-to-nearest)


def _weight_mean(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over rows of |w| / max|w| of its quantization group: [K] (AutoAWQ's w_mean)."""
    a = weight.abs()
    parts = [
        a[:, sl] / (a[:, sl].amax(dim=1, keepdim=True) + 1e-6)
        for sl in _group_slices(a.shape[1], group_size)
    ]
    return torch.cat(parts, dim=1).mean(dim=0)


def search_scale(
    x: torch.Tensor,
    weight: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    grid: int = GRID,
    duo_scaling: bool = True,
    block: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ScaleSearch:
    """The AWQ scale of one linear group: x [n, K] its calibration inputs, weight [N, K] the
    stacked weights of the linears that read x. Minimizes mean((f(x W'^T) - f(x W^T))^2) over
    W' = Q(W * s) / s, s = x_mean^alpha / sqrt(max * min), alpha in i / grid, and with
    `duo_scaling` also over s = x_mean^alpha / w_mean^(1 - alpha) (AutoAWQ's default, which
    also favours the input channels whose weights are small in their group). f is `block`
    (what the rest of the block makes of the group's outputs: AutoAWQ scores gate/up on the
    MLP's output) or the identity. alpha = 0 of the first family, plain round-to-nearest,
    comes first and wins ties."""
    x, w = x.float(), weight.float()
    if block is None:
        # mean((x D^T)^2) = sum((D H) * D) / (n N), H = x^T x, D = W' - W: a [N, K] x [K, K]
        # product per candidate instead of [n, K] x [K, N] (n tokens > K inputs here).
        gram = x.t() @ x
        scale_err = 1.0 / (x.shape[0] * w.shape[0])

        def error(approx: torch.Tensor) -> float:
            d = approx - w
            return float(((d @ gram) * d).sum()) * scale_err
    else:
        y = block(x @ w.t())

        def error(approx: torch.Tensor) -> float:
            return float((block(x @ approx.t()) - y).pow(2).mean())

    x_mean = x.abs().mean(dim=0)
    w_mean = _weight_mean(w, group_size) if duo_scaling else None
    errors, candidates = [], []
    for duo in (False, True) if duo_scaling else (False,):
        for i in range(grid):
            s = x_mean.pow(i / grid)
            if duo:
                s = s / (w_mean.pow(1 - i / grid) + 1e-4)
            s = s.clamp_min(1e-4)
            s = s / (s.max() * s.min()).sqrt()
            approx = fake_quantize(w * s, bits, group_size) / s
            errors.append(error(approx))
            candidates.append((s, i / grid, duo))
    best = min(range(len(errors)), key=errors.__getitem__)  # the first of equals
    s, alpha, duo = candidates[best]
    return ScaleSearch(s, alpha, duo, errors[best], errors[0])


def mlp_output(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """gate_up's outputs -> the MLP's output: gate_up's bias, the MLP's activation-and-mul
    (`act_and_mul`: SwiGLU, Gemma's GeGLU), the full-precision down projection (whose bias
    cancels in the search's differences)."""
    mlp = layer.mlp
    w_down = mlp.down_proj.weight.detach().float().clone()
    bias = mlp.gate_up_proj.bias
    b = None if bias is None else bias.detach().float().clone()

    def f(h: torch.Tensor) -> torch.Tensor:
        if b is not None:
            h = h + b
        return mlp.act_and_mul(h) @ w_down.t()

    return f


def search_clip(
    x: torch.Tensor,
    weight: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    grid: int = GRID,
    max_shrink: float = 0.5,
    max_tokens: int = 512,
) -> torch.Tensor:
    """AutoAWQ's clipping search: per output row and group of inputs, the clip value m (w
    clamped to [-m, m] before quantization) among max|w| * (1 - i / grid), i < grid *
    max_shrink, with the least squared error of that group's share of the output, on up to
    `max_tokens` evenly spaced calibration inputs. Returns m [N, groups]."""
    x, w = x.float(), weight.float()
    if x.shape[0] > max_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, max_tokens).long()]
    slices = _group_slices(w.shape[1], group_size)
    best_m = torch.empty(w.shape[0], len(slices))
    for g, cols in enumerate(slices):
        wg, xg = w[:, cols], x[:, cols]
        y = xg @ wg.t()  # [n, N]
        org_max = wg.abs().amax(dim=1)
        best_err = torch.full((w.shape[0],), float("inf"))
        for i in range(int(grid * max_shrink)):
            m = org_max * (1 - i / grid)
            clipped = torch.maximum(torch.minimum(wg, m[:, None]), -m[:, None])
            q = fake_quantize(clipped, bits, wg.shape[1])
            err = (xg @ q.t() - y).pow(2).mean(dim=0)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_m[better, g] = m[better]
    return best_m


def apply_clip(weight: torch.Tensor, clip: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [N, K] clamped per row and group to [-clip, clip] (clip [N, groups])."""
    out = weight.clone()
    for g, cols in enumerate(_group_slices(weight.shape[1], group_size)):
        m = clip[:, g : g + 1]
        out[:, cols] = torch.maximum(torch.minimum(out[:, cols], m), -m)
    return out


def _o_proj_foldable(layer: nn.Module) -> bool:
    """o_proj's inputs come straight from v_proj's outputs only without GQA (AutoAWQ's rule)."""
    attn = layer.self_attn
    return (
        attn.num_kv_heads == attn.num_heads and attn.kv_size == attn.o_proj.input_size_per_partition
    )


def fold_scales(layer: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Fold AWQ scales into a decoder layer in place, leaving its function unchanged: a
    linear's input columns are multiplied by s and the op before it divides its output by s
    (q/k/v's and gate/up's: the norm the layer's `norm_before` names). `scales` maps GROUPS
    entries to [K] scales ("self_attn.o_proj" only where `_o_proj_foldable`)."""
    attn, mlp = layer.self_attn, layer.mlp
    for name in NORM_FOLDED:
        if name in scales and name not in getattr(layer, "norm_before", {}):
            raise ValueError(f"{type(layer).__name__} has no norm before {name} to fold into")
    with torch.no_grad():
        if "self_attn.qkv_proj" in scales:
            s = scales["self_attn.qkv_proj"]
            layer.get_submodule(layer.norm_before["self_attn.qkv_proj"]).divide_output_(s)
            attn.qkv_proj.weight.mul_(s)
        if "self_attn.o_proj" in scales:
            if not _o_proj_foldable(layer):
                raise ValueError("o_proj scales fold into v_proj only without GQA")
            s = scales["self_attn.o_proj"]
            v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
            attn.qkv_proj.weight[v_rows].div_(s[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_rows].div_(s)
            attn.o_proj.weight.mul_(s)
        if "mlp.gate_up_proj" in scales:
            s = scales["mlp.gate_up_proj"]
            layer.get_submodule(layer.norm_before["mlp.gate_up_proj"]).divide_output_(s)
            mlp.gate_up_proj.weight.mul_(s)
        if "mlp.down_proj" in scales:
            s = scales["mlp.down_proj"]
            inter = mlp.down_proj.input_size_per_partition
            up_rows = slice(inter, 2 * inter)  # act(gate) * up: only up is linear in s
            mlp.gate_up_proj.weight[up_rows].div_(s[:, None])
            if mlp.gate_up_proj.bias is not None:
                mlp.gate_up_proj.bias[up_rows].div_(s)
            mlp.down_proj.weight.mul_(s)


@contextmanager
def _input_hooks(layer: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """While open, the inputs [tokens, K] of `layer`'s linears (GROUPS) are appended per name
    to the yielded lists."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in GROUPS}
    hooks = []
    for name in GROUPS:

        def hook(mod: nn.Module, args: tuple, name: str = name) -> None:
            captured[name].append(args[0].reshape(-1, args[0].shape[-1]).float().clone())

        hooks.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def _calibration_inputs(calib: Calibration) -> dict[str, torch.Tensor]:
    """The inputs [tokens, K] of the calibration's current layer's linears (GROUPS)."""
    with _input_hooks(calib.layers[calib.index]) as captured:
        calib.forward()
    return {name: torch.cat(xs) for name, xs in captured.items()}


def _subsample(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    if x.shape[0] <= max_tokens:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, max_tokens).long()]


def awq_layer(
    layer: nn.Module,
    inputs: dict[str, torch.Tensor],
    bits: int = 4,
    group_size: int = 128,
    clip: bool = True,
    max_tokens: int = 4096,
) -> dict[str, tuple[RTNResult, float, float]]:
    """AWQ of one decoder layer in place: scale search on `inputs` (`_calibration_inputs`),
    folding, clipping search, round-to-nearest; the linears' weights become their dequantized
    values. The searches see up to `max_tokens` evenly spaced calibration tokens. Returns per
    GROUPS entry (quantization, relative output error of AWQ on the folded layer's inputs, of
    plain round-to-nearest on the original ones)."""
    xs = {name: _subsample(x, max_tokens) for name, x in inputs.items()}
    originals = {name: layer.get_submodule(name).weight.detach().float().clone() for name in GROUPS}
    scales: dict[str, torch.Tensor] = {}
    for name in GROUPS:
        if name == "self_attn.o_proj" and not _o_proj_foldable(layer):
            continue
        x, block = xs[name], None
        if name == "mlp.gate_up_proj":
            # Scored on the MLP's output: two full products per candidate, where the other
            # groups need one [N, K] x [K, K] (search_scale's Gram form); the most calibration
            # time by far, so it sees fewer tokens (the choice of one alpha among 40 is stable).
            x, block = _subsample(x, BLOCK_SEARCH_TOKENS), mlp_output(layer)
        scales[name] = search_scale(x, originals[name], bits, group_size, block=block).scales
    fold_scales(layer, scales)
    out: dict[str, tuple[RTNResult, float, float]] = {}
    attn = layer.self_attn
    for name in GROUPS:
        module = layer.get_submodule(name)
        s = scales.get(name, torch.ones(module.input_size_per_partition))
        x_folded = xs[name] / s  # the inputs the folded model feeds this linear
        w = module.weight.detach().float()
        if clip:
            if name == "self_attn.qkv_proj":  # q and k are not clipped (AutoAWQ)
                v_rows = slice(attn.q_size + attn.kv_size, None)
                clipped = w.clone()
                m = search_clip(x_folded, w[v_rows], bits, group_size)
                clipped[v_rows] = apply_clip(w[v_rows], m, group_size)
            else:
                clipped = apply_clip(w, search_clip(x_folded, w, bits, group_size), group_size)
        else:
            clipped = w
        res = quantize_rtn(clipped, bits, group_size)
        out[name] = (
            res,
            relative_error(x_folded, w, res.dequantized),
            relative_error(
                xs[name], originals[name], fake_quantize(originals[name], bits, group_size)
            ),
        )
    with torch.no_grad():
        for name in GROUPS:
            layer.get_submodule(name).weight.copy_(out[name][0].dequantized)
    return out


def awq_quantize(
    model: nn.Module,
    sequences: list[list[int]],
    bits: int = 4,
    group_size: int = 128,
    clip: bool = True,
    max_tokens: int = 4096,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, float]]]:
    """AWQ of a loaded Pagoda decoder model (float32, CPU) in place, decoder layer by
    decoder layer; its linears end up holding their dequantized weights and its norms the
    folded scales. Returns the checkpoint's tensors (AutoAWQ GEMM names and layout, float16,
    tied embeddings once) and per linear module the relative output error on the calibration
    inputs of AWQ and of round-to-nearest. (`cfg` is not read: the layer-wise calibration takes
    the cache's shape from the layers.)"""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit (AutoAWQ GEMM), got bits={bits}")
    layers = check_model_scales_fold(model, "awq")
    errors: dict[str, tuple[float, float]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name in GROUPS:
            if any(n % 8 for n in layer.get_submodule(name).output_partition_sizes):
                raise ValueError(f"AWQ needs output sizes divisible by 8 ({name})")
    calib = LayerwiseCalibration(model, sequences)
    for i, layer in enumerate(layer_progress(layers, "AWQ")):
        inputs = _calibration_inputs(calib)
        results = awq_layer(layer, inputs, bits, group_size, clip, max_tokens)
        del inputs
        calib.advance()  # layer i scaled and quantized: layer i+1's inputs
        for name, (res, awq_err, rtn_err) in results.items():
            full = f"model.layers.{i}.{name}"
            errors[full] = (awq_err, rtn_err)
            module = layer.get_submodule(name)
            for prefix, cols in shard_columns(model, full, module):
                tensors[prefix + ".qweight"] = pack_awq(res.values[:, cols].contiguous())
                tensors[prefix + ".qzeros"] = pack_awq(res.zeros[:, cols].contiguous())
                tensors[prefix + ".scales"] = res.scales[:, cols].contiguous()
                if module.bias is not None:
                    tensors[prefix + ".bias"] = module.bias.data[cols].half().contiguous()
    linear_prefixes = {f"model.layers.{i}.{name}" for i in range(len(layers)) for name in GROUPS}
    tensors.update(unquantized_tensors(model, linear_prefixes))
    return tensors, errors


def quantize_model_awq(
    model_path: str,
    output_dir: str,
    sequences: list[list[int]],
    bits: int = 4,
    group_size: int = 128,
    clip: bool = True,
    max_tokens: int = 4096,
) -> dict[str, tuple[float, float]]:
    """AWQ-quantize the decoder model `model_path` (HF dir or .gguf) on the calibration token
    `sequences` (`awq_quantize`) and write an AutoAWQ GEMM checkpoint to `output_dir`
    (config.json with its quantization_config, model.safetensors). Returns per linear module
    the relative output error on the calibration inputs of AWQ and of round-to-nearest."""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit (AutoAWQ GEMM), got bits={bits}")
    from pagoda.model.loader import get_model_config_dict

    check_config_scales_fold(get_model_config_dict(model_path), "awq")  # before the load
    model, hf_config = load_calibration_model(model_path, sequences, "awq")
    tensors, errors = awq_quantize(model, sequences, bits, group_size, clip, max_tokens)
    quantization_config = {
        "quant_method": "awq",
        "bits": bits,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    write_checkpoint(output_dir, hf_config, quantization_config, tensors, source=model_path)
    return errors
