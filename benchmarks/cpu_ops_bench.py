"""Microbenchmark of the C CPU ops against torch: the GEMMs per row count (to place
`MAX_GEMV_ROWS` and check the packed kernel's lead over torch's GEMM) and the element-wise ops
at decode shapes, at the ISA level selected (or forced with --isa / $PAGODA_CPU_ISA).

    python benchmarks/cpu_ops_bench.py [--rows 1 2 4 8 16 32 64] [--shapes 960x576 ...]
        [--isa avx2] [--threads 2] [--stat median|min]

Defaults are SmolLM2-135M's projections (qkv, o, gate_up, down, lm_head). Prints microseconds
per call (the variants interleaved call by call) with GFLOP/s, for torch's F.linear on float32
and on bf16 weights, the bf16 GEMM on packed weights, and the skinny GEMM on plain weights of
the --dtype (float32: the path of float32 models), and the weight bytes per second the packed
GEMM streams. `--stat min` is steadier on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagoda

from pagoda.kernels import cpu  # noqa: E402
from pagoda.kernels.cpu import gemm as cpu_gemm  # noqa: E402
from pagoda.kernels.cpu import ops  # noqa: E402
from pagoda.kernels.reference import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref  # noqa: E402
from pagoda.utils.cpu_build import ISA_ENV, ISA_LEVELS  # noqa: E402

_COLD_BYTES = 96 << 20
_SHAPES = ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]


_STAT = statistics.median


def time_us(fn: Callable[[], object], iters: int) -> float:
    return times_us([fn], iters)[0]


def times_us(fns: list[Callable[[], object]], iters: int) -> list[float]:
    """Microseconds per call of each fn (median, or min with --stat min), the fns interleaved
    call by call (so a noisy neighbour on the machine slows them alike)."""
    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [_STAT(ts) * 1e6 for ts in times]


def _cycle(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    weights.append(weights.pop(0))
    return fn(x, weights[0])


def _register_tiles(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    old = cpu_gemm.set_amx_min_rows(1 << 30)
    try:
        return cpu_gemm.packed_linear(x, packed)
    finally:
        cpu_gemm.set_amx_min_rows(old)


def bench_linear(shapes: list[str], rows: list[int], iters: int, dtype: torch.dtype) -> None:
    """F.linear on float32 and on bf16 weights vs the packed bf16 GEMM vs the skinny GEMM on
    plain `dtype` weights (rows up to MAX_GEMV_ROWS[dtype])."""
    amx = cpu_gemm.amx_active()
    tiles = f" (AMX tiles from {cpu_gemm.amx_min_rows()} rows)" if amx else ""
    print(
        "linear [N x K], M rows: us (GFLOP/s) of F.linear fp32 | F.linear bf16 | packed bf16 "
        f"GEMM{tiles} | skinny "
        f"GEMM {str(dtype).replace('torch.', '')} (up to {ops.MAX_GEMV_ROWS[dtype]} rows)"
        f"{' | packed, register tiles' if amx else ''} || packed GB/s of weights, "
        "packed vs fp32 / bf16 F.linear"
    )
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        # Cycle through copies of the weights that overflow the L3, so every call streams its
        # weight from DRAM as a decode step does.
        count = 1 + _COLD_BYTES // (n * k * 4)
        fp32 = [torch.randn(n, k) for _ in range(count)]
        bf16 = [w.to(torch.bfloat16) for w in fp32]
        packs = [cpu_gemm.pack_weight(w) for w in bf16]
        plain = fp32 if dtype is torch.float32 else bf16
        for m in rows:
            x32 = torch.randn(m, k)
            x16 = x32.to(torch.bfloat16)
            xd = x32 if dtype is torch.float32 else x16
            fns = [
                functools.partial(_cycle, F.linear, x32, fp32),
                functools.partial(_cycle, F.linear, x16, bf16),
                functools.partial(_cycle, cpu_gemm.packed_linear, x16, packs),
            ]
            if m <= ops.MAX_GEMV_ROWS[dtype]:
                fns.append(functools.partial(_cycle, cpu.linear, xd, plain))
            if amx:  # the packed GEMM's AVX-512 register tiles, for comparison
                fns.append(functools.partial(_cycle, _register_tiles, x16, packs))
            ts = times_us(fns, iters)
            flop = 2 * m * n * k
            cells = " | ".join(f"{t:8.1f} ({flop / t / 1e3:5.1f})" for t in ts)
            t_p = ts[2]
            print(
                f"  {n:6d}x{k:<5d} M={m:4d}: {cells} || {n * k * 2 / t_p / 1e3:5.1f} GB/s, "
                f"{ts[0] / t_p:4.2f}x / {ts[1] / t_p:4.2f}x"
            )


def bench_elementwise(rows: list[int], iters: int, hidden: int = 576, inter: int = 1536) -> None:
    print("element-wise, bf16: torch reference us | C us")
    w = torch.randn(hidden).to(torch.bfloat16)
    cache = torch.randn(2048, 64)
    for m in rows:
        x, r = torch.randn(m, hidden).bfloat16(), torch.randn(m, hidden).bfloat16()
        gate_up = torch.randn(m, 2 * inter).bfloat16()
        qkv = torch.randn(m, 960).bfloat16()
        q, k = qkv[:, :576].view(m, 9, 64), qkv[:, 576:768].view(m, 3, 64)
        pos = torch.randint(0, 2048, (m,))
        cases = {
            "rms_norm+residual": (rms_norm_ref, cpu.rms_norm, (x, w, 1e-5, r)),
            "silu_and_mul": (silu_and_mul_ref, cpu.silu_and_mul, (gate_up,)),
            "rotary_embedding": (
                rotary_embedding_ref,
                cpu.rotary_embedding,
                (pos, q, k, cache, 64),
            ),
        }
        for name, (ref, fast, args) in cases.items():
            t_ref = time_us(functools.partial(ref, *args), iters)
            t_c = time_us(functools.partial(fast, *args), iters)
            print(f"  M={m:3d} {name:18s}: {t_ref:8.1f} | {t_c:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=_SHAPES, help="NxK weight shapes")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="float32",
        help="weights of the skinny GEMM on plain weights",
    )
    parser.add_argument("--isa", choices=ISA_LEVELS, help="force a level ($PAGODA_CPU_ISA)")
    parser.add_argument("--threads", type=int, help="default: torch's intra-op thread count")
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    args = parser.parse_args()
    global _STAT
    _STAT = min if args.stat == "min" else statistics.median
    if args.isa:
        os.environ[ISA_ENV] = args.isa
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.cpu_ops_available():
        raise SystemExit("the C CPU ops are not available here (see the warning above)")
    print(f"ISA level {ops.ops_isa()}, {torch.get_num_threads()} threads, {args.stat} of calls")
    bench_linear(args.shapes, args.rows, args.iters, getattr(torch, args.dtype))
    bench_elementwise(args.rows, args.iters)


if __name__ == "__main__":
    main()
