"""The quantized-weight CPU GEMM (`pagoda.kernels.cpu.quant`, GGUF blocks in the x8 layout)
against the packed bf16 GEMM (`pagoda.kernels.cpu.gemm`) on the embedded model's layer shapes,
at several row counts:

    python benchmarks/cpu_quant_gemm_bench.py [--rows 1 8 32 64 256] [--threads 1 2]
        [--isa avx2] [--reps 100]

Shapes: qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536] as Q4_1, and the
tied LM head [49152, 576] as Q8_0 (the embedded model's types), random blocks with sane
scales. Prints microseconds per call (the best of 5 rounds of --reps calls, after a warm-up)
and GFLOP/s; the weights stay in cache between calls, so this measures arithmetic, not memory
bandwidth. --isa picks the quantized kernel's ISA level (default: this CPU's best).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import pagoda  # noqa: F401 - sets the OpenMP wait policy before torch's first parallel region
from pagoda.kernels.cpu import gemm
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


def best_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - t0) / reps * 1e6)
    return min(rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--isa", default=None, help="the quantized kernel's ISA level")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    print(f"quantized kernel: {kernel_isa(args.isa)}")
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
                tq = best_us(functools.partial(quant_linear, x, qw, isa=args.isa), reps)
                tb = best_us(functools.partial(gemm.packed_linear, xb, packed[name]), reps)
                flop = 2 * m * n * k
                print(
                    f"threads {threads} rows {m:4d} {name:8s} {qw.type_name}: "
                    f"quantized {tq:9.1f} us ({flop / tq / 1e3:6.1f} GFLOP/s), "
                    f"bf16 packed {tb:9.1f} us ({flop / tb / 1e3:6.1f} GFLOP/s), "
                    f"ratio {tq / tb:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
