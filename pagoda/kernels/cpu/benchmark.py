"""Microbenchmark of the C CPU ops against torch: the skinny GEMM and (bf16) the GEMM on packed
weights per row count (to place `MAX_GEMV_ROWS` and check the packed kernel's lead over
torch's GEMM) and the element-wise ops at decode shapes.

    python -m pagoda.kernels.cpu.benchmark [--rows 1 2 4 8 16 32 64] [--shapes 960x576 ...]

Defaults are SmolLM2-135M's projections (qkv, o, gate_up, down, lm_head). Prints microseconds
per call (median, the variants interleaved call by call) and the weight-streaming bandwidth
(skinny GEMM) or GFLOP/s (packed GEMM) reached.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu
from pagoda.kernels.cpu import gemm as cpu_gemm
from pagoda.kernels.reference import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref

_COLD_BYTES = 96 << 20
_SHAPES = ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]


def time_us(fn: Callable[[], object], iters: int) -> float:
    return times_us([fn], iters)[0]


def times_us(fns: list[Callable[[], object]], iters: int) -> list[float]:
    """Median microseconds per call of each fn, the fns interleaved call by call (so a noisy
    neighbour on the machine slows them alike)."""
    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e6 for ts in times]


def _cycle(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    weights.append(weights.pop(0))
    return fn(x, weights[0])


def bench_linear(shapes: list[str], rows: list[int], iters: int, dtype: torch.dtype) -> None:
    """F.linear vs the skinny GEMM (plain weight) vs, for bf16, the GEMM on packed weights."""
    packed = dtype is torch.bfloat16
    print(
        "linear [N x K], M rows: torch F.linear us | skinny GEMM us"
        + (" | packed GEMM us (GFLOP/s) | packed vs torch" if packed else " (GB/s) | speedup")
    )
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        # Cycle through copies of the weight that overflow the L3, so every call streams its
        # weight from DRAM as a decode step does.
        size = dtype.itemsize
        copies = [torch.randn(n, k).to(dtype) for _ in range(1 + _COLD_BYTES // (n * k * size))]
        packs = [cpu_gemm.pack_weight(w) for w in copies] if packed else []
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            fns = [
                functools.partial(_cycle, F.linear, x, copies),
                functools.partial(_cycle, cpu.linear, x, copies),
            ]
            if packed:
                fns.append(functools.partial(_cycle, cpu_gemm.packed_linear, x, packs))
            t_ref, t_c, *t_packed = times_us(fns, iters)
            line = f"  {n:6d}x{k:<5d} M={m:4d}: {t_ref:9.1f} | {t_c:9.1f}"
            if packed:
                t_p = t_packed[0]
                gflops = 2 * m * n * k / t_p / 1e3
                line += f" | {t_p:9.1f} ({gflops:5.0f}) | {t_ref / t_p:5.2f}x"
            else:
                line += f" ({n * k * size / t_c / 1e3:5.1f}) | {t_ref / t_c:5.2f}x"
            print(line)


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
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if not cpu.cpu_ops_available():
        raise SystemExit("the C CPU ops are not available here (see the warning above)")
    print(f"{torch.get_num_threads()} threads")
    bench_linear(args.shapes, args.rows, args.iters, getattr(torch, args.dtype))
    bench_elementwise(args.rows, args.iters)


if __name__ == "__main__":
    main()
