"""W8A16 on the GPU: 8-bit GPTQ weights kept 8-bit (`pagoda/kernels/w8a16.py`) vs dense bf16
cuBLAS, for the Llama-3-8B linear layers (qkv 4096->6144, o 4096->4096, gate_up 4096->28672,
down 14336->4096; group 128, symmetric unless --zeros) at M = 1, 16, 64, 256, 1024 rows, with
cold weights (copies cycled, more bytes than the 60 MB L2) inside CUDA graphs.

    python benchmarks/w8a16_bench.py --out-dir results/w8a16          # the H200 run
    python benchmarks/w8a16_bench.py --out-dir DIR --sweep            # + kernel configs
    python benchmarks/w8a16_bench.py --tiny --out-dir /tmp/w8   # tiny shapes on a CPU
        # through the Triton interpreter (float32): every code path and the JSON, in seconds

One line per (shape, M): what `w8a16_linear` runs by default (`choose_config`) and its time,
the Triton kernel with `default_config` at every M, the dequantized weight + cuBLAS at every
M, the best swept kernel config (--sweep), bf16 cuBLAS on the dense weight, the weight
bandwidth of the default (qweight + scales + zeros bytes / time) and its max |error| against
the dequantized weight in fp32; then ms per decode step (4 GEMMs x 32 layers) per M, and the
row count from which dequantize-then-cuBLAS beat the kernel on every shape (what
`w8a16.DEQUANT_MIN_M` should be). The JSON (`w8a16_bench.json` in --out-dir) holds it all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_common import sweep_device  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
LAYERS = 32
M_VALUES = (1, 16, 64, 256, 1024)
L2_BYTES = 60e6
# --tiny: interpreter-sized shapes (K ragged against the tiles for down), groups of 32.
TINY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 200)}
TINY_GROUP = 32
TINY_M_VALUES = (1, 16, 130)
COLUMNS = ("w8a16", "kernel", "dequant", "best", "cublas")


def layer_weights(n: int, k: int, group: int, zeros: bool, act_order: bool, device: str, gen):
    """Random 8-bit weights of an [n, k] layer in the kernel's layout (`W8Weight`)."""
    import torch

    from pagoda.model.quantization.w8_layout import W8Weight

    groups = -(-k // group)
    qweight = torch.randint(0, 256, (n, k), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen, device=device) * 2e-4 + 1e-5).half()
    z = None
    if zeros:
        z = torch.randint(-127, 129, (groups, n), generator=gen, device=device).to(torch.int16)
    perm = None
    if act_order:
        perm = torch.randperm(k, generator=gen, device=device).to(torch.int32)
    return W8Weight(qweight, scales, z, group, perm)


def sweep_configs(m: int, n: int, k: int, group: int, num_sms: int, tiny: bool) -> list[tuple]:
    """W8A16Config tuples around `default_config`: tile widths, splits and stages."""
    from pagoda.kernels.skinny_gemm import SMEM_BUDGET, split_k_plan
    from pagoda.kernels.w8a16 import _group_arg, default_config

    base = default_config(m, n, k, group, num_sms)
    bm = base.block_m
    block_ns = (16, 32) if tiny else ((64, 128, 256) if bm <= 32 else (64, 128))
    block_ks = (base.block_k,) if tiny or bm <= 32 else (64, 128)
    splits = sorted({max(1, base.split_k // 2), base.split_k, 2 * base.split_k})
    stages = (2,) if tiny else ((3, 4, 6) if bm <= 32 else (3, 4))
    out = [tuple(base)]
    for bn, bk, split, st in itertools.product(block_ns, block_ks, splits, stages):
        warps = 8 if bn * bm >= 128 * 128 else 4
        after = bm <= 64 and _group_arg(k, group, bk) % bk == 0
        if st * (bn * bk + bm * bk * 2) > SMEM_BUDGET or split_k_plan(k, bk, split)[1] != split:
            continue
        cfg = (bm, bn, bk, split, warps, st, after)
        if cfg not in out:
            out.append(cfg)
    return out[:4] if tiny else out


def measure(
    name: str,
    n: int,
    k: int,
    m: int,
    x,
    packed: list,
    dense: list,
    configs: list[tuple],
    seconds: Callable,
) -> dict:
    import torch.nn.functional as F

    from pagoda.kernels.w8a16 import (
        DEQUANT,
        W8A16Config,
        choose_config,
        default_config,
        w8a16_linear,
    )
    from pagoda.kernels.w8a16 import _num_sms as num_sms
    from pagoda.model.quantization.w8_layout import dequantize_w8

    def per_copy(call, weights) -> float:
        def run() -> None:
            for w in weights:
                call(w)

        return seconds(run) / len(weights) * 1e6

    def w8(cfg) -> Callable:
        return lambda w: w8a16_linear(
            x, w.qweight, w.scales, w.zeros, w.group_size, None, w.perm, config=cfg
        )

    w0 = packed[0]
    group = w0.group_size
    nbytes = sum(t.nbytes for t in (w0.qweight, w0.scales, w0.zeros) if t is not None)
    chosen = choose_config(m, n, k, group, num_sms(x.device), x.element_size())
    row = {"shape": name, "n": n, "k": k, "m": m, "weight_bytes": nbytes}
    row["default"] = chosen if chosen == DEQUANT else list(chosen)
    row["w8a16_us"] = per_copy(w8(None), packed)
    row["kernel_us"] = per_copy(w8(default_config(m, n, k, group, num_sms(x.device))), packed)
    row["dequant_us"] = per_copy(w8(DEQUANT), packed)
    row["cublas_us"] = per_copy(lambda w: F.linear(x, w), dense)
    timings, failures = [], []
    for cfg in configs:
        try:
            timings.append({"config": list(cfg), "us": per_copy(w8(W8A16Config(*cfg)), packed)})
        except Exception as e:  # noqa: BLE001 - a config that does not build or run: reported
            failures.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    best = min(timings, key=lambda r: r["us"], default=None)
    row["configs"], row["failures"] = timings, failures
    row["best_config"] = best and best["config"]
    row["best_us"] = best and best["us"]
    row["w8a16_gbps"] = nbytes / (row["w8a16_us"] * 1e-6) / 1e9
    ref = F.linear(x.float(), dequantize_w8(w0, k))
    row["max_abs_err"] = (w8(None)(w0).float() - ref).abs().max().item()
    row["max_abs_ref"] = ref.abs().max().item()
    return row


def _fmt(us: float | None, width: int = 8) -> str:
    return f"{us:{width}.1f}" if us is not None else f"{'-':>{width}}"


def print_row(row: dict) -> None:
    default = "dequant" if row["default"] == "dequant" else f"kernel{tuple(row['default'][:4])}"
    print(
        f"{row['shape']:8s} M={row['m']:5d}  W8A16 {_fmt(row['w8a16_us'])} us "
        f"({row['w8a16_gbps']:6.0f} GB/s, {default})  kernel {_fmt(row['kernel_us'])}  "
        f"dequant+cuBLAS {_fmt(row['dequant_us'])}  best {_fmt(row['best_us'])} "
        f"{tuple(row['best_config'] or ())}  | bf16 cuBLAS {_fmt(row['cublas_us'])}  "
        f"max|err| {row['max_abs_err']:.3g} of {row['max_abs_ref']:.3g}",
        flush=True,
    )


def summarize(rows: list[dict], shapes: dict) -> dict:
    """ms per decode step per M (the 4 layer GEMMs x LAYERS) and where dequantizing wins."""
    steps = []
    for m in sorted({r["m"] for r in rows}):
        by_shape = [r for r in rows if r["m"] == m]
        if len(by_shape) != len(shapes):
            continue
        step: dict = {"m": m}
        for col in COLUMNS:
            times = [r[col + "_us"] for r in by_shape]
            step[col + "_ms"] = None if None in times else sum(times) * LAYERS / 1e3
        step["speedup_vs_cublas"] = step["cublas_ms"] / step["w8a16_ms"]
        steps.append(step)
    print(f"\nms per decode step ({len(shapes)} GEMMs x {LAYERS} layers):")
    print(f"{'M':>5s} " + " ".join(f"{c:>8s}" for c in COLUMNS) + "  W8A16 vs cuBLAS")
    for s in steps:
        cells = " ".join(_fmt(s[c + "_ms"]) for c in COLUMNS)
        print(f"{s['m']:5d} {cells}  {s['speedup_vs_cublas']:6.2f}x")
    # The smallest M from which dequantize-then-cuBLAS beat the kernel on every shape, at every
    # larger M too: the dispatch threshold these measurements support.
    ms = sorted({r["m"] for r in rows})
    wins = {m: all(r["dequant_us"] < r["kernel_us"] for r in rows if r["m"] == m) for m in ms}
    dequant_from = next((m for i, m in enumerate(ms) if all(wins[x] for x in ms[i:])), None)
    print(f"dequantize-then-cuBLAS beat the kernel on every shape from M = {dequant_from}")
    return {"steps": steps, "dequant_wins_from_m": dequant_from}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out-dir", help="folder for w8a16_bench.json (made if missing)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter on a CPU)")
    ap.add_argument("--sweep", action="store_true", help="also time kernel configs")
    ap.add_argument("--shapes", nargs="+", help="subset of " + " ".join(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, help="row counts (default: 1 16 64 256 1024)")
    ap.add_argument("--zeros", action="store_true", help="zero points (default: symmetric)")
    ap.add_argument("--act-order", action="store_true", help="inputs gathered through a perm")
    ap.add_argument("--group", type=int, default=None, help="group size (default 128)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument(
        "--budget-s", type=float, default=600.0, help="past this, --sweep times no more configs"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    dev = sweep_device(args.tiny)
    import triton

    from pagoda.kernels.skinny_gemm import prepare

    shapes = TINY_SHAPES if args.tiny else SHAPES
    shapes = {s: shapes[s] for s in (args.shapes or shapes)}
    group = args.group or (TINY_GROUP if args.tiny else GROUP)
    m_values = args.m or (TINY_M_VALUES if args.tiny else M_VALUES)
    seconds = dev.seconds(1 if args.tiny else args.reps)
    print(
        f"{dev.device} {dev.name}, torch {torch.__version__}, triton {triton.__version__}: "
        f"W8A16 group {group}, {'zeros' if args.zeros else 'symmetric'}"
        f"{', act order' if args.act_order else ''}, {dev.dtype}",
        flush=True,
    )
    prepare(dev.device)  # the split-K counters, outside any graph capture
    t0 = time.perf_counter()
    rows = []
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device=dev.device).manual_seed(0)

        def one(n=n, k=k, gen=gen):
            return layer_weights(n, k, group, args.zeros, args.act_order, dev.device, gen)

        packed = [one()]
        copies = 1 if args.tiny else math.ceil(3 * L2_BYTES / packed[0].qweight.nbytes)
        packed += [one() for _ in range(copies - 1)]
        dense_copies = 1 if args.tiny else math.ceil(3 * L2_BYTES / (n * k * 2))
        dense = [
            torch.randn(n, k, generator=gen, device=dev.device, dtype=dev.dtype) * 0.02
            for _ in range(dense_copies)
        ]
        for m in m_values:
            configs = []
            if args.sweep and time.perf_counter() - t0 < args.budget_s:
                configs = sweep_configs(m, n, k, group, dev.num_sms, args.tiny)
            x = torch.randn(m, k, generator=gen, device=dev.device, dtype=dev.dtype)
            row = measure(name, n, k, m, x, packed, dense, configs, seconds)
            row["copies"], row["dense_copies"] = copies, dense_copies
            print_row(row)
            rows.append(row)
        del packed, dense
        if dev.on_gpu:
            torch.cuda.empty_cache()
    summary = summarize(rows, shapes)
    failures = [(r["shape"], r["m"], f) for r in rows for f in r["failures"]]
    for shape, m, f in failures[:10]:
        print(f"  failed: {shape} M={m} {tuple(f['config'])}: {f['error'][:160]}")
    result = {
        "device": dev.name if dev.on_gpu else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "summary": summary,
    }
    print(f"\ntimed in {result['seconds']:.0f} s", flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "w8a16_bench.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
