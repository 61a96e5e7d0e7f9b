"""The quantized-weight CPU GEMM (`pagoda.kernels.cpu.quant`, GGUF blocks in the x8 layout)
against the packed bf16 GEMM (`pagoda.kernels.cpu.gemm`) on the embedded model's layer shapes,
at several row counts:

    python benchmarks/cpu_quant_gemm_bench.py [--rows 1 8 32 64 256] [--threads 1 2]
        [--isa avx2] [--reps 100]

Shapes: qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536] as Q4_1, and the
tied LM head [49152, 576] as Q8_0 (the embedded model's types), random blocks with sane
scales. Prints microseconds per call (the best of 5 rounds of --reps calls, after a warm-up)
and GFLOP/s; the weights stay in cache between calls, so this measures arithmetic, not memory
bandwidth. --isa picks the quantized kernel's ISA level (default: this CPU's best). On a CPU
with AMX two more columns time both kernels with their AMX tiles held off (the vector tiles
alone), the two paths of each kernel called alternately round by round.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import pagoda  # noqa: F401 - sets the OpenMP wait policy before torch's first parallel region
from pagoda.kernels.cpu import gemm, quant
from pagoda.kernels.cpu.quant import QuantWeight, kernel_isa, pack_x8, quant_linear

Q4_1, Q8_0 = 3, 8
SHAPES = {
    "qkv": (960, 576, Q4_1),
    "o": (576, 576, Q4_1),
    "gate_up": (3072, 576, Q4_1),
    "down": (576, 1536, Q4_1),
    "lm_head": (49152, 576, Q8_0),
}


def random_weight(n: int, k: int, ggml_type: int) -> QuantWeight:
    """Random GGUF blocks (d = 0.01, Q4_1's m = -0.05) in the x8 layout."""
    gen = torch.Generator().manual_seed(n * k)
    block = 20 if ggml_type == Q4_1 else 34
    blocks = torch.randint(0, 256, (n, k // 32, block), dtype=torch.uint8, generator=gen)
    blocks[:, :, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if ggml_type == Q4_1:
        blocks[:, :, 2:4] = torch.tensor([-0.05], dtype=torch.float16).view(torch.uint8)
    return QuantWeight(pack_x8(blocks.reshape(n, -1), ggml_type, k), ggml_type, n, k, x8=True)


def best_us(fns: list, reps: int) -> list[float]:
    """Microseconds per call of each fn: the best of 5 rounds, the fns taking turns by round."""
    for fn in fns:
        for _ in range(3):
            fn()
    rounds: list[list[float]] = [[] for _ in fns]
    for _ in range(5):
        for fn, times in zip(fns, rounds, strict=True):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps * 1e6)
    return [min(times) for times in rounds]


def without_amx(fn, *args, **kwargs):
    """fn with both kernels' AMX tiles held off (their vector tiles at every row count)."""
    old_q, old_g = quant.set_amx_min_rows(1 << 30), gemm.set_amx_min_rows(1 << 30)
    try:
        return fn(*args, **kwargs)
    finally:
        quant.set_amx_min_rows(old_q)
        gemm.set_amx_min_rows(old_g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--isa", default=None, help="the quantized kernel's ISA level")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    amx = quant.amx_active(args.isa) and gemm.amx_active()
    print(f"quantized kernel: {kernel_isa(args.isa)}{', AMX tiles' if amx else ''}")
    weights = {name: (random_weight(n, k, t), n, k) for name, (n, k, t) in SHAPES.items()}
    packed = {
        name: gemm.pack_weight(torch.randn(n, k).bfloat16()) for name, (n, k, _) in SHAPES.items()
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            for name, (qw, n, k) in weights.items():
                x = torch.randn(m, k)
                xb = x.bfloat16()
                reps = max(3, min(args.reps, int(2e9 / (2 * m * n * k))))  # <= ~2 GFLOP a round
                fq = functools.partial(quant_linear, x, qw, isa=args.isa)
                fb = functools.partial(gemm.packed_linear, xb, packed[name])
                fns = [fq, fb]
                if amx:
                    fns += [functools.partial(without_amx, fq), functools.partial(without_amx, fb)]
                times = best_us(fns, reps)
                tq, tb = times[:2]
                flop = 2 * m * n * k
                line = (
                    f"threads {threads} rows {m:4d} {name:8s} {qw.type_name}: "
                    f"quantized {tq:9.1f} us ({flop / tq / 1e3:6.1f} GFLOP/s), "
                    f"bf16 packed {tb:9.1f} us ({flop / tb / 1e3:6.1f} GFLOP/s), "
                    f"ratio {tq / tb:.2f}"
                )
                if amx:
                    vq, vb = times[2:]
                    line += (
                        f" | vector tiles: quantized {vq:9.1f} us ({vq / tq:.2f}x), "
                        f"bf16 packed {vb:9.1f} us ({vb / tb:.2f}x)"
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main()
