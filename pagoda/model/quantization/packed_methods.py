"""The linear methods of loaded layers that stay quantized on the GPU: 4-bit AWQ / GPTQ layers
repacked for the W4A16 kernel (`w4_layout.py`, `pagoda.kernels.w4a16`) and 8-bit GPTQ layers
for the W8A16 kernel (`w8_layout.py`, `pagoda.kernels.w8a16`). The AWQ / GPTQ methods of
`pagoda.model.quantization` install them once a layer's checkpoint tensors are in; with a
layer's `fused_ops` off they dequantize per call and run F.linear (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs
from pagoda.model.layers.linear import LinearMethodBase
from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4
from pagoda.model.quantization.w8_layout import W8Weight, dequantize_w8


class _KeptQuantizedMethod(LinearMethodBase):
    """A layer a checkpoint's method repacked after loading: `apply` runs the kernel on the
    packed weight (`packed`, `run`); with the layer's `fused_ops` off, the weight dequantized
    per call and F.linear (the reference)."""

    repacked_by = ""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise TypeError(f"{type(self).__name__} runs layers that {self.repacked_by} repacked")

    @staticmethod
    def packed(layer: nn.Module) -> W4Weight | W8Weight:
        raise NotImplementedError

    @staticmethod
    def dequantize(w: W4Weight | W8Weight, k: int) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def run(x: torch.Tensor, w: W4Weight | W8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = layer.input_size_per_partition
        if not getattr(layer, "fused_ops", True):
            weight = self.dequantize(self.packed(layer), k).to(x.dtype)
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = self.run(x2, self.packed(layer), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class W4A16LinearMethod(_KeptQuantizedMethod):
    """A loaded 4-bit layer kept packed (`w4_qweight`, `w4_scales`, `w4_zeros`, `w4_perm`,
    `w4_group_size`, made by `_PackedUntilLoaded.repack_to_w4a16`): the W4A16 kernels."""

    repacked_by = "an AWQ/GPTQ method"

    @staticmethod
    def packed(layer: nn.Module) -> W4Weight:
        return W4Weight(
            layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_group_size, layer.w4_perm
        )

    @staticmethod
    def dequantize(w: W4Weight, k: int) -> torch.Tensor:
        return dequantize_w4(w, k)

    @staticmethod
    def run(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.kernels.w4a16 import w4a16_linear

        return w4a16_linear(x, w.qweight, w.scales, w.zeros, w.group_size, bias, w.perm)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The CUDA decode kernel's product with the activation on its sums
        (`w4a16_silu_and_mul`), where it runs these inputs and PAGODA_W4A16_SILU is on (the
        default)."""
        if not envs.PAGODA_W4A16_SILU or not getattr(layer, "fused_ops", True) or not x.is_cuda:
            return None
        from pagoda.kernels.w4a16 import w4a16_silu_and_mul

        k = layer.input_size_per_partition
        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        w = self.packed(layer)
        y = w4a16_silu_and_mul(x2, w.qweight, w.scales, w.zeros, w.group_size, bias, w.perm)
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


class W8A16LinearMethod(_KeptQuantizedMethod):
    """A loaded 8-bit layer kept 8-bit (`w8_qweight`, `w8_scales`, `w8_zeros`, `w8_perm`,
    `w8_group_size`, made by `_PackedUntilLoaded.repack_to_w8a16`): `w8a16_linear` (the
    Triton kernel, or the dequantized weight and cuBLAS for many rows)."""

    repacked_by = "a GPTQ method"

    @staticmethod
    def packed(layer: nn.Module) -> W8Weight:
        return W8Weight(
            layer.w8_qweight, layer.w8_scales, layer.w8_zeros, layer.w8_group_size, layer.w8_perm
        )

    @staticmethod
    def dequantize(w: W8Weight, k: int) -> torch.Tensor:
        return dequantize_w8(w, k)

    @staticmethod
    def run(x: torch.Tensor, w: W8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.kernels.w8a16 import w8a16_linear

        return w8a16_linear(x, w.qweight, w.scales, w.zeros, w.group_size, bias, w.perm)
