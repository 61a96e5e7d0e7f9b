"""The int8 rule with one CTA an SM where no tile gives two (`_ONE_WAVE_PROGRAMS`) against the
rule before it, per layer (us, cold weights as w8a8_bench's sweep times them), at 192-512
rows on the Llama-3-8B layers it changes."""

import math
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import L2_BYTES, gemm, step_fn, time_step  # noqa: E402

from pagoda.kernels.scaled_mm import quantize_weight  # noqa: E402
from pagoda.kernels.scaled_mm_triton import W8A8Config, choose_w8a8_config  # noqa: E402


def old_rule(m: int, n: int) -> W8A8Config:
    for bm, bn, stages in ((128, 128, 3), (64, 128, 4)):
        if -(-m // bm) * -(-n // bn) >= 190:
            return W8A8Config(bm, bn, 128, 8, stages, 4)
    return W8A8Config(64, 64, 128, 8, 5, 4)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
g = torch.Generator(device="cuda").manual_seed(0)
total = {}
for name, (n, k) in SHAPES.items():
    copies = max(2, min(32, math.ceil(3 * L2_BYTES / (n * k))))
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_weight(w, torch.int8)
    layers = [[(wq.clone(), ws.reshape(-1).clone())] for _ in range(copies)]
    for m in (192, 256, 384, 512):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        new, old = choose_w8a8_config(m, n, k), old_rule(m, n)
        if new == old:
            print(f"{name:>5} {m:>4}: unchanged {new.name}", flush=True)
            continue
        t = {}
        for label, cfg in (("old", old), ("new", new), ("old", old), ("new", new)):
            us = time_step(step_fn(gemm("int8", cfg), layers, [x]), "cuda", 10) / copies * 1e3
            t[label] = min(t.get(label, us), us)
        print(f"{name:>5} {m:>4}: {old.name} {t['old']:.1f} us -> {new.name} {t['new']:.1f} us "
              f"({t['new'] / t['old'] - 1:+.1%})", flush=True)  # fmt: skip
