"""Linear layers that own their weight layout and know how to load (and shard) checkpoint tensors.

A layer delegates storage and the matmul to a `LinearMethodBase` (unquantized today; AWQ, GPTQ,
INT8, FP8 and GGUF methods plug in through the same seam): the method registers the layer's
parameters, tagging each with `output_dim` / `input_dim`, and the layer's `weight_loader` copies a
checkpoint tensor into the right slice of them. Fused layers (`QKVParallelLinear`,
`MergedColumnParallelLinear`) take one checkpoint tensor per shard (`"q"`, `"k"`, `"v"`; or the
index of `gate_proj` / `up_proj`), which is how one loader serves every checkpoint (nano-vllm's
`packed_modules_mapping`). Tensor parallelism follows Megatron-LM: column layers split their
outputs across ranks, row layers their inputs and sum the partial products with an all-reduce.
On CPU, a bf16 weight is packed after loading for the C GEMM of `pagoda.kernels.cpu.gemm`.
With the layer's `fused_ops` on, `pagoda.kernels.linear.dense_linear` picks the kernel (GEMV,
skinny GEMM, packed GEMM, cuBLAS / oneDNN; its docstring holds the rules); off, `F.linear` (on
the unpacked weight) is the reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.cpu import gemm as cpu_gemm
from pagoda.kernels.linear import dense_linear
from pagoda.model.parallel import (
    divide,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (casting dtype), or raise ValueError if the shapes differ."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: the model expects {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    copy_checked(param.data, loaded_weight)


class LinearMethodBase(ABC):
    """How a linear layer stores its weight and computes `x @ W^T`.

    `create_weights` registers the layer's parameters (each tagged with `output_dim` and, where it
    has one, `input_dim`, so the layer's weight loader can place and shard checkpoint slices);
    `apply` runs the product; `process_weights_after_loading` may repack once all tensors are in.
    """

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None: ...

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate_up layer's product in one kernel, where the method
        has one for these inputs; else None (the caller runs `apply`, then the activation)."""
        return None

    def input_quantization(self, layer: nn.Module) -> torch.dtype | None:
        """The 8-bit dtype this layer quantizes its input to, per token, where it takes the
        input already quantized instead (a `QuantizedRows` from the RMSNorm or SiLU-and-mul
        before it, which then quantize as they write); None: it takes the activations as
        they are (the default)."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense `[out, in]` weight in the model dtype."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if getattr(layer, "fused_ops", False):
            return dense_linear(x, layer.weight, bias)  # the kernel choice: pagoda.kernels.linear
        weight = layer.weight
        if cpu_gemm.is_packed(weight):
            weight = cpu_gemm.unpack_weight(weight)  # the reference path, at a copy per call
        return F.linear(x, weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Packed for the C GEMM, replacing the plain weight: one copy in memory. (Loading
        # into the packed parameter again fails on its shape.)
        if cpu_gemm.packing_supported(layer.weight):
            layer.weight = cpu_gemm.pack_weight(layer.weight.data)


class LinearBase(nn.Module):
    """Common parts: the linear method, an optional bias, and per-parameter weight loaders."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        linear_method: LinearMethodBase | None,
        params_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.params_dtype
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=self.params_dtype),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"output_dim": 0})
        else:
            self.register_parameter("bias", None)
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):  # a linear method may bring its own
                set_weight_attrs(p, {"weight_loader": self.weight_loader})
        self.fused_ops = True  # the C skinny GEMM on CPU (see the module docstring)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        raise NotImplementedError

    def _param_rows(self, param: torch.Tensor, rows: int) -> int:
        """Output rows in `rows` logical outputs, for parameters packed along the output dim."""
        return rows * param.shape[param.output_dim] // self.output_size_per_partition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def input_quantization(self) -> torch.dtype | None:
        """`LinearMethodBase.input_quantization` of this layer."""
        return self.linear_method.input_quantization(self)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        linear_method: LinearMethodBase | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, [output_size], bias, linear_method, params_dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        copy_checked(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Outputs split across ranks: rank r holds output rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        linear_method: LinearMethodBase | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_sizes = output_sizes
        parts = [divide(s, self.tp_size, "linear output size") for s in output_sizes]
        super().__init__(input_size, parts, bias, linear_method, params_dtype)

    def _load_shard(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        offset: int,
        size: int,
        rank: int,
        num_parts: int | None = None,
    ) -> None:
        """Copy part `rank` of `num_parts` (default tp_size) equal parts of the checkpoint tensor
        into this rank's rows [offset, offset + size)."""
        dim = param.output_dim
        num_parts = self.tp_size if num_parts is None else num_parts
        p_off, p_size = self._param_rows(param, offset), self._param_rows(param, size)
        dst = param.data.narrow(dim, p_off, p_size)
        if num_parts > 1:
            if loaded_weight.dim() != dst.dim() or loaded_weight.shape[dim] != p_size * num_parts:
                expected = list(dst.shape)
                expected[dim] *= num_parts
                raise ValueError(
                    f"shape mismatch: the model expects {tuple(expected)}, "
                    f"got {tuple(loaded_weight.shape)}"
                )
            loaded_weight = loaded_weight.narrow(dim, rank * p_size, p_size)
        copy_checked(dst, loaded_weight)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if len(self.output_partition_sizes) > 1 and self.tp_size > 1:
            raise ValueError("a pre-fused checkpoint tensor cannot be split across TP ranks")
        self._load_shard(param, loaded_weight, 0, self.output_size_per_partition, self.tp_rank)

    def _load_fused(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        checkpoint_sizes: list[int],
        shard_ids: list[Any],
    ) -> None:
        """A checkpoint tensor holding every shard stacked along the output dim (Phi-3's
        qkv_proj / gate_up_proj), split into its shards (logical sizes `checkpoint_sizes`) and
        loaded one by one, so each rank takes its slice of each."""
        dim, total = param.output_dim, sum(checkpoint_sizes)
        rows = loaded_weight.shape[dim] if loaded_weight.dim() > dim else 0
        if rows == 0 or rows * total == 0 or (rows * checkpoint_sizes[0]) % total:
            raise ValueError(
                f"a fused tensor of shape {tuple(loaded_weight.shape)} does not split into "
                f"shards of {checkpoint_sizes} outputs"
            )
        pieces = loaded_weight.split([rows * s // total for s in checkpoint_sizes], dim)
        for piece, sid in zip(pieces, shard_ids):
            self.weight_loader(param, piece, sid)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers on one input, fused (e.g. gate_proj and up_proj); shard_id = index."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            if self.tp_size == 1:
                return super().weight_loader(param, loaded_weight)
            ids = list(range(len(self.output_sizes)))
            return self._load_fused(param, loaded_weight, self.output_sizes, ids)
        offset = sum(self.output_partition_sizes[:shard_id])
        self._load_shard(
            param, loaded_weight, offset, self.output_partition_sizes[shard_id], self.tp_rank
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projections; shard_id in ("q", "k", "v"). With more ranks than KV heads,
    each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        linear_method: LinearMethodBase | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tp vs KV heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [q_size * tp_size, kv_size * tp_size, kv_size * tp_size],
            bias,
            linear_method,
            params_dtype,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            if self.tp_size == 1:
                return super().weight_loader(param, loaded_weight)
            q = self.num_heads * self.head_size * self.tp_size
            kv = self.num_kv_heads * self.head_size * self.tp_size // self.num_kv_head_replicas
            return self._load_fused(param, loaded_weight, [q, kv, kv], ["q", "k", "v"])
        q_size, kv_size = self.output_partition_sizes[0], self.output_partition_sizes[1]
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        parts = self.tp_size if shard_id == "q" else self.tp_size // self.num_kv_head_replicas
        self._load_shard(param, loaded_weight, offset, size, rank, parts)


class RowParallelLinear(LinearBase):
    """Inputs split across ranks; the partial products are summed (all-reduce), then the bias.

    With `reduce_results=False` (vLLM's flag) the output is this rank's partial sum, the bias
    added on rank 0 only, for a caller that sums it with other partial sums and all-reduces
    once (Qwen2-MoE's shared expert and routed experts, `SharedExpertMoeBlock`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        linear_method: LinearMethodBase | None = None,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.reduce_results = reduce_results
        in_part = divide(input_size, self.tp_size, "linear input size")
        super().__init__(in_part, [output_size], bias, linear_method, params_dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        dim = getattr(param, "input_dim", None)
        if self.tp_size > 1 and dim is not None:
            size = param.shape[dim]
            if loaded_weight.shape[dim] != size * self.tp_size:
                copy_checked(param.data, loaded_weight)  # raises with the shapes
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        if not self.reduce_results:  # a partial sum, the bias counted once across the ranks
            return self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        out = tensor_model_parallel_all_reduce(self.linear_method.apply(self, x))
        return out if self.bias is None else out + self.bias
