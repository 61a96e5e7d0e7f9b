"""W8A8 GEMMs on the GPU: INT8 (`torch._int_mm` + Pagoda's Triton row quantization and
epilogue) and FP8 (the same quantization + `torch._scaled_mm` row-wise) against dense bf16
cuBLAS, for the Llama-3-8B linear layers, per decode / prefill step: the 4 GEMMs of 32 layers
(each layer its own weights, more bytes than the L2), captured in one CUDA graph, at
M = 1, 16, 64, 256, 1024, 4096 rows. Activation quantization is included in the W8A8 times.

    python benchmarks/w8a8_bench.py               # the table (< 3 min on an H200)
    python benchmarks/w8a8_bench.py --dry-run     # tiny shapes, plain path, on a CPU

Prints per M: ms per step for bf16, int8 and fp8, the speed-ups over bf16, and each 8-bit
path's relative error against its dequantize-then-matmul reference on one layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagoda.kernels.scaled_mm import (  # noqa: E402
    FP8_DTYPE,
    fp8_supported,
    quantize_weight,
    scaled_mm,
    scaled_mm_ref,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
M_VALUES = (1, 16, 64, 256, 1024, 4096)
DRY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 80)}


def make_layers(shapes, layers, device, modes):
    """Per mode, `layers` x [(weight, scale) per shape]: bf16 dense, int8 and fp8 quantized."""
    g = torch.Generator(device=device).manual_seed(0)
    out = {m: [] for m in modes}
    for _ in range(layers):
        per = {m: [] for m in modes}
        for n, k in shapes.values():
            w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * 0.02
            if "bf16" in modes:
                per["bf16"].append((w, None))
            for mode, dtype in (("int8", torch.int8), ("fp8", FP8_DTYPE)):
                if mode in modes:
                    w_q, scale = quantize_weight(w, dtype)
                    per[mode].append((w_q, scale.reshape(-1).contiguous()))
            del w
        for m in modes:
            out[m].append(per[m])
    return out


def step_fn(mode, layers, xs):
    """One step: every layer's 4 GEMMs on inputs xs (one per shape's K)."""

    def run():
        for per in layers:
            for (w, scale), x in zip(per, xs):
                if mode == "bf16":
                    F.linear(x, w)
                else:
                    scaled_mm(x, w, scale)

    return run


def time_step(fn, device, iters: int) -> float:
    """ms per call of fn, through a CUDA graph on a GPU (launch costs out), wall time on a CPU."""
    if device.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    del graph
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU")
    p.add_argument("--m", default=None, help="comma-separated row counts")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    shapes, layers = (DRY_SHAPES, 2) if dry else (SHAPES, LAYERS)
    m_values = tuple(int(v) for v in args.m.split(",")) if args.m else M_VALUES
    if dry:
        m_values = tuple(min(m, 64) for m in m_values[:3])
    modes = ["bf16", "int8"] + (["fp8"] if dry or fp8_supported(device) else [])
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}; {len(shapes)} GEMMs x {layers} layers per step")
    t0 = time.perf_counter()
    weights = make_layers(shapes, layers, device, modes)
    print(f"weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator(device=device).manual_seed(1)
    # Relative error of each 8-bit path against its reference, one layer, M = 64.
    errors = {}
    for mode in modes[1:]:
        errs = []
        for (w, scale), (_, k) in zip(weights[mode][0], shapes.values()):
            x = torch.randn(64, k, device=device, generator=g, dtype=torch.bfloat16)
            y = scaled_mm(x, w, scale).float()
            ref = scaled_mm_ref(x, w, scale).float()
            errs.append(float((y - ref).norm() / ref.norm()))
        errors[mode] = max(errs)
    print("max relative error vs dequantize-then-matmul: " + ", ".join(
        f"{m} {e:.1e}" for m, e in errors.items()))  # fmt: skip
    header = f"{'M':>6} | " + " | ".join(f"{m + ' ms':>9}" for m in modes)
    header += " | " + " | ".join(f"{m + ' x':>7}" for m in modes[1:])
    print(header)
    print("-" * len(header))
    for m in m_values:
        xs = [torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
              for _, k in shapes.values()]  # fmt: skip
        iters = args.iters or (3 if dry else max(3, min(20, int(2000 / max(m, 100)))))
        times = {mode: time_step(step_fn(mode, weights[mode], xs), device, iters) for mode in modes}
        row = f"{m:>6} | " + " | ".join(f"{times[mode]:>9.2f}" for mode in modes)
        row += " | " + " | ".join(f"{times['bf16'] / times[mode]:>6.2f}x" for mode in modes[1:])
        print(row, flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
