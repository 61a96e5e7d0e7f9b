"""AWQ / GPTQ / W8A8 checkpoints on the CPU: their layers as GGUF blocks (the default, where
the format has a block form) against `PAGODA_CPU_QUANTIZED=0` (AWQ / GPTQ dequantized at
load, int8 W8A8 through the float32 reference product), with the embedded GGUF file as the
yardstick. Per model and path: the bytes the linear layers hold, single-stream decode (a
128-token prompt, 256 new tokens, greedy: the time of 257 minus the time of 1, as
`cpu_decode.py`) and prompt processing (one 512-token prompt), medians of --repeats runs after
a warm-up, each setting in its own process, settings alternating.

    pagoda quantize --method awq --output /tmp/q/awq
    pagoda quantize --method gptq --act-order --output /tmp/q/gptq-ao
    pagoda quantize --method gptq --bits 8 --sym --output /tmp/q/gptq8-sym
    pagoda quantize --method w8a8 --output /tmp/q/w8a8
    python benchmarks/cpu_quantized_checkpoints.py /tmp/q/awq /tmp/q/gptq-ao /tmp/q/gptq8-sym \
        /tmp/q/w8a8 [--repeats 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _measure(model: str | None, repeats: int) -> dict[str, float]:
    import pagoda  # noqa: F401 - sets the OpenMP wait policy before torch loads libgomp
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=model,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        seed=0,
    )
    net = llm.llm_engine.executor.model_runner.model
    linear_bytes = sum(
        t.numel() * t.element_size()
        for m in net.modules()
        if hasattr(m, "linear_method") and m is not getattr(net, "lm_head", None)
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    )

    def seconds(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0

    short, long = list(range(1000, 1128)), list(range(1000, 1512))
    seconds(short, 8)
    decode = [256 / (seconds(short, 257) - seconds(short, 1)) for _ in range(repeats)]
    prompt = [512 / seconds(long, 1) for _ in range(repeats)]
    return {
        "linear_mb": linear_bytes / 2**20,
        "decode": statistics.median(decode),
        "prompt": statistics.median(prompt),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("models", nargs="*", help="AWQ / GPTQ checkpoint directories")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="times each setting is measured")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one setting
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(_measure(args.one or None, args.repeats)))
        return
    settings = [("embedded GGUF (Q4_1 / Q8_0)", "", "1")]
    for m in args.models:
        settings += [(f"{os.path.basename(m)}, default", m, "1")]
        settings += [(f"{os.path.basename(m)}, PAGODA_CPU_QUANTIZED=0", m, "0")]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in settings}
    for _ in range(args.rounds):
        for name, model, flag in settings:
            env = {**os.environ, "PAGODA_CPU_QUANTIZED": flag, "PAGODA_LOGGING_LEVEL": "warning"}
            cmd = [sys.executable, __file__, "--one", model, "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, results[name][-1], flush=True)
    print("\n| model, path | linear layers (MB) | decode tok/s | prompt tok/s |\n|---|---|---|---|")
    for name, runs in results.items():
        decode = statistics.median(r["decode"] for r in runs)
        prompt = statistics.median(r["prompt"] for r in runs)
        print(f"| {name} | {runs[0]['linear_mb']:.1f} | {decode:.1f} | {prompt:.0f} |")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx2" if "avx2" in flags else "other"
    print(f"\ncommit {commit}; {cpu} ({isa}), {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
