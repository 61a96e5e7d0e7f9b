"""The warp-specialized W4A16 kernel's configs given on the command line (WsConfig fields,
e.g. 128,1,1,4,8,0,2) against the rule and bf16 cuBLAS, per Llama-3-8B layer and row count,
us a call (cold weights, CUDA graphs, as `w4a16_skinny_bench.py` times them)."""

import math
import os
import sys

sys.path[:0] = ["benchmarks", "."]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pagoda.kernels.w4a16_ws import WsConfig, config_reason  # noqa: E402
from sweep_common import graph_seconds  # noqa: E402
from w4a16_bench import GROUP, L2_BYTES, SHAPES, packed_layer  # noqa: E402

from pagoda.kernels.skinny_gemm import prepare  # noqa: E402
from pagoda.kernels.w4a16 import w4a16_linear  # noqa: E402

configs = [WsConfig(*map(int, a.split(","))) for a in sys.argv[1:]]
for c in configs:
    assert config_reason(c) is None, (c, config_reason(c))
rows = [int(v) for v in os.environ.get("ROWS", "128,256").split(",")]
prepare("cuda")
gen = torch.Generator(device="cuda").manual_seed(0)
print(
    f"{'shape':8s} {'M':>4s} {'cublas':>7s} {'rule':>7s} "
    + " ".join(f"{c.name:>22s}" for c in configs)
)
for name, (n, k) in SHAPES.items():
    one = packed_layer(n, k, GROUP, "cuda", gen)
    copies = math.ceil(3 * L2_BYTES / sum(t.nbytes for t in one))
    packed = [one] + [packed_layer(n, k, GROUP, "cuda", gen) for _ in range(copies - 1)]
    dense = [
        torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(math.ceil(3 * L2_BYTES / (n * k * 2)))
    ]
    for m in rows:
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)

        def timed(call, weights):
            def run():
                for w in weights:
                    call(w)

            return graph_seconds(run, 10) / len(weights) * 1e6

        line = f"{name:8s} {m:4d} {timed(lambda w, x=x: F.linear(x, w), dense):7.1f} "
        line += f"{timed(lambda p, x=x: w4a16_linear(x, *p, GROUP), packed):7.1f} "
        for c in configs:
            line += (
                f"{timed(lambda p, c=c, x=x: w4a16_linear(x, *p, GROUP, config=c), packed):22.1f} "
            )
        print(line, flush=True)
    del packed, dense
    torch.cuda.empty_cache()
