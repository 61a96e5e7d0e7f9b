"""Time the sampler on a mixed batch:

    python benchmarks/sampler_bench.py [--batch 64] [--vocab 49152]

The batch cycles through greedy, plain random, top-p, top-k + top-p, min-p, seeded and
penalised/logprob requests, like a busy server's, with 200-token prompts and 100 output tokens
each. It reports the median wall and CPU time of `SamplingMetadata.from_requests` and of one sampler call
(metadata excluded), and the plain-greedy fast path for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagoda

from pagoda.sample.sampler import Sampler, SamplingMetadata  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
    SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.3, logprobs=5),
    SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=1),
]


def _time(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """Median wall time and median process CPU time (all threads) of `fn`, in milliseconds.

    On a shared CPU the CPU time is the steadier number: it leaves out time spent descheduled.
    """
    wall, cpu = [], []
    for _ in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall[2:]), statistics.median(cpu[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's op table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    torch.manual_seed(0)
    b, v = args.batch, args.vocab
    params = [MIXED_PARAMS[i % len(MIXED_PARAMS)] for i in range(b)]
    prompts = [torch.randint(0, v, (200,)).tolist() for _ in range(b)]
    outputs = [torch.randint(0, v, (100,)).tolist() for _ in range(b)]
    generators = [
        torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
        for p in params
    ]
    logits = (torch.randn(b, v, device=device) * 3).to(getattr(torch, args.dtype))
    sampler = Sampler()

    def build() -> SamplingMetadata:
        return SamplingMetadata.from_requests(params, prompts, outputs, generators, v, device)

    md = build()
    t_md = _time(build, device, args.iters)
    t_sample = _time(lambda: sampler(logits, md), device, args.iters)
    greedy = [SamplingParams(temperature=0.0)] * b
    md_greedy = SamplingMetadata.from_requests(greedy, prompts, outputs, [None] * b, v, device)
    t_greedy = _time(lambda: sampler(logits, md_greedy), device, args.iters)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for _ in range(5):
                sampler(logits, md)
        sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=25))
    print(f"batch {b} x vocab {v} on {device} ({args.dtype}, {torch.get_num_threads()} threads)")
    for name, (wall, cpu) in (
        ("metadata (from_requests)", t_md),
        ("sampler, mixed params", t_sample),
        ("sampler, plain greedy", t_greedy),
    ):
        print(f"  {name:26s} wall {wall:8.2f} ms   cpu {cpu:8.2f} ms")


if __name__ == "__main__":
    main()
