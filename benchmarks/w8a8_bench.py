"""W8A8 GEMMs on the GPU against dense bf16 cuBLAS, for the Llama-3-8B linear layers (qkv
4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096), per decode / prefill step:
the 4 GEMMs of 32 layers (each layer its own weights, more bytes than the L2), captured in one
CUDA graph, at M = 1, 16, 64, 128, 256, 512, 1024, 4096 rows. Columns:

- bf16: F.linear (cuBLAS) on the dense weights;
- int_mm: Pagoda's Triton row quantization + `torch._int_mm` (cuBLASLt, int32 out) + the
  Triton epilogue kernel (`scaled_mm_cuda(..., config="int_mm")`);
- int8: the row quantization + what `scaled_mm` runs: the fused Triton int8 GEMM (scales and
  bias in its epilogue) with the config `choose_w8a8_config` picks, on sm_90 from 65 rows the
  CUDA kernel (`w8a8_wgmma.py`);
- scaled_mm: the row quantization + `torch._scaled_mm` (cuBLASLt fp8) with row-wise scales
  (sm_89+), at every M;
- fp8: what `scaled_mm` runs for fp8 weights: the fused Triton GEMM on e4m3 up to 64 rows, on
  sm_90 the CUDA kernel at 65-128, `torch._scaled_mm` above.
- int8_fq / fp8_fq: what a model's layers run (`PAGODA_W8A8_FUSED_QUANT`): the RMSNorm or
  SiLU-and-mul before qkv, gate_up and down quantizes its output for them, so those take
  their inputs quantized (`QuantizedRows`) and run the product alone; o quantizes its own.
- fp8_fq_exact: fp8_fq with each K tile's sum promoted to float32 (PAGODA_FP8_FAST_ACCUM=0);
  the other fp8 columns accumulate as the default says (fast: the tensor cores' precision).

Activation quantization is included in every 8-bit time but the _fq columns' qkv, gate_up and
down (there the kernel before writes it, at no extra pass); the quant column is that
quantization alone (the int8 row quantization of each GEMM's input, no GEMM).

    python benchmarks/w8a8_bench.py                    # the table (~2 min on an H200)
    python benchmarks/w8a8_bench.py --sweep            # + every int8 and fp8 config (~1 min)
    python benchmarks/w8a8_bench.py --sweep --out w8a8.json   # the same, kept as JSON
    python benchmarks/w8a8_bench.py --tiny --sweep     # tiny shapes on a CPU through the
        # Triton interpreter (float32): every code path, in about a minute

Prints per M: ms per step for each column, the speed-ups over bf16, and first each 8-bit path's
relative error against its dequantize-then-matmul reference on one layer. --sweep then times
every config of `w8a8_config_candidates` per (dtype, shape, M) on cold weights (copies of
the layer cycled past the L2, one CUDA graph) and prints per (shape, M) the chosen config's
time, the library GEMM's (int_mm / scaled_mm), the best config and its time; then per M the
step time (x 32 layers) of the chosen configs vs the best per shape: what
`choose_w8a8_config` should say. (--tiny sweeps int8 only: without fp8 tensor cores
`scaled_mm_cuda` takes the plain path for fp8 weights.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_common import precompile, sweep_device  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
M_VALUES = (1, 16, 64, 128, 256, 512, 1024, 4096)
L2_BYTES = 60e6
# --tiny: interpreter-sized shapes (down's K ragged against 128-deep K tiles).
TINY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 200)}
TINY_LAYERS = 1
TINY_M_VALUES = (1, 70)
MODES = ("bf16", "int_mm", "int8", "scaled_mm", "fp8", "int8_fq", "fp8_fq", "fp8_fq_exact")
FP8_MODES = ("scaled_mm", "fp8", "fp8_fq", "fp8_fq_exact")
# The layers whose input the kernel before them quantizes in the _fq columns.
PREQUANTIZED = ("qkv", "gate_up", "down")


def make_layers(shapes, layers, device, modes, dtype):
    """Per mode, `layers` x [(weight, scale) per shape]: dense, int8 and fp8 quantized."""
    import torch

    from pagoda.kernels.scaled_mm import FP8_DTYPE, quantize_weight

    g = torch.Generator(device=device).manual_seed(0)
    qdtypes = {"int_mm": torch.int8, "int8": torch.int8, "int8_fq": torch.int8}
    qdtypes.update(scaled_mm=FP8_DTYPE, fp8=FP8_DTYPE, fp8_fq=FP8_DTYPE, fp8_fq_exact=FP8_DTYPE)
    out = {m: [] for m in modes}
    for _ in range(layers):
        per = {m: [] for m in modes}
        for n, k in shapes.values():
            w = torch.randn(n, k, device=device, generator=g, dtype=dtype) * 0.02
            made = {}  # the same quantized weights for both paths of a dtype
            for mode in modes:
                if mode == "bf16":
                    per[mode].append((w, None))
                    continue
                qd = qdtypes[mode]
                if qd not in made:
                    w_q, scale = quantize_weight(w, qd)
                    made[qd] = (w_q, scale.reshape(-1).contiguous())
                per[mode].append(made[qd])
            if "bf16" not in modes:
                del w
        for m in modes:
            out[m].append(per[m])
    return out


def gemm(mode: str, config=None):
    """The call of one column: (x, w, scale) -> y."""
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.scaled_mm import scaled_mm
    from pagoda.kernels.scaled_mm_triton import (
        INT_MM,
        SCALED_MM,
        quantize_rows_triton,
        scaled_mm_cuda,
    )

    if mode == "bf16":
        return lambda x, w, s: F.linear(x, w)
    if mode == "quant":
        return lambda x, w, s: quantize_rows_triton(x, torch.int8)
    if mode == "fp8_fq_exact":  # the variable is read as the kernels launch (or are captured)

        def exact(x, w, s):
            before = os.environ.get("PAGODA_FP8_FAST_ACCUM")
            os.environ["PAGODA_FP8_FAST_ACCUM"] = "0"
            try:
                return scaled_mm(x, w, s)
            finally:
                if before is None:
                    del os.environ["PAGODA_FP8_FAST_ACCUM"]
                else:
                    os.environ["PAGODA_FP8_FAST_ACCUM"] = before

        return exact
    if mode.endswith(("_fq", "_fq_exact")):  # x: a tensor or `QuantizedRows`
        return lambda x, w, s: scaled_mm(x, w, s)
    if mode == "int_mm":
        config = INT_MM
    if mode == "scaled_mm":
        config = SCALED_MM
    return lambda x, w, s: scaled_mm_cuda(x, w, s, None, config=config)


def _inputs(mode: str, shapes: dict, xs: list) -> list:
    """Each shape's input for a mode: for the _fq modes the layers of `PREQUANTIZED` get theirs
    quantized already (what RMSNorm / SiLU-and-mul hand them), made once outside the timing."""
    if "_fq" not in mode:
        return xs
    import torch

    from pagoda.kernels.scaled_mm import FP8_DTYPE, QuantizedRows, quantize_rows_ref

    qd = torch.int8 if mode == "int8_fq" else FP8_DTYPE
    return [
        QuantizedRows(*quantize_rows_ref(x, qd), x.dtype) if name in PREQUANTIZED else x
        for name, x in zip(shapes, xs)
    ]


def step_fn(call, layers, xs):
    """One step: every layer's GEMMs on inputs xs (one per shape's K)."""

    def run():
        for per in layers:
            for (w, scale), x in zip(per, xs):
                call(x, w, scale)

    return run


def time_step(fn, device, iters: int) -> float:
    """ms per call of fn, through a CUDA graph on a GPU (launch costs out), wall time on a CPU."""
    import torch

    if device != "cuda":
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


def _compile_key(m: int, k: int, cfg) -> tuple:
    """What makes a distinct kernel: the config, split or not, ragged K, and M's
    specialization by the launcher (1, divisible by 16, other)."""
    spec = 1 if m == 1 else (16 if m % 16 == 0 else 0)
    return (cfg._replace(split_k=min(cfg.split_k, 2)), k % cfg.block_k == 0, spec)


def _precompile_one(job: tuple) -> str | None:
    """Build one config in a worker process (into Triton's on-disk cache) by running it."""
    import torch

    from pagoda.kernels.scaled_mm_triton import W8A8Config, w8a8_gemm

    m, n, k, cfg, device, dtype_name = job
    dtype = getattr(torch, dtype_name)
    a = torch.zeros(m, k, dtype=torch.int8, device=device).view(dtype)
    b = torch.zeros(n, k, dtype=torch.int8, device=device).view(dtype)
    xs = torch.ones(m, 1, device=device)
    ws = torch.ones(n, device=device)
    try:
        w8a8_gemm(a, xs, b, ws, None, torch.bfloat16, W8A8Config(*cfg))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported by the sweep
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def sweep(args, dev, shapes, weights, m_values, dtype, g, mode: str = "int8") -> list[dict]:
    """Every candidate config per (shape, M), on cold copies of the shape's `mode` weights
    (int8 or fp8)."""
    import torch

    from pagoda.kernels import w8a8_wgmma
    from pagoda.kernels.scaled_mm import FP8_DTYPE
    from pagoda.kernels.scaled_mm_triton import (
        INT_MM,
        SCALED_MM,
        W8A8Config,
        w8a8_config_candidates,
    )
    from pagoda.kernels.skinny_gemm import prepare

    qdtype = torch.int8 if mode == "int8" else FP8_DTYPE
    library = INT_MM if mode == "int8" else SCALED_MM
    plan = {}
    for (name, (n, k)), m in ((s, m) for s in shapes.items() for m in m_values):
        wgmma = dev.on_gpu and w8a8_wgmma.available(torch.device(dev.device))
        cands = w8a8_config_candidates(m, n, k, qdtype, wgmma)
        if args.tiny:  # a few, one split-K among them
            cands = cands[:3] + [c for c in cands[3:] if c.split_k > 1][:1]
        plan[name, m] = cands
    total = sum(len(c) for c in plan.values())
    print(f"\n{mode} sweep: {total} timings over {len(plan)} (shape, M)", flush=True)
    if dev.on_gpu and args.jobs > 1:
        todo = {}
        for (name, m), cands in plan.items():
            n, k = shapes[name]
            for c in cands:
                if isinstance(c, W8A8Config):  # Triton's; the CUDA kernel builds in-process
                    job = (m, n, k, tuple(c), dev.device, str(qdtype).split(".")[-1])
                    todo.setdefault(_compile_key(m, k, c), job)
        precompile(_precompile_one, todo.values(), args.jobs, cpu=False)
    prepare(dev.device)  # the split-K counters, outside any graph capture
    t0 = time.perf_counter()
    rows = []
    header = f"{'shape':>8} {'M':>5} | {'chosen us':>9} {library + ' us':>12} | best config"
    print(header + " " * 30 + "| best us | chosen/best")
    for name, (n, k) in shapes.items():
        idx = list(shapes).index(name)
        per_copy = n * k
        copies = 1 if args.tiny else max(2, min(LAYERS, math.ceil(3 * L2_BYTES / per_copy)))
        ws = [weights[mode][layer][idx] for layer in range(min(copies, len(weights[mode])))]
        for m in m_values:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {name} M={m} and later skipped")
                return rows
            x = torch.randn(m, k, device=dev.device, generator=g, dtype=dtype)
            times = {}
            for cfg in plan[name, m]:
                key = cfg if isinstance(cfg, str) else cfg.name
                call = gemm(mode, cfg)
                try:
                    ms = time_step(step_fn(call, [[w] for w in ws], [x]), dev.device, args.reps)
                    times[key] = ms / len(ws) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not build or run
                    print(f"  {name} M={m} {key}: {type(e).__name__}: {str(e)[:120]}")
            chosen = plan[name, m][0]
            chosen = chosen if isinstance(chosen, str) else chosen.name
            fused = {c: t for c, t in times.items() if c != library}
            best = min(fused, key=fused.get) if fused else None
            row = dict(
                dtype=mode, shape=name, m=m, n=n, k=k, chosen=chosen, best=best, times_us=times
            )
            rows.append(row)
            tc, tm = times.get(chosen, math.nan), times.get(library, math.nan)
            tb = times.get(best, math.nan)
            print(
                f"{name:>8} {m:>5} | {tc:>9.1f} {tm:>12.1f} | {best or '-':<40} | {tb:>7.1f} | "
                f"{tc / tb:.2f}",
                flush=True,
            )
    # Per M: the step (32 layers) with the chosen configs, the best per shape, the library's.
    print(f"\n{mode} per step (x 32 layers), ms: chosen configs / best fused per shape / {library}")
    for m in m_values:
        got = [r for r in rows if r["m"] == m]
        if len(got) != len(shapes):
            continue
        sums = [
            sum(r["times_us"].get(key(r), math.nan) for r in got) * LAYERS / 1e3
            for key in (lambda r: r["chosen"], lambda r: r["best"], lambda r: library)
        ]
        bests = ", ".join(f"{r['shape']} {r['best']}" for r in got)
        print(f"M={m:>5}: {sums[0]:.2f} / {sums[1]:.2f} / {sums[2]:.2f}   best: {bests}")
    print(f"sweep took {time.perf_counter() - t0:.0f} s")
    return rows


def _config_name(cfg) -> str:
    return "plain" if cfg is None else cfg if isinstance(cfg, str) else cfg.name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, Triton interpreter on a CPU")
    p.add_argument("--dry-run", action="store_true", help="the same as --tiny")
    p.add_argument("--m", default=None, help="comma-separated row counts")
    p.add_argument("--iters", type=int, default=None, help="graph replays per table timing")
    p.add_argument("--sweep", action="store_true", help="time every config per (shape, M)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--reps", type=int, default=10, help="graph replays per sweep timing")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="processes that precompile the swept kernels first (0: compile on first use)",
    )
    p.add_argument("--budget-s", type=float, default=420.0, help="stop the sweep after this")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import torch

    args.tiny = args.tiny or args.dry_run or not torch.cuda.is_available()
    dev = sweep_device(args.tiny)  # the interpreter without a GPU, before kernels are imported
    import triton

    from pagoda.kernels.scaled_mm import fp8_supported, scaled_mm_ref
    from pagoda.kernels.scaled_mm_triton import _cuda_path

    device = dev.device
    dtype = dev.dtype  # bf16 on a GPU, float32 in the interpreter
    shapes, layers = (TINY_SHAPES, TINY_LAYERS) if args.tiny else (SHAPES, LAYERS)
    if args.shapes:
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    m_values = tuple(int(v) for v in args.m.split(",")) if args.m else None
    m_values = m_values or (TINY_M_VALUES if args.tiny else M_VALUES)
    modes = [m for m in MODES if m not in FP8_MODES or args.tiny or fp8_supported(device)]
    name = "CPU (Triton interpreter, float32)" if not dev.on_gpu else dev.name
    print(
        f"{name}, torch {torch.__version__}, triton {triton.__version__}; "
        f"{len(shapes)} GEMMs x {layers} layers per step"
    )
    t0 = time.perf_counter()
    weights = make_layers(shapes, layers, device, modes, dtype)
    print(f"weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator(device=device).manual_seed(1)
    # Relative error of each 8-bit path against its reference, one layer, M = 64.
    errors = {}
    for mode in modes[1:]:
        errs = []
        for (w, scale), (_, k) in zip(weights[mode][0], shapes.values()):
            x = torch.randn(64, k, device=device, generator=g, dtype=dtype)
            y = gemm(mode)(x, w, scale).float()
            ref = scaled_mm_ref(x, w, scale).float()
            errs.append(float((y - ref).norm() / ref.norm()))
        errors[mode] = max(errs)
    print("max relative error vs dequantize-then-matmul: " + ", ".join(
        f"{m} {e:.1e}" for m, e in errors.items()))  # fmt: skip
    quant = gemm("quant")
    header = f"{'M':>6} | " + " | ".join(f"{m + ' ms':>9}" for m in modes) + " |  quant ms"
    header += " | " + " | ".join(f"{m + ' x':>8}" for m in modes[1:])
    print(header)
    print("-" * len(header))
    table = []
    for m in m_values:
        xs = [torch.randn(m, k, device=device, generator=g, dtype=dtype)
              for _, k in shapes.values()]  # fmt: skip
        iters = args.iters or (1 if args.tiny else max(3, min(20, int(2000 / max(m, 100)))))
        times = {
            mode: time_step(
                step_fn(gemm(mode), weights[mode], _inputs(mode, shapes, xs)), device, iters
            )
            for mode in modes
        }
        times["quant"] = time_step(step_fn(quant, weights[modes[0]], xs), device, iters)
        row = f"{m:>6} | " + " | ".join(f"{times[mode]:>9.2f}" for mode in modes)
        row += f" | {times['quant']:>9.2f}"
        row += " | " + " | ".join(f"{times['bf16'] / times[mode]:>7.2f}x" for mode in modes[1:])
        configs = {  # what the dispatch picks for these weights (the CUDA kernel included)
            dt: {
                s: _config_name(_cuda_path(m, w, None)) for s, (w, _) in zip(shapes, weights[dt][0])
            }
            for dt in ("int8", "fp8")
            if dt in weights
        }
        table.append(dict(m=m, ms=times, configs=configs))
        print(row, flush=True)
    for dt in ("int8", "fp8"):
        print(f"{dt} configs: " + "; ".join(
            f"M={r['m']}: " + ", ".join(f"{s} {c}" for s, c in r["configs"][dt].items())
            for r in table))  # fmt: skip
    rows = []
    if args.sweep:
        for mode in ("int8", "fp8"):
            if mode in modes and (mode == "int8" or not args.tiny):
                rows += sweep(args, dev, shapes, weights, m_values, dtype, g, mode)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, errors=errors, table=table, sweep=rows), f, indent=1)
        print(f"wrote {args.out}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
