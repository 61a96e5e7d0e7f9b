"""The paged-attention C kernel alone, called straight through ctypes (no plan, no backend):

    python benchmarks/cpu_attention_kernel.py [--seq-lens 128 400 700] [--requests 1]
        [--query-len 1] [--heads 9 3] [--head-size 64] [--dtype float32]
        [--kv-cache-dtype float16] [--threads 1] [--isa avx2]

Each of --requests requests has a cache of --seq-lens[i] keys in one contiguous run of blocks
and --query-len query rows (1: a decode; more: a prompt chunk over a cached prefix), one work
item per request. The cache is small enough to stay in the CPU caches, so this times the
kernel's arithmetic rather than memory; `cpu_attention_bench.py` times a real step's layer.
Prints the median microseconds per call. For an A/B of kernel sources, run each checkout with
its own PYTHONPATH and PAGODA_CACHE_DIR, alternately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagoda

from pagoda.attention.cpu.library import CACHE_DTYPE_CODES, DTYPE_CODES  # noqa: E402
from pagoda.model.loader import torch_dtype  # noqa: E402


def time_call(args: argparse.Namespace, seq_len: int) -> float:
    """Median microseconds of one kernel call over all requests at `seq_len` keys each."""
    from pagoda.attention.cpu.library import load_library

    fn = load_library().pagoda_paged_attention
    num_heads, num_kv_heads = args.heads
    d, bs, n, rows = args.head_size, args.block_size, args.requests, args.query_len
    dtype = torch_dtype(args.dtype)
    blocks = -(-seq_len // bs)
    g = torch.Generator().manual_seed(0)
    cache_dtype = torch_dtype(args.kv_cache_dtype or args.dtype)
    kv = torch.randn(2, n * blocks, bs, num_kv_heads, d, generator=g).to(cache_dtype)
    q = torch.randn(n * rows, num_heads, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    tables = torch.arange(n * blocks, dtype=torch.int32).reshape(n, blocks)
    seq_lens = torch.full((n,), seq_len, dtype=torch.int32)
    starts = torch.arange(0, n * rows + 1, rows, dtype=torch.int32)
    items = torch.tensor(
        [[b, 0, num_kv_heads, b * rows, (b + 1) * rows] for b in range(n)], dtype=torch.int32
    )
    call = (
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), kv[0].data_ptr(),
        kv[1].data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
        starts.data_ptr(), items.data_ptr(), n, num_heads, num_kv_heads, d, bs,
        DTYPE_CODES[dtype], CACHE_DTYPE_CODES[cache_dtype], d**-0.5, 1.0, 1.0, 0, 0.0,
        args.threads,
    )  # fmt: skip
    for _ in range(max(1, args.iters // 20)):
        fn(*call)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(*call)
        runs.append((time.perf_counter() - start) / args.iters * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 400, 700])
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--query-len", type=int, default=1, help="query rows per request")
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", help="the cache's dtype (default: --dtype)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isa", help="force the kernel's ISA level ($PAGODA_CPU_ISA)")
    args = p.parse_args(argv)
    from pagoda.utils.cpu_build import ISA_ENV, selected_isa

    if args.isa:
        os.environ[ISA_ENV] = args.isa
    times = {s: time_call(args, s) for s in args.seq_lens}
    print(
        f"{args.requests} request(s) x {args.query_len} row(s), heads {args.heads}, head "
        f"{args.head_size}, {args.dtype}, cache {args.kv_cache_dtype or args.dtype}, "
        f"{args.threads} thread(s), {selected_isa()}: "
        + ", ".join(f"{s} keys {us:.1f} us" for s, us in times.items())
    )


if __name__ == "__main__":
    main()
