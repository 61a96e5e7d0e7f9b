"""Host time per call (CPU microseconds to enqueue, the GPU kept ahead) of the eager W4A16
path against F.linear on bf16 weights, and of its parts, at the Llama-3-8B shapes: what an
eager (mixed prefill) step pays per layer before the GPU does."""

import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from w4a16_bench import packed_layer  # noqa: E402

from pagoda.kernels import w4a16, w4a16_wgmma  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def host_us(fn, calls=40):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # keep the GPU busy so that no call waits for it
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def row(name: str, n: int, k: int, m: int, qw, sc, zp, dense) -> str:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = w4a16.choose_config(m, n, k, 128, 132, 2)
    a = host_us(lambda: w4a16.w4a16_linear(x, qw, sc, zp, 128))
    b = host_us(lambda: F.linear(x, dense))
    c = host_us(lambda: w4a16_wgmma.tile_x(x, None, 64))
    d = host_us(lambda: w4a16.choose_config(m, n, k, 128, 132, 2))
    return f"{name:8s} {m:5d} {a:8.1f} {b:9.1f} {c:7.1f} {d:7.1f}  {type(cfg).__name__}"


gen = torch.Generator(device="cuda").manual_seed(0)
print(
    f"{'shape':8s} {'M':>5s} {'w4a16':>8s} {'F.linear':>9s} {'tile_x':>7s} {'choose':>7s}  config"
)
for name, (n, k) in SHAPES.items():
    qw, sc, zp = packed_layer(n, k, 128, "cuda", gen)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in (32, 64, 256, 1024, 2048):
        print(row(name, n, k, m, qw, sc, zp, dense))
