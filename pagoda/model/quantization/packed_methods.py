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

from pagoda.model.layers.linear import LinearMethodBase
from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4
from pagoda.model.quantization.w8_layout import W8Weight, dequantize_w8


class W4A16LinearMethod(LinearMethodBase):
    """A loaded 4-bit layer kept packed (`w4_qweight`, `w4_scales`, `w4_zeros`, `w4_perm`,
    `w4_group_size`, made by `_PackedUntilLoaded.repack_to_w4a16`): the Triton W4A16 kernel;
    with the layer's `fused_ops` off, the dequantized weight and F.linear (the reference)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise TypeError("W4A16LinearMethod runs layers that an AWQ/GPTQ method repacked")

    @staticmethod
    def packed(layer: nn.Module) -> W4Weight:
        return W4Weight(
            layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_group_size, layer.w4_perm
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = layer.input_size_per_partition
        if not getattr(layer, "fused_ops", True):
            weight = dequantize_w4(self.packed(layer), k).to(x.dtype)
            return F.linear(x, weight, bias)
        from pagoda.kernels.w4a16 import w4a16_linear

        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = w4a16_linear(
            x2,
            layer.w4_qweight,
            layer.w4_scales,
            layer.w4_zeros,
            layer.w4_group_size,
            bias,
            layer.w4_perm,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


class W8A16LinearMethod(LinearMethodBase):
    """A loaded 8-bit layer kept 8-bit (`w8_qweight`, `w8_scales`, `w8_zeros`, `w8_perm`,
    `w8_group_size`, made by `_PackedUntilLoaded.repack_to_w8a16`): `w8a16_linear` (the
    Triton kernel, or the dequantized weight and cuBLAS for many rows); with the layer's
    `fused_ops` off, the dequantized weight and F.linear (the reference)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        raise TypeError("W8A16LinearMethod runs layers that a GPTQ method repacked")

    @staticmethod
    def packed(layer: nn.Module) -> W8Weight:
        return W8Weight(
            layer.w8_qweight, layer.w8_scales, layer.w8_zeros, layer.w8_group_size, layer.w8_perm
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = layer.input_size_per_partition
        if not getattr(layer, "fused_ops", True):
            weight = dequantize_w8(self.packed(layer), k).to(x.dtype)
            return F.linear(x, weight, bias)
        from pagoda.kernels.w8a16 import w8a16_linear

        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        w = self.packed(layer)
        y = w8a16_linear(x2, w.qweight, w.scales, w.zeros, w.group_size, bias, w.perm)
        return y.reshape(*x.shape[:-1], y.shape[-1])
