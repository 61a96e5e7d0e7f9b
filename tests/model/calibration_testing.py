"""The full-model references of layer-wise calibration (`pagoda.model.quantization.calibration`):
each pass runs the whole model from the embeddings through `PagedRunner` (16-token blocks, the
block order `LayerwiseCalibration` reproduces), so a layer sees the activations that layer-wise
calibration must give it bit for bit.

`FullModelCalibration` has `LayerwiseCalibration`'s interface (O(layers^2) layer forwards);
`collect_hessians` gives every linear's Hessian from full-model passes (GPTQ's), and
`capture_layer_inputs` one decoder layer's linear inputs (AWQ's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from model_testing import PagedRunner
from torch import nn

from pagoda.model.layers.linear import LinearBase
from pagoda.model.quantization.awq import _calibration_inputs
from pagoda.model.quantization.calibration import BLOCK_SIZE
from pagoda.model.quantization.gptq import _hessian_hooks


class _Stop(Exception):
    pass


class FullModelCalibration:
    """The reference of `LayerwiseCalibration` (same interface): `forward` runs every sequence
    through the model from the embeddings (`PagedRunner.step(seq, 0)`, 16-token blocks),
    stopping after the current layer; `advance` only moves on. O(layers^2) layer forwards."""

    def __init__(
        self, model: nn.Module, cfg: dict[str, Any], sequences: Iterable[list[int]]
    ) -> None:
        self.model, self.cfg = model, cfg
        self.layers: nn.ModuleList = model.model.layers
        self.index = 0
        self._sequences = list(sequences)

    def forward(self) -> None:
        def stop(mod: nn.Module, args: tuple, out: Any) -> None:
            raise _Stop

        hook = self.layers[self.index].register_forward_hook(stop)
        try:
            for seq in self._sequences:
                blocks = -(-len(seq) // BLOCK_SIZE) + 1
                runner = PagedRunner(self.model, self.cfg, num_blocks=blocks, block_size=BLOCK_SIZE)
                try:
                    runner.step(seq, 0)
                except _Stop:
                    pass
        finally:
            hook.remove()

    def advance(self) -> None:
        self.index += 1


def collect_hessians(
    model: nn.Module,
    cfg: dict[str, Any],
    sequences: Iterable[list[int]],
    only: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """H = 2/n sum x x^T of the inputs of every linear layer (or those named in `only`), over
    the calibration sequences, from full-model passes (`quantize_model` gets the same per
    decoder layer from `LayerwiseCalibration`)."""
    modules = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and (only is None or name in only)
    ]
    with _hessian_hooks(modules) as hessians:
        for seq in sequences:
            blocks = -(-len(seq) // BLOCK_SIZE) + 1
            PagedRunner(model, cfg, num_blocks=blocks, block_size=BLOCK_SIZE).step(seq, 0)
    return hessians


def capture_layer_inputs(
    model: nn.Module, cfg: dict[str, Any], sequences: Iterable[list[int]], layer_idx: int
) -> dict[str, torch.Tensor]:
    """The inputs [tokens, K] of decoder layer `layer_idx`'s linears (`awq.GROUPS`) over the
    calibration sequences, from full-model passes that stop after that layer (`awq_quantize`
    gets the same from `LayerwiseCalibration` without the earlier layers)."""
    calib = FullModelCalibration(model, cfg, sequences)
    calib.index = layer_idx
    return _calibration_inputs(calib)
