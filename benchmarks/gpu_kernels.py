"""Micro-benchmark of Pagoda's Triton kernels on a CUDA GPU, against the memory roofline.

Decode attention is memory-bound: its figure of merit is the KV bytes it must read
(sum(seq_lens) * num_kv_heads * head_size * 2 (K and V) * bytes per element) over its time,
compared in the same run with a device-to-device copy (the achievable roofline; an H200's is
~4.3 TB/s). Prefill attention is reported in TFLOP/s (causal: 4 * heads * head_size FLOPs per
visible query-key pair). The cache write and the fused element-wise ops are reported in GB/s
of bytes moved. Shapes default to Llama-3-8B (32 query heads, 8 KV heads, head 128, block 16).

    python benchmarks/gpu_kernels.py                  # full table
    python benchmarks/gpu_kernels.py --quick          # a few rows per section
    python benchmarks/gpu_kernels.py --sweep          # decode tile/segment sweep for tuning
    python benchmarks/gpu_kernels.py --json out.json  # also write the rows as JSON
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from pagoda.attention.metadata import AttentionMetadata  # noqa: E402
from pagoda.attention.triton.reshape_and_cache import reshape_and_cache  # noqa: E402
from pagoda.attention.triton.unified_attention import (  # noqa: E402
    unified_attention,
    use_split_kv,
)
from pagoda.kernels.norm_act import rms_norm_triton, silu_and_mul_triton  # noqa: E402
from pagoda.kernels.rotary import rotary_embedding_triton  # noqa: E402

ROOFLINE_GBPS = 4300.0  # H200 HBM3e, device-to-device copy
ROWS: list[dict] = []


def _bench(fn, *args, rep: int = 200, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs) over about `rep` ms."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=rep, return_mode="median")


def _row(section: str, **fields) -> None:
    ROWS.append({"section": section, **fields})
    print(f"{section:10s} " + "  ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def copy_roofline(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _bench(dst.copy_, src)
    gbps = 2 * nbytes / ms / 1e6  # read + write
    _row("copy", MiB=nbytes >> 20, ms=f"{ms:.3f}", GBps=f"{gbps:.0f}")
    return gbps


def paged_step(
    query_lens: list[int],
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    layout: str = "nhd",
):
    """q, kv_cache and metadata of one step; each request owns random physical blocks.
    `layout` "hnd" stores each (block, KV head) as one contiguous [block_size, head_size]
    piece and hands the kernel the same [2, blocks, block_size, kv_heads, head_size] view."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    nblocks = [-(-s // block_size) for s in seq_lens]
    total = sum(nblocks)
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[start : start + n]
        start += n
    if layout == "hnd":
        cache = torch.empty(2, total, kv_heads, block_size, head_size, device="cuda", dtype=dtype)
    else:
        cache = torch.empty(2, total, block_size, kv_heads, head_size, device="cuda", dtype=dtype)
    cache.normal_()
    if cache_dtype != dtype:
        cache = (cache * 8).to(cache_dtype)
    if layout == "hnd":
        cache = cache.transpose(2, 3)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_size, device="cuda", dtype=dtype)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device="cuda"),
        query_start_loc=qsl.to("cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return q, cache, md


def bench_decode(args, copy_gbps: float) -> None:
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64, 128, 256]
    contexts = [2048] if args.quick else [1024, 2048, 4096, 8192]
    cache_dtypes = [torch.bfloat16, torch.float8_e4m3fn]
    scale = d**-0.5
    for cache_dtype in cache_dtypes:
        ks = torch.ones(1, device="cuda") if cache_dtype != torch.bfloat16 else None
        for batch in batches:
            for ctx in contexts:
                if batch * ctx > 256 * 4096:
                    continue
                q, cache, md = paged_step(
                    [1] * batch, [ctx - 1] * batch, h, kvh, d, bs, torch.bfloat16, cache_dtype
                )
                out = torch.empty_like(q)
                kv_bytes = batch * ctx * kvh * d * 2 * cache.element_size()
                times = {}
                for name, split in (("auto", None), ("split", True), ("nosplit", False)):
                    times[name] = _bench(
                        unified_attention, q, cache, out, md, scale, ks, ks, split_kv=split
                    )
                gbps = kv_bytes / times["auto"] / 1e6
                _row(
                    "decode",
                    kv=str(cache_dtype).removeprefix("torch."),
                    batch=batch,
                    ctx=ctx,
                    path="split" if use_split_kv(batch, kvh, 1) else "nosplit",
                    us=f"{times['auto'] * 1e3:.1f}",
                    us_split=f"{times['split'] * 1e3:.1f}",
                    us_nosplit=f"{times['nosplit'] * 1e3:.1f}",
                    GBps=f"{gbps:.0f}",
                    pct_4300=f"{100 * gbps / ROOFLINE_GBPS:.0f}%",
                    pct_copy=f"{100 * gbps / copy_gbps:.0f}%",
                )
                del q, cache, out


def _sweep_contexts(batch: int, ctx: str) -> list[int]:
    """`1024` -> every request 1024 tokens; `r` -> ragged, uniform in [200, 2000] (seed 0),
    as the contexts of workload a's decode steps."""
    if ctx == "r":
        gen = torch.Generator().manual_seed(0)
        return torch.randint(200, 2001, (batch,), generator=gen).tolist()
    return [int(ctx)] * batch


def bench_decode_sweep(args) -> None:
    """Decode attention over launch settings: tile, warps, pipeline stages, grid order, and
    split-KV segments for the small batches. A `sweep_best` row names the fastest per case."""
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    cases = [c.split("x") for c in args.sweep_cases.split(",")]
    names = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    cache_dtypes = [names[n] for n in args.sweep_kv.split(",")]
    orders = [o == "heads" for o in args.sweep_orders.split(",")]
    for (batch_s, ctx_s), cache_dtype, layout in itertools.product(
        cases, cache_dtypes, args.sweep_layouts.split(",")
    ):
        batch = int(batch_s)
        contexts = _sweep_contexts(batch, ctx_s)
        q, cache, md = paged_step(
            [1] * batch,
            [c - 1 for c in contexts],
            h,
            kvh,
            d,
            bs,
            torch.bfloat16,
            cache_dtype,
            layout,
        )
        ks = torch.ones(1, device="cuda") if cache_dtype != torch.bfloat16 else None
        out = torch.empty_like(q)
        kv_bytes = sum(contexts) * kvh * d * 2 * cache.element_size()
        auto_split = use_split_kv(batch, kvh, 1)
        segment_counts = (
            ((8, 16, 32) if auto_split else (1,))
            if args.sweep_segments == "auto"
            else [int(x) for x in args.sweep_segments.split(",")]
        )
        best = None
        ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
        for tile, warps, stages, heads_fastest, segs in itertools.product(
            ints(args.sweep_tiles),
            ints(args.sweep_warps),
            ints(args.sweep_stages),
            orders,
            segment_counts,
        ):
            kwargs = dict(
                tile_size=tile,
                num_warps=warps,
                num_stages=stages,
                heads_fastest=heads_fastest,
            )
            try:
                ms = _bench(
                    unified_attention,
                    q,
                    cache,
                    out,
                    md,
                    d**-0.5,
                    ks,
                    ks,
                    split_kv=segs > 1,
                    num_segments=segs,
                    rep=100,
                    **kwargs,
                )
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                _row("sweep", error=type(e).__name__, **kwargs)
                continue
            row = dict(
                kv=str(cache_dtype).removeprefix("torch."),
                layout=layout,
                batch=batch,
                ctx=ctx_s,
                segments=segs,
                **kwargs,
                us=f"{ms * 1e3:.1f}",
                GBps=f"{kv_bytes / ms / 1e6:.0f}",
            )
            _row("sweep", **row)
            if best is None or ms < best[0]:
                best = (ms, row)
        if best is not None:
            _row("sweep_best", **best[1])
        del q, cache, out


def _prefill_tflops(qlens: list[int], ctxs: list[int], heads: int, head_size: int, ms: float):
    """Causal attention FLOPs (4 * heads * head_size per visible query-key pair) per second."""
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(qlens, ctxs))
    return f"{4 * heads * head_size * pairs / ms / 1e9:.0f}"


def bench_prefill(args) -> None:
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    cases = [
        ("2k prompt", [2048], [0]),
        ("8x2k prompts", [2048] * 8, [0] * 8),
        ("2k chunk after 6k", [2048], [6144]),
        ("64 decodes + 512 chunk", [1] * 64 + [512], [2047] * 64 + [1024]),
    ]
    for name, qlens, ctxs in cases[:2] if args.quick else cases:
        q, cache, md = paged_step(qlens, ctxs, h, kvh, d, bs, torch.bfloat16, torch.bfloat16)
        out = torch.empty_like(q)
        ms = _bench(unified_attention, q, cache, out, md, d**-0.5)
        _row("prefill", case=name, ms=f"{ms:.3f}", TFLOPs=_prefill_tflops(qlens, ctxs, h, d, ms))


def _a_step(num_decodes: int, prefill_tokens: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens) of a step shaped like workload a's prefill steps: decodes
    with contexts uniform in [100, 1024], then fresh prompts of as many tokens (the last cut)."""
    gen = torch.Generator().manual_seed(0)
    qlens = [1] * num_decodes
    ctxs = torch.randint(100, 1025, (num_decodes,), generator=gen).tolist()
    left = prefill_tokens
    while left > 0:
        n = min(left, int(torch.randint(100, 1025, (1,), generator=gen)))
        qlens.append(n)
        ctxs.append(0)
        left -= n
    return qlens, ctxs


def bench_prefill_step(args) -> None:
    """Attention of a workload-a prefill step (128 decodes + 8064 prompt tokens): the whole
    batch in one launch, its decodes and its prompts each alone, and the prompts over tile
    shapes and launch settings (`--prefill-sweep`)."""
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    qlens, ctxs = _a_step(128, 8064)
    nd = 128

    for name, ql, cl in (
        ("a-step all", qlens, ctxs),
        ("a-step decodes", qlens[:nd], ctxs[:nd]),
        ("a-step prompts", qlens[nd:], ctxs[nd:]),
    ):
        q, cache, md = paged_step(ql, cl, h, kvh, d, bs, torch.bfloat16, torch.bfloat16)
        out = torch.empty_like(q)
        ms = _bench(unified_attention, q, cache, out, md, d**-0.5)
        _row("prefill", case=name, ms=f"{ms:.3f}", TFLOPs=_prefill_tflops(ql, cl, h, d, ms))
        if name == "a-step prompts" and args.prefill_sweep:
            for block_m, tile, warps, stages in itertools.product(
                (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
            ):
                kwargs = dict(block_m=block_m, tile_size=tile, num_warps=warps, num_stages=stages)
                try:
                    ms = _bench(unified_attention, q, cache, out, md, d**-0.5, rep=50, **kwargs)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    _row("prefill_sweep", error=type(e).__name__, **kwargs)
                    continue
                _row(
                    "prefill_sweep",
                    **kwargs,
                    ms=f"{ms:.3f}",
                    TFLOPs=_prefill_tflops(ql, cl, h, d, ms),
                )
        del q, cache, out


def bench_elementwise(args) -> None:
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    t, hidden, inter = args.tokens, args.hidden_size, args.intermediate_size
    bf = torch.bfloat16
    x = torch.randn(t, hidden, device="cuda", dtype=bf)
    r, w = torch.randn_like(x), torch.ones(hidden, device="cuda", dtype=bf)
    ms = _bench(rms_norm_triton, x, w, 1e-5, r)
    _row(
        "rms_norm",
        tokens=t,
        hidden=hidden,
        us=f"{ms * 1e3:.1f}",
        GBps=f"{4 * x.numel() * 2 / ms / 1e6:.0f}",
    )  # read x, r; write out, residual
    gu = torch.randn(t, 2 * inter, device="cuda", dtype=bf)
    ms = _bench(silu_and_mul_triton, gu)
    _row(
        "silu_mul",
        tokens=t,
        inter=inter,
        us=f"{ms * 1e3:.1f}",
        GBps=f"{1.5 * gu.numel() * 2 / ms / 1e6:.0f}",
    )
    cs = torch.randn(8192, d, device="cuda")
    pos = torch.randint(0, 8192, (t,), device="cuda")
    q = torch.randn(t, h * d, device="cuda", dtype=bf)
    k = torch.randn(t, kvh, d, device="cuda", dtype=bf)
    ms = _bench(rotary_embedding_triton, pos, q, k, cs, d)
    _row(
        "rope",
        tokens=t,
        us=f"{ms * 1e3:.1f}",
        GBps=f"{2 * (q.numel() + k.numel()) * 2 / ms / 1e6:.0f}",
    )
    for cache_dtype in (bf, torch.float8_e4m3fn):
        q_, cache, md = paged_step([t], [0], h, kvh, d, bs, bf, cache_dtype)
        slots = torch.randperm(cache.shape[1] * bs, device="cuda")[:t]
        kk = torch.randn(t, kvh, d, device="cuda", dtype=bf)
        ks = torch.ones(1, device="cuda") if cache_dtype != bf else None
        ms = _bench(reshape_and_cache, kk, kk, cache, slots, ks, ks)
        moved = 2 * kk.numel() * (2 + cache.element_size())
        _row(
            "kv_write",
            kv=str(cache_dtype).removeprefix("torch."),
            tokens=t,
            us=f"{ms * 1e3:.1f}",
            GBps=f"{moved / ms / 1e6:.0f}",
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few rows per section")
    p.add_argument("--sweep", action="store_true", help="decode tile / segment sweep")
    p.add_argument(
        "--prefill-sweep", action="store_true", help="tile / warps sweep of prompt attention"
    )
    p.add_argument("--skip-decode", action="store_true", help="no decode table (sweeps only)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument(
        "--sweep-cases", default="256x1024,96x1024,4x8192", help="BATCHxCTX,... (CTX r: ragged)"
    )
    p.add_argument("--sweep-kv", default="bf16,e4m3,e5m2", help="cache dtypes of the sweep")
    p.add_argument("--sweep-layouts", default="nhd", help="cache layouts: nhd and/or hnd")
    p.add_argument("--sweep-stages", default="2,3,4", help="pipeline stages of the sweep")
    p.add_argument("--sweep-tiles", default="64,128", help="key tiles (tokens) of the sweep")
    p.add_argument("--sweep-warps", default="2,4", help="warps per program of the sweep")
    p.add_argument(
        "--sweep-orders", default="reqs,heads", help="grid orders: reqs and/or heads fastest"
    )
    p.add_argument(
        "--sweep-segments",
        default="auto",
        help="split-KV segments of the sweep, 1 = unsplit (auto: 8,16,32 where the engine splits)",
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8192, help="rows for the element-wise ops")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--intermediate-size", type=int, default=14336)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py needs a CUDA GPU")
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    torch.manual_seed(0)
    copy_gbps = copy_roofline()
    if not args.skip_decode:
        bench_decode(args, copy_gbps)
    if args.sweep:
        bench_decode_sweep(args)
    bench_prefill(args)
    bench_prefill_step(args)
    bench_elementwise(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
