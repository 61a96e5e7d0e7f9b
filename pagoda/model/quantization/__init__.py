"""Weight-quantized Hugging Face checkpoints: AWQ and GPTQ (`quantization_config` in
config.json, or `quantization="awq"` / `"gptq"`).

The linear layers hold the checkpoint's packed tensors (layouts in `formats.py`) while it loads;
once every tensor is in, each layer is repacked or dequantized, on its device, once:
- 4-bit layers on CUDA (with triton) stay 4-bit: repacked into the W4A16 kernel's layout
  (`w4_layout.py`: qweight [N, K/8] int32, scales and uint8 zeros [groups, N]), the
  checkpoint's tensors freed, about K*N/2 bytes a layer; they run the Triton kernel of
  `pagoda.kernels.w4a16` at every row count (`W4A16LinearMethod`). GPTQ act-order layers too,
  their inputs sorted by group at load (the kernel gathers x through that permutation), when
  the shards of a fused layer share one g_idx; otherwise such a layer is dequantized.
- 8-bit GPTQ layers on CUDA (with triton) stay 8-bit: their codes as uint8 [N, K], scales
  and zeros (none where symmetric) [groups, N] (`w8_layout.py`), about K*N bytes a layer;
  they run `pagoda.kernels.w8a16` (`W8A16LinearMethod`: the Triton kernel up to 128 rows,
  the dequantized weight and cuBLAS above), act order as for 4 bits.
- on a CPU (float32 or bf16, the C kernels built), 4-bit layers and 8-bit ones whose codes fit
  int8 become the GGUF blocks the quantized CPU GEMM reads (`cpu_blocks.py`: Q4_1, Q4_0 where
  symmetric, Q8_0), act order as above; they run as a GGUF file's layers do;
- everything else (act-order shards that differ, groups not of whole 32-input blocks on a CPU,
  `PAGODA_W4A16=0`, `PAGODA_W8A16=0` or `PAGODA_CPU_QUANTIZED=0`) is dequantized to a dense
  weight in the model dtype and runs as an unquantized layer (the packed C GEMM on a CPU, the
  Triton GEMV / cuBLAS on a GPU): the dense model's memory.
`formats.dequantize_*` + F.linear is the reference of all (tests compare them); the methods of
the layers kept quantized are `packed_methods.py`'s. With tensor parallelism each rank loads
only its shards of the packed tensors (`tp_shards.py`: outputs of column-parallel layers, inputs
and their groups of row-parallel ones) and the above runs on them, on the rank's device; a GPTQ
act-order row-parallel shard (its inputs parts of many groups) is dequantized. A mixture of
experts' expert layers load the same way, each rank its shards; on a CPU they then become GGUF
blocks as above, elsewhere they are dequantized into the model's stacked expert weights
(`pagoda.model.layers.fused_moe`).

8-bit weights and activations (INT8 W8A8 and FP8, compressed-tensors checkpoints, or FP8 made
at load from a dense checkpoint with `quantization="fp8"`) are `w8a8.py`'s; `--load-format
dummy` with a quantization builds that format's layers with random weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagoda import envs
from pagoda.kernels import triton_available
from pagoda.model.layers.linear import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from pagoda.model.quantization import cpu_blocks
from pagoda.model.quantization.cpu_blocks import cpu_blocks_enabled
from pagoda.model.quantization.formats import dequantize_awq, dequantize_gptq
from pagoda.model.quantization.packed_methods import W4A16LinearMethod, W8A16LinearMethod
from pagoda.model.quantization.tp_shards import (
    compact_groups,
    rank_g_idx,
    row_split,
    shard_problem,
)
from pagoda.model.quantization.w4_layout import W4Weight, awq_to_w4, gptq_to_w4
from pagoda.model.quantization.w8_layout import W8Weight, gptq_to_w8
from pagoda.quant_config import (
    CT,
    DUMMY_QUANTIZATION_CONFIGS,
    QUANT_METHODS,
    checkpoint_accepts,
    checkpoint_quant_method,
    drop_router_exclusions,
    linear_method_refusal,
    parse_awq_config,
    parse_gptq_config,
)

logger = logging.getLogger(__name__)

# QUANT_METHODS, DUMMY_QUANTIZATION_CONFIGS, checkpoint_accepts and checkpoint_quant_method,
# public names of this package, are `pagoda.quant_config`'s, as are the AWQ / GPTQ config
# checks: torch-free, so that `pagoda plan` reads configs as the loader does.


def get_linear_method(
    quantization: str | None, hf_config: dict[str, Any], dummy: bool = False
) -> LinearMethodBase | None:
    """The linear method for `quantization` ("awq", "gptq", "compressed-tensors", "w8a8",
    "fp8"; None: the default). "gguf" is `load_model`'s to decide
    (`pagoda.model.quantization.gguf`). With `dummy` (random weights) and a config without a
    quantization_config, the method of a typical checkpoint of that format."""
    refusal = linear_method_refusal(quantization, hf_config, dummy)
    if refusal is not None:  # `pagoda plan` refuses with the same words
        raise ValueError(refusal)
    qc = hf_config.get("quantization_config")
    ckpt = checkpoint_quant_method(hf_config)
    if quantization is None and ckpt in (CT, "fp8"):
        quantization = ckpt  # nothing else can hold its int8 / fp8 tensors
    if quantization in (CT, "w8a8", "fp8"):
        from pagoda.model.quantization.w8a8 import CompressedTensorsW8A8Method, OnlineW8A8Method

        if ckpt in (CT, "fp8"):  # compressed-tensors, or vLLM's FP8 format (per-tensor scales)
            return CompressedTensorsW8A8Method(qc)
        # fp8: a bf16/fp16 checkpoint quantized per channel at load; w8a8: dummy weights
        return OnlineW8A8Method(torch.float8_e4m3fn if quantization == "fp8" else torch.int8)
    if quantization not in ("awq", "gptq"):
        return None
    if dummy and ckpt is None:
        qc = DUMMY_QUANTIZATION_CONFIGS[quantization]
    if quantization == "awq":
        return AWQLinearMethod(drop_router_exclusions(qc, hf_config))
    return GPTQLinearMethod(qc)


def w4a16_enabled(device: torch.device) -> bool:
    """Whether 4-bit layers on `device` stay packed: CUDA with triton, unless PAGODA_W4A16=0."""
    return device.type == "cuda" and triton_available() and envs.PAGODA_W4A16


def w8a16_enabled(device: torch.device) -> bool:
    """Whether 8-bit layers on `device` stay 8-bit: CUDA with triton, unless PAGODA_W8A16=0."""
    return device.type == "cuda" and triton_available() and envs.PAGODA_W8A16


class _PackedUntilLoaded(LinearMethodBase):
    """Registers the packed checkpoint tensors; after loading, the W4A16 kernel's packed layout
    or the dense weight replaces them."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.pack = 32 // bits
        self.dense = UnquantizedLinearMethod()
        self.w4a16 = W4A16LinearMethod()
        self.w8a16 = W8A16LinearMethod()

    def _group(self, in_size: int) -> int:
        return in_size if self.group_size in (-1, 0) else self.group_size

    def _num_groups(self, in_size: int) -> int:
        return -(-in_size // self._group(in_size))  # a shorter last group if it does not divide

    @staticmethod
    def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **attrs):
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(p, attrs)
        layer.register_parameter(name, p)
        return p

    @staticmethod
    def _drop_checkpoint_tensors(layer: nn.Module) -> None:
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                del layer._parameters[name]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Loaded layers run with another method (see process_weights_after_loading).
        raise RuntimeError("a quantized layer runs only after its checkpoint is loaded")

    def _dense(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The loaded layer's dense [N, K] float32 weight, from its checkpoint tensors (this
        rank's shards); what MoE experts are stored as (`FusedMoE`)."""
        return self._dense(layer)

    def _w4(self, layer: nn.Module) -> W4Weight | None:
        """The layer in the W4A16 kernel's layout, or None where it has none."""
        raise NotImplementedError

    def _w8(self, layer: nn.Module) -> W8Weight | None:
        """The layer in the W8A16 kernel's layout, or None where it has none."""
        return None

    def _install(
        self, layer: nn.Module, packed: W4Weight | W8Weight, prefix: str, method: LinearMethodBase
    ) -> None:
        """The checkpoint's tensors replaced by `packed`'s as `prefix`_qweight etc."""
        self._drop_checkpoint_tensors(layer)
        for name in ("qweight", "scales", "zeros", "perm"):
            t = getattr(packed, name)
            layer.register_parameter(
                prefix + name, None if t is None else nn.Parameter(t, requires_grad=False)
            )
        setattr(layer, prefix + "group_size", packed.group_size)
        layer.register_parameter("weight", None)  # no dense weight (callers check for None)
        layer.linear_method = method  # from now on the kernel, no check per call

    def repack_to_w4a16(self, layer: nn.Module) -> bool:
        """Keep the loaded layer 4-bit, repacked for the W4A16 kernel, on its device; False
        (the layer untouched) where its format cannot be."""
        w4 = self._w4(layer) if self.bits == 4 else None
        if w4 is None:
            return False
        self._install(layer, w4, "w4_", self.w4a16)
        return True

    def repack_to_w8a16(self, layer: nn.Module) -> bool:
        """Keep the loaded layer 8-bit, in the W8A16 kernel's layout, on its device; False
        (the layer untouched) where its format cannot be."""
        w8 = self._w8(layer) if self.bits == 8 else None
        if w8 is None:
            return False
        self._install(layer, w8, "w8_", self.w8a16)
        return True

    def to_cpu_blocks(self, layer: nn.Module) -> bool:
        """Keep the loaded layer quantized as GGUF blocks for the quantized CPU GEMM; False
        (the layer untouched) where it has no exact block form (`cpu_blocks`)."""
        packed = self._w4(layer) if self.bits == 4 else self._w8(layer)
        if packed is None:
            return False
        k = layer.input_size_per_partition
        blocks = (
            cpu_blocks.w4_blocks(packed, k)
            if isinstance(packed, W4Weight)
            else cpu_blocks.w8_blocks(packed, k)
        )
        if blocks is None:
            if not getattr(self, "_told_no_blocks", False):
                self._told_no_blocks = True
                logger.info(
                    "%d-bit layers without an exact GGUF block form (groups of whole 32-input "
                    "blocks, fp16 scales; 8 bits: every q - z within int8) are dequantized",
                    self.bits,
                )
            return False
        self._drop_checkpoint_tensors(layer)
        cpu_blocks.install(layer, blocks, packed.perm)
        if not getattr(self, "_told_cpu_blocks", False):
            self._told_cpu_blocks = True  # once per model, not per layer
            logger.info(
                "%d-bit layers on the CPU run as %s blocks in the quantized CPU GEMM "
                "(PAGODA_CPU_QUANTIZED=0 dequantizes them at load)",
                self.bits,
                blocks.type_name,
            )
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device = layer.qweight.device
        if w4a16_enabled(device) and self.repack_to_w4a16(layer):
            return
        if w8a16_enabled(device) and self.repack_to_w8a16(layer):
            return
        if cpu_blocks_enabled(device, layer.params_dtype) and self.to_cpu_blocks(layer):
            return
        weight = self._dense(layer).to(layer.params_dtype)
        self._drop_checkpoint_tensors(layer)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.linear_method = self.dense  # from now on an unquantized layer, no check per call
        self.dense.process_weights_after_loading(layer)


class AWQLinearMethod(_PackedUntilLoaded):
    """AutoAWQ's GEMM layout, 4-bit, zero points: kept packed on CUDA (the W4A16 kernel)."""

    def __init__(self, qc: dict[str, Any]) -> None:
        scheme = parse_awq_config(qc)
        super().__init__(scheme.bits, scheme.group_size)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        whole = self.group_size in (-1, 0)  # one group per row: on every rank whole
        layer.quant_shard_problem = shard_problem(layer, "AWQ", self.group_size, 8, False, whole)
        if layer.quant_shard_problem:
            return  # refused by name at load (`tp_shards.raise_shard_problems`)
        groups = 1 if whole else self._num_groups(k)
        if n % self.pack:
            raise ValueError(f"AWQ needs output sizes divisible by {self.pack}, got {n}")
        group_dims = {} if whole else {"input_dim": 0}
        self._param(layer, "qweight", (k, n // self.pack), torch.int32, output_dim=1, input_dim=0)
        self._param(
            layer, "qzeros", (groups, n // self.pack), torch.int32, output_dim=1, **group_dims
        )
        self._param(layer, "scales", (groups, n), torch.float16, output_dim=1, **group_dims)

    def _dense(self, layer: nn.Module) -> torch.Tensor:
        group = self._group(layer.input_size_per_partition)
        return dequantize_awq(layer.qweight, layer.qzeros, layer.scales, group)

    def _w4(self, layer: nn.Module) -> W4Weight:
        group = self._group(layer.input_size_per_partition)
        return awq_to_w4(layer.qweight, layer.qzeros, layer.scales, group)


class GPTQLinearMethod(_PackedUntilLoaded):
    """AutoGPTQ's layout, 4 or 8 bits, act-order through g_idx (one per fused shard). On CUDA
    4-bit layers stay packed (the W4A16 kernel) and 8-bit ones 8-bit (the W8A16 kernel),
    act-order ones with their inputs sorted by group when all shards share one g_idx."""

    def __init__(self, qc: dict[str, Any]) -> None:
        scheme = parse_gptq_config(qc)
        super().__init__(scheme.bits, scheme.group_size)
        self.sym, self.desc_act = scheme.sym, scheme.desc_act

    def init_dummy_weights(self, layer: nn.Module) -> None:
        """After `init_dummy_weights`' random bits: symmetric zeros where the config says sym
        (every zero 2**(bits-1), stored minus one), and scales the step of `bits`-bit weights
        of the same size (the random ones are 4-bit steps)."""
        if self.sym:
            stored = (1 << (self.bits - 1)) - 1
            word = sum(stored << s for s in range(0, 32, self.bits))
            layer.qzeros.fill_(word - (1 << 32) if word >= 1 << 31 else word)
        layer.scales.mul_(2.0 ** (4 - self.bits))

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        group = self._group(k)
        # A row-parallel rank keeps every group where its inputs are not whole groups of
        # their own: act order, or one group per row.
        whole = self.group_size in (-1, 0) or self.desc_act
        layer.quant_shard_problem = shard_problem(
            layer, f"GPTQ {self.bits}-bit", self.group_size, self.pack, True, whole
        )
        if layer.quant_shard_problem:
            return  # refused by name at load (`tp_shards.raise_shard_problems`)
        if k % self.pack or n % self.pack:
            raise ValueError(f"GPTQ needs sizes divisible by {self.pack}, got in {k}, out {n}")
        self._param(layer, "qweight", (k // self.pack, n), torch.int32, output_dim=1, input_dim=0)
        keep_all = row_split(layer) and whole and self.group_size not in (-1, 0)
        groups = self._num_groups(k * layer.tp_size) if keep_all else self._num_groups(k)
        group_dims = {} if whole else {"input_dim": 0}
        self._param(
            layer, "qzeros", (groups, n // self.pack), torch.int32, output_dim=1, **group_dims
        )
        self._param(layer, "scales", (groups, n), torch.float16, output_dim=1, **group_dims)
        # g_idx: one row per fused shard (q, k and v each have their own act-order); the
        # default k // group_size where a checkpoint has none.
        g_idx = self._param(
            layer, "g_idx", (len(output_partition_sizes), k), torch.int32, optional=True
        )
        g_idx.data.copy_((torch.arange(k) // group).expand(len(output_partition_sizes), k))
        shard_index = {"q": 0, "k": 1, "v": 2}

        def load_g_idx(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            loaded = rank_g_idx(layer, loaded, group, local=not whole)
            # Group numbers index the scales and zeros: one out of range failed in torch's
            # indexing, a negative one read another group (a model answering garbage).
            if loaded.numel() and not (0 <= int(loaded.min()) and int(loaded.max()) < groups):
                raise ValueError(
                    f"g_idx holds group numbers from {int(loaded.min())} to {int(loaded.max())}, "
                    f"outside the layer's {groups} groups [0, {groups})"
                )
            rows = (
                range(param.shape[0]) if shard_id is None else [shard_index.get(shard_id, shard_id)]
            )
            for r in rows:
                if loaded.shape != param.shape[1:]:
                    raise ValueError(f"g_idx of shape {tuple(loaded.shape)}, expected ({k},)")
                param.data[r].copy_(loaded)

        g_idx.weight_loader = load_g_idx

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if row_split(layer) and self.desc_act and self.group_size not in (-1, 0):
            compact_groups(layer)  # only the groups this rank's inputs use
        super().process_weights_after_loading(layer)

    def _dense(self, layer: nn.Module) -> torch.Tensor:
        sizes = layer.output_partition_sizes
        parts, start = [], 0
        for i, size in enumerate(sizes):  # each shard with its own g_idx
            cols = slice(start, start + size)
            packed = slice(start // self.pack, (start + size) // self.pack)
            parts.append(
                dequantize_gptq(
                    layer.qweight[:, cols],
                    layer.qzeros[:, packed],
                    layer.scales[:, cols],
                    layer.g_idx[i],
                    self.bits,
                )
            )
            start += size
        return torch.cat(parts, dim=0)

    def _w4(self, layer: nn.Module) -> W4Weight | None:
        group = self._group(layer.input_size_per_partition)
        return self._told_if_none(
            layer, gptq_to_w4(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, group)
        )

    def _w8(self, layer: nn.Module) -> W8Weight | None:
        group = self._group(layer.input_size_per_partition)
        return self._told_if_none(
            layer, gptq_to_w8(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, group)
        )

    def _told_if_none(
        self, layer: nn.Module, packed: W4Weight | W8Weight | None
    ) -> W4Weight | W8Weight | None:
        if packed is not None:
            return packed
        if row_split(layer):
            if not getattr(self, "_told_row_act_order", False):
                self._told_row_act_order = True  # once per model, not per layer
                logger.warning(
                    "GPTQ act-order row-parallel layers (o_proj, down_proj) with "
                    "tensor_parallel_size > 1 are dequantized on each rank: a rank's inputs "
                    "hold parts of many groups, which no input permutation makes groups of "
                    "group_size consecutive inputs (the kernels' layout)"
                )
        elif not getattr(self, "_told_act_order", False):
            self._told_act_order = True  # once per model, not per layer
            logger.info(
                "GPTQ act-order layers whose fused shards have different g_idx are "
                "dequantized (one input permutation must serve the shards that share x)"
            )
        return None


__all__ = [
    "AWQLinearMethod",
    "DUMMY_QUANTIZATION_CONFIGS",
    "checkpoint_accepts",
    "GPTQLinearMethod",
    "QUANT_METHODS",
    "W4A16LinearMethod",
    "W8A16LinearMethod",
    "checkpoint_quant_method",
    "get_linear_method",
    "w4a16_enabled",
    "w8a16_enabled",
]
