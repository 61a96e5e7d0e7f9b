"""Does any cuBLASLt algorithm beat torch's cuBLAS call on the Llama-3-8B GEMMs?

    python benchmarks/cublaslt_probe.py [--m 64 128 192 256 8192] [--max-algos 32] [--out F.json]

For each weight shape and row count M: torch's `F.linear` (cuBLAS), then every algorithm the
cuBLASLt heuristic offers for the problem (`pagoda.kernels.cublaslt`), each checked against
torch's output and timed in a CUDA graph of 20 calls over weight copies that together exceed
the 60 MB L2 (cold weights, as in a decode step). Prints torch, the heuristic's first answer,
and the best answer with its rank and configuration; then ms per decode step (4 GEMMs x 32
layers + LM head) for torch and for the best algorithms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagoda.kernels.cublaslt import WORKSPACE_BYTES, LtMatmul  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
CALLS = 20
REPLAYS = 5


def _time_graph(fn) -> float:
    """us per call of fn(i) for i in 0..CALLS-1, captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(CALLS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def probe(name: str, n: int, k: int, m: int, max_algos: int, ws: torch.Tensor) -> dict:
    dtype = torch.bfloat16
    copies = max(1, min(8, math.ceil(180e6 / (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    ref = F.linear(x, weights[0]).float()
    torch_us = _time_graph(lambda i: torch.mm(x, weights[i % copies].t(), out=out))
    lt = LtMatmul(m, n, k, dtype, max_algos)
    rows = []
    for cand in lt.candidates:
        if cand.workspace > WORKSPACE_BYTES:
            continue
        try:
            out.zero_()
            lt.run(x, weights[0], out, cand, ws)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            if not err <= 0.05:
                rows.append({"rank": cand.rank, "error": err, **cand.config})
                continue
            us = _time_graph(lambda i, c=cand: lt.run(x, weights[i % copies], out, c, ws))
        except RuntimeError as e:  # an algorithm that fails to launch is skipped, and said
            rows.append({"rank": cand.rank, "failed": str(e)[:80], **cand.config})
            continue
        rows.append({"rank": cand.rank, "us": us, "waves": round(cand.waves, 2), **cand.config})
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    first = next((r for r in rows if r["rank"] == 0 and "us" in r), None)
    flops = 2 * m * n * k
    line = f"{name:8s} M={m:5d}  torch {torch_us:8.1f} us ({flops / torch_us / 1e6:5.0f} TFLOP/s)"
    if first:
        line += f"  lt#0 {first['us']:8.1f}"
    if best:
        cfg = {k_: v for k_, v in best.items() if k_ not in ("us", "waves")}
        line += f"  best {best['us']:8.1f} ({flops / best['us'] / 1e6:5.0f} TFLOP/s) {cfg}"
    line += f"  [{len(timed)} timed of {len(lt.candidates)}]"
    print(line, flush=True)
    weights.clear()
    return {"shape": name, "m": m, "torch_us": torch_us, "algos": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[64, 96, 128, 160, 192, 224, 256, 8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--max-algos", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    for m in args.m:
        for name in args.shapes:
            if name == "lm_head" and m > 256:
                continue  # logits are taken for the last token of each request only
            n, k = SHAPES[name]
            results.append(probe(name, n, k, m, args.max_algos, ws))
    print("\nms per decode step (4 GEMMs x 32 layers + LM head): torch | best cuBLASLt")
    for m in args.m:
        rows = [r for r in results if r["m"] == m]
        if len(rows) != len(SHAPES) or m > 256:
            continue
        torch_ms = best_ms = 0.0
        for r in rows:
            times = [a["us"] for a in r["algos"] if "us" in a] or [r["torch_us"]]
            count = 1 if r["shape"] == "lm_head" else 32
            torch_ms += count * r["torch_us"] / 1e3
            best_ms += count * min(min(times), r["torch_us"]) / 1e3
        print(f"  M={m:4d}  {torch_ms:6.2f} | {best_ms:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
