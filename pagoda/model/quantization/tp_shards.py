"""Tensor-parallel shards of AWQ / GPTQ layers: which ones a rank can take, and the group
bookkeeping of row-parallel ones (their inputs, and so their groups, split across ranks).

Column-parallel layers (qkv, gate_up) split their outputs: every packed tensor is cut along its
output dim (AWQ's qweight / qzeros and GPTQ's qzeros hold 8 outputs a word, so each rank's part
of each fused shard must be a multiple of 8), the groups and g_idx stay whole. Row-parallel
layers (o_proj, down_proj) split their inputs: qweight by rows (GPTQ: 32 / bits inputs a word),
scales and zeros by groups, so a rank's inputs must be whole groups, as vLLM requires;
GPTQ's g_idx is cut with the rows and made rank-local. A GPTQ act-order (desc_act) layer keeps
every group's scales and zeros on each rank instead (a rank's inputs belong to groups in no
order), as vLLM does, and its g_idx stays global until `compact_groups` renumbers the groups the
rank uses. A layer that cannot be split so is refused at load (`raise_shard_problems`), naming
it, its sizes, the group size and the tensor_parallel_size.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.layers.linear import ColumnParallelLinear, RowParallelLinear


def row_split(layer: nn.Module) -> bool:
    """Whether `layer` splits its inputs across ranks (a row-parallel layer, tp > 1)."""
    return isinstance(layer, RowParallelLinear) and layer.tp_size > 1


def shard_problem(
    layer: nn.Module,
    fmt: str,
    group_size: int,
    pack: int,
    packs_inputs: bool,
    whole_groups: bool,
) -> str | None:
    """Why `layer`'s rank cannot hold its shard of a `fmt` checkpoint (None: it can). `pack`:
    values per int32 word, along the outputs of the zeros (and AWQ's qweight), along the inputs
    of GPTQ's qweight (`packs_inputs`); `whole_groups`: the groups stay whole on every rank (a
    GPTQ act-order layer, or one group per row), so a rank's inputs need not be whole groups."""
    tp = getattr(layer, "tp_size", 1)
    if tp == 1:
        return None
    where = f"tensor_parallel_size={tp}, {fmt} group_size={group_size}"
    if isinstance(layer, ColumnParallelLinear):
        replicas = [1, *[getattr(layer, "num_kv_head_replicas", 1)] * 2]  # q, k, v: KV heads
        for i, (size, part) in enumerate(zip(layer.output_sizes, layer.output_partition_sizes)):
            full = size // replicas[min(i, 2)]
            if part % pack:
                return (
                    f"{part} of its {full} outputs per rank ({where}) is not a multiple of "
                    f"{pack}, the outputs packed in one int32 word of its tensors"
                )
    if row_split(layer):
        k = layer.input_size_per_partition
        full = k * tp
        if packs_inputs and k % pack:
            return (
                f"{k} of its {full} inputs per rank ({where}) is not a multiple of {pack}, "
                "the inputs packed in one int32 word of its qweight"
            )
        if not whole_groups and k % group_size:
            return (
                f"{k} of its {full} inputs per rank ({where}) is not a whole number of "
                "quantization groups: a group would be split between two ranks"
            )
    return None


def raise_shard_problems(model: nn.Module) -> None:
    """Raise ValueError naming the first layer whose shard this rank cannot hold (set by the
    AWQ / GPTQ methods' `create_weights` as `layer.quant_shard_problem`), before any weight is
    read."""
    bad = [
        (name, m.quant_shard_problem)
        for name, m in model.named_modules()
        if getattr(m, "quant_shard_problem", None)
    ]
    if not bad:
        return
    name, why = bad[0]
    more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
    raise ValueError(
        f"{name}{more}: {why}. Pick a tensor_parallel_size whose shards of every layer are "
        "whole words and groups (as vLLM requires), or tensor_parallel_size=1"
    )


def rank_g_idx(
    layer: nn.Module, loaded: torch.Tensor, group_size: int, local: bool
) -> torch.Tensor:
    """This rank's part of a GPTQ g_idx [K]: all of it on a column-parallel layer; the rank's
    inputs on a row-parallel one, their groups numbered from the rank's first where `local`
    (its scales and zeros hold only its groups), else global (every group kept)."""
    if not row_split(layer):
        return loaded
    k = layer.input_size_per_partition
    if loaded.shape != (k * layer.tp_size,):
        raise ValueError(f"g_idx of shape {tuple(loaded.shape)}, expected ({k * layer.tp_size},)")
    part = loaded[layer.tp_rank * k : (layer.tp_rank + 1) * k]
    if not local:
        return part
    part = part - layer.tp_rank * (k // group_size)
    if part.numel() and (int(part.min()) < 0 or int(part.max()) >= k // group_size):
        raise ValueError(
            "g_idx puts inputs of this rank in other ranks' groups: an act-order checkpoint "
            "whose config says desc_act false"
        )
    return part


def compact_groups(layer: nn.Module) -> None:
    """A row-parallel act-order layer that kept every group: only the groups its g_idx uses
    are kept, renumbered in order (so a rank whose inputs are whole groups gets plain groups,
    `act_order_perm`'s condition to stay quantized)."""
    used, local = torch.unique(layer.g_idx, return_inverse=True)
    layer.scales.data = layer.scales.data[used].contiguous()
    layer.qzeros.data = layer.qzeros.data[used].contiguous()
    layer.g_idx.data = local.to(layer.g_idx.dtype)
