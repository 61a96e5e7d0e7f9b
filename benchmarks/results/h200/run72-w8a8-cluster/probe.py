"""The CUDA 8-bit GEMM (`pagoda/kernels/w8a8_wgmma.py`) with thread-block clusters sharing
tiles by multicast copies (`WgmmaW8A8Config.cm` / `.cn`): per Llama-3-8B layer the us of the
rule's config, of its cluster variants and of a few cluster tiles (cold weights, as
w8a8_bench's sweep times them), int8 and fp8 (fp8 also cuBLASLt's `SCALED_MM`); then whole
steps (4 GEMMs x 32 layers, `w8a8_bench`'s _fq columns) with the rule against the best config
per layer of this sweep, bf16 beside them, all in this one process."""

import math
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import (  # noqa: E402
    L2_BYTES,
    LAYERS,
    SHAPES,
    _inputs,
    gemm,
    make_layers,
    step_fn,
    time_step,
)

from pagoda.kernels import w8a8_wgmma  # noqa: E402
from pagoda.kernels.scaled_mm import FP8_DTYPE, quantize_weight  # noqa: E402
from pagoda.kernels.scaled_mm_triton import SCALED_MM  # noqa: E402
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config as W  # noqa: E402

M_VALUES = [int(v) for v in os.environ.get("PROBE_M", "128,192,256,384,512,1024").split(",")]
FP8_M = [int(v) for v in os.environ.get("PROBE_FP8_M", "256,512").split(",")]
EXTRA = [W(64, 64, 6, 2, cm=4), W(64, 128, 4, 2, cm=2), W(128, 128, 4, cm=2, cn=2),
         W(128, 256, 4, cm=2)]  # fmt: skip
g = torch.Generator(device="cuda").manual_seed(0)
rule = w8a8_wgmma.choose_config


def candidates(m, n, k, fp8):
    base = rule(m, n, k)
    out = [base, base._replace(cm=2), base._replace(cn=2), base._replace(cm=2, cn=2)]
    out += [c for c in EXTRA if c not in out]
    out = [c for c in out if w8a8_wgmma.config_reason(c) is None]
    return ([SCALED_MM] if fp8 else []) + out


def name(c):
    return c if isinstance(c, str) else c.name


best = {}
for fp8 in (False, True):
    qd = FP8_DTYPE if fp8 else torch.int8
    sums = {}
    for layer, (n, k) in SHAPES.items():
        copies = max(2, min(32, math.ceil(3 * L2_BYTES / (n * k))))
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight(w, qd)
        layers = [[(wq.clone(), ws.reshape(-1).clone())] for _ in range(copies)]
        for m in FP8_M if fp8 else M_VALUES:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            t = {}
            for cfg in candidates(m, n, k, fp8):
                try:
                    ms = time_step(step_fn(gemm("fp8" if fp8 else "int8", cfg), layers, [x]),
                                   "cuda", 10)  # fmt: skip
                    t[cfg] = ms / copies * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"  {layer} {m} {name(cfg)}: {type(e).__name__} {str(e)[:120]}")
            r = rule(m, n, k)
            b = min(t, key=t.get)
            best[(fp8, n, k, m)] = b
            sums.setdefault(m, [0.0, 0.0])
            sums[m][0] += t.get(r, float("nan")) * LAYERS / 1e3
            sums[m][1] += t[b] * LAYERS / 1e3
            line = " ".join(f"{name(c)}={v:.1f}" for c, v in t.items())
            print(f"{'fp8' if fp8 else 'int8'} {layer:>7} {m:>5}: rule {name(r)} "
                  f"{t.get(r, float('nan')):.1f} us | best {name(b)} {t[b]:.1f} | {line}",
                  flush=True)  # fmt: skip
        del layers, wq, w
    for m, (r, b) in sums.items():
        print(f"{'fp8' if fp8 else 'int8'} sum M={m}: rule (with row quant) {r:.2f} ms, "
              f"best per layer {b:.2f} ms", flush=True)  # fmt: skip
torch.cuda.empty_cache()

# Whole steps: the rule, then the best config per layer of the sweep (fp8's best may be
# cuBLASLt), in the same process.
modes = ("bf16", "int8_fq", "fp8_fq")
weights = make_layers(SHAPES, LAYERS, "cuda", modes, torch.bfloat16)
import pagoda.kernels.scaled_mm_triton as smt  # noqa: E402

real_choose = smt.choose_w8a8_config


def tuned(m, n, k, dtype=torch.int8, wgmma=False, num_sms=132):
    got = best.get((dtype != torch.int8, n, k, m))
    return got if got is not None and wgmma else real_choose(m, n, k, dtype, wgmma, num_sms)


print("whole steps, ms:   M   bf16  int8_fq rule / best  fp8_fq rule / best", flush=True)
for m in M_VALUES:
    xs = [torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
          for _, k in SHAPES.values()]  # fmt: skip
    row = {}
    for mode in modes:
        ins = _inputs(mode, SHAPES, xs)
        for variant in ("rule", "best") if mode != "bf16" else ("rule",):
            smt.choose_w8a8_config = tuned if variant == "best" else real_choose
            row[(mode, variant)] = time_step(step_fn(gemm(mode), weights[mode], ins), "cuda", 20)
    smt.choose_w8a8_config = real_choose
    bf = row[("bf16", "rule")]
    print(f"  {m:>5}  {bf:6.2f}  " + "  ".join(
        f"{mode} {row[(mode, 'rule')]:.2f} ({bf / row[(mode, 'rule')]:.2f}x) / "
        f"{row[(mode, 'best')]:.2f} ({bf / row[(mode, 'best')]:.2f}x)"
        for mode in modes[1:]), flush=True)  # fmt: skip
