"""Attention-only benchmark: the C kernel vs the torch backend on one layer's decode batch.

    python benchmarks/cpu_attention_bench.py [--batch 64] [--context 300] [--heads 9 3]
        [--head-size 64] [--block-size 16] [--dtype bfloat16] [--kv-cache-dtype float16]
        [--layers 30] [--prefill 0] [--isa avx2]

Times `forward` on a batch of `--batch` decodes whose caches hold `--context` tokens (plus,
with `--prefill N`, one N-token chunk over a `--context`-token cached prefix), with blocks
scattered over a cache of `--layers` layers' size so nothing stays in the CPU caches between
calls, as in a real step. Prints ms per layer and per step (x layers), and the K/V bytes read
per second against the roofline that implies.
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

from pagoda.attention.metadata import AttentionMetadata  # noqa: E402
from pagoda.model.loader import torch_dtype  # noqa: E402


class _Layer:
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        self.layer_idx, self.num_heads, self.num_kv_heads = 0, num_heads, num_kv_heads
        self.head_size, self.k_scale, self.v_scale = head_size, 1.0, 1.0


def _metadata(specs: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    nbs = [-(-(c + n) // block_size) for c, n in specs]
    tables, slots = [], []
    for (c, n), nb in zip(specs, nbs):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table + [0] * (max(nbs) - nb))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    return AttentionMetadata.from_lists(specs, slots, tables)


def bench(backend_name: str, args: argparse.Namespace) -> float:
    """Median ms of one layer's forward."""
    from pagoda.attention.backend import get_attn_backend

    backend = get_attn_backend("cpu", backend_name)
    dtype = torch_dtype(args.dtype)
    num_heads, num_kv_heads = args.heads
    specs = [(args.context, 1)] * args.batch + ([(args.context, args.prefill)] * bool(args.prefill))
    per_layer = sum(-(-(c + n) // args.block_size) for c, n in specs)
    num_blocks = per_layer * args.layers + 1
    cache_shape = (2, num_blocks, args.block_size, num_kv_heads, args.head_size)
    cache = torch.randn(cache_shape, dtype=torch_dtype(args.kv_cache_dtype or args.dtype))
    tokens = sum(n for _, n in specs)
    q = torch.randn(tokens, num_heads, args.head_size, dtype=dtype)
    k = torch.randn(tokens, num_kv_heads, args.head_size, dtype=dtype)
    v = torch.randn_like(k)
    layer = _Layer(num_heads, num_kv_heads, args.head_size)
    # One metadata per "layer", each over its own scattered blocks of the one big cache.
    mds = [_metadata(specs, args.block_size, num_blocks, seed) for seed in range(args.layers)]
    times = []
    for it in range(args.iters + 1):
        start = time.perf_counter()
        for md in mds:
            backend.forward(layer, q, k, v, cache, md, args.head_size**-0.5)
        if it:  # the first pass builds every plan (once per step in real use)
            times.append((time.perf_counter() - start) / args.layers)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--prefill", type=int, default=0, help="add one chunk of N rows")
    p.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", help="the cache's dtype (default: --dtype)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"])
    p.add_argument("--isa", help="force the kernel's ISA level ($PAGODA_CPU_ISA)")
    args = p.parse_args(argv)
    from pagoda.attention.cpu.library import load_library
    from pagoda.utils.cpu_build import ISA_ENV, selected_isa

    if args.isa:
        os.environ[ISA_ENV] = args.isa

    elem = torch_dtype(args.kv_cache_dtype or args.dtype).itemsize
    bf16dp = bool(load_library().pagoda_paged_attention_bf16dp())
    kv_bytes = 2 * (args.context + 1) * args.heads[1] * args.head_size * elem
    kv_bytes *= args.batch + bool(args.prefill)
    print(
        f"batch {args.batch} x ctx {args.context}, prefill {args.prefill}, heads {args.heads}, "
        f"head {args.head_size}, block {args.block_size}, {args.dtype}, "
        f"cache {args.kv_cache_dtype or args.dtype}, "
        f"{torch.get_num_threads()} threads; K/V {kv_bytes / 1e6:.2f} MB per layer; "
        f"kernel: {selected_isa()}, bf16 path: {'AVX512_BF16' if bf16dp else 'fp32 FMA'}"
    )
    for name in args.backends:
        ms = bench(name, args)
        print(
            f"  {name:6s}: {ms:7.3f} ms/layer, {ms * args.layers:8.2f} ms/step "
            f"({args.layers} layers), {kv_bytes / ms / 1e6:6.1f} GB/s of K/V"
        )


if __name__ == "__main__":
    main()
