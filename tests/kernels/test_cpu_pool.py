"""The CPU kernels' thread pool (`pagoda/kernels/cpu/pool.c`) against the OpenMP regions it
replaces: every output element is computed by one thread either way, so the results must be
bitwise equal whoever ran which item, and stay so in a forked child (whose pool starts anew)."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.kernels.cpu import pool, quant
from pagoda.kernels.cpu.quant import QuantWeight, pack_x8

try:
    LIB = quant.load_quant_library()
except Exception as e:  # no compiler
    pytest.skip(f"quantized CPU GEMM unavailable: {e}", allow_module_level=True)
if pool.load_pool() is None:
    pytest.skip(
        "the CPU thread pool does not build here (or PAGODA_CPU_POOL=0)", allow_module_level=True
    )


def q8_0_weight(n: int, k: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 32, 34), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half()
    raw[:, :, :2] = scales.view(torch.uint8).view(n, k // 32, 2)
    raw = raw.reshape(n, -1)
    return QuantWeight(pack_x8(raw, 8, k), 8, n, k, x8=True)


def run(x: torch.Tensor, w: QuantWeight, use_pool: bool, threads: int) -> torch.Tensor:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    LIB.pagoda_quant_set_parallel_run(pool.parallel_run_pointer() if use_pool else None)
    try:
        return quant.quant_linear(x, w)
    finally:
        LIB.pagoda_quant_set_parallel_run(pool.parallel_run_pointer())
        torch.set_num_threads(old)


@pytest.mark.parametrize("m", [1, 5, 70, 200])
def test_pool_equals_openmp_and_one_thread(m):
    w = q8_0_weight(1000, 256, seed=m)  # enough work for threads at one row
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    one = run(x, w, use_pool=False, threads=1)
    for threads in (2, 3, 4):  # more threads than cores too: late workers find no work
        assert torch.equal(run(x, w, use_pool=True, threads=threads), one)
        assert torch.equal(run(x, w, use_pool=False, threads=threads), one)


def test_many_jobs_in_a_row():
    """Back-to-back jobs (the workers still spinning, or asleep after a pause)."""
    w = q8_0_weight(1000, 128, seed=1)
    x = torch.randn(3, 128)
    want = run(x, w, use_pool=False, threads=1)
    for i in range(2000):
        assert torch.equal(run(x, w, use_pool=True, threads=2), want)
        if i % 500 == 0:
            import time

            time.sleep(0.002)  # past the spin: the workers sleep, the next job wakes them


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_forked_child_gets_its_own_workers():
    w = q8_0_weight(1000, 256, seed=2)
    x = torch.randn(4, 256)
    want = run(x, w, use_pool=True, threads=2)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: no parent workers; the pool starts its own
        ok = torch.equal(run(x, w, use_pool=True, threads=2), want)
        os._exit(0 if ok and pool.load_pool().pagoda_pool_workers() >= 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
