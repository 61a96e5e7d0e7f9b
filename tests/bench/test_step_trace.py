"""The per-step GPU trace of workload a (`benchmarks/pagoda_bench.StepTimer.trace_summary`):
step kinds, GPU time and the idle gaps between steps, from stand-in CUDA events."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from pagoda_bench import StepTimer  # noqa: E402


class _Event:
    def __init__(self, t_ms: float) -> None:
        self.t = t_ms

    def elapsed_time(self, other: _Event) -> float:
        return other.t - self.t


class _Cuda:
    @staticmethod
    def synchronize() -> None:
        pass


def test_trace_splits_gpu_time_and_idle_gaps_by_step_kind() -> None:
    timer = StepTimer.__new__(StepTimer)
    timer._cuda = _Cuda()
    # (start, end, tokens, requests, context): a prefill step, two decode steps of 200 and one
    # of 3 requests; the GPU waits 0.5 ms before the second decode and 2 ms before the last.
    timer.trace = [
        (_Event(0.0), _Event(100.0), 8192, 40, 9000),
        (_Event(100.0), _Event(110.0), 200, 200, 150_000),
        (_Event(110.5), _Event(120.5), 200, 200, 150_400),
        (_Event(122.5), _Event(127.0), 3, 3, 3000),
    ]
    s = timer.trace_summary()
    assert s["gpu_span_ms"] == 127.0 and s["gpu_idle_between_steps_ms"] == 2.5
    kinds = s["by_kind"]
    assert kinds["prefill"]["steps"] == 1 and kinds["prefill"]["gpu_ms"] == 100.0
    assert kinds["decode>=192"]["steps"] == 2 and kinds["decode>=192"]["gpu_ms_per_step"] == 10.0
    assert kinds["decode>=192"]["idle_before_ms"] == 0.5
    assert kinds["decode>=1"]["idle_before_ms"] == 2.0
    assert s["longest_idle_gaps"][0] == {
        "ms": 2.0,
        "step": 3,
        "kind": "decode>=1",
        "after": "decode>=192",
    }
