"""The Ray actor of one tensor-parallel rank (`RayExecutor`): a `TensorParallelWorker`
(`tp_worker`) driven by remote calls instead of a pipe.

The actor is created bare, so that the driver can first ask where it landed (`node_info`: its
node, IP address, GPU ids and pid) and, on rank 0, for a free port for the torch.distributed
rendezvous; `start` then sets the environment the driver decided (the node's GPUs made visible
to each of its ranks, the driver's $PAGODA_* settings) and builds the worker. Ray runs an
actor's calls from one caller one at a time, in the order they were made, so the steps reach
the runner in order (it keeps its requests by their diffs). After a failure every later call
raises at once: this rank's peers would wait for it in a collective that never comes.

Torch-free until `start`; `ray` is imported only inside the actor process.
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import TYPE_CHECKING, Any

from pagoda import envs
from pagoda.config import EngineConfig

if TYPE_CHECKING:
    from pagoda.core.outputs import ModelRunnerOutput
    from pagoda.executor.tp_worker import TensorParallelWorker


class RayWorker:
    """One rank's actor; `ray.remote(RayWorker)` in the driver."""

    def __init__(self) -> None:
        self.worker: TensorParallelWorker | None = None
        self.failed: str | None = None

    def node_info(self) -> tuple[str, str, list[str], int]:
        """(node id, node IP address, the GPU ids Ray gave this actor, pid)."""
        import ray

        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        return ctx.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid()

    def free_port(self) -> int:
        """A port free on this actor's node, for the rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(
        self,
        rank: int,
        world_size: int,
        config: EngineConfig,
        init_method: str,
        ranks_on_node: int,
        device_index: int | None,
        env: dict[str, str],
    ) -> int:
        """Join the process group and load this rank's shard; returns its bytes per KV block.
        `env` is set first (CUDA_VISIBLE_DEVICES, the driver's $PAGODA_* variables), before
        anything here touches CUDA, which reads the visible devices once."""
        envs.update_environment(env)

        def build() -> int:
            from pagoda.executor.tp_worker import TensorParallelWorker
            from pagoda.worker.model_runner import num_cpu_threads

            cpu_threads = max(1, num_cpu_threads() // ranks_on_node)
            self.worker = TensorParallelWorker(
                rank, world_size, config, init_method, cpu_threads, device_index
            )
            return self.worker.runner.bytes_per_block()

        return self._run(build)

    def execute_step(self, step: bytes) -> ModelRunnerOutput | None:
        """Run one step, a pickled `SchedulerOutput`; rank 0 returns its sampled tokens."""
        return self._run(lambda: self._worker().execute_step(pickle.loads(step)))

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        return self._run(lambda: self._worker().call(method, args))

    def _worker(self) -> TensorParallelWorker:
        if self.worker is None:
            raise RuntimeError("this rank's worker was never started")
        return self.worker

    def _run(self, fn: Any) -> Any:
        if self.failed is not None:
            raise RuntimeError(f"this rank failed earlier ({self.failed}): it takes no more work")
        try:
            return fn()
        except BaseException as e:
            self.failed = repr(e)
            raise
