"""Time the sampler on a mixed batch: `python -m pagoda.sample.benchmark --batch 64 --vocab 49152`.

The batch cycles through greedy, plain random, top-p, top-k + top-p, min-p, seeded and
penalised/logprob requests, like a busy server's, with 200-token prompts and 100 output tokens
each. It reports the median time of `SamplingMetadata.from_requests` and of one sampler call
(metadata excluded), and the plain-greedy fast path for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.sample.sampler import Sampler, SamplingMetadata
from pagoda.sampling_params import SamplingParams

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


def _time(fn, device: torch.device, iters: int) -> float:
    """Median wall time of `fn` in milliseconds (synchronising the device around each call)."""
    times = []
    for _ in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
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
    print(
        f"batch {b} x vocab {v} on {device} ({args.dtype}, {torch.get_num_threads()} threads): "
        f"metadata {t_md:.2f} ms, sampler (mixed) {t_sample:.2f} ms, "
        f"sampler (plain greedy) {t_greedy:.2f} ms"
    )


if __name__ == "__main__":
    main()
