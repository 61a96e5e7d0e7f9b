"""`MultiprocExecutor`: tensor parallelism over one worker process per rank (vLLM's
MultiprocExecutor, in small).

The driver (the engine's process) spawns `tensor_parallel_size` workers (`multiproc_worker`),
which join a torch.distributed group (gloo on CPU, NCCL on CUDA, rendezvous on a free local
port) and each build a `ModelRunner` on their shard. Each step's `SchedulerOutput` (plain data:
new requests whole, then per-step diffs) is pickled once when the step is launched and written
to every worker's pipe by a sender thread, so the engine never blocks on a full pipe; only
rank 0 answers with the sampled tokens. The KV cache gets the smallest block count any rank
can hold.

Failures reach the engine as exceptions, never as a hang: every wait watches all workers' pipes
(a worker reports its exception before it exits) and process sentinels (a worker killed from
outside), and a step that takes longer than $PAGODA_EXECUTE_MODEL_TIMEOUT_S (default 300 s)
fails. After a failure the workers are stopped and every later call raises. Workers stop on
`shutdown()`, when the executor is garbage-collected, at interpreter exit, and by themselves
when the driver process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.utils.processes import born_ignoring_sigint, children_allowed

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
# After the first sign of a failure, how long to gather what the other workers report.
_FAILURE_GRACE_S = 0.5


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the executor is unusable afterwards."""


class MultiprocStepFuture:
    """One launched step; `get()` waits for rank 0's `ModelRunnerOutput`."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor, self._seq = executor, seq
        self._output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._step_result(self._seq)
        return self._output


class TensorParallelExecutorBase:
    """What the tensor-parallel executors share over their `collective_rpc` (every rank runs a
    runner method) and `execute_model_async` (a step to every rank, rank 0's output back)."""

    _bytes_per_block: int

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        raise NotImplementedError

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Any:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        """The smallest block count any rank can hold."""
        return min(self.collective_rpc("determine_num_blocks"))

    def bytes_per_block(self) -> int:
        """One block's bytes summed over the ranks (each holds its KV heads' share)."""
        return self._bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get()


class MultiprocExecutor(TensorParallelExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        from pagoda.worker.model_runner import num_cpu_threads

        self.config = config
        self.world_size = tp = config.parallel_config.tensor_parallel_size
        self.step_timeout_s = envs.PAGODA_EXECUTE_MODEL_TIMEOUT_S
        self._error: BaseException | None = None
        self._launched = 0  # steps sent
        self._received = 0  # steps whose result rank 0 has sent and the driver read
        self._results: dict[int, ModelRunnerOutput] = {}
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        worker_config = _worker_config(config)
        cpu_threads = max(1, num_cpu_threads() // tp)
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stop_gracefully = [True]  # False after a failure: the others may be stuck
        self._sender = threading.Thread(
            target=_send_loop, args=(self._outbox, self._conns), name="pagoda-tp-send", daemon=True
        )
        # Everything the shutdown needs, and nothing that refers to self: the finalizer runs
        # when the executor is garbage-collected or at interpreter exit.
        self._finalizer = weakref.finalize(
            self,
            _stop_workers,
            self._procs,
            self._conns,
            self._outbox,
            self._sender,
            self._stop_gracefully,
        )
        try:
            self._start_workers(worker_config, init_method, cpu_threads)
            ready = self._wait_for(set(range(tp)), None, "start", reraise=True)
        except BaseException:
            self.shutdown()
            raise
        self._bytes_per_block = sum(ready.values())
        logger.info(
            "Tensor parallel: %d worker processes (pids %s) over %s",
            tp,
            ", ".join(str(p.pid) for p in self._procs),
            "NCCL" if config.device_config.device == "cuda" else "gloo",
        )

    # -- the executor interface (the rest in TensorParallelExecutorBase) ----------------------
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> MultiprocStepFuture:
        """Send the step to every worker now; `.get()` on the result waits for rank 0's
        output."""
        self._check_alive()
        try:
            self._send("execute_step", (scheduler_output,))
        except Exception as e:  # noqa: BLE001 - the runners' requests would be out of step
            self._fail(WorkerError("cannot send the step to the tensor-parallel workers"), e)
        self._launched += 1
        return MultiprocStepFuture(self, self._launched - 1)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        """Call `method(*args)` of every rank's runner; returns the results in rank order.
        Steps still in flight are finished first."""
        self._check_alive()
        while self._received < self._launched:
            self._step_result(self._received, keep=True)
        self._send(method, args)
        replies = self._wait_for(set(range(self.world_size)), timeout, method)
        return [replies[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        """Stop the workers (a clean exit, or terminated if they do not leave in time)."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- internals ----------------------------------------------------------------------------
    def _start_workers(
        self, worker_config: EngineConfig, init_method: str, cpu_threads: int
    ) -> None:
        from pagoda.executor.multiproc_worker import run_worker

        ctx = multiprocessing.get_context("spawn")  # fork after torch and threads is unsafe
        with children_allowed(), born_ignoring_sigint():
            for rank in range(self.world_size):
                conn, child_conn = ctx.Pipe(duplex=True)
                args = (
                    rank,
                    self.world_size,
                    worker_config,
                    init_method,
                    child_conn,
                    os.getpid(),
                    cpu_threads,
                )
                proc = ctx.Process(
                    target=run_worker,
                    args=args,
                    name=f"pagoda-tp-worker-{rank}",
                    daemon=True,  # terminated at interpreter exit, whatever else happens
                )
                proc.start()
                child_conn.close()  # the child's end lives in the child only: EOF on its death
                self._procs.append(proc)
                self._conns.append(conn)
        self._sender.start()

    def _send(self, method: str, args: tuple[Any, ...]) -> None:
        self._outbox.put(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))

    def _step_result(self, seq: int, keep: bool = False) -> ModelRunnerOutput:
        while seq not in self._results:
            self._check_alive()
            if self._received >= self._launched:
                raise RuntimeError(f"step {seq} was never launched")
            reply = self._wait_for({0}, self.step_timeout_s, "execute_model")
            self._results[self._received] = reply[0]
            self._received += 1
        return self._results[seq] if keep else self._results.pop(seq)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise WorkerError(
                f"the tensor-parallel workers are stopped after an earlier failure: {self._error}"
            )
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel executor is shut down")

    def _wait_for(
        self, ranks: set[int], timeout: float | None, what: str, reraise: bool = False
    ) -> dict[int, Any]:
        """One reply from each of `ranks`, watching every worker's pipe and liveness. A worker's
        error (or death, or the timeout) stops all workers and raises: the worker's own
        exception when `reraise` (start-up: a bad checkpoint, an unshardable model), else a
        `WorkerError` naming the rank, with the worker's traceback."""
        replies: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(replies) < len(ranks):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*self._conns, *by_sentinel], remaining)
            if not ready:
                self._fail(
                    WorkerError(
                        f"tensor-parallel step '{what}' got no answer within {timeout:g} s "
                        "(raise $PAGODA_EXECUTE_MODEL_TIMEOUT_S if steps are this slow)"
                    )
                )
            # Pipes first: a failing worker sends its error before its sentinel fires.
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):
                rank = by_sentinel[obj] if isinstance(obj, int) else by_conn[id(obj)]
                conn = self._conns[rank]
                if isinstance(obj, int) and not conn.poll(0):
                    self._fail_workers(what, reraise, {})
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail_workers(what, reraise, {})
                except Exception as e:  # noqa: BLE001 - a reply that does not unpickle
                    self._fail(WorkerError(f"unreadable reply from worker rank {rank}"), cause=e)
                if msg[0] == "error":
                    self._fail_workers(what, reraise, {rank: (msg[1], msg[2])})
                if rank not in ranks or rank in replies:
                    self._fail(WorkerError(f"unexpected reply from worker rank {rank} to '{what}'"))
                replies[rank] = msg[1]
        return replies

    def _fail_workers(
        self, what: str, reraise: bool, errors: dict[int, tuple[BaseException, str]]
    ) -> None:
        """Raise for workers that failed: first gather, for a moment, what every rank has to
        say (a worker that raised or died takes its peers' collectives down with it, and the
        report should name the cause, not only the first symptom read)."""
        deadline = time.monotonic() + _FAILURE_GRACE_S
        dead: dict[int, int | None] = {}
        while True:
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
                try:
                    while rank not in errors and conn.poll(0):
                        msg = conn.recv()
                        if msg[0] == "error":
                            errors[rank] = (msg[1], msg[2])
                except (EOFError, OSError):
                    pass
                if rank not in errors and not proc.is_alive():
                    dead[rank] = proc.exitcode
            pending = [r for r in range(self.world_size) if r not in errors and r not in dead]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            wait([x for r in pending for x in (self._conns[r], self._procs[r].sentinel)], left)
        if reraise and errors:  # start-up: the worker's own error (a bad checkpoint, ...)
            rank, (exc, _) = min(errors.items())
            exc.add_note(f"(in tensor-parallel worker rank {rank})")
            self._fail(exc)
        # Causes first: killed by a signal, exited without a word, then the exceptions.
        lines = [
            f"rank {r} was killed by signal {-c}" for r, c in sorted(dead.items()) if c and c < 0
        ]
        lines += [f"rank {r} exited ({c})" for r, c in sorted(dead.items()) if not c or c > 0]
        lines += [f"rank {r} raised {exc!r}" for r, (exc, _) in sorted(errors.items())]
        message = f"tensor-parallel workers failed in '{what}': " + "; ".join(lines)
        if what == "start" and dead and not errors:
            message += (
                "; if your script builds the LLM at module level, put that under "
                "`if __name__ == '__main__':` (spawned workers import the main module)"
            )
        for r, (_, tb) in sorted(errors.items()):
            message += f"\n--- rank {r}'s traceback ---\n{tb}"
        first_error = min(errors.items())[1][0] if errors else None
        self._fail(WorkerError(message), cause=first_error)

    def _fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        self._error = error
        self._stop_gracefully[0] = False
        self.shutdown()
        if cause is not None:
            raise error from cause
        raise error


def _worker_config(config: EngineConfig) -> EngineConfig:
    """The config the workers run: on a CPU the default KV budget is split over the ranks (the
    total stays what one process would take). On CUDA each rank captures its CUDA graphs in
    lockstep with the others, NCCL's all-reduces inside them (`enforce_eager` turns them off)."""
    cc, dc = config.cache_config, config.device_config
    tp = config.parallel_config.tensor_parallel_size
    if dc.device == "cpu":
        if cc.kv_cache_memory_bytes is None and cc.num_gpu_blocks_override is None:
            from pagoda.worker.kv_cache import cpu_kv_cache_bytes

            budget = cpu_kv_cache_bytes() // tp
            config = config.replace(
                cache_config=dataclasses.replace(cc, kv_cache_memory_bytes=budget)
            )
    return config


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send_loop(outbox: queue.SimpleQueue, conns: list[Any]) -> None:
    """Write each pickled message to every worker, in order, until None."""
    while True:
        buf = outbox.get()
        if buf is None:
            return
        for conn in conns:
            try:
                conn.send_bytes(buf)
            except (OSError, ValueError):  # a dead worker: the receiving side reports it
                pass


def _stop_workers(
    procs: list[Any],
    conns: list[Any],
    outbox: queue.SimpleQueue,
    sender: threading.Thread,
    graceful: list[bool],
) -> None:
    """Ask the workers to leave (after the messages already queued) and wait for them, then
    terminate whatever is left; after a failure (`graceful[0]` false) kill them at once: a
    worker may be stuck in a collective with a dead peer."""
    outbox.put(pickle.dumps(("shutdown", ())))
    outbox.put(None)
    if graceful[0]:
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop: terminating it", proc.pid)
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_TIMEOUT_S)
    if sender.is_alive():  # writes to dead workers fail at once: it reaches the None
        sender.join(_JOIN_TIMEOUT_S)
    for conn in conns:
        conn.close()
