"""One tensor-parallel worker process: its rank's shard of the model and KV cache, run on the
driver's orders (`MultiprocExecutor`).

`run_worker` joins the process group (gloo on CPU, NCCL on CUDA), sets the layers' rank
(`set_tensor_parallel`), builds a `TensorParallelModelRunner` on its shard and then serves the
driver's pipe: each message is a pickled `(method, args)`; a step ("execute_step", a
`StepDelta` that the worker's `RequestMirror` turns back into a `SchedulerOutput`) is answered by
rank 0 only (the sampled tokens), a call of a runner method by each rank. A failure is sent
back as `("error", exception, traceback)` and ends the worker: the ranks' collectives would be out
of step. The worker also ends when the driver's pipe closes or the driver process is gone.

Only rank 0 samples, so seeded and unseeded sampling cannot diverge between ranks; the others
take part in the LM head's all-gather and, when the next step may read the sampled ids on the
device (async scheduling), receive them by a broadcast from rank 0.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.executor.step_delta import RequestMirror
from pagoda.model.parallel import set_tensor_parallel
from pagoda.worker.input_batch import StepInputs
from pagoda.worker.model_runner import (
    _PROMPT_LOGPROBS_CHUNK,
    ModelRunner,
    StepOutputFuture,
)

# Runner methods the driver may call on every rank (`collective_rpc`); steps come as
# "execute_step" with a `StepDelta`.
WORKER_METHODS = frozenset({"determine_num_blocks", "bytes_per_block", "initialize_kv_cache"})
_PARENT_POLL_S = 1.0


class TensorParallelModelRunner(ModelRunner):
    """A `ModelRunner` on one rank's shard: rank 0 samples, the other ranks do not."""

    def __init__(self, engine_config: EngineConfig, tp_rank: int) -> None:
        super().__init__(engine_config)
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

    def _sample(self, step: StepInputs, hidden: torch.Tensor, future: StepOutputFuture) -> None:
        if self.tp_rank == 0:
            super()._sample(step, hidden, future)
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
            rows = {req.request_id: lo for req, lo, hi in step.sample_reqs if hi - lo == 1}
            self._prev_sampled = (ids, rows)

    def _prompt_logprobs(
        self, step: StepInputs, hidden: torch.Tensor, rid: str, rows: list[int], targets: list[int]
    ) -> list[dict[int, tuple[float, int]]]:
        if self.tp_rank == 0:
            return super()._prompt_logprobs(step, hidden, rid, rows, targets)
        for i in range(0, len(rows), _PROMPT_LOGPROBS_CHUNK):  # the same collectives as rank 0
            chunk = torch.tensor(rows[i : i + _PROMPT_LOGPROBS_CHUNK], device=hidden.device)
            self.model.compute_logits(hidden.index_select(0, chunk))
        return []


def run_worker(
    rank: int,
    world_size: int,
    config: EngineConfig,
    init_method: str,
    conn: Any,
    parent_pid: int,
    cpu_threads: int,
) -> None:
    """Entry point of worker `rank` (a spawned process)."""
    # Ctrl-C reaches the whole process group: the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid,), name="pagoda-parent-watch", daemon=True
    ).start()
    try:
        runner = _build_runner(rank, world_size, config, init_method, cpu_threads)
        conn.send(("ok", runner.bytes_per_block()))
    except BaseException as e:  # noqa: BLE001 - the driver re-raises it
        _send_error(conn, e)
        raise SystemExit(1) from None
    try:
        _serve(rank, runner, conn)
    except BaseException as e:  # noqa: BLE001 - the driver raises it in the engine
        _send_error(conn, e)
        raise SystemExit(1) from None
    if dist.is_initialized():
        dist.destroy_process_group()


def _build_runner(
    rank: int, world_size: int, config: EngineConfig, init_method: str, cpu_threads: int
) -> TensorParallelModelRunner:
    on_cuda = config.device_config.device == "cuda"
    if not on_cuda and "PAGODA_CPU_THREADS" not in os.environ:
        # The ranks share the cores: one thread per core each would oversubscribe them.
        os.environ["PAGODA_CPU_THREADS"] = str(cpu_threads)
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size
    )
    set_tensor_parallel(rank, world_size)
    runner = TensorParallelModelRunner(config, rank)
    runner.load_model()
    return runner


def _serve(rank: int, runner: TensorParallelModelRunner, conn: Any) -> None:
    mirror = RequestMirror()
    while True:
        try:
            buf = conn.recv_bytes()
        except (EOFError, OSError):  # the driver closed its end: nobody is listening
            return
        method, args = pickle.loads(buf)
        if method == "execute_step":
            output = runner.execute_model(mirror.decode(args[0]))
            if rank == 0:
                conn.send(("ok", output))
        elif method == "shutdown":
            return
        elif method in WORKER_METHODS:
            conn.send(("ok", getattr(runner, method)(*args)))
        else:
            raise ValueError(f"unknown worker method {method!r}")


def _send_error(conn: Any, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - one that does not survive pickling travels as its text
        e = RuntimeError(repr(e))
    try:
        conn.send(("error", e, tb))
    except (OSError, EOFError, ValueError):
        pass


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when the driver process is gone (killed without a shutdown): a worker
    waiting in a collective would never read its pipe's end of file."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)
