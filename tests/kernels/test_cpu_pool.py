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


def test_ops_on_the_pool_equal_openmp_and_one_thread():
    """The ops library's row ops and GEMMs (`cpu_ops.c`, simd.h's parallel_range) on the pool,
    on OpenMP regions and on one thread: each row, panel or tile is one thread's, so the
    results are bitwise equal."""
    from pagoda.kernels.cpu import gemm, ops

    if not ops.cpu_ops_available():
        pytest.skip("the C CPU ops do not build here")
    lib = ops.load_cpu_ops()
    g = torch.Generator().manual_seed(0)
    rows, hidden, heads, hs = 300, 576, 9, 64  # enough work to split at every op
    x = torch.randn(rows, hidden, generator=g)
    res = torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    gu = torch.randn(rows, 2 * 1536, generator=g)
    qk = torch.randn(rows, (heads + 3) * hs, generator=g)
    positions = torch.randint(0, 1000, (rows,), generator=g)
    cos_sin = torch.randn(1000, hs, generator=g)
    w_dense = torch.randn(1000, hidden, generator=g)
    packed = gemm.pack_weight(w_dense.bfloat16()) if gemm.packing_supported(w_dense) else None

    def all_ops(use_pool: bool, threads: int) -> list[torch.Tensor]:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        lib.pagoda_cpu_ops_set_parallel_run(pool.parallel_run_pointer() if use_pool else None)
        try:
            h, r = x.clone(), res.clone()
            ops.rms_norm(h, w, 1e-5, residual=r)
            q, k = qk[:, : heads * hs].clone(), qk[:, heads * hs :].clone()
            ops.rotary_embedding(positions, q, k, cos_sin, hs)
            out = [h, r, ops.silu_and_mul(gu), q, k, ops.linear(x[:7], w_dense)]
            if packed is not None:
                out.append(gemm.packed_linear(x.bfloat16(), packed))
            return out
        finally:
            lib.pagoda_cpu_ops_set_parallel_run(pool.parallel_run_pointer())
            torch.set_num_threads(old)

    one = all_ops(use_pool=False, threads=1)
    for threads in (2, 3):
        for use_pool in (True, False):
            got = all_ops(use_pool, threads)
            assert all(torch.equal(a, b) for a, b in zip(got, one, strict=True)), (
                use_pool,
                threads,
            )
