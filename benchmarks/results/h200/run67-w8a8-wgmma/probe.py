"""The CUDA int8 wgmma GEMM (`pagoda/kernels/w8a8_wgmma.py`): its error against
`plain_quantized_mm` on awkward shapes, then per Llama-3-8B layer the us of each config
against the Triton rule's (cold weights, as w8a8_bench's sweep times them) at 128-1024 rows,
and the step sums (4 layers x 32) of the rule and of the best wgmma config per layer."""

import math
import os
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import L2_BYTES, SHAPES, gemm, step_fn, time_step  # noqa: E402

from pagoda.kernels.scaled_mm import plain_quantized_mm, quantize_weight  # noqa: E402
from pagoda.kernels.scaled_mm_triton import choose_w8a8_config, w8a8_gemm  # noqa: E402
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config as W  # noqa: E402

ONLY = sys.argv[1] if len(sys.argv) > 1 else "all"  # check, time, fp8 (check + time)
FP8 = ONLY == "fp8"
QD = torch.float8_e4m3fn if FP8 else torch.int8
g = torch.Generator(device="cuda").manual_seed(0)
CONFIGS = [W(128, 128, 3, 2), W(128, 64, 4, 2), W(64, 128, 4, 2), W(64, 64, 6, 2),
           W(128, 128, 4), W(128, 128, 6), W(128, 256, 3), W(128, 256, 4)]  # fmt: skip

if ONLY in ("all", "check", "fp8"):
    t0 = time.time()
    for m, n, k, bias, dt in ((1, 64, 128, False, torch.bfloat16), (100, 200, 300 - 12, True,
            torch.bfloat16), (256, 4096, 4096, False, torch.bfloat16), (129, 6144, 4096, True,
            torch.float16), (512, 1000, 14336, False, torch.bfloat16)):  # fmt: skip
        xq = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8, generator=g)
        wq = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=g)
        if FP8:  # values of e4m3's whole range, signs mixed
            xq, wq = (torch.randn(t.shape, device="cuda", generator=g) * 64 for t in (xq, wq))
            xq, wq = xq.to(QD), wq.to(QD)
        xs = torch.rand(m, 1, device="cuda", generator=g) * 1e-3
        ws = torch.rand(n, device="cuda", generator=g) * 1e-3
        b = torch.randn(n, device="cuda", generator=g).to(dt) if bias else None
        ref = plain_quantized_mm(xq, xs, wq, ws, b, dt).float()
        for cfg in CONFIGS:
            y = w8a8_gemm(xq, xs, wq, ws, b, dt, cfg).float()
            torch.cuda.synchronize()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            print(f"check m={m} n={n} k={k} bias={bias} {dt} {cfg.name}: rel err {err:.2e}",
                  flush=True)  # fmt: skip
    print(f"checks took {time.time() - t0:.0f} s", flush=True)

if ONLY in ("all", "time", "fp8"):
    sums = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(32, math.ceil(3 * L2_BYTES / (n * k))))
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight(w, QD)
        layers = [[(wq.clone(), ws.reshape(-1).clone())] for _ in range(copies)]
        for m in [int(v) for v in os.environ.get("PROBE_M", "128,256,384,512,1024").split(",")]:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            t = {}
            for cfg in [choose_w8a8_config(m, n, k, QD)] + CONFIGS:
                name_ = cfg if isinstance(cfg, str) else cfg.name
                try:
                    ms = time_step(step_fn(gemm("fp8" if FP8 else "int8", cfg), layers, [x]),
                                   "cuda", 10)  # fmt: skip
                    t[name_] = ms / copies * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {m} {name_}: {type(e).__name__} {str(e)[:100]}")
            rule = choose_w8a8_config(m, n, k, QD)
            rule = rule if isinstance(rule, str) else rule.name
            best = min((c for c in t if c.startswith("wgmma")), key=t.get)
            sums.setdefault(m, [0.0, 0.0])
            sums[m][0] += t[rule] * 32 / 1e3
            sums[m][1] += t[best] * 32 / 1e3
            line = " ".join(f"{c}={v:.1f}" for c, v in t.items() if c.startswith("wgmma"))
            print(f"{name:>7} {m:>5}: rule {rule} {t[rule]:.1f} us | best {best} {t[best]:.1f}"
                  f" | {line}", flush=True)  # fmt: skip
    for m, (r, b) in sums.items():
        print(f"step M={m}: rule (incl. row quant) {r:.2f} ms, best wgmma per layer {b:.2f} ms")
