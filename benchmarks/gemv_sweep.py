"""One-row GEMV on the GPU: Pagoda's Triton kernel over a grid of tile shapes vs cuBLAS, for the
Llama-3-8B decode shapes, with cold weights (copies cycled) inside CUDA graphs.

    python benchmarks/gemv_sweep.py            # per shape: cuBLAS and the best Triton tiles
    python benchmarks/gemv_sweep.py --blas     # cuBLASLt vs cuBLAS for M = 1..256, 32 layers

These are the measurements behind the tile rule of `pagoda/kernels/gemv.py` and the
benchmarks README (H200, 2026-11-29).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagoda.kernels.gemv import _gemv_kernel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 6  # weight copies cycled per replay: more bytes than the 60 MB L2


def graph_seconds(fn, reps: int = 20) -> float:
    """Seconds per call of `fn` replayed in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _triton_seconds(x, ws, y, tiles: tuple[int, int, int, int]) -> float:
    n, k = ws[0].shape
    bn, bk, warps, stages = tiles
    grid = (triton.cdiv(n, bn),)

    def run() -> None:
        for w in ws:
            _gemv_kernel[grid](
                x, w, x, y, n, k, k, SILU_AND_MUL=False, HAS_BIAS=False, BLOCK_N=bn,
                BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps,
            )  # fmt: skip

    return graph_seconds(run) / len(ws)


def _cublas_seconds(x, ws) -> float:
    def run() -> None:
        for w in ws:
            torch.nn.functional.linear(x, w)

    return graph_seconds(run) / len(ws)


def sweep_tiles() -> None:
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        t_cublas = _cublas_seconds(x, ws)
        grid = itertools.product((8, 16, 32), (256, 512), (4, 8), (1, 4))
        t, tiles = min((_triton_seconds(x, ws, y, tiles), tiles) for tiles in grid)
        _triton_seconds(x, ws[:1], y, tiles)
        err = (y.float() - torch.nn.functional.linear(x, ws[0]).float()).abs().max().item()
        gb = n * k * 2 / 1e9
        print(
            f"{name:8s} N={n} K={k}: cuBLAS {t_cublas * 1e6:6.1f} us ({gb / t_cublas / 1e3:.2f} "
            f"TB/s) | Triton best {t * 1e6:6.1f} us ({gb / t / 1e3:.2f} TB/s) (BLOCK_N, BLOCK_K, "
            f"warps, stages) = {tiles} max|err| {err:.3g}",
            flush=True,
        )


def _layers_seconds(layers, xs) -> float:
    def run() -> None:
        for layer in layers:
            for w in layer:
                torch.nn.functional.linear(xs[w.shape[1]], w)

    return graph_seconds(run)


def compare_blas_libraries() -> None:
    for m, lib in itertools.product((1, 2, 4, 8, 256), ("cublaslt", "cublas")):
        torch.backends.cuda.preferred_blas_library(lib)
        layers = [
            [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES.values()]
            for _ in range(32)
        ]
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES.values()}
        ms = _layers_seconds(layers, xs) * 1e3
        print(f"M={m:4d} {lib:9s} {ms:7.3f} ms for the GEMMs of 32 layers", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blas", action="store_true", help="cuBLASLt vs cuBLAS instead")
    args = ap.parse_args()
    compare_blas_libraries() if args.blas else sweep_tiles()


if __name__ == "__main__":
    main()
