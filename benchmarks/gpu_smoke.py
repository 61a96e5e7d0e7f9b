"""GPU smoke test of the whole engine with dummy weights: torch vs triton attention, timing.

python benchmarks/gpu_smoke.py [--preset benchmarks/presets/llama-3.2-1b]
"""

import argparse
import random
import time

import torch

from pagoda import LLM, SamplingParams

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="benchmarks/presets/llama-3.2-1b")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(32000) for _ in range(rng.randint(20, 300))]}
        for _ in range(16)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        t0 = time.perf_counter()
        llm = LLM(
            args.preset,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=args.dtype,
            max_model_len=2048,
            attention_backend=backend,
            gpu_memory_utilization=0.5,
            enforce_eager=True,
        )
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t3 = time.perf_counter()
        results[backend] = [o.outputs[0].token_ids for o in outs]
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"{backend}: start {t1 - t0:.1f}s first {t2 - t1:.2f}s second {t3 - t2:.2f}s "
            f"({n / (t3 - t2):.0f} out tok/s)",
            flush=True,
        )
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(results["torch"], results["triton"]))
    pos = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(results["torch"], results["triton"])
    ]
    print(f"greedy identical: {same}/{len(prompts)}; first divergence positions: {pos}")
