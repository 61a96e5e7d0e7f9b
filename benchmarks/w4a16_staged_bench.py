"""W4A16 at many rows on the GPU: the dense weight staged through the L2 cache a slice of rows at
a time (`w4a16_skinny.staged_linear`: dequantize a slice into a reused buffer, cuBLAS from
there) against dequantizing the whole weight first (`DEQUANT`), what `w4a16_linear` picks by
default, and dense bf16 cuBLAS, for the Llama-3-8B linear layers (group 128), cold weights
(copies cycled, more bytes than the L2), in CUDA graphs.

    python benchmarks/w4a16_staged_bench.py --out staged.json
    python benchmarks/w4a16_staged_bench.py --m 256 1024 --chunk-mb 16 --streams 1

One line per (shape, M): us per variant ("staged<MB>x<streams>"), each checked against the
dequantized reference; then ms per decode step (4 GEMMs x 32 layers) per M and variant.
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
from sweep_common import graph_seconds  # noqa: E402
from w4a16_bench import GROUP, L2_BYTES, LAYERS, SHAPES, packed_layer  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--shapes", nargs="+", help="subset of " + " ".join(SHAPES))
    ap.add_argument("--chunk-mb", nargs="+", type=float, default=[8, 16, 24, 32])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="list one staged call's kernels")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from pagoda.kernels.skinny_gemm import prepare
    from pagoda.kernels.w4a16 import DEQUANT, choose_config, w4a16_linear
    from pagoda.kernels.w4a16_skinny import staged_linear
    from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    prepare("cuda")
    shapes = {s: SHAPES[s] for s in (args.shapes or SHAPES)}
    staged = [(mb, st) for mb in args.chunk_mb for st in args.streams]
    rows, t0 = [], time.perf_counter()
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        one = packed_layer(n, k, GROUP, "cuda", gen)
        packed_bytes = sum(t.nbytes for t in one)
        copies = math.ceil(3 * L2_BYTES / packed_bytes)
        packed = [one] + [packed_layer(n, k, GROUP, "cuda", gen) for _ in range(copies - 1)]
        dense = [
            torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(math.ceil(3 * L2_BYTES / (n * k * 2)))
        ]
        ref_w = dequantize_w4(W4Weight(*one, GROUP, None), k)
        for m in args.m:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ref_w)

            def timed(call, weights) -> float:
                def run() -> None:
                    for w in weights:
                        call(w)

                return graph_seconds(run, args.reps) / len(weights) * 1e6

            def error(out, ref=ref) -> float:
                return (out.float() - ref).abs().max().item() / ref.abs().max().item()

            line = {"shape": name, "m": m}
            line["cublas_bf16"] = timed(lambda w, x=x: F.linear(x, w), dense)
            line["dequant"] = timed(
                lambda p, x=x: w4a16_linear(x, *p, GROUP, config=DEQUANT), packed
            )
            line["default"] = timed(lambda p, x=x: w4a16_linear(x, *p, GROUP), packed)
            line["default_config"] = str(choose_config(m, n, k, GROUP))
            errs = {}
            for mb, st in staged:
                key = f"staged{mb:g}x{st}"

                def call(p, x=x, mb=mb, st=st):
                    return staged_linear(x, *p, GROUP, None, None, int(mb * 2**20), st)

                line[key] = timed(call, packed)
                errs[key] = error(call(one))
            line["max_err"] = max(errs.values())
            rows.append(line)
            print(
                f"{name:8s} M={m:5d} "
                + " ".join(f"{key} {v:7.1f}" for key, v in line.items() if isinstance(v, float))
                + f"  default={line['default_config']}",
                flush=True,
            )
            if args.profile and name == "gate_up" and m == args.m[-1]:
                from torch.profiler import ProfilerActivity, profile

                mb, st = staged[0]
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    staged_linear(x, *one, GROUP, None, None, int(mb * 2**20), st)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        del packed, dense, ref_w
        torch.cuda.empty_cache()

    variants = [v for v in rows[0] if isinstance(rows[0][v], float) and v != "max_err"]
    print(f"\nms per decode step ({len(shapes)} GEMMs x {LAYERS} layers):")
    print(f"{'M':>5s} " + " ".join(f"{v:>14s}" for v in variants))
    summary = []
    for m in args.m:
        lines = [r for r in rows if r["m"] == m]
        step = {"m": m, **{v: sum(r[v] for r in lines) * LAYERS / 1e3 for v in variants}}
        summary.append(step)
        print(f"{m:5d} " + " ".join(f"{step[v]:14.3f}" for v in variants))
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
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
