"""Where a W4A16 decode step's time goes, kernel by kernel: the step of
`w4a16_skinny_bench.py --step` (qkv, o, gate_up and down of 32 distinct Llama-3-8B layers by
`w4a16_linear`'s default, dummy 4-bit weights, group 128) captured in one CUDA graph and
replayed under the torch profiler; per row count, each kernel's time a step (summed over its
launches), its launches, and the step's wall time against the sum of its kernels (the rest:
launch gaps and waits between dependent kernels). bf16 cuBLAS on dense weights of the same
shapes is profiled the same way for comparison. With programmatic dependent launch (PDL, the
default) a kernel starts before the one before it ends and waits inside its own interval, so
the kernels' times overlap and their sum exceeds the wall time: `--pdl 0` for a breakdown.

    python benchmarks/w4a16_step_kernels.py --m 1 16 64 128 256 [--pdl 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def profile_graph(
    fn, reps: int, layers: int
) -> tuple[float, dict[str, tuple[float, int]], list[tuple[str, float]]]:
    """(wall ms a replay, {kernel name: (us a replay, launches a replay)}, [(kernel name, us)]
    for each kernel of one layer in launch order, averaged over the layers and replays) of
    `fn` captured in a CUDA graph; the last is empty where a replay's kernels do not split
    into `layers` equal sequences."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / reps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    timeline = []
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        name = event.name.split("(")[0][:60]
        us = getattr(event, "device_time_total", None)
        us = us if us is not None else event.cuda_time_total
        totals[name][0] += us
        totals[name][1] += 1
        timeline.append((event.time_range.start, name, us))
    timeline.sort()
    per_layer: list[tuple[str, float]] = []
    if timeline and len(timeline) % (reps * layers) == 0:
        n = len(timeline) // (reps * layers)
        names = [name for _, name, _ in timeline[:n]]
        if all(timeline[i][1] == names[i % n] for i in range(len(timeline))):
            per_layer = [
                (names[j], sum(us for _, _, us in timeline[j::n]) / (reps * layers))
                for j in range(n)
            ]
    return wall_ms, {k: (v[0] / reps, v[1] // reps) for k, v in totals.items()}, per_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 16, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="write the tables to this JSON file")
    ap.add_argument("--pdl", choices=("0", "1"), help="PAGODA_PDL for the step's kernels")
    args = ap.parse_args()
    if args.pdl is not None:
        os.environ["PAGODA_PDL"] = args.pdl

    import torch
    from w4a16_skinny_bench import LAYERS, _step_fns, _step_layers

    from pagoda.kernels.skinny_gemm import prepare

    prepare("cuda")
    gen, packed, dense = _step_layers()
    print(torch.cuda.get_device_name())
    results = []
    for m in args.m:
        _, w4_step, dense_step = _step_fns(m, gen, packed, dense)
        for what, fn in (("w4a16", w4_step), ("bf16", dense_step)):
            wall_ms, kernels, per_layer = profile_graph(fn, args.reps, LAYERS)
            busy_ms = sum(us for us, _ in kernels.values()) / 1e3
            print(f"\n{what} M={m}: {wall_ms:.3f} ms a step, kernels {busy_ms:.3f} ms busy")
            for name, (us, launches) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
                each = us / max(launches, 1)
                print(f"  {us / 1e3:8.3f} ms {launches:5d} x {each:7.2f} us  {name}")
            print("  a layer, in launch order (qkv, o, gate_up, down):")
            for name, us in per_layer:
                print(f"    {us:7.2f} us  {name}")
            results.append(
                {
                    "m": m,
                    "what": what,
                    "wall_ms": wall_ms,
                    "busy_ms": busy_ms,
                    "kernels": kernels,
                    "per_layer": per_layer,
                }
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "steps": results}, f, indent=1)


if __name__ == "__main__":
    main()
