"""One W4A16 GEMM of a Llama-3-8B layer by the rule (or an explicit wgmma config), for a
profiler: `python one_gemm.py qkv 64 [reps] [WgmmaConfig(...)]` (after a warm-up, `reps`
calls)."""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../../../.."
sys.path[:0] = [ROOT, ROOT + "/benchmarks"]

import torch  # noqa: E402
from w4a16_bench import GROUP, SHAPES, packed_layer  # noqa: E402

from pagoda.kernels.skinny_gemm import prepare  # noqa: E402
from pagoda.kernels.w4a16 import w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_wgmma import WgmmaConfig  # noqa: E402

name, m = sys.argv[1], int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
cfg = eval(sys.argv[4], {"WgmmaConfig": WgmmaConfig}) if len(sys.argv) > 4 else None
prepare("cuda")
n, k = SHAPES[name]
gen = torch.Generator(device="cuda").manual_seed(0)
layer = packed_layer(n, k, GROUP, "cuda", gen)
x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    w4a16_linear(x, *layer, GROUP, config=cfg)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for _ in range(reps):
    w4a16_linear(x, *layer, GROUP, config=cfg)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
