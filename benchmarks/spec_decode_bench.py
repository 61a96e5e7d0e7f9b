"""Single-stream decode with and without n-gram speculative decoding, on a task that copies its
input (where prompt lookup pays off), interleaved runs, same greedy tokens checked.

    python benchmarks/spec_decode_bench.py [--model PATH] [--max-tokens 200] [--runs 3]

Prints output tokens/s per run and the medians (the embedded model on a CPU by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagoda import LLM, SamplingParams

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()[:1500]
    prompt = [{"role": "user", "content": "Copy this text exactly:\n\n" + text}]
    engines = {
        "plain": LLM(args.model, max_model_len=2048),
        "ngram": LLM(args.model, max_model_len=2048, speculative_config=SPEC),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for run in range(args.runs + 1):  # run 0 warms up
        for name, llm in engines.items():
            t0 = time.perf_counter()
            out = llm.chat(prompt, params, use_tqdm=False)[0].outputs[0]
            dt = time.perf_counter() - t0
            tokens[name] = out.token_ids
            if run:
                rates[name].append(len(out.token_ids) / dt)
                print(f"run {run} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    print(f"same tokens: {tokens['plain'] == tokens['ngram']} ({len(tokens['plain'])})")
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.1f} output tok/s")


if __name__ == "__main__":
    main()
