"""Executors: run the model runner in-process (one device) or across workers (tensor parallel).

`make_executor(config)` picks one: `UniProcExecutor` for tensor_parallel_size 1,
`MultiprocExecutor` (one worker process per rank, torch.distributed) above it, or `RayExecutor`
(one Ray actor per rank, possibly on several machines) with distributed_executor_backend "ray".
Ray is optional: only that backend imports it. All have the same methods:
`determine_num_blocks`, `bytes_per_block`, `initialize_kv_cache`, `execute_model`,
`execute_model_async` (whose result's `.get()` waits for the step's output) and `shutdown`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.config import EngineConfig
from pagoda.model.parallel import divide

if TYPE_CHECKING:
    from pagoda.executor.multiproc import MultiprocExecutor
    from pagoda.executor.ray_executor import RayExecutor
    from pagoda.executor.uniproc import UniProcExecutor


def make_executor(config: EngineConfig) -> UniProcExecutor | MultiprocExecutor | RayExecutor:
    pc = config.parallel_config
    if pc.distributed_executor_backend not in (None, "mp", "ray"):
        raise ValueError(
            f"distributed_executor_backend must be 'mp' or 'ray', got "
            f"{pc.distributed_executor_backend!r}"
        )
    if pc.tensor_parallel_size == 1:
        from pagoda.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    check_tensor_parallel_config(config)
    if pc.distributed_executor_backend == "ray":
        try:
            import ray  # noqa: F401 - optional: only this backend needs it
        except ImportError as e:
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray, which is not installed: "
                "`pip install ray` (or leave the backend unset for worker processes, 'mp')"
            ) from e
        from pagoda.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagoda.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)


def check_tensor_parallel_config(config: EngineConfig) -> None:
    """Refuse, before any worker starts, what tensor parallelism cannot shard or run yet."""
    pc = config.parallel_config
    tp = pc.tensor_parallel_size
    mc = config.model_config
    divide(mc.num_attention_heads, tp, "num_attention_heads")
    kv = mc.num_kv_heads
    if tp > kv and tp % kv:
        raise ValueError(
            f"tensor_parallel_size ({tp}) is larger than num_key_value_heads ({kv}) but not a "
            "multiple of it: each KV head must be replicated on a whole number of ranks; "
            "pick a tensor_parallel_size that divides or is a multiple of the KV heads"
        )
    if tp < kv:
        divide(kv, tp, "num_key_value_heads")
    divide(mc.vocab_size, tp, "vocab_size")
    divide(int(mc.hf_config["intermediate_size"]), tp, "intermediate_size")
    if config.device_config.device != "cuda":
        return
    import torch

    found = torch.cuda.device_count()
    if pc.distributed_executor_backend != "ray" and found < tp:
        # (Ray's GPUs may be on other machines: RayExecutor counts the cluster's.)
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs, this machine shows {found}: lower "
            "--tensor-parallel-size (or check CUDA_VISIBLE_DEVICES)"
        )
    spec = config.speculative_config
    if spec is not None and spec.model is not None and found == 0:
        raise ValueError(
            "a draft model runs whole in the engine's own process, beside the ranks, and this "
            "process sees no GPU: run Pagoda on a node with a GPU (or use method 'ngram')"
        )
