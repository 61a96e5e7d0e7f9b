"""The CUDA 8-bit kernel's K split (`WgmmaW8A8Config.split_k`, in run 69's working tree only:
dropped after it) against the same tiles unsplit,
us a layer (cold weights, row quantization included), where the rule splits: o and down at
192-256 rows, int8 and fp8."""

import math
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import L2_BYTES, gemm, step_fn, time_step  # noqa: E402

from pagoda.kernels.scaled_mm import quantize_weight  # noqa: E402
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config as W  # noqa: E402
from pagoda.kernels.w8a8_wgmma import choose_config  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)
for mode, qd in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
    for name, (n, k) in {"o": (4096, 4096), "down": (4096, 14336)}.items():
        copies = max(2, min(32, math.ceil(3 * L2_BYTES / (n * k))))
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight(w, qd)
        layers = [[(wq.clone(), ws.reshape(-1).clone())] for _ in range(copies)]
        for m in (192, 256):
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            rule = choose_config(m, n, k)
            cfgs = [rule._replace(split_k=s) for s in (1, 2, 4)] + [W(64, 64, 6, 2)]
            t = {}
            for cfg in cfgs + cfgs:
                us = time_step(step_fn(gemm(mode, cfg), layers, [x]), "cuda", 10) / copies * 1e3
                t[cfg.name] = min(t.get(cfg.name, us), us)
            line = " ".join(f"{c}={v:.1f}" for c, v in t.items())
            print(f"{mode} {name:>5} {m:>4}: rule {rule.name} | {line}", flush=True)
