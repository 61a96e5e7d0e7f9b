"""Skinny GEMMs of decode batches on the GPU: cuBLAS, cuBLASLt and Pagoda's Triton
`skinny_linear` over a grid of configs, for the Llama-3-8B shapes and M = 2..256 rows, with
cold weights (copies cycled, more bytes than the 60 MB L2) inside CUDA graphs.

    python benchmarks/gemm_sweep.py --out gemm_sweep.json           # full grid (~4 min, H200)
    python benchmarks/gemm_sweep.py --quick --out gemm_sweep.json   # fewer configs
    python benchmarks/gemm_sweep.py --dry-run    # tiny shapes, a few configs: every code path
        # (grid, precompile pool, skipped configs, summary, JSON) in seconds; on a machine
        # without a GPU through the Triton interpreter

One line per (shape, M): cuBLAS, cuBLASLt, the best Triton config and default_config's, in us,
and the best one's weight bandwidth; then ms per decode step (4 GEMMs x 32 layers + lm_head)
per M. Configs that fail to compile or run are skipped and listed. Triton covers M <= 128;
larger M time the two BLAS libraries only. These are the measurements behind
`default_config` in `pagoda/kernels/skinny_gemm.py`.
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

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),  # once per step, not per layer
}
LAYERS = 32
M_VALUES = (2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
L2_BYTES = 60e6
SMEM_LIMIT = 227 * 1024  # per SM on sm_90

# (block_n, block_k, num_warps, num_stages) candidates; splits from SPLITS where sensible.
FULL_GRID = ((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5, 6))
QUICK_GRID = ((64, 128), (128, 256), (4,), (3, 4))
SPLITS = (1, 2, 4, 8)
# --dry-run: interpreter-sized shapes and tiles that still split K raggedly.
DRY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "down": (64, 224), "lm_head": (200, 64)}
DRY_M_VALUES = (2, 16, 33, 160)
DRY_GRID = ((16, 32), (16, 32), (4,), (2,))
BAD_CONFIG = (48, 32, 1, 4, 2)
CONFIG_NAMES = (
    "block_n",
    "block_k",
    "split_k",
    "num_warps",
    "num_stages",
)  # BLOCK_N not a power of two: must be reported, not crash


def config_grid(
    m: int, n: int, k: int, grid: tuple, num_sms: int, elem_bytes: int = 2
) -> list[tuple[int, int, int, int, int]]:
    """(block_n, block_k, split_k, num_warps, num_stages) to time, default_config's first:
    pipelines that fit the SM's shared memory, 8 warps only for tiles of >= 2048 outputs, and
    splits that keep whole BLOCK_K blocks (>= 2 a split) and are needed (half the split gives
    < 4 waves)."""
    from pagoda.kernels.skinny_gemm import block_m_for, default_config, split_k_plan

    block_m = block_m_for(m)
    configs = []
    for block_n, block_k, warps, stages in itertools.product(*grid):
        if stages * (block_n + block_m) * block_k * elem_bytes > SMEM_LIMIT:
            continue
        if warps == 8 and block_n * block_m < 2048:
            continue
        tiles = -(-n // block_n)
        for split in SPLITS:
            k_per_split, splits = split_k_plan(k, block_k, split)
            if splits != split or (split > 1 and k_per_split < 2 * block_k):
                continue
            if split > 1 and tiles * split // 2 >= 4 * num_sms:
                continue
            configs.append((block_n, block_k, split, warps, stages))
    default = default_config(m, n, k, num_sms, elem_bytes=elem_bytes)
    return [default] + [c for c in configs if c != default]


def _compile_key(m: int, cfg: tuple) -> tuple:
    """What makes a distinct Triton kernel: tiles, warps, stages, split or not, and whether M
    is divisible by 16 (the launcher specializes that); N and K here always are."""
    from pagoda.kernels.skinny_gemm import block_m_for

    block_n, block_k, split, warps, stages = cfg
    return (block_m_for(m), m % 16 == 0, block_n, block_k, split > 1, warps, stages)


_WORKER_TENSORS: dict = {}


def _precompile_one(job: tuple) -> str | None:
    """Compile one config in a worker process (into Triton's on-disk cache, which the main
    process then hits) by running it once; the error text when it fails."""
    import torch

    from pagoda.kernels.skinny_gemm import skinny_linear

    m, n, k, cfg, device, dtype = job
    key = (n, k, device, dtype)
    if key not in _WORKER_TENSORS:
        _WORKER_TENSORS.clear()
        _WORKER_TENSORS[key] = torch.empty(n, k, device=device, dtype=getattr(torch, dtype))
    w = _WORKER_TENSORS[key]
    x = torch.zeros(m, k, device=device, dtype=w.dtype)
    try:
        skinny_linear(x, w, **dict(zip(CONFIG_NAMES, cfg)))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported by the sweep
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _per_weight(seconds, call, x, ws) -> float:
    def run() -> None:
        for w in ws:
            call(x, w)

    return seconds(run) / len(ws)


def _blas_seconds(seconds, x, ws, library: str) -> float | None:
    import torch

    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library(library)
    except RuntimeError:  # a CPU build has no cuBLASLt
        return None
    try:
        return _per_weight(seconds, torch.nn.functional.linear, x, ws)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def sweep_shape_m(name, n, k, m, x, ws, configs, seconds, num_sms) -> dict:
    import torch

    from pagoda.kernels.skinny_gemm import default_config, skinny_linear

    row = {"shape": name, "n": n, "k": k, "m": m}
    row["cublas_us"] = _blas_seconds(seconds, x, ws, "cublas") * 1e6
    lt = _blas_seconds(seconds, x, ws, "cublaslt")
    row["cublaslt_us"] = None if lt is None else lt * 1e6
    timings, failures = [], []
    for cfg in configs:
        kwargs = dict(zip(CONFIG_NAMES, cfg))
        try:
            t = _per_weight(seconds, lambda a, b, kw=kwargs: skinny_linear(a, b, **kw), x, ws)
            timings.append({"config": list(cfg), "us": t * 1e6})
        except Exception as e:  # noqa: BLE001 - a config that does not build or run: skip it
            failures.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    row["configs"], row["failures"] = timings, failures
    if not timings:
        return row
    best = min(timings, key=lambda r: r["us"])
    default = list(default_config(m, n, k, num_sms, elem_bytes=x.element_size()))
    row["best_config"], row["triton_us"] = best["config"], best["us"]
    row["default_config"] = default
    row["default_us"] = next((r["us"] for r in timings if r["config"] == default), None)
    row["triton_tbps"] = n * k * ws[0].element_size() / (best["us"] * 1e-6) / 1e12
    ref = torch.nn.functional.linear(x.float(), ws[0].float())
    out = skinny_linear(x, ws[0], **dict(zip(CONFIG_NAMES, best["config"])))
    row["max_abs_err"] = (out.float() - ref).abs().max().item()
    return row


def _fmt(us: float | None, width: int = 7) -> str:
    return f"{us:{width}.1f}" if us is not None else f"{'-':>{width}}"


def print_row(row: dict) -> None:
    gb = row["n"] * row["k"] * 2 / 1e9
    line = (
        f"{row['shape']:8s} M={row['m']:4d}  cuBLAS {_fmt(row['cublas_us'])} us "
        f"({gb / row['cublas_us'] * 1e3:.2f} TB/s)  cuBLASLt {_fmt(row['cublaslt_us'])} us"
    )
    if "triton_us" in row:
        line += (
            f"  Triton best {_fmt(row['triton_us'])} us ({row['triton_tbps']:.2f} TB/s) "
            f"{tuple(row['best_config'])}  default {_fmt(row['default_us'])} us "
            f"{tuple(row['default_config'])}  max|err| {row['max_abs_err']:.3g}"
        )
    if row.get("configs") is not None:
        line += f"  [{len(row['configs'])} configs, {len(row['failures'])} failed]"
    print(line, flush=True)


def summarize(rows: list[dict], shapes: dict) -> list[dict]:
    """ms per decode step per M: the layer GEMMs x LAYERS plus lm_head once."""
    summary = []
    for m in sorted({r["m"] for r in rows}):
        by_shape = {r["shape"]: r for r in rows if r["m"] == m}
        if set(by_shape) != set(shapes):
            continue
        step = {"m": m}
        for key, pick in (
            ("cublas_ms", lambda r: r["cublas_us"]),
            ("triton_ms", lambda r: r.get("triton_us")),
            ("best_of_both_ms", lambda r: min(r["cublas_us"], r.get("triton_us") or math.inf)),
        ):
            times = {s: pick(r) for s, r in by_shape.items()}
            if any(t is None for t in times.values()):
                step[key] = None
                continue
            total = sum(t * (1 if s == "lm_head" else LAYERS) for s, t in times.items())
            step[key] = total / 1e3
        summary.append(step)
    print("\nms per decode step (4 GEMMs x 32 layers + lm_head):")
    print(f"{'M':>5s} {'cuBLAS':>8s} {'Triton':>8s} {'best of':>8s}")
    for s in summary:
        print(
            f"{s['m']:5d} {_fmt(s['cublas_ms'], 8)} "
            f"{_fmt(s['triton_ms'], 8)} {_fmt(s['best_of_both_ms'], 8)}"
        )
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", help="write every timing and the summary to this JSON file")
    ap.add_argument("--quick", action="store_true", help="fewer configs (block_n 64/128, ...)")
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny shapes (the Triton interpreter on a CPU)"
    )
    add_sweep_args(
        ap,
        SHAPES,
        "row counts (default: 2..256)",
        240.0,
        "past this many seconds, the remaining (shape, M) take the --quick grid",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    dev = sweep_device(args.dry_run)
    on_gpu, device, dtype, num_sms = dev.on_gpu, dev.device, dev.dtype, dev.num_sms
    import triton

    from pagoda.kernels.skinny_gemm import MAX_ROWS, prepare

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    shapes = {s: shapes[s] for s in (args.shapes or shapes)}
    m_values = args.m or (DRY_M_VALUES if args.dry_run else M_VALUES)
    grid = DRY_GRID if args.dry_run else (QUICK_GRID if args.quick else FULL_GRID)
    reps = 2 if args.dry_run else args.reps
    seconds = dev.seconds(reps)
    esize = torch.empty((), dtype=dtype).element_size()

    plan = {}
    for (name, (n, k)), m in itertools.product(shapes.items(), m_values):
        configs = config_grid(m, n, k, grid, num_sms, esize) if m <= MAX_ROWS else []
        if args.dry_run and configs:
            configs = configs[:6] + [BAD_CONFIG]
        plan[name, m] = configs
    n_cfg = sum(len(c) for c in plan.values())
    print(
        f"{device} {dev.name}, torch "
        f"{torch.__version__}, triton {triton.__version__}: {n_cfg} Triton timings over "
        f"{len(plan)} (shape, M)",
        flush=True,
    )
    if args.jobs > 1:
        dt = str(dtype).removeprefix("torch.")
        todo = {}
        for (s, m), cs in plan.items():
            for c in cs:
                if c != BAD_CONFIG:
                    todo.setdefault(_compile_key(m, c), (m, *shapes[s], c, device, dt))
        precompile(_precompile_one, todo.values(), args.jobs, cpu=not on_gpu)
    prepare(device)  # the split-K counters, outside any graph capture

    t0 = time.perf_counter()
    rows, over_budget = [], False
    for name, (n, k) in shapes.items():
        copies = 1 if args.dry_run else max(1, math.ceil(3 * L2_BYTES / (n * k * esize)))
        gen = torch.Generator(device=device).manual_seed(0)
        ws = [
            torch.randn(n, k, generator=gen, device=device, dtype=dtype) * 0.02
            for _ in range(copies)
        ]
        for m in m_values:
            configs = plan[name, m]
            if not over_budget and time.perf_counter() - t0 > args.budget_s and configs:
                over_budget = True
                print(f"-- past {args.budget_s:.0f} s: the --quick grid from here --", flush=True)
            if over_budget and configs:
                configs = config_grid(m, n, k, QUICK_GRID, num_sms, esize)
            x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            row = sweep_shape_m(name, n, k, m, x, ws, configs, seconds, num_sms)
            row["copies"] = copies
            print_row(row)
            rows.append(row)
        del ws
        if on_gpu:
            torch.cuda.empty_cache()
    summary = summarize(rows, shapes)
    failures = [(r["shape"], r["m"], f) for r in rows for f in r.get("failures", [])]
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
    print(f"\nswept in {result['seconds']:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
