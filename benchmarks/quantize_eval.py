"""Perplexity of the embedded model (or MODEL) dense, GPTQ-, AWQ- and round-to-nearest
quantized, on held-out text: what `pagoda quantize` buys.

    python benchmarks/quantize_eval.py [--model PATH] [--bits 4] [--group-size 64]
        [--calibration-file FILE] [--eval-file FILE] [--act-order]
        [--methods dense,gptq,awq,rtn] [--num-samples 32] [--seq-len 512] [--eval-tokens N]

Calibrates on the built-in text (or FILE) in up to --num-samples windows of --seq-len tokens,
evaluates on benchmarks/README.md (or FILE; its first N tokens with --eval-tokens) in 512-token
windows through prompt logprobs, float32 on the CPU. AWQ is 4-bit only.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

from pagoda import LLM, SamplingParams
from pagoda.config import embedded_model_path
from pagoda.model.quantization.awq import quantize_model_awq
from pagoda.model.quantization.gptq import (
    BUILTIN_CALIBRATION,
    calibration_sequences,
    quantize_model,
)
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
    p.add_argument("--methods", default="dense,gptq,awq,rtn", help="comma-separated")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"dense", "gptq", "awq", "rtn"}
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
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            start = time.perf_counter()
            out = os.path.join(tmp, method)
            if method == "dense":
                out = model
            elif method == "awq":
                quantize_model_awq(model, out, sequences, args.bits, args.group_size)
            else:
                quantize_model(
                    model, out, sequences, args.bits, args.group_size, args.act_order, method
                )
            seconds = time.perf_counter() - start
            llm = LLM(out, tokenizer=model, dtype="float32", max_model_len=1024)
            ppl = perplexity(llm, windows)
            del llm
            print(
                f"  {method:5s} perplexity {ppl:8.3f}  (quantization {seconds:6.1f} s)", flush=True
            )


if __name__ == "__main__":
    main()
