"""The CUDA W8A8 kernel's K split among a cluster (`WgmmaW8A8Config.ck`): per Llama-3-8B
layer and row count, the us of the rule (with its split), of the rule's tiles without it, of
split candidates and, for fp8, of cuBLASLt's fp8 GEMM (`torch._scaled_mm`, the rule past 128
rows); inputs quantized already (the product alone), cold weights (copies cycled past L2), in
CUDA graphs. Then the step sums (x 32 layers) of the rule, of the rule without splits and of
the best per layer.

    PROBE_M=128,192,256,512 python probe.py int8|fp8
"""

import math
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import L2_BYTES, SHAPES, time_step  # noqa: E402

from pagoda.kernels import w8a8_wgmma  # noqa: E402
from pagoda.kernels.scaled_mm import quantize_rows_ref, quantize_weight  # noqa: E402
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config as W  # noqa: E402

FP8 = len(sys.argv) > 1 and sys.argv[1] == "fp8"
QD = torch.float8_e4m3fn if FP8 else torch.int8
SPLITS = [W(128, 128, 6, ck=2), W(128, 128, 4, ck=2), W(128, 128, 6, ck=4),
          W(64, 64, 6, 2, ck=2), W(64, 64, 6, 2, ck=4), W(128, 256, 4, ck=2),
          W(128, 64, 4, 2, ck=2), W(64, 128, 4, 2, ck=2)]  # fmt: skip
g = torch.Generator(device="cuda").manual_seed(0)


def product(cfg):
    if cfg == "cublaslt":

        def call(xq, xs, w, ws):
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.reshape(1, -1),
                                    out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip
    else:

        def call(xq, xs, w, ws):
            return w8a8_wgmma.w8a8_wgmma(xq, xs, w, ws, None, torch.bfloat16, cfg)

    return call


sums: dict[int, list[float]] = {}
for name, (n, k) in SHAPES.items():
    copies = max(2, min(32, math.ceil(3 * L2_BYTES / (n * k))))
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight(w, QD)
    ws = ws.reshape(-1).float().contiguous()
    layers = [(wq.clone(), ws.clone()) for _ in range(copies)]
    for m in [int(v) for v in os.environ.get("PROBE_M", "128,192,256,512").split(",")]:
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        xq, xs = quantize_rows_ref(x, QD)
        xs = xs.float().contiguous()
        rule = w8a8_wgmma.choose_config(m, n, k)
        plain = w8a8_wgmma._tiles(m, n, k)
        cands = [rule, plain] + [c for c in SPLITS if c not in (rule, plain)]
        if FP8:
            cands.append("cublaslt")
        t = {}
        for cfg in cands:
            label = cfg if isinstance(cfg, str) else cfg.name
            call = product(cfg)

            def run(call=call, layers=layers, xq=xq, xs=xs):
                for wl, wsl in layers:
                    call(xq, xs, wl, wsl)

            try:
                t[label] = time_step(run, "cuda", 10) / copies * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {m} {label}: {type(e).__name__} {str(e)[:120]}", flush=True)
        r, p = rule.name, plain.name
        best = min(t, key=t.get)
        acc = sums.setdefault(m, [0.0, 0.0, 0.0])
        for i, label in enumerate((r, p, best)):
            acc[i] += t.get(label, math.nan) * 32 / 1e3
        line = " ".join(f"{c}={v:.1f}" for c, v in t.items())
        print(
            f"{name:>7} {m:>5}: rule {r} {t.get(r, math.nan):.1f} us | no split {p} "
            f"{t.get(p, math.nan):.1f} | best {best} {t[best]:.1f} | {line}",
            flush=True,
        )
for m, (r, p, b) in sums.items():
    print(
        f"step M={m} ({'fp8' if FP8 else 'int8'}, products only): rule {r:.2f} ms, "
        f"without splits {p:.2f}, best per layer {b:.2f}"
    )
