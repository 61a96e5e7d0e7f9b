"""One tensor-parallel worker process of `MultiprocExecutor`: the pipe to the driver around a
`TensorParallelWorker` (`tp_worker`), which holds the rank's process group, model shard and KV
cache.

`run_worker` builds the worker and then serves the driver's pipe: each message is a pickled
`(method, args)`; a step ("execute_step", a `SchedulerOutput`) is answered by rank 0 only (the
sampled tokens), a call of a runner method by each rank. On CUDA a step already followed by the
next one in the pipe is answered after that one is launched (the device stays busy: async
scheduling).
A failure is sent back as `("error", exception, traceback)` and ends the worker: the ranks'
collectives would be out of step. The worker also ends when the driver's pipe closes or the driver process is gone.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

from pagoda.config import EngineConfig
from pagoda.executor.tp_worker import TensorParallelWorker
from pagoda.worker.model_runner import StepOutputFuture

_PARENT_POLL_S = 1.0
# While a step runs: how long each wait for the driver's next message lasts before the step's
# completion is checked again.
_NEXT_STEP_POLL_S = 0.0002


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
        worker = TensorParallelWorker(rank, world_size, config, init_method, cpu_threads)
        conn.send(("ok", worker.runner.bytes_per_block()))
    except BaseException as e:  # noqa: BLE001 - the driver re-raises it
        _send_error(conn, e)
        raise SystemExit(1) from None
    try:
        _serve(worker, conn)
    except BaseException as e:  # noqa: BLE001 - the driver raises it in the engine
        _send_error(conn, e)
        raise SystemExit(1) from None
    worker.close()


def _serve(worker: TensorParallelWorker, conn: Any) -> None:
    # The step launched last, not yet answered: when the driver has already sent the next one
    # (async scheduling), that one is launched first, so the device never waits for this
    # process to prepare inputs. Answers keep the order of the requests. On a CPU a launch
    # computes the whole step: each is answered at once.
    pending: StepOutputFuture | None = None
    launch_ahead = worker.runner.device.type == "cuda"

    def answer_pending() -> None:
        nonlocal pending
        if pending is not None:
            output = pending.get()
            pending = None
            if worker.rank == 0:
                conn.send(("ok", output))

    while True:
        if pending is not None:
            # Answer the step in flight once its tokens are sampled (the driver may be waiting
            # for them), unless the next step arrives first: that one is launched first.
            while not pending.done() and not conn.poll(_NEXT_STEP_POLL_S):
                pass
            if not conn.poll(0):
                answer_pending()
        try:
            buf = conn.recv_bytes()
        except (EOFError, OSError):  # the driver closed its end: nobody is listening
            return
        method, args = pickle.loads(buf)
        if method == "execute_step":
            launched = worker.launch_step(args[0])
            answer_pending()
            pending = launched
            if not launch_ahead:
                answer_pending()
            continue
        answer_pending()
        if method == "shutdown":
            return
        conn.send(("ok", worker.call(method, args)))


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
