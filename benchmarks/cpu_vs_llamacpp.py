"""Pagoda's quantized-GGUF CPU path against llama.cpp, one engine after the other, on the same
GGUF file and thread count: single-stream decode (128-token prompt, 256 new tokens), prompt
processing (512-token prompt), greedy outputs on 10 prompts (Pagoda's own numerics, and
llama.cpp's arithmetic op by op: `PAGODA_CPU_NUMERICS=ggml`), and perplexity of the quantized
path against the dequantized one on a fixed text.

    python benchmarks/cpu_vs_llamacpp.py --llamacpp-python /tmp/llamacpp-venv/bin/python \\
        [--model PATH.gguf] [--threads 2] [--repeats 3] [--out results.json]

llama.cpp runs through `llama-cpp-python` in its own interpreter (a venv made with
`python -m venv V && V/bin/pip install llama-cpp-python numpy`, which builds llama.cpp from
source), as a child process of this script given the same token ids. Pagoda runs with its
defaults (float32 activations, the weights kept quantized, a float16 KV cache); llama.cpp with
its default f16 KV cache.
Timings are medians of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Explain paged attention in one paragraph.",
    "Write a haiku about the sea.",
    "What is machine learning?",
    "List three uses of a paperclip:",
    "The quick brown fox",
    "In 1905, Albert Einstein published",
    "To make a cup of tea, first",
    "你是一个AI助手。请回答：什么是机器学习？",
]
GREEDY_TOKENS = 32

# The llama.cpp side, run by the other interpreter: reads a JSON job on stdin, prints results.
LLAMACPP_WORKER = r"""
import json, statistics, sys, time
from llama_cpp import Llama
job = json.load(sys.stdin)
# llama.cpp's default f16 KV cache, as Pagoda's float32 model keeps on a CPU by default
llm = Llama(job["model"], n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=job["threads"],
            n_threads_batch=job["threads"], type_k=1, type_v=1, verbose=False)
def greedy(ids, n):
    out = []
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) == n:
            return out
def timed(fn):
    fn()
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return statistics.median(times)
def prefill(ids):
    llm.reset(); llm.eval(ids)
t1 = timed(lambda: greedy(job["decode_prompt"], 1))
t257 = timed(lambda: greedy(job["decode_prompt"], 257))
pp = timed(lambda: prefill(job["pp_prompt"]))
import llama_cpp
print(json.dumps({"version": llama_cpp.__version__, "decode_tok_s": 256 / (t257 - t1),
                  "pp_tok_s": len(job["pp_prompt"]) / pp,
                  "greedy": [greedy(p, job["greedy_tokens"]) for p in job["greedy_prompts"]]}))
"""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_pagoda(model: str, threads: int, repeats: int, job: dict, numerics: str = "pagoda") -> dict:
    """Timings and greedy outputs; with `numerics` other than "pagoda" (`$PAGODA_CPU_NUMERICS`),
    the greedy outputs and the decode rate only (`repeats` timed runs)."""
    import torch

    from pagoda import LLM, SamplingParams

    torch.set_num_threads(threads)
    os.environ["PAGODA_CPU_NUMERICS"] = numerics
    llm = LLM(
        model=model,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(ids: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    if numerics != "pagoda":
        t0 = time.perf_counter()
        greedy = [generate(p, GREEDY_TOKENS) for p in job["greedy_prompts"]]
        seconds = time.perf_counter() - t0
        t1 = timed(lambda: generate(job["decode_prompt"], 1))
        t257 = timed(lambda: generate(job["decode_prompt"], 257))
        os.environ.pop("PAGODA_CPU_NUMERICS")
        return {"greedy": greedy, "greedy_seconds": seconds, "decode_tok_s": 256 / (t257 - t1)}
    t1 = timed(lambda: generate(job["decode_prompt"], 1))
    t257 = timed(lambda: generate(job["decode_prompt"], 257))
    pp = timed(lambda: generate(job["pp_prompt"], 1))
    greedy = [generate(p, GREEDY_TOKENS) for p in job["greedy_prompts"]]
    mc = llm.llm_engine.config.model_config
    return {
        "dtype": mc.dtype,
        "quantization": mc.quantization,
        "decode_tok_s": 256 / (t257 - t1),
        "pp_tok_s": len(job["pp_prompt"]) / pp,
        "greedy": greedy,
    }


def perplexities(model: str, ids: list[int], ggml_variant: str, window: int = 512) -> dict:
    """Perplexity of the quantized (quantization="gguf") and dequantized float32 models, over a
    float32 KV cache, of the quantized one over the float16 cache a CPU runs by default, and of
    that one in llama.cpp's arithmetic (the ggml numerics of `ggml_variant`)."""
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    )
    import torch
    from model_testing import PagedRunner  # one sequence through a paged cache, no scheduler

    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    cfg = get_model_config_dict(model)
    out = {}
    for name, quantization, cache_dtype in (
        ("quantized", "gguf", torch.float32),
        ("quantized_f16_cache", "gguf", torch.float16),
        ("quantized_ggml_numerics", "gguf", torch.float16),
        ("dequantized", None, torch.float32),
    ):
        m = load_model(
            ModelConfig(
                model=model,
                hf_config=cfg,
                dtype="float32",
                max_model_len=window,
                quantization=quantization,
            )
        )
        if name == "quantized_ggml_numerics":  # llama.cpp's arithmetic op by op
            m.enable_ggml_numerics(ggml_variant)
        nll, count = 0.0, 0
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                continue
            runner = PagedRunner(m, cfg, num_blocks=window // 4 + 2, cache_dtype=cache_dtype)
            with torch.no_grad():
                logp = torch.log_softmax(runner.step(chunk, 0).double(), dim=-1)
            nll -= logp[:-1].gather(1, torch.tensor(chunk[1:]).unsqueeze(1)).sum().item()
            count += len(chunk) - 1
        out[name] = math.exp(nll / count)
        del m
    out["tokens"] = count
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-python", required=True, help="python of a llama-cpp-python venv")
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--ggml-numerics",
        default="ggml",
        choices=["ggml", "ggml-avx2", "ggml-avx512"],
        help="the PAGODA_CPU_NUMERICS of the second greedy run: ggml matches a llama.cpp built "
        "natively here; ggml-avx2 one built without AVX-512 (GGML_NATIVE=OFF GGML_AVX2=ON)",
    )
    args = p.parse_args()

    from pagoda.config import embedded_model_path
    from pagoda.model.quantization.gptq import BUILTIN_CALIBRATION
    from pagoda.tokenizer import get_tokenizer

    model = args.model or embedded_model_path()
    tok = get_tokenizer(model)
    text_ids = tok.encode(BUILTIN_CALIBRATION * 2)  # a fixed text: 544 tokens
    job = {
        "model": model,
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_prompt": text_ids[:128],
        "pp_prompt": text_ids[:512],
        "greedy_prompts": [tok.encode(t) for t in PROMPTS],
        "greedy_tokens": GREEDY_TOKENS,
    }
    print(f"CPU: {cpu_name()}, {args.threads} threads; model {os.path.basename(model)}", flush=True)
    results = {"cpu": cpu_name(), "threads": args.threads, "model": os.path.basename(model)}
    results["pagoda"] = run_pagoda(model, args.threads, args.repeats, job)
    results["pagoda_ggml_numerics"] = run_pagoda(
        model, args.threads, 1, job, numerics=args.ggml_numerics
    )
    proc = subprocess.run(
        [args.llamacpp_python, "-c", LLAMACPP_WORKER],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(f"llama.cpp worker failed:\n{proc.stderr[-3000:]}")
    results["llamacpp"] = json.loads(proc.stdout.strip().splitlines()[-1])
    from pagoda.model.models.llama_ggml import variant_of

    variant = variant_of(args.ggml_numerics)
    results["perplexity"] = perplexities(model, tok.encode(BUILTIN_CALIBRATION), variant)
    for key, name in (("greedy_equal", "pagoda"), ("greedy_equal_ggml", "pagoda_ggml_numerics")):
        pairs = zip(results[name]["greedy"], results["llamacpp"]["greedy"])
        results[key] = f"{sum(a == b for a, b in pairs)}/{len(PROMPTS)}"
    pg, lc, ppl = results["pagoda"], results["llamacpp"], results["perplexity"]
    print(
        f"pagoda ({pg['dtype']}, quantization={pg['quantization']}) vs llama.cpp {lc['version']}:"
    )
    print(
        f"  decode, 128-token prompt, 256 new tokens: {pg['decode_tok_s']:.1f} vs "
        f"{lc['decode_tok_s']:.1f} tok/s ({pg['decode_tok_s'] / lc['decode_tok_s']:.2f}x)"
    )
    print(
        f"  prompt processing, 512 tokens: {pg['pp_tok_s']:.1f} vs {lc['pp_tok_s']:.1f} tok/s "
        f"({pg['pp_tok_s'] / lc['pp_tok_s']:.2f}x)"
    )
    print(f"  greedy outputs equal ({GREEDY_TOKENS} tokens): {results['greedy_equal']}")
    ggml = results["pagoda_ggml_numerics"]
    print(
        f"  greedy outputs equal with PAGODA_CPU_NUMERICS={args.ggml_numerics}: "
        f"{results['greedy_equal_ggml']} "
        f"({ggml['greedy_seconds']:.1f} s for the 10 prompts; decode {ggml['decode_tok_s']:.1f} "
        "tok/s)"
    )
    change = 100 * (ppl["quantized"] / ppl["dequantized"] - 1)
    change16 = 100 * (ppl["quantized_f16_cache"] / ppl["dequantized"] - 1)
    change_ggml = 100 * (ppl["quantized_ggml_numerics"] / ppl["dequantized"] - 1)
    print(
        f"  perplexity over {ppl['tokens']} tokens: quantized {ppl['quantized']:.3f}, "
        f"dequantized {ppl['dequantized']:.3f} ({change:+.2f}%); quantized over the float16 "
        f"KV cache {ppl['quantized_f16_cache']:.3f} ({change16:+.2f}%); with "
        f"PAGODA_CPU_NUMERICS={args.ggml_numerics} {ppl['quantized_ggml_numerics']:.3f} "
        f"({change_ggml:+.2f}%)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
