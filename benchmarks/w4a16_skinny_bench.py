"""W4A16 on the GPU by row count: the CUDA decode kernel (`pagoda/kernels/w4a16_gemv.py`, a
sweep of its configs, up to 64 rows, each checked against the reference), the Triton few-row kernel (`pagoda/kernels/w4a16_skinny.py`,
a small sweep of its configs), `_w4a16_kernel` (`pagoda/kernels/w4a16.py`, default_config),
dequantize-then-cuBLAS, what `w4a16_linear` picks by default (`choose_config`), and dense bf16
cuBLAS, for the Llama-3-8B linear layers (group 128), cold weights (copies cycled, more bytes
than the L2), in CUDA graphs.

    python benchmarks/w4a16_skinny_bench.py --out w4a16_skinny.json
    python benchmarks/w4a16_skinny_bench.py --m 1 16 --shapes o    # a subset
    python benchmarks/w4a16_skinny_bench.py --top 3 --family wgmma --out w4a16_skinny.json

One line per (shape, M, variant): us and the packed weights' bandwidth (qweight + scales +
zeros bytes / time; the dense bf16 weight's bytes for cuBLAS); per (shape, M) the fastest
CUDA and Triton few-row configs; then ms per decode step (4 GEMMs x 32 layers) per M and
variant. Every CUDA config's timing is in the JSON (variant "cuda").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_common import graph_seconds, precompile  # noqa: E402
from w4a16_bench import GROUP, L2_BYTES, LAYERS, SHAPES, packed_layer  # noqa: E402

M_VALUES = (1, 4, 16, 24, 32, 64, 128, 192, 256, 1024)


def gemv_grid(m: int, ring: bool = False) -> list[tuple]:
    """GemvConfig tuples to time: the default first, then a few (row tiles, warps, depth) each
    with the code paths (L2 prefetch, sums by mma, early x) on and off, then the shared-memory
    ring (bulk) at its stages and chunk sizes; each also as a programmatic dependent launch
    (pdl, sm_90). With `ring`, the ring only (with pdl): the rule's shapes at 2-3 stages of 2
    K steps a warp, x loaded a step ahead or at its turn (x_early), and registers held to 20,
    27 or 36 resident warps an SM or not (min_warps); and K split among clusters of 2 or 4
    CTAs (splits)."""
    from pagoda.kernels.w4a16_gemv import (
        MAX_M,
        RING_LIMIT,
        SMEM_LIMIT,
        GemvConfig,
        m_tiles,
        ring_bytes,
        smem_bytes,
    )

    if m > MAX_M:
        return []
    if ring:
        configs = []
        shapes = ((1, 8, 0), (2, 8, 0), (2, 4, 1), (2, 4, 0))
        for (rt, warps, sums), x_early, min_warps, stages in itertools.product(
            shapes, (1, 0), (0, 20, 27, 36), (2, 3)
        ):
            cfg = GemvConfig(rt, warps, sum_mma=sums, x_early=x_early, bulk=1, pdl=1)
            configs.append(tuple(cfg._replace(stages=stages, chunk=2 * warps, min_warps=min_warps)))
        for (rt, warps, sums), splits, (x_early, min_warps) in itertools.product(
            shapes, (2, 4), ((1, 0), (0, 27))
        ):
            cfg = GemvConfig(rt, warps, sum_mma=sums, x_early=x_early, bulk=1, chunk=2 * warps)
            configs.append(tuple(cfg._replace(pdl=1, min_warps=min_warps, splits=splits)))
        return [c for c in configs if smem_bytes(m_tiles(m), GemvConfig(*c)) <= SMEM_LIMIT]
    configs = [tuple(GemvConfig())]
    shapes = ((1, 8, 2), (1, 4, 2), (1, 8, 4), (2, 8, 2), (2, 4, 2), (2, 4, 4))
    flags = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 1, 1))
    configs += [shape + f for shape in shapes for f in flags]
    # Weights through the shared-memory ring: (row tiles, warps) x stages x chunk x sums by mma.
    for rt, warps in ((1, 8), (1, 4), (2, 8), (2, 4)):
        for stages, mult, sums in itertools.product((2, 4, 8), (1, 2, 4), (0, 1)):
            configs.append((rt, warps, 2, 0, sums, 1, 1, stages, warps * mult))
    configs = [tuple(GemvConfig(*c)._replace(pdl=pdl)) for c in configs for pdl in (0, 1)]
    configs = [
        c
        for c in configs
        if smem_bytes(m_tiles(m), GemvConfig(*c)) <= SMEM_LIMIT
        and ring_bytes(GemvConfig(*c)) <= RING_LIMIT
    ]
    return list(dict.fromkeys(configs))


def _build_gemv(job: tuple) -> str | None:
    """Compile the CUDA kernel variant of (m, GemvConfig) for bf16 x and fp16 scales."""
    import torch

    from pagoda.kernels.w4a16_gemv import GemvConfig, config_reason, get_kernel, shape_reason

    m, cfg = job
    cfg = GemvConfig(*cfg)
    x = torch.empty(m, 2 * GROUP, device="cuda", dtype=torch.bfloat16)  # groups of one K step
    reason = config_reason(cfg, x.device) or shape_reason(m, 4096, cfg)
    if reason:
        return reason
    scales = torch.empty(1, 1, device="cuda", dtype=torch.float16)
    built = get_kernel(x, scales, cfg, False, False, GROUP)
    return None if built else "no kernel"


def wgmma_grid(m: int) -> list[tuple]:
    """WgmmaConfig tuples to time from 17 rows: activation tiles of 32 and 64 rows (up to 32
    rows) or 64 and 128, 1 or 2 warpgroups, 2 or 4 K steps of weights in flight, 1 or 2 A
    buffers, 1 or 2 CTAs a SM; 4 stages (6 were no faster), K split by `split_for`; 4
    warpgroups where their 128 registers a thread do not spill; tiles of 96-224 rows that hold
    all the rows in one; past 128 rows also tiles of 256 rows (K split by `split_for`, 2 and 4
    ways; one A buffer, or two with 2 K steps of weights in flight); the rule's configs with K
    split 1-6 ways."""
    from pagoda.kernels.w4a16 import wgmma_config
    from pagoda.kernels.w4a16_wgmma import BN_VALUES, WgmmaConfig, config_reason

    if m < 17:
        return []
    grid = itertools.product((32, 64) if m <= 32 else (64, 128), (1, 2), (2, 4), (1, 2), (1, 2))
    configs = [WgmmaConfig(bn, wg, 4, depth, 0, ab, cps) for bn, wg, depth, ab, cps in grid]
    # (bn, warpgroups, stages, depth, split_k, a_buffers, ctas_per_sm)
    configs.append(WgmmaConfig(32 if m <= 32 else 64, 4, 4, 2, 0, 1, 1))
    fit = min((bn for bn in BN_VALUES if bn >= m), default=None)  # one tile of all the rows
    if fit in (96, 160, 192, 224):
        grid = itertools.product((1, 2), (2, 4), (1, 2))
        configs += [WgmmaConfig(fit, wg, 4, depth, 0, ab, 1) for wg, depth, ab in grid]
        if fit == 96:
            configs.append(WgmmaConfig(fit, 4, 4, 2, 0, 1, 1))
    if m > 128:  # 256 rows a CTA, 3 stages of 64 KB; K split as the rule or 2, 4 ways
        grid = itertools.product((1, 2), (2, 4), (0, 2, 4))
        configs += [WgmmaConfig(256, wg, 3, depth, split, 1) for wg, depth, split in grid]
        grid = itertools.product((1, 2), (0, 2))  # two A buffers: 255 registers, no spill
        configs += [WgmmaConfig(256, wg, 3, 2, split, 2) for wg, split in grid]
    # The rule's configs with K split 1-6 ways (split_for splits only grids that then still fit
    # one wave: 96-400 CTAs on 132 SMs run 1.5-3 waves, the last one part empty).
    for n, k in SHAPES.values():
        rule = wgmma_config(m, n, k, GROUP)
        if rule is not None:
            configs += [rule._replace(split_k=split) for split in (1, 2, 3, 4, 6)]
    configs = list(dict.fromkeys(configs))
    return [tuple(c) for c in configs if config_reason(c) is None]


def few_row_mode(cfg: tuple) -> str:
    """The Triton few-row kernel's configs as two families: the many-row modes ("wide": x in
    planar order) and the rest ("skinny")."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig

    return "wide" if SkinnyConfig(*cfg).planar else "skinny"


def _build_wgmma(cfg: tuple) -> str | None:
    """Compile the wgmma kernel of `cfg` for bf16 x and fp16 scales, with and without split K."""
    import torch

    from pagoda.kernels.w4a16_wgmma import WgmmaConfig, get_kernel

    x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
    scales = torch.empty(1, 1, device="cuda", dtype=torch.float16)
    built = [get_kernel(x, scales, WgmmaConfig(*cfg), False, split) for split in (False, True)]
    return None if all(built) else "no kernel"


def skinny_grid(m: int, n: int, k: int, num_sms: int) -> list[tuple]:
    """SkinnyConfig tuples to time: choose_config's first, then block_n x warps x stages x
    split around the one that covers the SMs about twice, then choose_config's in the many-row
    modes (x in planar order; also zero and scale per weight)."""
    from pagoda.kernels.skinny_gemm import split_k_plan
    from pagoda.kernels.w4a16 import skinny_config

    base = skinny_config(m, n, k, GROUP, num_sms)
    if base is None or m > 128:
        return []
    configs = [tuple(base)]
    bm = base.block_m
    for bn, warps, stages in itertools.product((128, 256), (4, 8), (3, 4)):
        if (bn == 128 and warps == 8) or (bm == 64 and stages == 4):
            continue
        if stages * (bn * 128 // 2 + bm * 128 * 2) > 200 * 1024:
            continue
        tiles = -(-n // bn) * -(-m // bm)
        auto = max(1, min(8, (2 * num_sms) // tiles))
        for split in sorted({auto, min(16, auto * 2)}):
            split = split_k_plan(k, 128, split)[1]
            cfg = (bm, bn, 128, split, warps, stages)
            if cfg not in configs:
                configs.append(cfg)
    if k % 128 == 0:  # choose_config's tile with x in planar order, and with scales per weight
        configs += [(*base[:6], True, False), (*base[:6], True, True)]
    return configs


def wide_grid(m: int, n: int, k: int, num_sms: int) -> list[tuple]:
    """SkinnyConfig tuples of the many-row modes (x in planar order, zero and scale per
    weight: `planar`, `scale_w`) from 64 rows: 64-row x tiles against 128- and 256-row weight
    tiles (the unpacked tile stays in registers), 128-row ones against 64 and 128 (through
    shared memory: Triton's choice at 8 warps), 3 and 4 stages, K split until the grid covers
    the SMs about twice."""
    from pagoda.kernels.skinny_gemm import split_k_plan

    if m < 64 or k % 128:
        return []
    configs = []
    for bm, bn, warps in ((64, 128, 4), (64, 256, 8), (128, 64, 4), (128, 128, 8), (256, 64, 8)):
        if bm > max(64, m):
            continue
        for stages in (2, 3, 4):
            if stages * (bn * 128 // 2 + bm * 128 * 2) > 220 * 1024 or (stages == 2 and bm != 256):
                continue
            tiles = -(-n // bn) * -(-m // bm)
            split = split_k_plan(k, 128, max(1, min(8, (2 * num_sms) // tiles)))[1]
            configs.append((bm, bn, 128, split, warps, stages, True, True))
    return configs


def _build(job: tuple) -> str | None:
    """Compile one few-row config (into Triton's cache) by running it on a small layer."""
    import torch

    from pagoda.kernels.w4a16_skinny import SkinnyConfig, skinny_w4a16

    cfg = SkinnyConfig(*job)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = 512, 128 * max(8, cfg.split_k)
    qweight, scales, zeros = packed_layer(n, k, GROUP, "cuda", gen)
    x = torch.randn(cfg.block_m, k, device="cuda", dtype=torch.bfloat16)
    try:
        skinny_w4a16(x, qweight, scales, zeros, GROUP, None, None, cfg)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported by the timing loop
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def top_configs(rows: list[dict], family: str, n: int) -> list[str]:
    """Per (shape, M) of a sweep's rows: cuBLAS's and the default's us, then the `n` fastest
    configs of `family` (its rows' variant: "cuda" for the GEMV, "wgmma" for the wgmma
    kernel, "skinny" / "wide" for the Triton few-row kernel's modes) with their us."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["m"]), []).append(r)
    lines = []
    for (shape, m), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ref = {r["variant"]: r["us"] for r in group if r["variant"] in ("cublas_bf16", "default")}
        mine = [r for r in group if r["variant"] in (family, f"{family}_best")]
        mine.sort(key=lambda r: r["us"])
        best = [f"{r['us']:.1f} {list(r['config'])}" for r in mine[:n] if r.get("config")]
        cublas, default = ref.get("cublas_bf16", float("nan")), ref.get("default", float("nan"))
        lines.append(
            f"{shape:8s} {m:5d} cublas {cublas:6.1f} default {default:6.1f}  " + "; ".join(best)
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write every timing to this JSON file")
    ap.add_argument("--shapes", nargs="+", help="subset of " + " ".join(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, help="row counts (default: 1..1024)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--no-sweep", action="store_true", help="choose_config only")
    ap.add_argument("--no-cuda-sweep", action="store_true", help="no sweep of the CUDA kernel")
    ap.add_argument("--no-wgmma-sweep", action="store_true", help="no sweep of the wgmma kernel")
    ap.add_argument(
        "--gemv-ring",
        action="store_true",
        help="the CUDA sweep: the ring's stages, x_early, min_warps and splits at the rule's "
        "shapes",
    )
    ap.add_argument(
        "--step",
        action="store_true",
        help="only time whole decode steps: the 4 GEMMs of 32 distinct layers in order, in one "
        "graph, by default (with and without programmatic dependent launch) and bf16 cuBLAS",
    )
    ap.add_argument(
        "--best-from",
        metavar="JSON",
        help="with --step: also time the fastest wgmma configs per layer (wgmma_best) in this "
        "sweep's JSON as a step",
    )
    ap.add_argument(
        "--gemv-variants",
        nargs="+",
        metavar="FIELD=VALUE[,FIELD=VALUE...]|rule",
        help="with --step: instead of the other columns, the default step with these GemvConfig "
        "fields set in every config the GEMV rule picks (e.g. min_warps=0 or "
        "sc_ring=1,stages=3; 'rule' for none), in one process, the variants in turn twice "
        "(A B A B), and bf16 cuBLAS",
    )
    ap.add_argument(
        "--top",
        type=int,
        help="no timing: from the JSON of --out, the N fastest configs of --family per (shape, "
        "M) with cuBLAS's and the default's times",
    )
    ap.add_argument("--family", default="wgmma", help="with --top: wgmma or cuda")
    args = ap.parse_args(argv)
    if args.top:
        with open(args.out) as f:
            rows = json.load(f)["rows"]
        for line in top_configs(rows, args.family, args.top):
            print(line)
        return {}
    if args.step and args.gemv_variants:
        variants = {v: gemv_overrides(v) for v in args.gemv_variants}
        return variants_main(args.m or (1, 4, 8, 16), variants, args.reps, args.out)
    if args.step:
        return step_main(args.m or (1, 4, 8, 16, 32, 64), args.reps, args.out, args.best_from)

    import torch
    import torch.nn.functional as F
    import triton

    from pagoda.kernels.skinny_gemm import prepare
    from pagoda.kernels.w4a16 import DEQUANT, choose_config, default_config, w4a16_linear
    from pagoda.kernels.w4a16_gemv import GemvConfig
    from pagoda.kernels.w4a16_skinny import SkinnyConfig
    from pagoda.kernels.w4a16_wgmma import WgmmaConfig
    from pagoda.model.quantization.w4_layout import W4Weight, dequantize_w4

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {s: SHAPES[s] for s in (args.shapes or SHAPES)}
    m_values = args.m or M_VALUES
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    grids = {
        (s, m): (
            [] if args.no_sweep else skinny_grid(m, n, k, num_sms) + wide_grid(m, n, k, num_sms)
        )
        for (s, (n, k)), m in itertools.product(shapes.items(), m_values)
    }
    keys = {(*c[:3], max(1, min(c[3], 2)), *c[4:]) for g in grids.values() for c in g}
    if args.jobs > 1 and keys:
        precompile(_build, sorted(keys), args.jobs, cpu=False)
    from concurrent.futures import ThreadPoolExecutor

    from pagoda.kernels.w4a16_gemv import m_tiles

    gemv_grids = {m: [] if args.no_cuda_sweep else gemv_grid(m, args.gemv_ring) for m in m_values}
    # Each config's variant for every row count, compiled by NVRTC on threads.
    jobs = {(m_tiles(m), c): (m, c) for m, g in gemv_grids.items() for c in g}
    t_build = time.perf_counter()
    wgmma_grids = {m: [] if args.no_wgmma_sweep else wgmma_grid(m) for m in m_values}
    wgmma_jobs = sorted({c for g in wgmma_grids.values() for c in g})
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        failed = [j for j, e in zip(jobs.values(), pool.map(_build_gemv, jobs.values())) if e]
        failed += [j for j, e in zip(wgmma_jobs, pool.map(_build_wgmma, wgmma_jobs)) if e]
    print(
        f"compiled {len(jobs) + 2 * len(wgmma_jobs)} CUDA variants in {time.perf_counter() - t_build:.1f} s"
        + (f", failed: {failed}" if failed else ""),
        flush=True,
    )
    prepare("cuda")

    rows, t0 = [], time.perf_counter()
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        one = packed_layer(n, k, GROUP, "cuda", gen)
        packed_bytes = sum(t.nbytes for t in one)
        copies = math.ceil(3 * L2_BYTES / packed_bytes)
        packed = [one] + [packed_layer(n, k, GROUP, "cuda", gen) for _ in range(copies - 1)]
        dense = [
            torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(math.ceil(3 * L2_BYTES / (n * k * 2)))
        ]
        ref_w = dequantize_w4(W4Weight(*one, GROUP, None), k)
        for m in m_values:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ref_w)

            def timed(call, weights) -> float:
                def run() -> None:
                    for w in weights:
                        call(w)

                return graph_seconds(run, args.reps) / len(weights) * 1e6

            def record(variant, us, nbytes, cfg=None, err=None, where=(name, n, k, m)) -> dict:
                row = dict(zip(("shape", "n", "k", "m"), where), variant=variant, us=us)
                row.update(tbps=nbytes / (us * 1e-6) / 1e12, config=cfg, max_err=err)
                rows.append(row)
                return row

            def w4(cfg, x=x):
                return lambda p: w4a16_linear(x, *p, GROUP, config=cfg)

            def error(cfg, x=x, one=one, ref=ref) -> float:
                out = w4a16_linear(x, *one, GROUP, config=cfg).float()
                return (out - ref).abs().max().item() / ref.abs().max().item()

            record("cublas_bf16", timed(lambda w, x=x: F.linear(x, w), dense), n * k * 2)
            old = default_config(m, n, k, GROUP, num_sms)
            record("old_kernel", timed(w4(old), packed), packed_bytes, list(old), error(old))
            if m >= 64:
                record("dequant_cublas", timed(w4(DEQUANT), packed), packed_bytes, None)
            chosen = choose_config(m, n, k, GROUP, num_sms)
            chosen_row = record(
                "default",
                timed(w4(None), packed),
                packed_bytes,
                chosen if chosen == DEQUANT else list(chosen),
                error(None),
            )

            def sweep_family(
                variant, configs, make, x=x, packed=packed, nbytes=packed_bytes, at=f"{name} M={m}"
            ) -> None:
                """Time and check every config of one kernel (`variant`: its name, or a function
                of the config naming it); the fastest correct one of each name is recorded
                again as `<name>_best`."""
                best = {}
                for cfg in configs:
                    kind = variant(cfg) if callable(variant) else variant
                    try:
                        us = timed(w4(make(*cfg), x), packed)
                        err = error(make(*cfg), x)
                    except Exception as e:  # noqa: BLE001 - a config that does not build or run
                        print(f"  {at} {kind} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                        continue
                    row = record(kind, us, nbytes, list(cfg), err)
                    if err > 2e-2:
                        print(f"  {at} {kind} {cfg}: WRONG, max error {err:.3g}")
                    elif kind not in best or us < best[kind]["us"]:
                        best[kind] = row
                for kind, row in best.items():
                    row["variant"] = f"{kind}_best"

            sweep_family("cuda", gemv_grids[m], GemvConfig)
            sweep_family("wgmma", wgmma_grids[m], WgmmaConfig)
            sweep_family(few_row_mode, grids[name, m], SkinnyConfig)
            line = f"{name:8s} M={m:5d} " + "  ".join(
                f"{r['variant']} {r['us']:7.1f} us {r['tbps']:5.2f} TB/s"
                + (f" {r['config']}" if r["variant"].endswith("_best") else "")
                for r in rows
                if r["shape"] == name
                and r["m"] == m
                and r["variant"] not in ("skinny", "wide", "cuda", "wgmma")
            )
            print(line + f"  err {chosen_row['max_err']:.2g}", flush=True)
            if args.out:  # what is done so far, in case the run is cut short
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)
        del packed, dense, ref_w
        torch.cuda.empty_cache()

    variants = (
        "cublas_bf16",
        "old_kernel",
        "dequant_cublas",
        "default",
        "skinny_best",
        "wide_best",
        "cuda_best",
        "wgmma_best",
    )
    print(f"\nms per decode step ({len(shapes)} GEMMs x {LAYERS} layers):")
    print(f"{'M':>5s} " + " ".join(f"{v:>14s}" for v in variants))
    summary = []
    for m in m_values:
        step = {"m": m}
        for v in variants:
            times = [r["us"] for r in rows if r["m"] == m and r["variant"] == v]
            step[v] = sum(times) * LAYERS / 1e3 if len(times) == len(shapes) else None
        summary.append(step)
        print(
            f"{m:5d} "
            + " ".join(f"{step[v]:14.3f}" if step[v] else f"{'-':>14s}" for v in variants)
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "summary": summary,
    }
    print(f"\ntimed in {result['seconds']:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _step_layers():
    """A generator and the 32 distinct layers of the step benchmarks: packed 4-bit weights
    and dense bf16 ones of the same shapes, on the GPU."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = [
        {s: packed_layer(n, k, GROUP, "cuda", gen) for s, (n, k) in SHAPES.items()}
        for _ in range(LAYERS)
    ]
    dense = [
        {s: torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
         for s, (n, k) in SHAPES.items()}
        for _ in range(LAYERS)
    ]  # fmt: skip
    return gen, packed, dense


def _step_fns(m: int, gen, packed, dense):
    """x of m rows for each K, and a decode step's GEMMs in order over every layer: 4-bit by
    `w4a16_linear`'s default, and bf16 by cuBLAS."""
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.w4a16 import w4a16_linear

    xs = {k: torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
          for _, k in SHAPES.values()}  # fmt: skip

    def w4_step() -> None:
        for layer in packed:
            for s, (_, k) in SHAPES.items():
                w4a16_linear(xs[k], *layer[s], GROUP)

    def dense_step() -> None:
        for layer in dense:
            for s, (_, k) in SHAPES.items():
                F.linear(xs[k], layer[s])

    return xs, w4_step, dense_step


def step_main(m_values, reps: int, out: str | None, best_from: str | None = None) -> dict:
    """ms per decode step timed as one: qkv, o, gate_up and down of 32 distinct layers, in that
    order, in one CUDA graph (the next kernel's start overlaps the last one's end as it would
    in the model), for `w4a16_linear`'s default with PAGODA_PDL=1 and =0, the rule without
    the bulk ring (the register kernel up to 8 rows, then the Triton kernels), the wgmma
    kernel with 64- and 128-row activation tiles (from 17 rows), and bf16 cuBLAS on dense
    weights of the same shapes. With `best_from` (a sweep's JSON), also that sweep's fastest
    wgmma configs per layer and row count (wgmma_best) as a step."""
    import torch

    from pagoda.kernels.skinny_gemm import prepare
    from pagoda.kernels.w4a16 import fallback_config, gemv_config, w4a16_linear
    from pagoda.kernels.w4a16_wgmma import WgmmaConfig

    prepare("cuda")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen, packed, dense = _step_layers()
    rows = []
    print(f"\nms per decode step, timed whole ({len(SHAPES)} GEMMs x {LAYERS} distinct layers):")
    print(f"{'M':>5s} {'default':>10s} {'no PDL':>10s} {'no ring':>10s} {'bf16':>10s}", end="")
    print(f" {'wgmma 64':>10s} {'wgmma 128':>10s} {'wgmma 256':>10s}")
    for m in m_values:
        xs, w4_step, dense_step = _step_fns(m, gen, packed, dense)

        registers = {
            s: gemv_config(m, n, k, GROUP, bulk=False) or fallback_config(m, n, k, GROUP, num_sms)
            for s, (n, k) in SHAPES.items()
        }

        def register_step(xs=xs, registers=registers) -> None:
            for layer in packed:
                for s, (_, k) in SHAPES.items():
                    w4a16_linear(xs[k], *layer[s], GROUP, config=registers[s])

        row = {"m": m}
        for key, pdl in (("default", "1"), ("no_pdl", "0")):
            os.environ["PAGODA_PDL"] = pdl
            row[key] = graph_seconds(w4_step, reps) * 1e3
        os.environ.pop("PAGODA_PDL")
        row["no_ring"] = graph_seconds(register_step, reps) * 1e3
        if m >= 17:
            tiles = [WgmmaConfig(bn=64), WgmmaConfig(bn=128)]
            if m >= 256:
                tiles.append(WgmmaConfig(bn=256, stages=3, a_buffers=1))
            for tile in tiles:

                def wgmma_step(xs=xs, cfg=tile) -> None:
                    for layer in packed:
                        for s, (_, k) in SHAPES.items():
                            w4a16_linear(xs[k], *layer[s], GROUP, config=cfg)

                row[f"wgmma{tile.bn}"] = graph_seconds(wgmma_step, reps) * 1e3
        for family, picked in best_configs(best_from, m).items():

            def best_step(xs=xs, picked=picked) -> None:
                for layer in packed:
                    for s, (_, k) in SHAPES.items():
                        w4a16_linear(xs[k], *layer[s], GROUP, config=picked.get(s))

            row[family] = graph_seconds(best_step, reps) * 1e3
            print(f"  {family} at {m} rows: {row[family]:.3f} ms, {picked}")
        row["cublas_bf16"] = graph_seconds(dense_step, reps) * 1e3
        rows.append(row)
        print(
            f"{m:5d} "
            + " ".join(
                f"{row[v]:10.3f}" if v in row else f"{'-':>10s}"
                for v in ("default", "no_pdl", "no_ring", "cublas_bf16")
                + ("wgmma64", "wgmma128", "wgmma256")
            )
        )
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": rows}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def best_configs(path: str | None, m: int) -> dict[str, dict]:
    """{"wgmma_best": {shape: WgmmaConfig}}: the fastest wgmma configs at `m` rows in the
    sweep JSON at `path`, where it timed every shape (none without a path)."""
    from pagoda.kernels.w4a16_wgmma import WgmmaConfig

    if path is None:
        return {}
    with open(path) as f:
        rows = json.load(f)["rows"]
    found = {}
    for family in ("wgmma_best",):
        picked = {
            r["shape"]: WgmmaConfig(*r["config"])
            for r in rows
            if r["m"] == m and r["variant"] == family
        }
        if set(picked) == set(SHAPES):
            found[family] = picked
    return found


def gemv_overrides(spec: str) -> dict[str, int]:
    """GemvConfig fields from "field=value[,field=value...]" ("rule": none)."""
    from pagoda.kernels.w4a16_gemv import GemvConfig

    if spec == "rule":
        return {}
    fields = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in GemvConfig._fields or not value.lstrip("-").isdigit():
            raise SystemExit(f"--gemv-variants: {item!r} is not FIELD=INT of {GemvConfig._fields}")
        fields[name] = int(value)
    return fields


def variants_main(m_values, variants: dict[str, dict[str, int]], reps: int, out: str | None):
    """ms per decode step as `step_main` times its default, with each variant's GemvConfig
    fields set in every config `w4a16.gemv_config` picks, in turn, twice over (A B A B: a
    drift of the GPU's clock shows as a difference between the two passes), and bf16 cuBLAS."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pagoda.kernels import w4a16
    from pagoda.kernels.skinny_gemm import prepare
    from pagoda.kernels.w4a16_gemv import m_tiles

    prepare("cuda")
    gen, packed, dense = _step_layers()
    rule = w4a16.gemv_config

    def use(fields: dict[str, int]) -> None:
        def gemv_config(*args, **kwargs):
            cfg = rule(*args, **kwargs)
            return None if cfg is None else cfg._replace(**fields)

        w4a16.gemv_config = gemv_config

    print(f"\nms per decode step, timed whole ({len(SHAPES)} GEMMs x {LAYERS} distinct layers),")
    print("the GEMV rule's configs with these fields set, each timed in two passes:")
    print(f"{'M':>5s} " + " ".join(f"{n:>17s}" for n in variants) + f" {'bf16':>8s}")
    rows = []
    try:
        jobs = {}  # the variants' kernels, compiled by NVRTC on threads first
        for fields in variants.values():
            use(fields)
            for m in m_values:
                cfgs = (w4a16.gemv_config(m, n, k, GROUP) for n, k in SHAPES.values())
                jobs |= {(m_tiles(m), tuple(c)): (m, tuple(c)) for c in cfgs if c is not None}
        with ThreadPoolExecutor(8) as pool:
            built = pool.map(_build_gemv, jobs.values())
            failed = [j for j, e in zip(jobs.values(), built) if e]
        print(f"compiled {len(jobs)} CUDA variants" + (f", failed: {failed}" if failed else ""))
        for m in m_values:
            _, w4_step, dense_step = _step_fns(m, gen, packed, dense)
            row = {"m": m, **{n: [] for n in variants}}
            for _ in range(2):
                for name, fields in variants.items():
                    use(fields)
                    row[name].append(graph_seconds(w4_step, reps) * 1e3)
            row["cublas_bf16"] = graph_seconds(dense_step, reps) * 1e3
            rows.append(row)
            cells = [f"{row[n][0]:8.3f}/{row[n][1]:8.3f}" for n in variants]
            print(f"{m:5d} " + " ".join(cells) + f" {row['cublas_bf16']:8.3f}")
    finally:
        w4a16.gemv_config = rule
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": rows}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
