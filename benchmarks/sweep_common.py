"""What the kernel sweeps (gemm_sweep.py, w4a16_bench.py) share: the Triton interpreter for a
CPU dry run, their common options and device, building every distinct kernel of a sweep in a
process pool first, and timing a call (CUDA-graph replays on a GPU, wall time in a dry run)."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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


def add_sweep_args(
    ap: argparse.ArgumentParser,
    shape_names: Iterable[str],
    m_help: str,
    budget_s: float,
    budget_help: str,
) -> None:
    """The options both sweeps take: --shapes, --m, --reps, --jobs, --budget-s."""
    ap.add_argument("--shapes", nargs="+", help="subset of " + " ".join(shape_names))
    ap.add_argument("--m", nargs="+", type=int, help=m_help)
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="processes that precompile the kernels first (0: compile on first use)",
    )
    ap.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)


@dataclass
class SweepDevice:
    """Where a sweep runs: an H200 (bf16, CUDA-graph timings) or, for --dry-run without a GPU,
    the Triton interpreter on CPU tensors (float32: bf16 is NaN there; wall-clock timings)."""

    on_gpu: bool
    device: str
    dtype: Any
    num_sms: int
    name: str

    def seconds(self, reps: int) -> Callable[[Callable[[], object]], float]:
        return (lambda fn: graph_seconds(fn, reps)) if self.on_gpu else wall_seconds


def sweep_device(dry_run: bool) -> SweepDevice:
    """The GPU if there is one; else the interpreter, for a --dry-run only (set up before the
    kernel modules are imported)."""
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not dry_run:
            raise SystemExit("needs a CUDA GPU (or --dry-run)")
        setup_interpreter()
    return SweepDevice(
        on_gpu=on_gpu,
        device="cuda" if on_gpu else "cpu",
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 132,
        name=torch.cuda.get_device_name() if on_gpu else "interpreter",
    )
