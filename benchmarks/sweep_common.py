"""What the kernel sweeps (gemm_sweep.py, w4a16_bench.py) share: the Triton interpreter for a
CPU dry run, building every distinct kernel of a sweep in a process pool first, and timing a
call (CUDA-graph replays on a GPU, wall time in a dry run)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_interpreter() -> None:
    """CPU tensors through the Triton interpreter (before the kernel module is imported)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    from kernel_testing import enable_interpreter_without_cuda

    enable_interpreter_without_cuda()


def _worker_init(interpret: bool) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if interpret:
        setup_interpreter()


def precompile(
    build_one: Callable[[tuple], str | None], jobs: Iterable[tuple], processes: int, cpu: bool
) -> None:
    """Run `build_one(job)` (one launch: the kernel lands in Triton's on-disk cache, which the
    timing process then hits; returns the error text when the build fails) over `jobs` in
    `processes` processes: serial compiles (~0.3 s each, hundreds of them) would take most of
    the time budget. `build_one` must be a module-level function (spawned workers)."""
    jobs = list(jobs)
    t0 = time.perf_counter()
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=ctx, initializer=_worker_init, initargs=(cpu,)
        ) as pool:
            errors = [e for e in pool.map(build_one, jobs, chunksize=2) if e]
    except Exception as e:  # noqa: BLE001 - the timing loop compiles on first use instead
        print(f"precompile pool failed ({type(e).__name__}: {e}); compiling serially", flush=True)
        return
    print(
        f"precompiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s with {processes} "
        f"processes ({len(errors)} failed)",
        flush=True,
    )


def graph_seconds(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call of `fn` replayed in a CUDA graph: gemv_sweep.py's timing."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemv_sweep import graph_seconds as timed

    return timed(fn, reps)


def wall_seconds(fn: Callable[[], object], reps: int = 1) -> float:
    """--dry-run on a CPU: plain wall time (exercises the code, measures nothing useful)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps
