"""Tensor-parallel state for model layers: this process's rank and the group size.

Layers read `get_tp_rank()` / `get_tp_size()` when they are built to size their shard, and
`tensor_model_parallel_all_reduce` sums partial outputs. With one process (the default, and
everything on CPU today) the size is 1 and the all-reduce is the identity; an executor that
starts several workers calls `set_tensor_parallel(rank, size)` after
`torch.distributed.init_process_group` and before building the model.
"""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} is outside a group of size {size}")
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}); "
            "pick a tensor_parallel_size that divides it"
        )
    return numerator // denominator
