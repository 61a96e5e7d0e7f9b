"""W4A16 on the GPU: Pagoda's Triton kernel on 4-bit packed weights (`pagoda/kernels/w4a16.py`)
vs dense bf16 (cuBLAS, and Pagoda's dense dispatch: the GEMV at one row, the skinny GEMM at
2..32/64), for the Llama-3-8B linear layers (group 128) and M = 1..1024 rows, with cold
weights (copies cycled, more bytes than the 60 MB L2) inside CUDA graphs.

    python benchmarks/w4a16_bench.py --quick --out w4a16.json   # a small sweep (< 3 min)
    python benchmarks/w4a16_bench.py --out w4a16.json           # a wider sweep (--budget-s)
    python benchmarks/w4a16_bench.py --no-sweep                 # default configs only
    python benchmarks/w4a16_bench.py --dry-run    # tiny shapes on a CPU through the Triton
        # interpreter: every code path (grid, precompile, failures, summary, JSON) in seconds

One line per (shape, M): W4A16 with `default_config` and with the best swept config, in us,
their packed-weight bandwidth (qweight + scales + zeros bytes / time), cuBLAS and Pagoda's
dense path on the bf16 weight, and the kernel's max |error| against the dequantized weight
(fp32 reference); then ms per decode step (4 layers' GEMMs x 32) per M. Configs that fail to
compile or run are listed, not fatal. These measurements should set `default_config`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_common import add_sweep_args, precompile, sweep_device  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
LAYERS = 32
M_VALUES = (1, 2, 8, 16, 32, 64, 128, 256, 1024)
L2_BYTES = 60e6
# --dry-run: interpreter-sized shapes (K ragged against the tiles for down), groups of 32.
DRY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 200)}
DRY_GROUP = 32
DRY_M_VALUES = (1, 3, 40)
BAD_CONFIG = (16, 48, 32, 1, 4, 2, True, False)  # block_n not a power of two: reported


def config_grid(m: int, n: int, k: int, group: int, mode: str, num_sms: int) -> list[tuple]:
    """W4A16Config tuples to time, default_config's first. mode: "quick", "full" or "dry"."""
    from pagoda.kernels.skinny_gemm import SMEM_BUDGET, split_k_plan
    from pagoda.kernels.w4a16 import _tile_groups, default_config

    base = default_config(m, n, k, group, num_sms)
    small = base.block_m <= 32
    if mode == "dry":
        grid = ((base.block_m,), (16, 32), (32,), (4,), (2,))
    elif small:
        grid = (
            (base.block_m,),
            (64, 128) if mode == "quick" else (32, 64, 128),
            (128,) if mode == "quick" else (64, 128),
            (4,),
            (4, 6) if mode == "quick" else (3, 4, 6, 8),
        )
    else:
        grid = ((64, 128), (64, 128), (64, 128), (4, 8), (3,) if mode == "quick" else (3, 4))
    variants = ((True, False), (False, False)) if small else ((True, True), (False, False))
    configs = []
    for (bm, bn, bk, warps, stages), (after, pre) in itertools.product(
        itertools.product(*grid), variants
    ):
        if bm > max(16, base.block_m) or (after and not _tile_groups(k, group, bk)):
            continue
        if stages * (bn * bk // 2 + bm * bk * 2) * 2 > SMEM_BUDGET:
            continue
        if warps == 8 and bn * bm < 8192:
            continue
        tiles = -(-n // bn) * -(-m // bm)
        for split in (1, 2, 4, 8):
            if split_k_plan(k, bk, split)[1] != split or tiles * split > 4 * num_sms:
                continue
            if split > 1 and tiles >= num_sms:
                continue
            configs.append((bm, bn, bk, split, warps, stages, after, pre))
    return [tuple(base)] + [c for c in configs if c != tuple(base)]


def packed_layer(n: int, k: int, group: int, device: str, gen):
    """Random packed 4-bit weights (qweight, scales, zeros) of an [n, k] layer."""
    import torch

    groups = -(-k // group)
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (n, -(-k // 8)), generator=gen, device=device, dtype=torch.int32
    )
    scales = (torch.rand(groups, n, generator=gen, device=device) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (groups, n), generator=gen, device=device).to(torch.uint8)
    return qweight, scales, zeros


def _precompile_one(job: tuple) -> str | None:
    """Build one config in a worker process (into Triton's on-disk cache) by running it."""
    import torch

    from pagoda.kernels.w4a16 import W4A16Config, w4a16_linear

    m, n, k, group, cfg, device, dtype = job
    gen = torch.Generator(device=device).manual_seed(0)
    qweight, scales, zeros = packed_layer(n, k, group, device, gen)
    x = torch.zeros(m, k, device=device, dtype=getattr(torch, dtype))
    try:
        w4a16_linear(x, qweight, scales, zeros, group, config=W4A16Config(*cfg))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported by the sweep
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _compile_key(k: int, cfg: tuple) -> tuple:
    """What makes a distinct kernel: the config, split or not, and whether K needs masks (M is
    never specialized); N and K of one shape class share builds."""
    bm, bn, bk, split, warps, stages, after, pre = cfg
    return (bm, bn, bk, split > 1, warps, stages, after, pre, k % bk == 0)


def pagoda_dense(x, w):
    """What an unquantized CUDA layer runs: the GEMV, the skinny GEMM or cuBLAS."""
    import torch.nn.functional as F

    from pagoda.kernels import few_rows_linear, one_row_linear

    y = one_row_linear(x, w)
    if y is None:
        y = few_rows_linear(x, w)
    return F.linear(x, w) if y is None else y


def measure(name, n, k, group, m, x, packed, dense, configs, seconds) -> dict:
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.w4a16 import W4A16Config, w4a16_linear
    from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4

    def per_copy(call, weights) -> float:
        def run() -> None:
            for w in weights:
                call(w)

        return seconds(run) / len(weights)

    packed_bytes = sum(t.numel() * t.element_size() for t in packed[0])
    row = {"shape": name, "n": n, "k": k, "m": m, "packed_bytes": packed_bytes}
    row["cublas_us"] = per_copy(lambda w: F.linear(x, w), dense) * 1e6
    row["pagoda_dense_us"] = per_copy(lambda w: pagoda_dense(x, w), dense) * 1e6
    timings, failures = [], []
    for cfg in configs:
        config = W4A16Config(*cfg)
        try:
            t = per_copy(lambda p, c=config: w4a16_linear(x, *p, group, config=c), packed)
            timings.append({"config": list(cfg), "us": t * 1e6})
        except Exception as e:  # noqa: BLE001 - a config that does not build or run: skip it
            failures.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    row["configs"], row["failures"] = timings, failures
    row["default_config"] = list(configs[0])
    row["default_us"] = next((r["us"] for r in timings if r["config"] == list(configs[0])), None)
    best = min(timings, key=lambda r: r["us"], default=None)
    row["best_config"] = best and best["config"]
    row["best_us"] = best and best["us"]
    if best is not None:
        row["best_gbps"] = packed_bytes / (best["us"] * 1e-6) / 1e9
    qweight, scales, zeros = packed[0]
    ref_w = dequantize_w4(W4Weight(qweight, scales, zeros, group, None), k)
    ref = F.linear(x.float(), ref_w)
    out = w4a16_linear(x, qweight, scales, zeros, group)
    row["max_abs_err"] = (out.float() - ref).abs().max().item()
    row["max_abs_ref"] = ref.abs().max().item()
    del ref_w, ref
    if x.is_cuda:
        torch.cuda.empty_cache()
    return row


def _fmt(us: float | None, width: int = 7) -> str:
    return f"{us:{width}.1f}" if us is not None else f"{'-':>{width}}"


def print_row(row: dict) -> None:
    gbps = lambda us: row["packed_bytes"] / (us * 1e-6) / 1e9 if us else 0.0  # noqa: E731
    print(
        f"{row['shape']:8s} M={row['m']:5d}  W4A16 default {_fmt(row['default_us'])} us "
        f"({gbps(row['default_us']):6.0f} GB/s)  best {_fmt(row['best_us'])} us "
        f"({gbps(row['best_us']):6.0f} GB/s) {tuple(row['best_config'] or ())}  | bf16 "
        f"cuBLAS {_fmt(row['cublas_us'])}  Pagoda dense {_fmt(row['pagoda_dense_us'])}  "
        f"max|err| {row['max_abs_err']:.3g} of {row['max_abs_ref']:.3g}  "
        f"[{len(row['configs'])} configs, {len(row['failures'])} failed]",
        flush=True,
    )


def summarize(rows: list[dict], shapes: dict) -> list[dict]:
    """ms per decode step per M: the 4 layer GEMMs x LAYERS."""
    summary = []
    keys = ("default_us", "best_us", "cublas_us", "pagoda_dense_us")
    for m in sorted({r["m"] for r in rows}):
        by_shape = [r for r in rows if r["m"] == m]
        if len(by_shape) != len(shapes):
            continue
        step = {"m": m}
        for key in keys:
            times = [r[key] for r in by_shape]
            step[key.replace("_us", "_ms")] = None if None in times else sum(times) * LAYERS / 1e3
        summary.append(step)
    print(f"\nms per decode step ({len(shapes)} GEMMs x {LAYERS} layers):")
    print(f"{'M':>5s} {'W4 dflt':>8s} {'W4 best':>8s} {'cuBLAS':>8s} {'dense':>8s}")
    for s in summary:
        cells = " ".join(_fmt(s[k.replace("_us", "_ms")], 8) for k in keys)
        print(f"{s['m']:5d} {cells}")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", help="write every timing and the summary to this JSON file")
    ap.add_argument("--quick", action="store_true", help="a small config sweep")
    ap.add_argument("--no-sweep", action="store_true", help="default configs only")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (interpreter on a CPU)")
    add_sweep_args(
        ap,
        SHAPES,
        "row counts (default: 1..1024)",
        120.0,
        "past this many seconds of timing, the remaining points take default configs",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    dev = sweep_device(args.dry_run)
    on_gpu, device, dtype, num_sms = dev.on_gpu, dev.device, dev.dtype, dev.num_sms
    import triton

    from pagoda.kernels.skinny_gemm import prepare

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    shapes = {s: shapes[s] for s in (args.shapes or shapes)}
    group = DRY_GROUP if args.dry_run else GROUP
    m_values = args.m or (DRY_M_VALUES if args.dry_run else M_VALUES)
    mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
    reps = 1 if args.dry_run else args.reps
    seconds = dev.seconds(reps)

    plan = {}
    for (name, (n, k)), m in itertools.product(shapes.items(), m_values):
        configs = config_grid(m, n, k, group, mode, num_sms)
        plan[name, m] = configs[:1] if args.no_sweep else configs[: 4 if args.dry_run else None]
        if args.dry_run:
            plan[name, m].append(BAD_CONFIG)
    print(
        f"{device} {dev.name}, torch "
        f"{torch.__version__}, triton {triton.__version__}: "
        f"{sum(len(c) for c in plan.values())} W4A16 timings over {len(plan)} (shape, M)",
        flush=True,
    )
    if args.jobs > 1 and not args.dry_run:
        dt = str(dtype).removeprefix("torch.")
        todo = {}
        for (s, m), cs in plan.items():
            n, k = shapes[s]
            for c in cs:
                todo.setdefault(_compile_key(k, c), (m, n, k, group, c, device, dt))
        precompile(_precompile_one, todo.values(), args.jobs, cpu=not on_gpu)
    prepare(device)  # the split-K counters, outside any graph capture

    t0 = time.perf_counter()
    rows, over_budget = [], False
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        one = packed_layer(n, k, group, device, gen)
        copies = 1 if args.dry_run else math.ceil(3 * L2_BYTES / sum(t.nbytes for t in one))
        packed = [one] + [packed_layer(n, k, group, device, gen) for _ in range(copies - 1)]
        dense_copies = 1 if args.dry_run else math.ceil(3 * L2_BYTES / (n * k * 2))
        dense = [
            torch.randn(n, k, generator=gen, device=device, dtype=dtype) * 0.02
            for _ in range(dense_copies)
        ]
        for m in m_values:
            configs = plan[name, m]
            if not over_budget and time.perf_counter() - t0 > args.budget_s:
                over_budget = True
                print(f"-- past {args.budget_s:.0f} s: default configs from here --", flush=True)
            if over_budget:
                configs = configs[:1]
            x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            row = measure(name, n, k, group, m, x, packed, dense, configs, seconds)
            row["copies"], row["dense_copies"] = copies, dense_copies
            print_row(row)
            rows.append(row)
        del packed, dense
        if on_gpu:
            torch.cuda.empty_cache()
    summary = summarize(rows, shapes)
    failures = [(r["shape"], r["m"], f) for r in rows for f in r["failures"]]
    if failures:
        print(f"\n{len(failures)} configs failed, e.g.:")
        for shape, m, f in failures[:10]:
            print(f"  {shape} M={m} {tuple(f['config'])}: {f['error'][:160]}")
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "summary": summary,
    }
    print(f"\ntimed in {result['seconds']:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
