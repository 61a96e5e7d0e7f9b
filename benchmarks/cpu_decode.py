"""Single-stream decode on the CPU, the embedded model: a 128-token prompt, 256 new tokens
(greedy, time of 257 tokens minus time of 1), medians of --repeats runs after a warm-up. For
A/B runs of an environment switch, one process per setting, e.g. the thread pool or the
one-call decoder stack:

    PAGODA_CPU_POOL=1 python benchmarks/cpu_decode.py
    PAGODA_CPU_POOL=0 python benchmarks/cpu_decode.py
    PAGODA_CPU_DECODER=0 python benchmarks/cpu_decode.py
    python benchmarks/cpu_decode.py --dtype float32     # a GGUF model's blocks kept quantized
    python benchmarks/cpu_decode.py --quantization fp8  # its weights cast to FP8 at load
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pagoda  # noqa: F401 - sets the OpenMP wait policy before torch loads libgomp
from pagoda import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="float32 keeps a GGUF model's blocks quantized")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (cast at load)")
    args = p.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        seed=0,
    )
    ids = list(range(1000, 1128))

    def seconds(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - t0

    seconds(8)
    runs = [256 / (seconds(257) - seconds(1)) for _ in range(args.repeats)]
    switches = " ".join(
        f"{name}={os.environ.get(name, '1')}"
        for name in ("PAGODA_CPU_POOL", "PAGODA_CPU_DECODER", "PAGODA_CPU_QUANTIZED")
    )
    print(
        f"{switches} decode tok/s: median {statistics.median(runs):.1f}, "
        f"runs {[round(r, 1) for r in runs]}"
    )


if __name__ == "__main__":
    main()
