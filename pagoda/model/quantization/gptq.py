"""Quantize a model ourselves with GPTQ (Frantar et al. 2022, arXiv:2210.17323) and write a
GPTQ checkpoint (the AutoGPTQ layout of `formats.py`) that Pagoda, vLLM and transformers load.

Calibration: the model runs over calibration token sequences (prefills through a paged KV
cache, the torch path on a CPU) while hooks on linear layers accumulate the Hessian H = 2/n * sum x x^T of their
inputs. Each weight matrix is then quantized column by column, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian's Cholesky factor, in
blocks of 128 columns; group scales and zeros are set when a group's first column comes up;
`act_order` visits columns by decreasing Hessian diagonal (`g_idx` records their groups). Each
decoder layer is calibrated on the activations of the model whose earlier layers are already
quantized (the paper's sequential variant), and within a layer q/k/v, o, gate/up and down in
that order, each on the layer with the earlier ones quantized (AutoGPTQ's true_sequential):
`LayerwiseCalibration` keeps every layer's inputs and reruns only that layer.

    pagoda quantize MODEL --output DIR [--bits 4] [--group-size 128] [--act-order]
        [--calibration-file FILE] [--num-samples 32] [--seq-len 512]

(`--method awq`: AWQ instead, `awq.py`; the command is `pagoda.quantize`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.model.quantization.checkpoint import (
    layer_progress,
    load_calibration_model,
    shard_columns,
    unquantized_tensors,
    write_checkpoint,
)
from pagoda.model.quantization.formats import pack_gptq_weight, quantize_groups


@dataclass
class GPTQResult:
    values: torch.Tensor  # [K, N] int32 in [0, 2**bits)
    zeros: torch.Tensor  # [groups, N] int32
    scales: torch.Tensor  # [groups, N] float32
    g_idx: torch.Tensor  # [K] int32
    dequantized: torch.Tensor  # [N, K] float32


def _group_params(
    w: torch.Tensor, maxq: int, sym: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max scale and zero per row of w [N, cols] (0.0 representable). The zero
    is at least 1: the checkpoint stores zero - 1 in `bits` bits (AutoGPTQ's format). With
    `sym`, AutoGPTQ's symmetric grid: scale 2 max|w| / maxq, zero (maxq + 1) / 2."""
    if sym:
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax == 0, 1.0, 2 * amax / maxq)
        return scale, torch.full_like(scale, (maxq + 1) // 2)
    lo = torch.minimum(w.amin(dim=1), torch.zeros(()))
    hi = torch.maximum(w.amax(dim=1), torch.zeros(()))
    flat = hi == lo
    lo, hi = torch.where(flat, lo - 1, lo), torch.where(flat, hi + 1, hi)
    scale = (hi - lo) / maxq
    return scale, torch.round(-lo / scale).clamp(1, maxq)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    act_order: bool = False,
    percdamp: float = 0.01,
    blocksize: int = 128,
    sym: bool = False,
) -> GPTQResult:
    """GPTQ of one [N, K] weight against the input Hessian [K, K] (`sym`: every zero point
    2**(bits - 1), see `_group_params`)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    group_size = k if group_size in (-1, 0) else group_size
    maxq = (1 << bits) - 1
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += percdamp * torch.mean(torch.diag(h)) * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q_vals = torch.zeros(n, k, dtype=torch.int32)
    deq = torch.zeros(n, k)
    num_groups = -(-k // group_size)  # the last group may be shorter
    scales, zeros = torch.zeros(num_groups, n), torch.zeros(num_groups, n)
    scale = zero = None
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # a group starts: its parameters from the current weights
                block = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group_size]
                scale, zero = _group_params(block, maxq, sym)
                scales[col // group_size], zeros[col // group_size] = scale, zero
            q = torch.clamp(torch.round(w1[:, i] / scale) + zero, 0, maxq)
            q_vals[:, col] = q.to(torch.int32)
            deq[:, col] = scale * (q - zero)
            err = (w1[:, i] - deq[:, col]) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    inv = torch.argsort(perm)
    # Column j of the permuted order belongs to group j // group_size.
    g_idx = (torch.arange(k) // group_size)[inv].to(torch.int32)
    return GPTQResult(
        values=q_vals[:, inv].t().contiguous(),
        zeros=zeros.to(torch.int32),
        scales=scales,
        g_idx=g_idx,
        dequantized=deq[:, inv],
    )


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """trace(D H D^T) / trace(W H W^T), D = approx - weight: the relative squared error of the
    layer's outputs on the inputs H was collected from."""
    w, d = weight.float(), approx.float() - weight.float()
    return float(
        torch.einsum("nk,kl,nl->", d, hessian, d) / torch.einsum("nk,kl,nl->", w, hessian, w)
    )


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> torch.Tensor:
    """Round-to-nearest in the same groups (and zeros >= 1): the baseline GPTQ improves on."""
    k = weight.shape[1]
    group = k if group_size in (-1, 0) else group_size
    values, zeros, scales = quantize_groups(weight, bits, group, symmetric=sym, min_zero=1)
    z = zeros.float().repeat_interleave(group, dim=0)
    s = scales.repeat_interleave(group, dim=0)[:k]
    return ((values.float() - z[:k]) * s).t()


def _rtn_result(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> GPTQResult:
    k = weight.shape[1]
    group = k if group_size in (-1, 0) else group_size
    values, zeros, scales = quantize_groups(weight, bits, group, symmetric=sym, min_zero=1)
    return GPTQResult(
        values=values,
        zeros=zeros,
        scales=scales,
        g_idx=(torch.arange(k) // group).to(torch.int32),
        dequantized=rtn(weight, bits, group_size, sym),
    )


@contextmanager
def _hessian_hooks(modules: Iterable[tuple[str, nn.Module]]) -> Iterator[dict[str, torch.Tensor]]:
    """While open, hooks on `modules` (name, linear) accumulate the sums of x x^T of their
    inputs; on leaving, the yielded dict is filled with H = 2/n sum x x^T per name."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hessians: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in modules:

        def hook(mod: nn.Module, args: tuple, name: str = name) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            if name not in sums:
                sums[name] = torch.zeros(x.shape[1], x.shape[1])
                counts[name] = 0
            sums[name] += x.t() @ x
            counts[name] += x.shape[0]

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        yield hessians
        hessians.update({name: 2.0 * sums[name] / counts[name] for name in sums})
    finally:
        for h in hooks:
            h.remove()


def quantize_model(
    model_path: str,
    output_dir: str,
    sequences: list[list[int]],
    bits: int = 4,
    group_size: int = 128,
    act_order: bool = False,
    method: str = "gptq",
    sym: bool = False,
) -> dict[str, tuple[float, float]]:
    """GPTQ-quantize every linear layer of `model_path` (HF dir or .gguf) on the calibration
    token `sequences` and write a GPTQ checkpoint to `output_dir` (config.json with its
    quantization_config, model.safetensors). Returns per layer the relative output error on the
    calibration inputs, trace(D H D^T) / trace(W H W^T) with D the weight's error, of GPTQ and
    of round-to-nearest with the same groups (for comparison). `method="rtn"` writes the
    round-to-nearest weights instead (a baseline checkpoint). `sym`: every zero point
    2**(bits - 1) (AutoGPTQ's `sym=True`; on a CPU such 8-bit layers run as Q8_0 blocks)."""
    from pagoda.model.layers.linear import LinearBase
    from pagoda.model.quantization.calibration import LayerwiseCalibration

    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be 'gptq' or 'rtn', got {method!r}")
    model, hf_config = load_calibration_model(model_path, sequences, method)
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, tuple[float, float]] = {}
    # Decoder layer by decoder layer: each one's Hessians come from its inputs in the model
    # whose earlier layers are quantized already (the paper's sequential GPTQ), so its rounding
    # is compensated on the activations the quantized model will feed it. The calibration
    # keeps each layer's inputs and runs only that layer (quantized) to get the next one's.
    stages: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            stage = name.split(".self_attn.")[0].split(".mlp.")[0]
            stages.setdefault(stage, []).append((name, module))
    linear_prefixes = {name for group in stages.values() for name, _ in group}
    calib = LayerwiseCalibration(model, sequences)
    if list(stages) != [f"model.layers.{i}" for i in range(len(calib.layers))]:
        raise ValueError(f"GPTQ here quantizes decoder layers' linears only, got {list(stages)}")
    results: list[tuple[str, nn.Module, GPTQResult]] = []
    for group in layer_progress(list(stages.values()), method.upper()):
        # Within the layer too, in order (AutoGPTQ's true_sequential): q/k/v, o, gate/up and
        # down each get their Hessian from the layer whose earlier linears are quantized.
        for name, module in group:
            with _hessian_hooks([(name, module)]) as hessians:
                calib.forward()
            w = module.weight.data.clone()
            if method == "rtn":
                res = _rtn_result(w, bits, group_size, sym)
            else:
                res = gptq_quantize(w, hessians[name], bits, group_size, act_order, sym=sym)
            errors[name] = (
                output_error(w, res.dequantized, hessians[name]),
                output_error(w, rtn(w, bits, group_size, sym), hessians[name]),
            )
            module.weight.data.copy_(res.dequantized)
            results.append((name, module, res))
        calib.advance()
    for name, module, res in results:
        for prefix, cols in shard_columns(model, name, module):
            tensors[prefix + ".qweight"] = pack_gptq_weight(res.values[:, cols], bits)
            tensors[prefix + ".qzeros"] = (
                pack_gptq_weight((res.zeros[:, cols] - 1).t().contiguous(), bits).t().contiguous()
            )
            tensors[prefix + ".scales"] = res.scales[:, cols].half().contiguous()
            tensors[prefix + ".g_idx"] = res.g_idx.clone()
            if module.bias is not None:
                tensors[prefix + ".bias"] = module.bias.data[cols].half().contiguous()
    tensors.update(unquantized_tensors(model, linear_prefixes))
    quantization_config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": sym,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
    }
    write_checkpoint(output_dir, hf_config, quantization_config, tensors, source=model_path)
    return errors


# A little English and code for calibration when no file is given; real calibration wants
# a few hundred samples of the model's own domain (--calibration-file).
BUILTIN_CALIBRATION = """\
The study of language models has moved from counting words to predicting them. A model reads
a sequence of tokens and assigns a probability to every possible next token; generation picks
one, appends it and repeats. Serving such models well is a matter of memory: the weights are
read once per step, the cache of keys and values grows with every token of every request.
Paged attention stores that cache in fixed-size blocks, continuous batching admits new requests
at every step, and quantization shrinks the weights to four or eight bits per value.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
The quick brown fox jumps over the lazy dog. Machine learning learns patterns from data;
deep learning stacks many layers of them; reinforcement learning learns from rewards.
"""


def calibration_sequences(token_ids: list[int], num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to `num_samples` windows of `seq_len` tokens cut evenly from `token_ids` (the whole
    text once if it is shorter than one window)."""
    if len(token_ids) <= seq_len:
        return [token_ids]
    starts = range(
        0,
        len(token_ids) - seq_len + 1,
        max(1, (len(token_ids) - seq_len) // max(1, num_samples - 1)),
    )
    return [token_ids[s : s + seq_len] for s in list(starts)[:num_samples]]
