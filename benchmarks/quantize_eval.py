"""Perplexity of the embedded model (or MODEL) dense, GPTQ-, AWQ-, round-to-nearest-, INT8
W8A8 (SmoothQuant) and FP8-quantized, on held-out text: what `pagoda quantize` buys.

    python benchmarks/quantize_eval.py [--model PATH] [--bits 4] [--group-size 64]
        [--calibration-file FILE] [--eval-file FILE] [--act-order]
        [--methods dense,gptq,awq,rtn,w8a8,fp8] [--num-samples 32] [--seq-len 512]
        [--eval-tokens N]

Calibrates on the built-in text (or FILE) in up to --num-samples windows of --seq-len tokens,
evaluates on benchmarks/README.md (or FILE; its first N tokens with --eval-tokens) in 512-token
windows through prompt logprobs, float32 on the CPU; GPTQ, AWQ and round-to-nearest twice,
dequantized (the weight quantization alone) and as a CPU runs them (GGUF blocks, int8
activations per 32 inputs). AWQ is 4-bit only; W8A8 is int8 weights per channel and activations
per token (SmoothQuant, alpha 0.5), FP8 the model's weights cast per channel to e4m3 at load
(`quantization="fp8"`, activations per token). Ends with one table (perplexity, change against
dense, quantization time) and the commit and CPU it ran on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterator

from pagoda import LLM, SamplingParams
from pagoda.config import embedded_model_path
from pagoda.model.quantization.awq import quantize_model_awq
from pagoda.model.quantization.gptq import (
    BUILTIN_CALIBRATION,
    calibration_sequences,
    quantize_model,
)
from pagoda.model.quantization.smoothquant import quantize_model_w8a8
from pagoda.tokenizer import get_tokenizer


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    nll, count = 0.0, 0
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--calibration-file", default=None)
    p.add_argument("--eval-file", default=os.path.join(os.path.dirname(__file__), "README.md"))
    p.add_argument("--eval-tokens", type=int, default=None, help="evaluate the first N only")
    p.add_argument("--methods", default="dense,gptq,awq,rtn,w8a8,fp8", help="comma-separated")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"dense", "gptq", "awq", "rtn", "w8a8", "fp8"}
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}")
    model = args.model or embedded_model_path()
    tok = get_tokenizer(model)
    calib = BUILTIN_CALIBRATION
    if args.calibration_file:
        with open(args.calibration_file, encoding="utf-8") as f:
            calib = f.read()
    with open(args.eval_file, encoding="utf-8") as f:
        eval_ids = tok.encode(f.read())[: args.eval_tokens]
    windows = [eval_ids[i : i + 512] for i in range(0, len(eval_ids) - 1, 512)]
    windows = [w for w in windows if len(w) > 1]
    sequences = calibration_sequences(tok.encode(calib), args.num_samples, args.seq_len)
    n_eval = sum(len(w) - 1 for w in windows)
    print(
        f"{args.bits}-bit, group {args.group_size}{', act-order' if args.act_order else ''}; "
        f"calibration {sum(len(s) for s in sequences)} tokens, evaluation {n_eval} tokens "
        f"({os.path.basename(args.eval_file)})",
        flush=True,
    )
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            start = time.perf_counter()
            out, quantization = os.path.join(tmp, method), None
            if method in ("dense", "fp8"):
                out = model
                quantization = "fp8" if method == "fp8" else None
            elif method == "awq":
                quantize_model_awq(model, out, sequences, args.bits, args.group_size)
            elif method == "w8a8":
                quantize_model_w8a8(model, out, sequences)
            else:
                quantize_model(
                    model, out, sequences, args.bits, args.group_size, args.act_order, method
                )
            seconds = time.perf_counter() - start
            # dense: a GGUF source's weights dequantized to float32 (PAGODA_GGUF_QUANTIZED=0),
            # not its blocks through the int8-activation kernels, so that the 8-bit methods
            # are measured against the float model they quantize. The 4-bit methods likewise
            # dequantized (PAGODA_CPU_QUANTIZED=0: the weight quantization alone), then as a
            # CPU runs them, GGUF blocks with int8 activations (the "+ CPU blocks" rows).
            runs = [(method, {"PAGODA_GGUF_QUANTIZED": "0"} if method == "dense" else {})]
            if method in ("gptq", "awq", "rtn"):
                runs = [(method, {"PAGODA_CPU_QUANTIZED": "0"}), (method + "+blocks", {})]
            for name, env in runs:
                with _environ(env):
                    llm = LLM(
                        out, quantization=quantization, dtype="float32", max_model_len=1024
                    )  # the quantized directories carry the source's tokenizer
                ppl = perplexity(llm, windows)
                del llm
                results[name] = (ppl, seconds)
                print(
                    f"  {name:12s} perplexity {ppl:8.3f}  (quantization {seconds:6.1f} s)",
                    flush=True,
                )
    print_table(results, args.bits, args.group_size)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def print_table(results: dict[str, tuple[float, float]], bits: int, group_size: int) -> None:
    import platform
    import subprocess

    names = {
        "dense": "dense (float32)",
        "w8a8": "INT8 W8A8 (SmoothQuant)",
        "fp8": "FP8 e4m3 (at load)",
        "awq": f"AWQ {bits}-bit g{group_size}",
        "gptq": f"GPTQ {bits}-bit g{group_size}",
        "rtn": f"round-to-nearest {bits}-bit g{group_size}",
    }
    dense = results.get("dense", (None, 0))[0]
    print("\n| method | perplexity | vs dense | quantization |\n|---|---|---|---|")
    for method, (ppl, seconds) in results.items():
        change = "" if dense is None or method == "dense" else f"{(ppl / dense - 1) * 100:+.2f}%"
        base, blocks = method.removesuffix("+blocks"), method.endswith("+blocks")
        name = names[base] + (", run as CPU GGUF blocks (int8 activations)" if blocks else "")
        print(f"| {name} | {ppl:.3f} | {change} | {seconds:.0f} s |")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\ncommit {commit}; {cpu}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
