"""Where one single-stream decode step's GPU time goes: the kernels of N steps of one request
(dummy weights, CUDA graphs as served) under torch.profiler, per step: each kernel's count and
time, the GPU's busy time and the step's wall time. What is not a GEMM/GEMV is the part a
faster 4-bit kernel cannot win back.

    python benchmarks/decode_step_profile.py --quantization awq [--steps 20] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

from pagoda_bench import _params, make_llm  # noqa: E402


def profile_steps(llm: Any, steps: int, prompt_len: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": [7] * prompt_len}, _params(2 * steps + 32))
    for _ in range(16):  # the prefill and some decode steps (graphs captured, warm)
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_request("p")
    kernels: dict[str, list[float]] = defaultdict(list)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels[e.name].append(e.device_time)
            spans.append((e.time_range.start, e.time_range.end))
    busy = sum(sum(v) for v in kernels.values()) / steps / 1e3
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    rows = sorted(((sum(v) / steps, len(v) / steps, n) for n, v in kernels.items()), reverse=True)
    return {
        "device": torch.cuda.get_device_name(),
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 3),
        "gpu_busy_ms_per_step": round(busy, 3),
        "gpu_span_ms_per_step": round((last - first) / steps / 1e3, 3),
        "kernels": [
            {"us_per_step": round(us, 2), "count_per_step": round(c, 2), "name": n[:160]}
            for us, c, n in rows
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "benchmarks", "presets", "llama-3-8b"))
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.device, args.enforce_eager, args.kv_cache_memory_bytes = "cuda", False, 4 << 30
    args.max_num_batched_tokens = 2048
    workload = SimpleNamespace(max_model_len=args.prompt_len + 2 * args.steps + 64)
    result = profile_steps(make_llm(args, workload), args.steps, args.prompt_len)
    print(
        f"{result['device']}: {result['wall_ms_per_step']} ms a step (wall), GPU busy "
        f"{result['gpu_busy_ms_per_step']} ms, first to last kernel "
        f"{result['gpu_span_ms_per_step']} ms"
    )
    print(f"{'us/step':>9s} {'n/step':>7s}  kernel")
    for k in result["kernels"][:40]:
        print(f"{k['us_per_step']:9.1f} {k['count_per_step']:7.1f}  {k['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
