"""One tensor-parallel rank, whatever carries the driver's orders to it: the worker process of
`MultiprocExecutor` (`multiproc_worker`) and the Ray actor of `RayExecutor` (`ray_worker`) both
drive a `TensorParallelWorker`.

A `TensorParallelWorker` joins the process group (gloo on CPU, NCCL on CUDA), sets the layers'
rank (`set_tensor_parallel`) and builds a `TensorParallelModelRunner` on its shard; then each
step arrives as the scheduler's own `SchedulerOutput` (plain data: new requests whole, then
diffs, which each rank's runner keeps its requests by), and only rank 0 returns the sampled
tokens. The runner methods in `WORKER_METHODS` are called on every rank. Steps must run in the
order the scheduler made them, and a rank that failed once must not run again: its peers'
collectives would be out of step (the carriers end the worker, or refuse later calls).

Only rank 0 samples, so seeded and unseeded sampling cannot diverge between ranks; the others
take part in the LM head's all-gather and, when the next step may read the sampled ids on the
device (async scheduling), receive them by a broadcast from rank 0.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.model.parallel import set_tensor_parallel
from pagoda.utils.heap import freeze_startup_heap
from pagoda.worker.input_batch import StepInputs
from pagoda.worker.model_runner import (
    _PROMPT_LOGPROBS_CHUNK,
    ModelRunner,
    StepOutputFuture,
)

# Runner methods the driver may call on every rank (`collective_rpc`); steps go through
# `TensorParallelWorker.execute_step`.
WORKER_METHODS = frozenset({"determine_num_blocks", "bytes_per_block", "initialize_kv_cache"})


class TensorParallelModelRunner(ModelRunner):
    """A `ModelRunner` on one rank's shard: rank 0 samples, the other ranks do not."""

    def __init__(
        self, engine_config: EngineConfig, tp_rank: int, cpu_threads: int | None = None
    ) -> None:
        super().__init__(engine_config, cpu_threads)
        self.tp_rank = tp_rank
        # With async scheduling a step's placeholder rows read the previous step's sampled ids
        # on the device (`_fill_placeholders`): every rank needs them. (Never with speculation:
        # the engine then runs steps synchronously.)
        self.share_sampled = (
            engine_config.scheduler_config.async_scheduling
            and engine_config.speculative_config is None
        )

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.tp_rank == 0:
            return super().execute_model(so)
        # Nothing waited for the device here (no sampled ids to read): the next step's input
        # preparation must wait for this step's host-to-device copies itself, so no
        # `copies_done()` (on a GPU the host buffers would be rewritten under the copies).
        return self.execute_model_async(so).get()

    def _sample(
        self,
        step: StepInputs,
        hidden: torch.Tensor,
        future: StepOutputFuture,
        so: SchedulerOutput,
    ) -> None:
        if self.tp_rank == 0:
            super()._sample(step, hidden, future, so)
            if self.share_sampled:
                assert self._prev_sampled is not None
                ids = self._prev_sampled[0].contiguous()
                dist.broadcast(ids, src=0)
                self._prev_sampled = (ids, self._prev_sampled[1])
            return
        # The LM head gathers the vocabulary shards: a collective every rank takes part in.
        if step.logits_indices is None:
            self.model.compute_logits(hidden[: len(step.sample_rows)])
        else:
            self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        if self.share_sampled:
            ids = torch.empty(len(step.sample_rows), dtype=torch.int64, device=hidden.device)
            dist.broadcast(ids, src=0)
            rows = {req.req_id: lo for req, lo, hi in step.sample_reqs if hi - lo == 1}
            self._prev_sampled = (ids, rows)

    def _score_prompt_rows(
        self, hidden: torch.Tensor, rows: list[int], score: Callable[[torch.Tensor, int], list]
    ) -> list:
        if self.tp_rank == 0:
            return super()._score_prompt_rows(hidden, rows, score)
        for i in range(0, len(rows), _PROMPT_LOGPROBS_CHUNK):  # the same collectives as rank 0
            chunk = torch.tensor(rows[i : i + _PROMPT_LOGPROBS_CHUNK], device=hidden.device)
            self.model.compute_logits(hidden.index_select(0, chunk))
        return []


class TensorParallelWorker:
    """Rank `rank` of `world_size`: its process group, its shard of the model and KV cache, and
    its runner's copy of the driver's requests.

    `init_method` is the torch.distributed rendezvous (`tcp://host:port`, rank 0's machine);
    `device_index` is the CUDA device this rank runs on (default: its rank, one machine with
    every GPU visible); `cpu_threads` its share of the cores on a CPU (unless
    $PAGODA_CPU_THREADS says otherwise)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: EngineConfig,
        init_method: str,
        cpu_threads: int,
        device_index: int | None = None,
    ) -> None:
        on_cuda = config.device_config.device == "cuda"
        # On a CPU the ranks share the cores: one thread per core each would oversubscribe them.
        threads = None if on_cuda else (envs.PAGODA_CPU_THREADS or cpu_threads)
        if on_cuda:
            torch.cuda.set_device(rank if device_index is None else device_index)
        dist.init_process_group(
            "nccl" if on_cuda else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
        )
        set_tensor_parallel(rank, world_size)
        self.rank = rank
        self.runner = TensorParallelModelRunner(config, rank, threads)
        self.runner.load_model()
        freeze_startup_heap()  # the model's objects, out of every full collection

    def execute_step(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; rank 0 returns its sampled tokens, the other ranks None."""
        output = self.runner.execute_model(so)
        return output if self.rank == 0 else None

    def launch_step(self, so: SchedulerOutput) -> StepOutputFuture:
        """Queue one step on the device without waiting for it: `.get()` on the result gives
        rank 0's sampled tokens (the other ranks' futures hold nothing to wait for). A worker
        that launches the next step before answering this one keeps its device busy while it
        prepares inputs, as the engine's async scheduling does in one process."""
        return self.runner.execute_model_async(so)

    def call(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        """`method(*args)` of this rank's runner, one of `WORKER_METHODS`."""
        if method not in WORKER_METHODS:
            raise ValueError(f"unknown worker method {method!r}")
        return getattr(self.runner, method)(*args)

    def close(self) -> None:
        if self.runner.cuda_graphs is not None:
            # Graphs that captured NCCL work keep the communicator busy: without dropping them
            # first, destroy_process_group hung (two H200s) until the driver terminated us.
            self.runner.cuda_graphs = None
            gc.collect()
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.destroy_process_group()
