"""Launch the CUDA W4A16 decode kernel on one Llama-3-8B layer shape a few times, eagerly, for
Nsight Compute to read its counters (stall reasons, DRAM throughput, issue rate):

    ncu --clock-control none --kernel-name pagoda_w4a16_gemv --launch-skip 4 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python benchmarks/w4a16_gemv_profile.py --shape gate_up --m 1

`--config` takes a GemvConfig as comma-separated integers (default: `gemv_config`'s choice);
`--wgmma` a WgmmaConfig instead, for the wgmma kernel (`--kernel-name pagoda_w4a16_wgmma`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4a16_bench import GROUP, SHAPES, packed_layer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gate_up")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--config", help="GemvConfig fields, e.g. 1,4,2,0,1,1,0,4,8,1")
    ap.add_argument("--wgmma", help="WgmmaConfig fields, e.g. 128,2,4,2,0")
    ap.add_argument("--launches", type=int, default=8)
    args = ap.parse_args()

    import torch

    from pagoda.kernels.w4a16 import gemv_config, w4a16_linear
    from pagoda.kernels.w4a16_gemv import GemvConfig
    from pagoda.kernels.w4a16_wgmma import WgmmaConfig

    n, k = SHAPES[args.shape]
    if args.wgmma:
        cfg = WgmmaConfig(*map(int, args.wgmma.split(",")))
    elif args.config:
        cfg = GemvConfig(*map(int, args.config.split(",")))
    else:
        cfg = gemv_config(args.m, n, k, GROUP)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [packed_layer(n, k, GROUP, "cuda", gen) for _ in range(4)]  # > L2 together
    x = torch.randn(args.m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    for i in range(args.launches):
        w4a16_linear(x, *layers[i % len(layers)], GROUP, config=cfg)
    torch.cuda.synchronize()
    print(f"{args.shape} M={args.m} {cfg}")


if __name__ == "__main__":
    main()
