"""Decode attention: the CUDA kernel (`pagoda/attention/cuda/`) against the Triton kernel, over
a bf16 and an FP8 (e4m3) cache, on workload a's decode shapes (Llama-3-8B: 32 query heads, 8 KV
heads, head 128, block 16).

    python benchmarks/cuda_decode_bench.py                 # table, KV GB/s read per kernel
    python benchmarks/cuda_decode_bench.py --variants      # also warps 2/4/8 x stages 2/3/4

Each row: batch, contexts (`r` = ragged, uniform in [200, 2000], seed 0), microseconds per
launch and the KV bytes read over that time. Each launch is captured in a CUDA graph and the
replays are timed (median, `triton.testing.do_bench`), as the engine runs decode steps, so host
launch costs do not count. The CUDA and Triton outputs are compared on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from gpu_kernels import _bench, _sweep_contexts, copy_roofline, paged_step  # noqa: E402

from pagoda.attention.cuda import paged_decode  # noqa: E402
from pagoda.attention.triton.unified_attention import (  # noqa: E402
    unified_attention,
    use_split_kv,
)


def graph_us(fn, *args, **kwargs) -> float:
    """Median microseconds of one replay of a CUDA graph holding fn(*args, **kwargs)."""
    fn(*args, **kwargs)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args, **kwargs)
    return 1e3 * _bench(graph.replay)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32,64,96,128,192,256")
    p.add_argument("--contexts", default="r,1024")
    p.add_argument("--variants", action="store_true", help="warps 2/4/8 x stages 2/3/4")
    p.add_argument("--layout", default="nhd", help="cache layout: nhd, or hnd (per block and head)")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    copy_gbps = copy_roofline()
    heads, kv_heads, d, bs = 32, 8, 128, 16
    scale = d**-0.5
    ks = torch.ones(1, device="cuda")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for ctx in args.contexts.split(","):
            contexts = _sweep_contexts(batch, ctx)
            row = {"batch": batch, "ctx": ctx, "layout": args.layout}
            for kv in ("bf16", "e4m3"):
                cache_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
                q, cache, md = paged_step(
                    [1] * batch, contexts, heads, kv_heads, d, bs, torch.bfloat16, cache_dtype,
                    args.layout,
                )  # fmt: skip
                out = torch.empty_like(q)
                kv_bytes = sum(c + 1 for c in contexts) * kv_heads * d * 2 * cache.element_size()
                for impl, cuda in (("triton", False), ("cuda", True)):
                    us = graph_us(
                        unified_attention, q, cache, out, md, scale, ks, ks, cuda_decode_kernel=cuda
                    )
                    row[f"{kv}_{impl}"] = round(us, 1)
                    row[f"{kv}_{impl}_GBps"] = round(kv_bytes / us / 1e3)
                ref = torch.empty_like(q)
                unified_attention(q, cache, ref, md, scale, ks, ks, cuda_decode_kernel=False)
                unified_attention(q, cache, out, md, scale, ks, ks, cuda_decode_kernel=True)
                row[f"{kv}_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                if args.variants and not use_split_kv(batch, kv_heads, 1):
                    kind = paged_decode.cache_kind(cache_dtype)
                    for warps in (2, 4, 8):
                        for stages in (2, 3, 4):
                            if paged_decode.smem_bytes(warps, stages, kind) > 200 * 1024:
                                continue
                            kern = paged_decode.get_kernel(4, bs, kind, True, warps, stages)
                            us = graph_us(
                                paged_decode.paged_decode, kern, q, cache, out, md,
                                scale * 1.4426950408889634, ks, ks, 1, None,
                            )  # fmt: skip
                            row[f"{kv}_cuda_w{warps}_s{stages}"] = round(us, 1)
                del q, cache, out, ref
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
