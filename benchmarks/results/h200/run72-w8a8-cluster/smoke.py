"""One small product each through the cluster variants of the 8-bit and W4A16 kernels, checked
against their references, before anything larger runs them (a cluster that deadlocks hangs
here, under a short timeout)."""

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels")]
from test_w4a16 import packed_weights  # noqa: E402

from pagoda.kernels import w8a8_wgmma  # noqa: E402
from pagoda.kernels.scaled_mm import plain_quantized_mm  # noqa: E402
from pagoda.kernels.w4a16 import w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_wgmma import WgmmaConfig  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randint(-127, 128, (200, 512), generator=g, device="cuda", dtype=torch.int8)
b = torch.randint(-127, 128, (320, 512), generator=g, device="cuda", dtype=torch.int8)
xs, ws = torch.rand(200, 1, device="cuda") / 1e3, torch.rand(320, device="cuda") / 1e3
ref = plain_quantized_mm(a, xs, b, ws, None, torch.float32)
for cfg in (w8a8_wgmma.WgmmaW8A8Config(128, 128, 4, cm=2),
            w8a8_wgmma.WgmmaW8A8Config(64, 64, 6, 2, cm=2, cn=2)):  # fmt: skip
    y = w8a8_wgmma.w8a8_wgmma(a, xs, b, ws, None, torch.bfloat16, cfg)
    torch.cuda.synchronize()
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    print(f"smoke w8a8 {cfg.name}: rel err {err:.1e}", flush=True)
    assert err < 1e-2
w4, dense = packed_weights("awq", n=320, k=1024, group=128, seed=0, device="cuda")
x = torch.randn(100, 1024, device="cuda").to(torch.bfloat16)
ref = F.linear(x.float(), dense)
for cfg in (WgmmaConfig(bn=64, warpgroups=1, depth=4, cluster=4), WgmmaConfig(bn=128, cluster=2)):
    y = w4a16_linear(x, w4.qweight, w4.scales, w4.zeros, w4.group_size, None, w4.perm, config=cfg)
    torch.cuda.synchronize()
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    print(f"smoke w4a16 {cfg}: rel err {err:.1e}", flush=True)
    assert err < 1e-2
print("smoke ok", flush=True)
