"""Mixture of experts on one GPU (issue 19): the Qwen3-30B-A3B shape, dummy bf16 weights.

Parts, each written to --json as soon as it ends:
- k: the fused MoE (Triton sort/align + two grouped GEMMs, `pagoda.kernels.fused_moe`) against
  the per-expert loop (`moe_experts_ref`, transformers' eager experts) on one layer's experts
  (128 of 768, top 8, hidden 2048), batch 1/16/64/256 tokens; eager and in a CUDA graph; time
  per layer over 8 layers' own weights in turn (so no layer's experts sit in L2), the weight
  bytes of the experts in use over that time, and the error of fused against loop;
- s: single-stream decode through the engine (128-token prompt, 256 tokens, median of 3);
- d: one decode step at batch 1 and 64 through the model runner (contexts of 256 tokens, the
  single stream's mean; CUDA graphs) and, at batch 1, the engine's time per token from part s,
  against the 48 MoE blocks alone at that batch (router + experts, in a graph): the MoE
  layers' share of step time, and the bytes a step must read (every weight but the embedding
  table once, the experts in use, the KV cache) over its time;
- a: offline throughput, 256 requests, prompts and outputs U[100, 1024] (h200_bench's a);
- t (not in the default parts): the fused experts at batch 1 and 16 per tile config.

    python benchmarks/moe_bench.py [--parts k,s,d,a] [--json $OUT/moe_bench.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import torch  # noqa: E402
from pagoda_bench import FULL, QUICK, bench_offline_throughput, bench_single_stream, make_llm  # noqa: E402

PRESET = os.path.join(REPO, "benchmarks", "presets", "qwen3-30b-a3b", "config.json")


def _time_ms(fn: Any, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph(fn: Any) -> Any:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _kernel_row(x: torch.Tensor, weights: list, routing: list, expert_bytes: int,
                inter: int) -> dict[str, Any]:  # fmt: skip
    """One batch size: fused (eager, graph) and loop over every layer's experts in turn."""
    from pagoda.kernels.fused_moe import fused_experts
    from pagoda.model.layers.fused_moe import moe_experts_ref

    layers = len(weights)
    b, h = x.shape
    k = routing[0][1].shape[1]
    used = sum(int(torch.unique(ids).numel()) for _, ids in routing)

    def fused() -> None:
        for (w13, w2), r in zip(weights, routing):
            fused_experts(x, w13, w2, *r)

    def loop() -> None:
        for (w13, w2), r in zip(weights, routing):
            moe_experts_ref(x, w13, w2, *r)

    errs = []
    for (w13, w2), r in zip(weights[:2], routing):
        ref = moe_experts_ref(x, w13, w2, *r).float()
        errs.append(((fused_experts(x, w13, w2, *r).float() - ref).norm() / ref.norm()).item())
    fused_ms = _time_ms(fused, 20) / layers
    graph_ms = _time_ms(_graph(fused), 50) / layers
    loop_ms = _time_ms(loop, 5, warmup=1) / layers
    per_layer_bytes = used / layers * expert_bytes + 2 * b * h * 2
    flops = 2 * b * k * 3 * h * inter
    return {
        "batch": b,
        "experts_in_use_per_layer": round(used / layers, 1),
        "fused_eager_us": round(fused_ms * 1e3, 1),
        "fused_graph_us": round(graph_ms * 1e3, 1),
        "loop_us": round(loop_ms * 1e3, 1),
        "speedup_eager": round(loop_ms / fused_ms, 1),
        "speedup_graph": round(loop_ms / graph_ms, 1),
        "fused_graph_gb_s": round(per_layer_bytes / graph_ms / 1e6, 1),
        "fused_graph_tflop_s": round(flops / graph_ms / 1e9, 2),
        "rel_err_vs_loop": round(max(errs), 5),
    }


def bench_kernels(cfg: dict[str, Any], batches: list[int], layers: int) -> list[dict[str, Any]]:
    from pagoda.model.layers.fused_moe import softmax_topk

    e, h = int(cfg["num_experts"]), int(cfg["hidden_size"])
    inter, k = int(cfg["moe_intermediate_size"]), int(cfg["num_experts_per_tok"])
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02

    weights = [(randn(e, 2 * inter, h), randn(e, h, inter)) for _ in range(layers)]
    rows = []
    for b in batches:
        x = randn(b, h) * 50
        routing = [softmax_topk(torch.randn(b, e, device="cuda", generator=g), k, True)
                   for _ in range(layers)]  # fmt: skip
        rows.append(_kernel_row(x, weights, routing, 3 * h * inter * 2, inter))
        print(rows[-1], flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


# Tiles tried by part t for few-token steps: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
SWEEP_TILES = [(16, 64, 128, 4, 3), (16, 32, 128, 4, 4), (16, 64, 256, 4, 2), (16, 128, 128, 4, 2),
               (16, 64, 64, 4, 4)]  # fmt: skip


def sweep_tiles(cfg: dict[str, Any], batches: list[int], layers: int) -> list[dict[str, Any]]:
    """Part t: the fused experts in a CUDA graph per tile config (default_config's first)."""
    from pagoda.kernels.fused_moe import fused_experts
    from pagoda.model.layers.fused_moe import softmax_topk

    e, h = int(cfg["num_experts"]), int(cfg["hidden_size"])
    inter, k = int(cfg["moe_intermediate_size"]), int(cfg["num_experts_per_tok"])
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02

    weights = [(randn(e, 2 * inter, h), randn(e, h, inter)) for _ in range(layers)]
    rows = []
    for b in batches:
        x = randn(b, h) * 50
        routing = [softmax_topk(torch.randn(b, e, device="cuda", generator=g), k, True)
                   for _ in range(layers)]  # fmt: skip
        for bm, bn, bk, warps, stages in SWEEP_TILES:
            tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps,
                        num_stages=stages)  # fmt: skip

            def run(tile: dict[str, int] = tile, x: torch.Tensor = x, routing: list = routing):
                for (w13, w2), r in zip(weights, routing):
                    fused_experts(x, w13, w2, *r, config=tile)

            us = _time_ms(_graph(run), 30) / layers * 1e3
            rows.append({"batch": b, "tile": [bm, bn, bk, warps, stages], "graph_us": round(us, 1)})
            print(rows[-1], flush=True)
    return rows


def _runner(llm: Any) -> Any:
    return llm.llm_engine.executor.model_runner


def _weight_bytes(model: Any) -> tuple[int, int]:
    """(bytes of every weight but the experts and the embedding table, bytes of one expert)."""
    from pagoda.model.layers.fused_moe import FusedMoE

    dense = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ".experts." not in name and "embed_tokens" not in name
    )
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    expert = (moe.w13_weight[0].numel() + moe.w2_weight[0].numel()) * moe.w2_weight.element_size()
    return dense, expert


def bench_decode_share(
    llm: Any, batches: list[int], context: int, stream_tok_s: float | None
) -> list[dict[str, Any]]:
    """Per batch: a decode step through the model runner (`runner_step_bench.py`) and the
    MoE blocks alone; at batch 1 also the single-stream engine's time per token (part s)."""
    from runner_step_bench import bench_decode

    runner = _runner(llm)
    model = runner.model
    cfg = model.config
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    dense_bytes, expert_bytes = _weight_bytes(model)
    kv_per_token = (2 * len(model.model.layers) * int(cfg["num_key_value_heads"])
                    * int(cfg["head_dim"]) * 2)  # fmt: skip
    rows = []
    for b in batches:
        try:
            step_ms = bench_decode(runner, b, context, 10)
        except Exception:  # noqa: BLE001 - the engine's per-token time still gives the share
            traceback.print_exc()
            step_ms = float("nan")
        x = torch.randn(b, int(cfg["hidden_size"]), device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            used = sum(int(torch.unique(m.select_experts(m.gate(x))[1]).numel()) for m in blocks)
            moe_ms = _time_ms(_graph(lambda x=x: [m(x) for m in blocks]), 30)
        expert_read = used * expert_bytes
        step_bytes = dense_bytes + expert_read + b * (context + 1) * kv_per_token
        rows.append(
            {
                "batch": b,
                "context": context,
                "step_ms": round(step_ms, 3),
                "moe_layers_ms": round(moe_ms, 3),
                "moe_share_of_step": round(moe_ms / step_ms, 3),
                "experts_in_use_per_layer": round(used / len(blocks), 1),
                "moe_bytes_gb": round(expert_read / 1e9, 3),
                "moe_gb_s": round(expert_read / moe_ms / 1e6, 1),
                "step_bytes_gb": round(step_bytes / 1e9, 3),
                "step_gb_s": round(step_bytes / step_ms / 1e6, 1),
            }
        )
        if b == 1 and stream_tok_s:
            engine_ms = 1e3 / stream_tok_s
            rows[-1].update(
                engine_ms_per_token=round(engine_ms, 3),
                moe_share_of_engine_token=round(moe_ms / engine_ms, 3),
                engine_gb_s=round(step_bytes / engine_ms / 1e6, 1),
            )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=PRESET, help="a config.json (dummy weights)")
    p.add_argument("--parts", default="k,s,d,a")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "moe_bench.json"))
    p.add_argument("--quick", action="store_true", help="small workloads (a dry run)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of parts s and a")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for parts s, d, a")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    w = QUICK if args.quick else FULL
    with open(args.model) as f:
        cfg = json.load(f)
    result: dict[str, Any] = {
        "model": os.path.relpath(args.model, REPO),
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none (dry run)",
        "torch": torch.__version__,
    }

    def save() -> None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    if "k" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        result["kernels"] = bench_kernels(cfg, batches, layers=2 if args.quick else 8)
        save()
    if "t" in parts:
        result["tiles"] = sweep_tiles(cfg, [1, 16], layers=4)
        torch.cuda.empty_cache()
        save()
    deadline = time.perf_counter() + args.time_budget
    if any(x in parts for x in ("s", "d", "a")):
        t0 = time.perf_counter()
        engine_args = argparse.Namespace(
            model=args.model, dtype="bfloat16", device=args.device,
            kv_cache_memory_bytes=None if args.device == "cuda" else 1 << 28,
            max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=False,
        )  # fmt: skip
        llm = make_llm(engine_args, w)
        result["engine_start_s"] = round(time.perf_counter() - t0, 1)
        save()
        for part, fn in (
            ("s", lambda: bench_single_stream(llm, w, deadline)),
            ("a", lambda: bench_offline_throughput(llm, w, deadline)),
            (
                "d",
                lambda: bench_decode_share(
                    llm,
                    [1, 64],
                    w.stream_prompt_len + w.stream_output_len // 2,
                    (result.get("s") or {}).get("decode_tokens_per_s"),
                ),
            ),
        ):
            if part not in parts:
                continue
            try:
                result[part] = fn()
            except Exception:  # noqa: BLE001 - one part's failure must not lose the others
                result[part] = {"error": traceback.format_exc()[-2000:]}
            save()
            print(part, json.dumps(result[part])[:1500], flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "a"}, indent=1))
    if isinstance(result.get("a"), dict):
        a = result["a"]
        print({k: a.get(k) for k in ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
