"""The W4A16 wgmma kernel (`pagoda/kernels/w4a16_wgmma.py`) with thread-block clusters along the
weight rows sharing each x tile by one multicast copy (`WgmmaConfig.cluster`): per Llama-3-8B
layer and row count the us a call (32 distinct layers in one graph, as a decode step runs
them) of the rule's config, its cluster variants and a few cluster tiles, and bf16 cuBLAS;
then whole steps with the rule against the best config per layer, in this one process."""

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from sweep_common import graph_seconds  # noqa: E402
from w4a16_bench import GROUP, LAYERS, SHAPES  # noqa: E402
from w4a16_skinny_bench import _step_layers  # noqa: E402

from pagoda.kernels.skinny_gemm import prepare  # noqa: E402
from pagoda.kernels.w4a16 import choose_config, w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_wgmma import WgmmaConfig, config_reason  # noqa: E402

M_VALUES = [int(v) for v in os.environ.get("PROBE_M", "64,128,192,256").split(",")]
prepare("cuda")
num_sms = torch.cuda.get_device_properties(0).multi_processor_count
gen, packed, dense = _step_layers()


def candidates(m, n, k):
    rule = choose_config(m, n, k, GROUP, num_sms)
    out = [rule]
    if isinstance(rule, WgmmaConfig):
        out += [rule._replace(cluster=2), rule._replace(cluster=4)]
    bn = min(256, 32 * -(-m // 32))
    for c in (WgmmaConfig(bn=bn, warpgroups=1, depth=4, a_buffers=1, cluster=4),
              WgmmaConfig(bn=bn, warpgroups=2, a_buffers=1, cluster=4),
              WgmmaConfig(bn=64, warpgroups=1, depth=4, cluster=4)):  # fmt: skip
        if c not in out and config_reason(c) is None:
            out.append(c)
    return out


def name(c):
    if not isinstance(c, WgmmaConfig):
        return type(c).__name__
    d = WgmmaConfig()
    return "wg(" + ",".join(f"{f}={v}" for f, v in c._asdict().items() if v != getattr(d, f)) + ")"


best = {}
for m in M_VALUES:
    xs = {k: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
          for _, k in SHAPES.values()}  # fmt: skip
    for s, (n, k) in SHAPES.items():
        t = {}
        for cfg in candidates(m, n, k):

            def run(cfg=cfg, s=s, k=k, xs=xs):
                for layer in packed:
                    w4a16_linear(xs[k], *layer[s], GROUP, config=cfg)

            try:
                t[cfg] = graph_seconds(run, 10) / LAYERS * 1e6
            except Exception as e:  # noqa: BLE001
                print(f"  {s} {m} {name(cfg)}: {type(e).__name__} {str(e)[:150]}", flush=True)

        def bf16(s=s, k=k, xs=xs):
            for layer in dense:
                F.linear(xs[k], layer[s])

        cublas = graph_seconds(bf16, 10) / LAYERS * 1e6
        rule = candidates(m, n, k)[0]
        b = min(t, key=t.get)
        best[(s, m)] = b
        line = " ".join(f"{name(c)}={v:.1f}" for c, v in t.items())
        print(f"{s:>7} {m:>4}: bf16 {cublas:.1f} us | rule {name(rule)} {t.get(rule, -1):.1f} | "
              f"best {name(b)} {t[b]:.1f} | {line}", flush=True)  # fmt: skip

print("whole steps, ms:    M   bf16   rule   best", flush=True)
for m in M_VALUES:
    xs = {k: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
          for _, k in SHAPES.values()}  # fmt: skip

    def step(tuned, xs=xs, m=m):
        for layer in packed:
            for s, (_, k) in SHAPES.items():
                w4a16_linear(xs[k], *layer[s], GROUP, config=best[(s, m)] if tuned else None)

    def bf16_step(xs=xs):
        for layer in dense:
            for s, (_, k) in SHAPES.items():
                F.linear(xs[k], layer[s])

    r = [graph_seconds(lambda: step(False), 10), graph_seconds(lambda: step(True), 10),
         graph_seconds(bf16_step, 10)]  # fmt: skip
    print(f"  {m:>18} {r[2] * 1e3:6.2f} {r[0] * 1e3:6.2f} {r[1] * 1e3:6.2f}", flush=True)
